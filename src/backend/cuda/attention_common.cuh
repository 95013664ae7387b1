// What every paged attention kernel shares: its parameter block, the mapping of a CTA to
// (query tile, kv head, head chunk, value chunk, context split), cache row addressing and
// loads, and the split-K merge. Compiled by nvcc for the GPU and by the host compiler for the
// simulator (attention_port.cuh).
//
// Work decomposition. The query heads of one kv head form a group (MLA: all heads, one latent
// "kv head"). A CTA owns up to kRows query rows = (token, head) pairs: hc heads of one group
// times tq consecutive tokens of one sequence (a "tile"), so each cache row it loads serves
// every one of those rows. The grid is
//   x: tiles (an upper bound sized from num_tokens and num_seqs; surplus CTAs exit),
//   y: context splits (split-K), each covering an equal share of the tile's keys,
//   z: kv_heads x nhc head chunks x ndv value-dim chunks,
// so it depends only on host-known sizes: a CUDA graph replays it with new metadata.
#pragma once

#include "backend/cuda/attention_port.cuh"
#include "backend/cuda/weight_stream.cuh"
#include "backend/kv_fp8.h"

namespace ds::cuda::kern {

// kCacheFP8: e4m3 codes plus F32 scales per slot and part (PagedKv's FP8 layout).
enum CacheType : int { kCacheF32 = 0, kCacheF16 = 1, kCacheBF16 = 2, kCacheFP8 = 3 };

struct AttnParams {
  // Query row (t, h): dims [0, q_dims) at q + t * q_ts + h * q_hs (F32, bytes), dims
  // [q_dims, dim) at q2 (MLA: q_latent then q_rope).
  const uint8_t* q = nullptr;
  int64_t q_ts = 0, q_hs = 0;
  const uint8_t* q2 = nullptr;
  int64_t q2_ts = 0, q2_hs = 0;
  int q_dims = 0;
  uint8_t* out = nullptr;  // row (t, h) at out + t * out_ts + h * out_hs, dv F32 values
  int64_t out_ts = 0, out_hs = 0;
  // Cache row of slot s, kv head g: k + s * slot_bytes + g * head_bytes. v == nullptr: the
  // values are the first dv dims of the key row (MLA's latent).
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  int cache_type = kCacheF32;
  int64_t slot_bytes = 0, head_bytes = 0;
  // kCacheFP8: key scales k_scale[slot * k_scale_parts + kv head * (rope_split ? 2 : 1) + part]
  // (part 1 = dims >= rope_split > 0), value scales v_scale[slot * kv_heads + kv head].
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int k_scale_parts = 0, rope_split = 0;
  int block_size = 1;
  int vec_ok = 0;  // rows and offsets aligned for 4-element vector loads
  int dim = 0;     // score dims (head_dim; MLA: R + P)
  int dv = 0;      // value / output dims (head_dim; MLA: R)
  int heads = 0, kv_heads = 1, group = 1;
  int hc = 1, nhc = 1, tq = 1;  // heads per chunk, chunks per group, tokens per tile
  int dvc = 0, ndv = 1;         // value dims per CTA, value chunks
  int splits = 1;
  int mla_rows = 16;        // MLA decode: heads per CTA (mla_decode_rows: 16, or 32 for BF16 Q / P)
  float scale_log2 = 1.0f;  // softmax scale * log2(e): scores live in base 2
  int causal = 1;
  const int32_t* query_start = nullptr;   // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0, num_seqs = 0, num_tokens = 0;
  // Split-K partials (splits > 1): unnormalized outputs and (max, sum) of each split.
  float* part_o = nullptr;   // [splits, num_tokens, heads, dv]
  float* part_ml = nullptr;  // [splits, num_tokens, heads, 2]
  // MlaAttentionParams::cache_settled: the cache rows and the step's metadata are no output of
  // the kernel just ahead, so a kernel may read them before its dependent-launch wait.
  int early_cache = 0;
  // Q rows 8-byte aligned: the register-Q MLA decode loads element pairs at once
  // (DEEPSERVE_MLA_Q_PAIRS).
  int q_pairs = 0;
  // The register-Q MLA decode's in-cluster merge gathers the splits' weights first
  // (DEEPSERVE_MLA_MERGE_GATHER; attention_mla_decode_tiles.cuh, merge_gathered).
  int merge_gather = 0;
  // The register-Q MLA decode's Q loads unconditional and split a pair at a time
  // (DEEPSERVE_MLA_Q_SPLIT2).
  int q_split2 = 0;
  // DEEPSERVE_MLA_PHASES (attention_mla_decode.cuh): the register-Q MLA decode's per-CTA phase
  // log (word 0 counts records; kMlaPhaseWords words a record from word kMlaPhaseWords), or null.
  unsigned long long* phase_log = nullptr;
  int phase_cap = 0;         // records the log holds
  long long phase_skip = 0;  // CTAs not logged first (warm-up)
};

// The CTA's share of the work, the same in every thread.
struct Tile {
  int seq = -1;
  int token0 = 0, ntok = 0;  // this tile's tokens
  int pos0 = 0;              // position of token0
  int ctx = 0;               // context length of the sequence
  int kvh = 0, hchunk = 0, dvi = 0, split = 0;
  int key_begin = 0, key_end = 0;  // this split's keys
  int dv0 = 0, nv = 0;             // value dims [dv0, dv0 + nv)
};

DS_KHD int ceil_div_int(int a, int b) {
  return (a + b - 1) / b;
}

// Finds the tile of CTA x: with one token per tile a binary search over query_start, else a
// warp-0 scan of the per-sequence tile counts (result shared through ints[0..1]). Returns
// false (in every thread) when x lies past the last tile.
DS_KDEV bool find_tile(const AttnParams& p, const Thread& th, int* ints, int key_tile, Tile& t) {
  int seq = -1, local = 0;
  if (p.tq == 1) {
    const int tok = th.bx;
    if (tok >= p.num_tokens) return false;
    if (tok < p.num_seqs && p.query_start[tok] == tok && p.query_start[tok + 1] == tok + 1) {
      seq = tok;  // decode: sequence i holds token i (two independent loads, no search)
    } else {
      int lo = 0, hi = p.num_seqs;  // query_start[lo] <= tok < query_start[hi]
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (p.query_start[mid] <= tok)
          lo = mid;
        else
          hi = mid;
      }
      seq = lo;
    }
    local = tok - p.query_start[seq];
  } else {
    if (th.warp == 0) {
      int base = 0, found = -1, found_local = 0;
      for (int s0 = 0; s0 < p.num_seqs; s0 += 32) {
        const int s = s0 + th.lane;
        const int c =
            s < p.num_seqs ? ceil_div_int(p.query_start[s + 1] - p.query_start[s], p.tq) : 0;
        int incl = c;
        for (int o = 1; o < 32; o <<= 1) {
          const int y = shfl_up_int(incl, o);
          if (th.lane >= o) incl += y;
        }
        const int excl = base + incl - c;
        const unsigned hit = ballot(th.bx >= excl && th.bx < excl + c);
        if (hit) {
          const int src = first_set(hit);
          found = s0 + src;
          found_local = th.bx - shfl_int(excl, src);
          break;
        }
        base += shfl_int(incl, 31);
      }
      if (th.lane == 0) {
        ints[0] = found;
        ints[1] = found_local;
      }
    }
    sync_block();
    seq = ints[0];
    local = ints[1];
    if (seq < 0) return false;
  }
  const int qs = p.query_start[seq];
  const int qlen = p.query_start[seq + 1] - qs;
  t.seq = seq;
  t.ctx = p.context_lens[seq];
  t.token0 = qs + local * p.tq;
  t.ntok = qlen - local * p.tq < p.tq ? qlen - local * p.tq : p.tq;
  t.pos0 = t.ctx - qlen + local * p.tq;
  int z = th.bz;
  t.dvi = z % p.ndv;
  z /= p.ndv;
  t.hchunk = z % p.nhc;
  t.kvh = z / p.nhc;
  t.split = th.by;
  t.dv0 = t.dvi * p.dvc;
  t.nv = p.dv - t.dv0 < p.dvc ? p.dv - t.dv0 : p.dvc;
  // Keys any row of the tile sees, shared out over the splits in whole key tiles.
  int n_keys = p.causal ? t.pos0 + t.ntok : t.ctx;
  if (n_keys > t.ctx) n_keys = t.ctx;
  if (n_keys < 0) n_keys = 0;
  const int per_split = ceil_div_int(ceil_div_int(n_keys, p.splits), key_tile) * key_tile;
  t.key_begin = t.split * per_split;
  t.key_end = t.key_begin + per_split < n_keys ? t.key_begin + per_split : n_keys;
  return true;
}

// Query row r of the CTA (0 <= r < kRows): its token, head and how many keys it sees; a row
// past the tile or the group sees none.
struct RowInfo {
  int token = 0, head = 0, n_keys = 0;
  bool valid = false;
};
DS_KDEV RowInfo row_info(const AttnParams& p, const Tile& t, int r) {
  RowInfo ri;
  const int tr = r / p.hc, hr = t.hchunk * p.hc + r % p.hc;
  if (tr >= t.ntok || hr >= p.group) return ri;
  ri.valid = true;
  ri.token = t.token0 + tr;
  ri.head = t.kvh * p.group + hr;
  int nk = p.causal ? t.pos0 + tr + 1 : t.ctx;
  if (nk > t.ctx) nk = t.ctx;
  ri.n_keys = nk < 0 ? 0 : nk;
  return ri;
}

// The CTA header in shared memory: tile lookup, key slots of the current tile, and the byte
// offsets of each query row in q and q2 (-1 for rows the tile does not fill).
constexpr int kHeaderBytes = 512;
constexpr int kMaxRows = 16;
struct Header {
  int* ints;        // [0, 2): tile lookup; [2, 2 + 32): key slots
  int64_t* q_off;   // [kMaxRows]
  int64_t* q2_off;  // [kMaxRows]
};
DS_KDEV Header header(uint8_t* smem) {
  Header h;
  h.ints = reinterpret_cast<int*>(smem);
  h.q_off = reinterpret_cast<int64_t*>(smem + 256);
  h.q2_off = h.q_off + kMaxRows;
  return h;
}

// Copies `total` units of kVec floats: load(u, x) for a batch of kBatch units per thread, then
// store(u, x) for each. Global loads would otherwise wait behind shared-memory stores the
// compiler cannot prove independent of them, one memory latency per unit.
template <int kBatch, int kVec, typename Load, typename Store>
DS_KDEV void batched_copy(int total, const Thread& th, Load load, Store store) {
  for (int u0 = th.tid; u0 < total; u0 += kBatch * th.nthreads) {
    float x[kBatch][kVec];
    DS_UNROLL for (int b = 0; b < kBatch; ++b) {
      const int u = u0 + b * th.nthreads;
      if (u < total) {
        load(u, x[b]);
      } else {
        DS_UNROLL for (int e = 0; e < kVec; ++e) x[b][e] = 0.0f;
      }
    }
    DS_UNROLL for (int b = 0; b < kBatch; ++b) {
      const int u = u0 + b * th.nthreads;
      if (u < total) store(u, x[b]);
    }
  }
}

// Fills the header's query row offsets for rows [0, rows) (threads < rows; sync before use).
DS_KDEV void set_query_rows(const AttnParams& p, const Thread& th, const Tile& t, int rows,
                            const Header& hd) {
  if (th.tid >= rows) return;
  const RowInfo ri = row_info(p, t, th.tid);
  hd.q_off[th.tid] = ri.valid ? ri.token * p.q_ts + ri.head * p.q_hs : -1;
  hd.q2_off[th.tid] = ri.valid ? ri.token * p.q2_ts + ri.head * p.q2_hs : -1;
}

// Query element d of CTA row r through the header's offsets, 0 past dim or for empty rows.
DS_KDEV float query_elem(const AttnParams& p, const Header& hd, int r, int d) {
  const int64_t off = hd.q_off[r];
  if (off < 0) return 0.0f;
  if (d < p.q_dims) return *reinterpret_cast<const float*>(p.q + off + int64_t(d) * 4);
  if (d < p.dim)
    return *reinterpret_cast<const float*>(p.q2 + hd.q2_off[r] + int64_t(d - p.q_dims) * 4);
  return 0.0f;
}

// Cache slot of position j of sequence seq.
DS_KDEV int64_t slot_of(const AttnParams& p, int seq, int j) {
  const int block = p.block_tables[int64_t(seq) * p.max_blocks_per_seq + j / p.block_size];
  return int64_t(block) * p.block_size + j % p.block_size;
}

struct alignas(16) Vec4f {
  float x[4];
};
struct alignas(8) Vec4h {
  uint16_t x[4];
};

// Elements [d, d + 4) of a cache row of n elements as F32 (0 past n).
DS_KDEV void load4(const uint8_t* row, int d, int n, int type, bool vec, float (&x)[4]) {
  if (vec && d + 4 <= n) {
    check_aligned(row + int64_t(d) * (type == kCacheF32 ? 4 : 2), type == kCacheF32 ? 16 : 8);
    if (type == kCacheF32) {
      const Vec4f v = *reinterpret_cast<const Vec4f*>(row + int64_t(d) * 4);
      DS_UNROLL for (int i = 0; i < 4; ++i) x[i] = v.x[i];
    } else {
      const Vec4h v = *reinterpret_cast<const Vec4h*>(row + int64_t(d) * 2);
      DS_UNROLL for (int i = 0; i < 4; ++i) {
        x[i] = type == kCacheBF16 ? bf16_bits_to_float(v.x[i]) : f16_bits_to_float(v.x[i]);
      }
    }
    return;
  }
  DS_UNROLL for (int i = 0; i < 4; ++i) {
    const int e = d + i;
    if (e >= n) {
      x[i] = 0.0f;
    } else if (type == kCacheF32) {
      x[i] = *reinterpret_cast<const float*>(row + int64_t(e) * 4);
    } else {
      const uint16_t h = *reinterpret_cast<const uint16_t*>(row + int64_t(e) * 2);
      x[i] = type == kCacheBF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
    }
  }
}

// Elements [d, d + 4) of an FP8 cache head row of n codes as F32 (0 past n): decode(code) *
// scales[0] below split, scales[1] from split on (split <= 0: one scale). vec: the codes are
// 4-byte aligned. The same products as kvfp8::dequant (and the CPU reference).
DS_KDEV void load4_fp8(const uint8_t* codes, const float* scales, int split, int d, int n, bool vec,
                       float (&x)[4]) {
  uint8_t c[4] = {0, 0, 0, 0};
  if (vec && d + 4 <= n) {
    check_aligned(codes + d, 4);
    const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + d);
    DS_UNROLL for (int i = 0; i < 4; ++i) c[i] = uint8_t(w >> (8 * i));
  } else {
    DS_UNROLL for (int i = 0; i < 4; ++i) c[i] = d + i < n ? codes[d + i] : uint8_t(0);
  }
  DS_UNROLL for (int i = 0; i < 4; ++i) {
    const int e = d + i;
    x[i] = e < n ? kvfp8::dequant(c[i], scales[split > 0 && e >= split ? 1 : 0]) : 0.0f;
  }
}

// Key dims [d, d + 4) of kv head kvh in slot `slot`, any cache type (zeros for slot < 0, a key
// past the tile). The FP8 branch is the one cache read other kernels can reuse as it is.
DS_KDEV void load_key4(const AttnParams& p, int kvh, int slot, int d, float (&x)[4]) {
  if (slot < 0) {
    x[0] = x[1] = x[2] = x[3] = 0.0f;
    return;
  }
  const uint8_t* row = p.k + int64_t(slot) * p.slot_bytes + kvh * p.head_bytes;
  if (p.cache_type == kCacheFP8) {
    const int per_head = p.rope_split > 0 ? 2 : 1;
    const float* s = p.k_scale + int64_t(slot) * p.k_scale_parts + kvh * per_head;
    load4_fp8(row, s, p.rope_split, d, p.dim, p.vec_ok, x);
  } else {
    load4(row, d, p.dim, p.cache_type, p.vec_ok, x);
  }
}

// Value dims [dv0 + d, dv0 + d + 4) of kv head kvh in slot `slot` (separate V), 0 past dv0 + n.
DS_KDEV void load_value4(const AttnParams& p, int kvh, int slot, int dv0, int d, int n,
                         float (&x)[4]) {
  if (slot < 0) {
    x[0] = x[1] = x[2] = x[3] = 0.0f;
    return;
  }
  const uint8_t* row = p.v + int64_t(slot) * p.slot_bytes + kvh * p.head_bytes;
  if (p.cache_type == kCacheFP8) {
    const float* s = p.v_scale + int64_t(slot) * p.kv_heads + kvh;
    load4_fp8(row + dv0, s, 0, d, n, p.vec_ok && dv0 % 4 == 0, x);
  } else {
    const int es = p.cache_type == kCacheF32 ? 4 : 2;
    load4(row + int64_t(dv0) * es, d, n, p.cache_type, p.vec_ok, x);
  }
}

DS_KDEV int64_t part_row(const AttnParams& p, int split, int token, int head) {
  return (int64_t(split) * p.num_tokens + token) * p.heads + head;
}

// An empty split (its keys lie past the tile's context) still reports every row it owns, so
// the merge can skip it: max = -inf, sum = 0.
DS_KDEV void write_empty_split(const AttnParams& p, const Thread& th, const Tile& t, int rows) {
  if (t.dvi != 0) return;
  for (int r = th.tid; r < rows; r += th.nthreads) {
    const RowInfo ri = row_info(p, t, r);
    if (!ri.valid) continue;
    float* ml = p.part_ml + part_row(p, t.split, ri.token, ri.head) * 2;
    ml[0] = -INFINITY;
    ml[1] = 0.0f;
  }
}

// Split-K merge: one CTA per (token, head) row; every split's partial is rescaled to the
// common max. Splits that saw no key of this row (max = -inf) are skipped.
struct MergeParams {
  const float* part_o = nullptr;   // [splits, num_tokens, heads, dv]
  const float* part_ml = nullptr;  // [splits, num_tokens, heads, 2]
  uint8_t* out = nullptr;
  int64_t out_ts = 0, out_hs = 0;
  int num_tokens = 0, heads = 0, dv = 0, splits = 1;
};

// Four consecutive floats to a 16-byte aligned address (loads: wstream::load_float4).
DS_KDEV void store_f4(float* p, const float (&v)[4]) {
#if defined(__CUDACC__)
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
#else
  for (int e = 0; e < 4; ++e) p[e] = v[e];
#endif
}

// Splits whose loads a merge thread issues together (the kernel is one round trip per chunk).
constexpr int kMergeChunk = 8;

// The scale of a merged row over `splits` splits: mx = the largest split max, inv = 1 / the sum
// over splits s (ascending, skipping empty ones: max -inf) of l_s * 2^(m_s - mx). m_of(s), l_of(s):
// split s's max and sum. The loads of kMergeChunk splits are issued before they are used.
template <typename MaxOf, typename SumOf>
DS_KDEV void merge_scale(int splits, const MaxOf& m_of, const SumOf& l_of, float& mx, float& inv) {
  mx = -INFINITY;
  for (int s0 = 0; s0 < splits; s0 += kMergeChunk) {
    float v[kMergeChunk];
    DS_UNROLL
    for (int i = 0; i < kMergeChunk; ++i) v[i] = s0 + i < splits ? m_of(s0 + i) : -INFINITY;
    DS_UNROLL
    for (int i = 0; i < kMergeChunk; ++i) mx = fmaxf(mx, v[i]);
  }
  float sum = 0.0f;
  for (int s0 = 0; s0 < splits; s0 += kMergeChunk) {
    float ms[kMergeChunk], ls[kMergeChunk];
    DS_UNROLL
    for (int i = 0; i < kMergeChunk; ++i) {
      const bool in = s0 + i < splits;
      ms[i] = in ? m_of(s0 + i) : -INFINITY;
      ls[i] = in ? l_of(s0 + i) : 0.0f;
    }
    DS_UNROLL
    for (int i = 0; i < kMergeChunk; ++i)
      if (ms[i] != -INFINITY) sum += ls[i] * exp2_approx(ms[i] - mx);
  }
  inv = 1.0f / sum;
}

// V consecutive dims of a merged row: the sum over splits s (ascending, skipping empty ones) of
// o_s * 2^(m_s - mx), times inv (merge_scale's). load_o(s, v) reads split s's V partial values.
template <int V, typename MaxOf, typename LoadO>
DS_KDEV void merge_dims(int splits, const MaxOf& m_of, const LoadO& load_o, float mx, float inv,
                        float (&acc)[V]) {
  DS_UNROLL
  for (int e = 0; e < V; ++e) acc[e] = 0.0f;
  for (int s0 = 0; s0 < splits; s0 += kMergeChunk) {
    float wgt[kMergeChunk], o[kMergeChunk][V];
    DS_UNROLL
    for (int i = 0; i < kMergeChunk; ++i) {
      const int s = s0 + i;
      const float ms = s < splits ? m_of(s) : -INFINITY;
      wgt[i] = ms;
      if (ms != -INFINITY) load_o(s, o[i]);
    }
    DS_UNROLL
    for (int i = 0; i < kMergeChunk; ++i) {
      if (wgt[i] == -INFINITY) continue;
      const float f = exp2_approx(wgt[i] - mx);
      DS_UNROLL
      for (int e = 0; e < V; ++e) acc[e] += o[i][e] * f;
    }
  }
  DS_UNROLL
  for (int e = 0; e < V; ++e) acc[e] *= inv;
}

// The in-cluster merge that gathers the weights first (the MLA decode's merge_gathered): for one
// row, from every split's max m_of(s) and sum l_of(s), each split's factor 2^(m_s - mx) through
// set_fac(s, f) (-inf for an empty split) and the returned 1 / sum, with merge_scale's
// operations in its order; then merge_sum_factors sums V values of each split with keys,
// ascending, and scales them as merge_dims does: the merge kernel's bits.
template <typename MaxOf, typename SumOf, typename SetFac>
DS_KDEV float merge_row_factors(int splits, const MaxOf& m_of, const SumOf& l_of,
                                const SetFac& set_fac) {
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, m_of(s));
  float sum = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float ms = m_of(s);
    float f = -INFINITY;
    if (ms != -INFINITY) {
      f = exp2_approx(ms - mx);
      sum += l_of(s) * f;
    }
    set_fac(s, f);
  }
  return 1.0f / sum;
}

// o[s]: split s's V values (read only where fac_of(s) is not -inf).
template <int V, int kMaxSplits, typename FacOf>
DS_KDEV void merge_sum_factors(int splits, const FacOf& fac_of, const float (&o)[kMaxSplits][V],
                               float inv, float (&acc)[V]) {
  DS_UNROLL
  for (int e = 0; e < V; ++e) acc[e] = 0.0f;
  DS_UNROLL
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s >= splits) break;
    const float f = fac_of(s);
    if (f == -INFINITY) continue;
    DS_UNROLL
    for (int e = 0; e < V; ++e) acc[e] += o[s][e] * f;
  }
  DS_UNROLL
  for (int e = 0; e < V; ++e) acc[e] *= inv;
}

// out row = sum over splits s (ascending, skipping empty ones) of part_o[s] * 2^(m_s - max),
// divided by the same weighted sum of the l_s. One CTA per (token, head) row; with V = 4 a
// thread owns 4 consecutive dims (16-byte loads), else one.
template <int V>
DS_KDEV void merge_splits_v(const MergeParams& m, const Thread& th) {
  const int row = th.bx;  // token * heads + head
  const int token = row / m.heads, head = row % m.heads;
  const int64_t stride = int64_t(m.num_tokens) * m.heads;
  const float* ml = m.part_ml + int64_t(row) * 2;
  const int64_t ml_step = stride * 2;
  const auto m_of = [&](int s) { return ml[s * ml_step]; };
  const auto l_of = [&](int s) { return ml[s * ml_step + 1]; };
  float mx, inv;
  merge_scale(m.splits, m_of, l_of, mx, inv);
  float* out = reinterpret_cast<float*>(m.out + token * m.out_ts + head * m.out_hs);
  const float* po = m.part_o + int64_t(row) * m.dv;
  const int64_t po_step = stride * m.dv;
  for (int d = th.tid * V; d < m.dv; d += th.nthreads * V) {
    float acc[V];
    merge_dims<V>(
        m.splits, m_of,
        [&](int s, float(&o)[V]) {
          if constexpr (V == 4) {
            const float4 q = wstream::load_float4(po + s * po_step + d);
            o[0] = q.x, o[1] = q.y, o[2] = q.z, o[3] = q.w;
          } else {
            o[0] = po[s * po_step + d];
          }
        },
        mx, inv, acc);
    if constexpr (V == 4)
      store_f4(out + d, acc);
    else
      out[d] = acc[0];
  }
}

// The merge of one cluster's splits (the MLA decode kernel's in-cluster merge): the `rows` x dv
// values of the group (dv a multiple of 4) are cut into 4-dim items shared out among the S CTAs
// in rank order, and CTA z, thread tid of nthreads, merges its items as merge_splits_v does (the
// same bits). has(row): whether the row exists; m_of(s, row), l_of(s, row): split s's max and
// sum; load_o(s, row, d, float(&)[4]): its partial dims d .. d + 4; store(row, d, acc).
template <typename Has, typename MaxOf, typename SumOf, typename LoadO, typename Store>
DS_KDEV void merge_cluster_items(int S, int z, int tid, int nthreads, int rows, int dv,
                                 const Has& has, const MaxOf& m_of, const SumOf& l_of,
                                 const LoadO& load_o, const Store& store) {
  const int per_row = dv / 4, items = rows * per_row, per = (items + S - 1) / S;
  const int end = (z + 1) * per < items ? (z + 1) * per : items;
  for (int i = z * per + tid; i < end; i += nthreads) {
    const int row = i / per_row, d = (i - row * per_row) * 4;
    if (!has(row)) continue;
    const auto m_row = [&](int s) { return m_of(s, row); };
    float mx, inv, acc[4];
    merge_scale(
        S, m_row, [&](int s) { return l_of(s, row); }, mx, inv);
    merge_dims<4>(
        S, m_row, [&](int s, float(&o)[4]) { load_o(s, row, d, o); }, mx, inv, acc);
    store(row, d, acc);
  }
}

// Whether the merge may use 16-byte accesses (dims in fours, aligned rows).
DS_KHD bool merge_vec4(const MergeParams& m) {
  return m.dv % 4 == 0 && (reinterpret_cast<uintptr_t>(m.out) | uintptr_t(m.out_ts) |
                           uintptr_t(m.out_hs) | reinterpret_cast<uintptr_t>(m.part_o)) %
                                  16 ==
                              0;
}

DS_KDEV void merge_splits(const MergeParams& m, const Thread& th) {
  if (merge_vec4(m))
    merge_splits_v<4>(m, th);
  else
    merge_splits_v<1>(m, th);
}

}  // namespace ds::cuda::kern
