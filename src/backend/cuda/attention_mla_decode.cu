// MLA decode attention over a BF16 latent cache: every sequence has one query, and all of its
// heads share every cache row, so a CTA takes 16 heads of one sequence as the M = 16 rows of
// mma.sync m16n8k16 tiles and streams its share of the context (a split) once:
//   S = Q [16, R + P] . K^T      (K = the cached rows, keys as n; ldmatrix from row-major rows)
//   O += P [16, keys] . V        (V = the first R dims of the same rows; ldmatrix .trans)
// 64-key tiles stream through a two-stage cp.async pipeline; 8 warps split the keys for S (8
// each) and the value dims for O (64 each). Q and P are split into BF16 hi + lo parts, so the
// products keep about F32 precision (the cache itself is exact BF16). Online softmax in base 2
// as the other attention kernels; splits write the same partials and share their merge.
// BF16 Q / P (kLo = false, AttentionPath::MlaDecodeBf16, not Auto's choice yet): Q and P are
// rounded to BF16 once (FlashMLA's precision), half the mma of the hi + lo form.
// FP8 cache (kFp8): the e4m3 codes are staged as BF16 (exact) by plain loads, and each key's
// scales are applied outside the MMAs: S = s_latent (Q_lat . codes) + s_rope (Q_rope . codes),
// and P is multiplied by s_latent before P . V, so the products stay as exact as for BF16.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "backend/cuda/attention_mla_decode.cuh"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"

namespace ds::cuda {
namespace {

using ptx::smem_u32;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;  // heads per CTA
constexpr int kKeys = 64;  // keys per tile
constexpr int kMaxSplits = 16;
constexpr int kMaxLongSplits = 128;
constexpr int kR = kMlaDecodeRank;  // value dims; kWarps x 64
constexpr int kMaxDim = kR + kMlaDecodeMaxRope;
constexpr int kRowBytes = kMaxDim * 2;  // staged row stride (BF16)
constexpr int kQBytes = kRows * kRowBytes;
constexpr int kTileBytes = kKeys * kRowBytes;
constexpr int kPBytes = kRows * kKeys * 2;
constexpr int kScaleBytes = kKeys * 2 * 4;  // FP8: (latent, rope) scale of each key of a stage
constexpr int kSlotBytes = kKeys * 8;       // cache slot of each key of a tile (-1: none)
// Q hi, Q lo, two cache stages, P hi, P lo, row max / sum exchange, two stages of scales, two
// tiles' slots.
constexpr int kSmemBytes = 2 * kQBytes + 2 * kTileBytes + 2 * kPBytes + 2 * kWarps * kRows * 4 +
                           2 * kScaleBytes + 2 * kSlotBytes;
// Q elements (pairs) each thread stages.
constexpr int kQPairs = kRows * (kMaxDim / 2) / kThreads;
static_assert(kRows * (kMaxDim / 2) % kThreads == 0, "Q pairs spread evenly over the threads");
static_assert(kR == kWarps * 64, "each warp owns 64 value dims");

// Byte offset of 16-byte chunk c of a staged row r (rows of `row_bytes`): chunks swizzled
// within groups of 8 by the row, so ldmatrix's 8 rows of a phase hit 8 different bank groups.
__device__ __forceinline__ uint32_t swz(int r, int c, int row_bytes) {
  return uint32_t(r * row_bytes + (((c & ~7) | ((c ^ r) & 7)) << 4));
}

// BF16 hi + lo of v (v ~= hi + lo to about 16 significant bits).
__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  lo = __float2bfloat16_rn(v - __bfloat162float(hi));
}

// The 8 FP8 codes of one staged 16-byte chunk as 8 BF16 values (e4m3 values are exact in BF16).
__device__ __forceinline__ uint4 fp8x8_to_bf16x8(uint2 w) {
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = i < 2 ? w.x : w.y;
    const int sh = 16 * (i & 1);
    const __nv_bfloat16 lo = __float2bfloat16_rn(fp8w::decode(uint8_t(word >> sh)));
    const __nv_bfloat16 hi = __float2bfloat16_rn(fp8w::decode(uint8_t(word >> (sh + 8))));
    out[i] = uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The keys of split `split` of sequence `seq`: whole 64-key tiles, as few splits as the context
// needs. Returns false (in every thread) for a split with no keys, after telling the merge to
// skip it.
struct SplitKeys {
  int token = 0, key_begin = 0, key_end = 0;
  bool partial = false;
};
__device__ __forceinline__ bool split_keys(const kern::AttnParams& p, int seq, int split, int h0,
                                           int tid, SplitKeys& k) {
  k.token = p.query_start[seq];
  const int ctx = p.context_lens[seq];
  const int tiles_total = (ctx + kKeys - 1) / kKeys;
  const int used = min(p.splits, tiles_total);
  const int tiles_per = used > 0 ? (tiles_total + used - 1) / used : 0;
  k.key_begin = split * tiles_per * kKeys;
  k.key_end = min(ctx, k.key_begin + tiles_per * kKeys);
  k.partial = p.splits > 1;
  if (k.key_begin < k.key_end) return true;
  if (k.partial && tid < kRows && h0 + tid < p.heads) {
    float* ml = p.part_ml + ((int64_t(split) * p.num_tokens + k.token) * p.heads + h0 + tid) * 2;
    ml[0] = -INFINITY;
    ml[1] = 0.0f;
  }
  return false;
}

// Rows g and g + 8 of a warp's 64 value dims (heads h0 + g (+ 8)): the normalized output, or
// with splits the split's unnormalized partial and (max, sum) of each row (m, l: rows g, g + 8).
__device__ __forceinline__ void store_rows(const kern::AttnParams& p, const SplitKeys& sk,
                                           int split, int h0, int warp, int lane,
                                           const float (&o)[8][4], const float (&m)[2],
                                           const float (&l)[2]) {
  const int g = lane >> 2, c2 = 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = h0 + g + 8 * h;
    if (head >= p.heads) continue;
    const int64_t prow = (int64_t(split) * p.num_tokens + sk.token) * p.heads + head;
    const float inv = sk.partial ? 1.0f : 1.0f / l[h];
    float* dst = sk.partial
                     ? p.part_o + prow * p.dv
                     : reinterpret_cast<float*>(p.out + sk.token * p.out_ts + head * p.out_hs);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int d = warp * 64 + n * 8 + c2;
      dst[d] = o[n][2 * h] * inv;
      dst[d + 1] = o[n][2 * h + 1] * inv;
    }
    if (sk.partial && warp == 0 && (lane & 3) == 0) {
      p.part_ml[prow * 2] = m[h];
      p.part_ml[prow * 2 + 1] = l[h];
    }
  }
}

// Grid (num_seqs, splits, ceil(heads / 16)).
template <bool kFp8, bool kLo>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const kern::AttnParams p) {
  pdl::enter();
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* q_hi = smem;
  uint8_t* q_lo = q_hi + kQBytes;
  uint8_t* stage0 = q_lo + kQBytes;
  uint8_t* p_hi = stage0 + 2 * kTileBytes;
  uint8_t* p_lo = p_hi + kPBytes;
  float* red_max = reinterpret_cast<float*>(p_lo + kPBytes);       // [kWarps][kRows]
  float* red_sum = red_max + kWarps * kRows;                       // [kWarps][kRows]
  float* scl0 = red_sum + kWarps * kRows;                          // FP8: [2 stages][kKeys][2]
  auto* slots = reinterpret_cast<int64_t*>(scl0 + 2 * kKeys * 2);  // [2 tiles][kKeys]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int seq = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * kRows;
  const int dim = p.dim, chunks = dim / 8;  // 16-byte chunks per cache row
  SplitKeys sk;
  if (!split_keys(p, seq, split, h0, tid, sk)) return;
  const int token = sk.token, key_begin = sk.key_begin, key_end = sk.key_end;

  // The cache slots of tile t's keys (-1 past the split) into slot table t & 1: one block-table
  // lookup per key, by the first kKeys threads, ahead of the copies that read them (after a
  // barrier), so a copy's address never waits on a global load.
  const int n_tiles = (key_end - key_begin + kKeys - 1) / kKeys;
  auto find_slots = [&](int t) {
    if (tid < kKeys && t < n_tiles) {
      const int j = key_begin + t * kKeys + tid;
      slots[(t & 1) * kKeys + tid] = j < key_end ? kern::slot_of(p, seq, j) : -1;
    }
  };
  // Calls chunk(r, c, slot) for the tile's (key row, 8-element chunk) pairs of this thread.
  auto for_tile_chunks = [&](int t, auto&& chunk) {
    const int64_t* ts = slots + (t & 1) * kKeys;
    for (int i = tid; i < kKeys * chunks; i += kThreads) {
      const int r = i / chunks, c = i - r * chunks;
      chunk(r, c, ts[r]);
    }
  };
  // FP8: plain loads of 8 codes per staged chunk, converted to BF16, and the keys' scales.
  auto load_tile_fp8 = [&](int stage, int t) {
    uint8_t* base = stage0 + stage * kTileBytes;
    for_tile_chunks(t, [&](int r, int c, int64_t slot) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (slot >= 0)
        v = fp8x8_to_bf16x8(*reinterpret_cast<const uint2*>(p.k + slot * p.slot_bytes + c * 8));
      *reinterpret_cast<uint4*>(base + swz(r, c, kRowBytes)) = v;
    });
    if (tid < kKeys) {
      const int64_t sl = slots[(t & 1) * kKeys + tid];
      float* sc = scl0 + (stage * kKeys + tid) * 2;
      sc[0] = sl >= 0 ? p.k_scale[sl * p.k_scale_parts] : 0.0f;
      sc[1] = sl >= 0 ? p.k_scale[sl * p.k_scale_parts + 1] : 0.0f;
    }
  };
  auto load_tile = [&](int stage, int t) {
    if constexpr (kFp8) {
      load_tile_fp8(stage, t);
      return;
    }
    const uint32_t base = smem_u32(stage0 + stage * kTileBytes);
    for_tile_chunks(t, [&](int r, int c, int64_t slot) {
      const uint8_t* src = slot >= 0 ? p.k + slot * p.slot_bytes + c * 16 : p.k;
      ptx::cp_async16(base + swz(r, c, kRowBytes), src, slot >= 0);
    });
  };
  find_slots(0);
  find_slots(1);
  __syncthreads();  // tiles 0 and 1's slots visible
  load_tile(0, 0);
  ptx::cp_async_commit();

  // Q rows (heads h0..h0+15 of the token) as hi / lo BF16, zeros past dim or past the heads:
  // every load of the thread is issued before the first conversion.
  float qv[kQPairs][2];
#pragma unroll
  for (int n = 0; n < kQPairs; ++n) {
    const int i = tid + n * kThreads;
    const int r = i / (kMaxDim / 2), d = (i - r * (kMaxDim / 2)) * 2;
    const int h = h0 + r;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int dd = d + e;
      qv[n][e] = 0.0f;
      if (h < p.heads) {
        if (dd < p.q_dims)
          qv[n][e] = *reinterpret_cast<const float*>(p.q + token * p.q_ts + h * p.q_hs + dd * 4);
        else if (dd < dim)
          qv[n][e] = *reinterpret_cast<const float*>(p.q2 + token * p.q2_ts + h * p.q2_hs +
                                                     (dd - p.q_dims) * 4);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < kQPairs; ++n) {
    const int i = tid + n * kThreads;
    const int r = i / (kMaxDim / 2), d = (i - r * (kMaxDim / 2)) * 2;
    __nv_bfloat16 hi[2], lo[2];
    split_bf16(qv[n][0], hi[0], lo[0]);
    split_bf16(qv[n][1], hi[1], lo[1]);
    const uint32_t off = swz(r, d / 8, kRowBytes) + (d % 8) * 2;
    *reinterpret_cast<__nv_bfloat162*>(q_hi + off) = __halves2bfloat162(hi[0], hi[1]);
    if constexpr (kLo)
      *reinterpret_cast<__nv_bfloat162*>(q_lo + off) = __halves2bfloat162(lo[0], lo[1]);
  }

  // Per row (g = lane / 4 and g + 8): running max (base 2) and sum, the same in every warp.
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float o[8][4] = {};                       // value dims warp*64 + n*8 + c2 (+1), rows g / g + 8
  const int lm = lane >> 3, li = lane & 7;  // ldmatrix: matrix and row of this lane's address

  for (int t = 0; t < n_tiles; ++t) {
    const int k0 = key_begin + t * kKeys;
    __syncthreads();  // the other stage and P are free (previous tile done)
    if (t + 1 < n_tiles) load_tile((t + 1) & 1, t + 1);
    ptx::cp_async_commit();
    // Tile t's copies were issued before the barrier above, so its slot table is free: fill
    // it for tile t + 2 (read after the next iteration's first barrier).
    find_slots(t + 2);
    ptx::cp_async_wait<1>();
    __syncthreads();  // tile t (and Q) visible to every warp
    const uint32_t kv = smem_u32(stage0 + (t & 1) * kTileBytes);

    // S for keys warp*8 .. +8: A = Q (16 x 16 per step), B = 8 keys x 16 dims. Even and odd
    // steps, and the hi and lo products, go to separate accumulators: the chain of dependent
    // mma is a quarter of the steps.
    float sa[2][4] = {}, sl[2][4] = {};
    const uint32_t qh = smem_u32(q_hi), ql = smem_u32(q_lo);
    auto qk_step = [&](int kk, float(&acc)[4], float(&acc_lo)[4]) {
      uint32_t ah[4], b[2];
      const uint32_t a_off = swz((lm & 1) * 8 + li, kk / 8 + (lm >> 1), kRowBytes);
      ptx::ldmatrix_x4(ah, qh + a_off);
      ptx::ldmatrix_x2(b, kv + swz(warp * 8 + li, kk / 8 + (lm & 1), kRowBytes));
      ptx::mma_bf16(acc, ah, b[0], b[1]);
      if constexpr (kLo) {
        uint32_t al[4];
        ptx::ldmatrix_x4(al, ql + a_off);
        ptx::mma_bf16(acc_lo, al, b[0], b[1]);
      }
    };
    float s[4];
    const float* scl = scl0 + (t & 1) * kKeys * 2;  // FP8: this tile's (latent, rope) scales
    if constexpr (kFp8) {
      // The latent and rope dims have their own scales: separate sums, scaled per key.
      float sr[2][4] = {}, srl[2][4] = {};
      for (int kk = 0; kk < kR; kk += 32) {
        qk_step(kk, sa[0], sl[0]);
        qk_step(kk + 16, sa[1], sl[1]);
      }
      for (int kk = kR; kk < dim; kk += 32) {
        qk_step(kk, sr[0], srl[0]);
        if (kk + 16 < dim) qk_step(kk + 16, sr[1], srl[1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float* ks = scl + (warp * 8 + c2 + (e & 1)) * 2;
        s[e] = ((sa[0][e] + sa[1][e]) + (sl[0][e] + sl[1][e])) * ks[0] +
               ((sr[0][e] + sr[1][e]) + (srl[0][e] + srl[1][e])) * ks[1];
      }
    } else {
      for (int kk = 0; kk < dim; kk += 32) {
        qk_step(kk, sa[0], sl[0]);
        if (kk + 16 < dim) qk_step(kk + 16, sa[1], sl[1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] = (sa[0][e] + sa[1][e]) + (sl[0][e] + sl[1][e]);
    }
    // Base-2 scores; keys past the split are -inf.
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = k0 + warp * 8 + c2 + (e & 1);
      s[e] = key < key_end ? s[e] * p.scale_log2 : -INFINITY;
      tmax[e >> 1] = fmaxf(tmax[e >> 1], s[e]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
    }
    if ((lane & 3) == 0) {
      red_max[warp * kRows + g] = tmax[0];
      red_max[warp * kRows + g + 8] = tmax[1];
    }
    __syncthreads();
    float m_new[2], alpha[2], psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m_run[h];
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_max[w * kRows + g + 8 * h]);
      m_new[h] = mx;  // finite: every tile holds at least one key of the split
      alpha[h] = exp2f(m_run[h] - mx);
    }
    // P = 2^(s - m) as hi / lo BF16 into shared memory (row g / g + 8, key warp*8 + c2).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float p0 = exp2f(s[2 * h] - m_new[h]), p1 = exp2f(s[2 * h + 1] - m_new[h]);
      psum[h] = p0 + p1;
      const int r = g + 8 * h, col = warp * 8 + c2;
      // FP8: V = s_latent * codes, so P . V takes P * s_latent (the sum keeps plain P).
      const float v0 = kFp8 ? p0 * scl[col * 2] : p0, v1 = kFp8 ? p1 * scl[(col + 1) * 2] : p1;
      __nv_bfloat16 hi0, lo0, hi1, lo1;
      split_bf16(v0, hi0, lo0);
      split_bf16(v1, hi1, lo1);
      const uint32_t off = swz(r, col / 8, kKeys * 2) + (col % 8) * 2;
      *reinterpret_cast<__nv_bfloat162*>(p_hi + off) = __halves2bfloat162(hi0, hi1);
      if constexpr (kLo)
        *reinterpret_cast<__nv_bfloat162*>(p_lo + off) = __halves2bfloat162(lo0, lo1);
      psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], 1);
      psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], 2);
    }
    if ((lane & 3) == 0) {
      red_sum[warp * kRows + g] = psum[0];
      red_sum[warp * kRows + g + 8] = psum[1];
    }
    __syncthreads();  // P and the sums visible
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tsum = 0.0f;
      for (int w = 0; w < kWarps; ++w) tsum += red_sum[w * kRows + g + 8 * h];
      l_run[h] = l_run[h] * alpha[h] + tsum;
      m_run[h] = m_new[h];
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    // O[:, warp*64 .. +64] += P . V: A = P (16 x 16 keys), B = 16 keys x 16 dims (.trans).
    const uint32_t ph = smem_u32(p_hi), pl = smem_u32(p_lo);
#pragma unroll
    for (int kk = 0; kk < kKeys; kk += 16) {
      uint32_t ah[4], al[4];
      const uint32_t a_off = swz((lm & 1) * 8 + li, kk / 8 + (lm >> 1), kKeys * 2);
      ptx::ldmatrix_x4(ah, ph + a_off);
      if constexpr (kLo) ptx::ldmatrix_x4(al, pl + a_off);
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        uint32_t b[4];  // (keys 0-7, dims n), (keys 8-15, dims n), same for dims n + 1
        const int dchunk = (warp * 64 + n * 8) / 8 + (lm >> 1);
        ptx::ldmatrix_x4_trans(b, kv + swz(kk + (lm & 1) * 8 + li, dchunk, kRowBytes));
        ptx::mma_bf16(o[n], ah, b[0], b[1]);
        if constexpr (kLo) ptx::mma_bf16(o[n], al, b[0], b[1]);
        ptx::mma_bf16(o[n + 1], ah, b[2], b[3]);
        if constexpr (kLo) ptx::mma_bf16(o[n + 1], al, b[2], b[3]);
      }
    }
  }
  ptx::cp_async_wait<0>();

  store_rows(p, sk, split, h0, warp, lane, o, m_run, l_run);
}

// The register-Q kernel (BF16 cache, 64 rope dims): the kernel above re-reads Q's 16 x 576
// fragments (18 KB, 36 with lo) from shared memory in every warp for every tile, about twice
// the tile's own bytes, and runs its S loop over a run-time dim. Here Q lives in registers as
// mma A fragments: warp w takes dim group w / 2 (9 of the 36 16-dim k-steps: 36 registers, 72
// with lo) and key half w % 2 (32 keys), so a tile's keys are read from shared memory once. The
// four dim groups' partial scores meet in shared memory (summed in group order), and warp w
// then owns rows 2w, 2w + 1 for the softmax, so the row max and sum need no exchange between
// warps. P . V is the kernel above's (each warp 64 value dims). Three barriers per tile.
namespace regq {
constexpr int kDim = kR + 64;                     // 576 score dims
constexpr int kGroups = 4;                        // dim groups
constexpr int kGroupSteps = kDim / 16 / kGroups;  // 9 k-steps per group
constexpr int kSStride = kKeys + 8;  // floats per partial-score row: float2 stores conflict-free
constexpr int kRedBytes = kGroups * kRows * kSStride * 4;
// Two cache stages, partial scores, P hi / lo, per-row alpha / max / sum, two tiles' slots.
constexpr int kSmemBytes =
    2 * kTileBytes + kRedBytes + 2 * kPBytes + 3 * kRows * 4 + 2 * kSlotBytes;
static_assert(kDim == kMaxDim && kDim % (16 * kGroups) == 0, "dim groups of whole k-steps");
static_assert(kGroups * 2 == kWarps && kRows == 2 * kWarps, "warp roles");
}  // namespace regq

// Grid (num_seqs, splits, ceil(heads / 16)).
template <bool kLo>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_regq_kernel(const kern::AttnParams p) {
  pdl::enter();
  using namespace regq;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* stage0 = smem;
  float* red_s = reinterpret_cast<float*>(stage0 + 2 * kTileBytes);  // [group][row][kSStride]
  uint8_t* p_hi = stage0 + 2 * kTileBytes + kRedBytes;
  uint8_t* p_lo = p_hi + kPBytes;
  float* row_alpha = reinterpret_cast<float*>(p_lo + kPBytes);  // [kRows]
  float* row_m = row_alpha + kRows;                             // [kRows]
  float* row_l = row_m + kRows;                                 // [kRows]
  auto* slots = reinterpret_cast<int64_t*>(row_l + kRows);      // [2 tiles][kKeys]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int seq = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * kRows;
  SplitKeys sk;
  if (!split_keys(p, seq, split, h0, tid, sk)) return;
  const int token = sk.token, key_begin = sk.key_begin, key_end = sk.key_end;
  const int n_tiles = (key_end - key_begin + kKeys - 1) / kKeys;
  // Cache slot of key k of tile t (-1 past the split).
  auto slot_at = [&](int t, int k) -> int64_t {
    const int j = key_begin + t * kKeys + k;
    return j < key_end ? kern::slot_of(p, seq, j) : -1;
  };
  // Warp w copies key rows w * 8 .. + 8 of a tile; lane l chunks l, l + 32 (and l + 64 < 72).
  constexpr int kChunks = kDim / 8;
  auto load_tile = [&](int stage, int t) {
    const uint32_t base = smem_u32(stage0 + stage * kTileBytes);
    const int64_t* ts = slots + (t & 1) * kKeys;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = warp * 8 + i;
      const int64_t slot = ts[r];
      const uint8_t* row = p.k + slot * p.slot_bytes;
#pragma unroll
      for (int m = 0; m < 3; ++m) {
        const int c = lane + 32 * m;
        if (c < kChunks)
          ptx::cp_async16(base + swz(r, c, kRowBytes), slot >= 0 ? row + c * 16 : p.k, slot >= 0);
      }
    }
  };
  if (tid < 2 * kKeys && tid / kKeys < n_tiles) slots[tid] = slot_at(tid / kKeys, tid % kKeys);
  __syncthreads();  // tiles 0 and 1's slots visible
  load_tile(0, 0);
  ptx::cp_async_commit();

  // Q fragments of this warp's dim group (rows g / g + 8 = heads h0 + g (+ 8); zeros past the
  // heads), as hi (and lo) BF16 pairs; every load is issued before the first conversion.
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int grp = warp >> 1, half = warp & 1;
  float qv[kGroupSteps][4][2];
#pragma unroll
  for (int s = 0; s < kGroupSteps; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = h0 + g + 8 * (e & 1);
      const int d = (grp * kGroupSteps + s) * 16 + 8 * (e >> 1) + c2;
      const uint8_t* src = d < kR ? p.q + token * p.q_ts + head * p.q_hs + d * 4
                                  : p.q2 + token * p.q2_ts + head * p.q2_hs + (d - kR) * 4;
      const bool ok = head < p.heads;
      qv[s][e][0] = ok ? reinterpret_cast<const float*>(src)[0] : 0.0f;
      qv[s][e][1] = ok ? reinterpret_cast<const float*>(src)[1] : 0.0f;
    }
  uint32_t qh[kGroupSteps][4], ql[kGroupSteps][4];
#pragma unroll
  for (int s = 0; s < kGroupSteps; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      __nv_bfloat16 hi[2], lo[2];
      split_bf16(qv[s][e][0], hi[0], lo[0]);
      split_bf16(qv[s][e][1], hi[1], lo[1]);
      const __nv_bfloat162 h2 = __halves2bfloat162(hi[0], hi[1]);
      const __nv_bfloat162 l2 = __halves2bfloat162(lo[0], lo[1]);
      qh[s][e] = *reinterpret_cast<const uint32_t*>(&h2);
      ql[s][e] = *reinterpret_cast<const uint32_t*>(&l2);
    }

  // Softmax row of this lane (its warp's rows 2w, 2w + 1) and its 4 keys.
  const int ro = 2 * warp + (lane >> 4), kq = (lane & 15) * 4;
  float m_run = -INFINITY, l_run = 0.0f;
  float o[8][4] = {};                       // value dims warp*64 + n*8 + c2 (+1), rows g / g + 8
  const int lm = lane >> 3, li = lane & 7;  // ldmatrix: matrix and row of this lane's address

  for (int t = 0; t < n_tiles; ++t) {
    const int k0 = key_begin + t * kKeys;
    ptx::cp_async_wait<0>();
    // Tile t visible to every warp; every warp is past tile t - 1, so the other stage, the
    // partial scores and P are free.
    __syncthreads();
    if (t + 1 < n_tiles) load_tile((t + 1) & 1, t + 1);
    ptx::cp_async_commit();
    // Tile t + 2's slots: looked up now, stored into table t & 1 after P . V (no copy reads it
    // any more), read after the next barrier.
    int64_t next_slot = -1;
    if (tid < kKeys && t + 2 < n_tiles) next_slot = slot_at(t + 2, tid);
    const uint32_t kv = smem_u32(stage0 + (t & 1) * kTileBytes);

    // Partial S over this warp's 9 k-steps for keys half*32 .. +32 (n-tiles j = 0..3). The
    // wrappers are asm volatile, so their order is the issue order: each step's K fragments
    // are loaded one step ahead of their mma.
    float sa[4][4] = {}, sl[4][4] = {};
    // K fragments of step s: per 16 keys np, (keys 0-7, dims 0-7), (keys 0-7, dims 8-15), the
    // same for keys 8-15.
    auto load_k = [&](int s, uint32_t(&b)[2][4]) {
      const int chunk = (grp * kGroupSteps + s) * 2 + (lm & 1);
#pragma unroll
      for (int np = 0; np < 2; ++np)
        ptx::ldmatrix_x4(b[np],
                         kv + swz(half * 32 + np * 16 + (lm >> 1) * 8 + li, chunk, kRowBytes));
    };
    uint32_t kb[2][2][4];  // two steps' fragments in flight
    load_k(0, kb[0]);
#pragma unroll
    for (int s = 0; s < kGroupSteps; ++s) {
      if (s + 1 < kGroupSteps) load_k(s + 1, kb[(s + 1) & 1]);
      const uint32_t(&b)[2][4] = kb[s & 1];
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        ptx::mma_bf16(sa[2 * np], qh[s], b[np][0], b[np][1]);
        ptx::mma_bf16(sa[2 * np + 1], qh[s], b[np][2], b[np][3]);
      }
      if constexpr (kLo) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          ptx::mma_bf16(sl[2 * np], ql[s], b[np][0], b[np][1]);
          ptx::mma_bf16(sl[2 * np + 1], ql[s], b[np][2], b[np][3]);
        }
      }
    }
    float* rs = red_s + grp * kRows * kSStride;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int key = half * 32 + j * 8 + c2;
      *reinterpret_cast<float2*>(rs + g * kSStride + key) =
          make_float2(sa[j][0] + sl[j][0], sa[j][1] + sl[j][1]);
      *reinterpret_cast<float2*>(rs + (g + 8) * kSStride + key) =
          make_float2(sa[j][2] + sl[j][2], sa[j][3] + sl[j][3]);
    }
    __syncthreads();  // partial scores visible

    // Row ro, keys kq .. kq + 3: the four groups' sums, base-2 scores, -inf past the split.
    float sv[4];
    {
      float4 x[kGroups];
#pragma unroll
      for (int q = 0; q < kGroups; ++q)
        x[q] = *reinterpret_cast<const float4*>(red_s + (q * kRows + ro) * kSStride + kq);
      sv[0] = ((x[0].x + x[1].x) + x[2].x) + x[3].x;
      sv[1] = ((x[0].y + x[1].y) + x[2].y) + x[3].y;
      sv[2] = ((x[0].z + x[1].z) + x[2].z) + x[3].z;
      sv[3] = ((x[0].w + x[1].w) + x[2].w) + x[3].w;
    }
    float tmax = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sv[i] = k0 + kq + i < key_end ? sv[i] * p.scale_log2 : -INFINITY;
      tmax = fmaxf(tmax, sv[i]);
    }
#pragma unroll
    for (int x = 1; x < 16; x <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, x));
    const float m_new = fmaxf(m_run, tmax);  // finite: every tile holds a key of the split
    const float alpha = exp2f(m_run - m_new);
    float pv[4], psum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pv[i] = exp2f(sv[i] - m_new);
      psum += pv[i];
    }
#pragma unroll
    for (int x = 1; x < 16; x <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, x);
    l_run = l_run * alpha + psum;
    m_run = m_new;
    {
      __nv_bfloat16 hi[4], lo[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) split_bf16(pv[i], hi[i], lo[i]);
      const uint32_t off = swz(ro, kq / 8, kKeys * 2) + (kq % 8) * 2;
      const __nv_bfloat162 h01 = __halves2bfloat162(hi[0], hi[1]);
      const __nv_bfloat162 h23 = __halves2bfloat162(hi[2], hi[3]);
      *reinterpret_cast<uint2*>(p_hi + off) = make_uint2(*reinterpret_cast<const uint32_t*>(&h01),
                                                         *reinterpret_cast<const uint32_t*>(&h23));
      if constexpr (kLo) {
        const __nv_bfloat162 l01 = __halves2bfloat162(lo[0], lo[1]);
        const __nv_bfloat162 l23 = __halves2bfloat162(lo[2], lo[3]);
        *reinterpret_cast<uint2*>(p_lo + off) = make_uint2(
            *reinterpret_cast<const uint32_t*>(&l01), *reinterpret_cast<const uint32_t*>(&l23));
      }
    }
    if ((lane & 15) == 0) row_alpha[ro] = alpha;
    __syncthreads();  // P and the rows' alpha visible

    const float a0 = row_alpha[g], a1 = row_alpha[g + 8];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      o[n][0] *= a0;
      o[n][1] *= a0;
      o[n][2] *= a1;
      o[n][3] *= a1;
    }
    // O[:, warp*64 .. +64] += P . V: A = P (16 x 16 keys), B = 16 keys x 16 dims (.trans).
    // Per 16 keys: every fragment load first, then the hi products of the 8 accumulators, then
    // the lo ones (each accumulator still takes hi before lo, as in the first kernel).
    const uint32_t ph = smem_u32(p_hi), pl = smem_u32(p_lo);
#pragma unroll
    for (int kk = 0; kk < kKeys; kk += 16) {
      uint32_t ah[4], al[4], b[4][4];  // b[n / 2]: (keys 0-7, dims n), (keys 8-15, dims n), n + 1
      const uint32_t a_off = swz((lm & 1) * 8 + li, kk / 8 + (lm >> 1), kKeys * 2);
      ptx::ldmatrix_x4(ah, ph + a_off);
      if constexpr (kLo) ptx::ldmatrix_x4(al, pl + a_off);
#pragma unroll
      for (int n = 0; n < 8; n += 2)
        ptx::ldmatrix_x4_trans(b[n / 2], kv + swz(kk + (lm & 1) * 8 + li,
                                                  (warp * 64 + n * 8) / 8 + (lm >> 1), kRowBytes));
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        ptx::mma_bf16(o[n], ah, b[n / 2][0], b[n / 2][1]);
        ptx::mma_bf16(o[n + 1], ah, b[n / 2][2], b[n / 2][3]);
      }
      if constexpr (kLo) {
#pragma unroll
        for (int n = 0; n < 8; n += 2) {
          ptx::mma_bf16(o[n], al, b[n / 2][0], b[n / 2][1]);
          ptx::mma_bf16(o[n + 1], al, b[n / 2][2], b[n / 2][3]);
        }
      }
    }
    if (tid < kKeys && t + 2 < n_tiles) slots[(t & 1) * kKeys + tid] = next_slot;
  }
  ptx::cp_async_wait<0>();
  if ((lane & 15) == 0) {
    row_m[ro] = m_run;
    row_l[ro] = l_run;
  }
  __syncthreads();  // every row's max and sum visible

  const float m_rows[2] = {row_m[g], row_m[g + 8]}, l_rows[2] = {row_l[g], row_l[g + 8]};
  store_rows(p, sk, split, h0, warp, lane, o, m_rows, l_rows);
}

}  // namespace

bool mla_decode_fits(const kern::AttnParams& a) {
  const int P = a.dim - a.dv;
  const bool fp8 = a.cache_type == kern::kCacheFP8;
  const bool cache_ok = a.cache_type == kern::kCacheBF16 ||
                        (fp8 && a.rope_split == kR && a.k_scale_parts == 2 && a.k_scale != nullptr);
  // FP8 rows are read 8 codes at a time (8-byte loads); BF16 rows by 16-byte cp.async.
  const int align = fp8 ? 8 : 16;
  return cache_ok && a.dv == kR && P >= 0 && P <= kMlaDecodeMaxRope && P % 16 == 0 &&
         a.num_tokens == a.num_seqs && a.kv_heads == 1 && a.slot_bytes % align == 0 &&
         reinterpret_cast<uintptr_t>(a.k) % align == 0;
}

int mla_decode_splits(const kern::AttnParams& a, int sm_count) {
  const int ctas = a.num_seqs * ((a.heads + kRows - 1) / kRows);
  if (ctas >= sm_count) return 1;
  const int64_t capacity = int64_t(a.max_blocks_per_seq) * a.block_size;
  const int64_t by_capacity = std::max<int64_t>(1, (capacity + kKeys - 1) / kKeys);
  // At most 16 while the context is short (the merge reads every split's partial, and a split
  // of a few tiles already streams well); long contexts may take one split per 4 tiles, up to
  // 128, so a lone 32k-token sequence streams from most SMs instead of 16 (H200: a 32k TPOT of
  // 11.5 ms against 4.2 ms at 1k with 16 splits).
  const int64_t cap = std::clamp<int64_t>(by_capacity / 4, kMaxSplits, kMaxLongSplits);
  // One CTA fits an SM (its shared memory), so the grid should be one wave: rounding the split
  // count up would start a second, mostly idle wave (W5's 8 x 128 heads: 64 CTAs x 3 splits =
  // 192 on 132 SMs took two waves of 7 tiles each; 2 splits take one of 10).
  return int(std::min<int64_t>({sm_count / ctas, by_capacity, cap}));
}

void launch_mla_decode(const kern::AttnParams& a, cudaStream_t stream, bool bf16_qp) {
  // Raised once per device before the first launch (outside any graph capture).
  static std::atomic<uint64_t> smem_set{0};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (!(smem_set.load() & bit)) {
    for (const void* kernel : {reinterpret_cast<const void*>(mla_decode_kernel<false, true>),
                               reinterpret_cast<const void*>(mla_decode_kernel<true, true>),
                               reinterpret_cast<const void*>(mla_decode_kernel<false, false>),
                               reinterpret_cast<const void*>(mla_decode_kernel<true, false>)})
      check_cuda(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
          "mla decode smem limit");
    for (const void* kernel : {reinterpret_cast<const void*>(mla_decode_regq_kernel<true>),
                               reinterpret_cast<const void*>(mla_decode_regq_kernel<false>)})
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      regq::kSmemBytes),
                 "mla decode smem limit");
    smem_set.fetch_or(bit);
  }
  const dim3 grid(unsigned(a.num_seqs), unsigned(a.splits),
                  unsigned((a.heads + kRows - 1) / kRows));
  const bool fp8 = a.cache_type == kern::kCacheFP8;
  // The register-Q kernel: BF16 cache, 64 rope dims, the latent from q (DeepSeek-V2 / V3).
  if (!fp8 && a.dim == regq::kDim && a.q_dims == kR && g_mla_decode_regq.on()) {
    if (bf16_qp)
      pdl::launch(mla_decode_regq_kernel<false>, grid, kThreads, regq::kSmemBytes, stream, a);
    else
      pdl::launch(mla_decode_regq_kernel<true>, grid, kThreads, regq::kSmemBytes, stream, a);
    check_cuda(cudaGetLastError(), "mla decode kernel");
    return;
  }
  if (fp8 && !bf16_qp)
    pdl::launch(mla_decode_kernel<true, true>, grid, kThreads, kSmemBytes, stream, a);
  else if (!bf16_qp)
    pdl::launch(mla_decode_kernel<false, true>, grid, kThreads, kSmemBytes, stream, a);
  else if (fp8)
    pdl::launch(mla_decode_kernel<true, false>, grid, kThreads, kSmemBytes, stream, a);
  else
    pdl::launch(mla_decode_kernel<false, false>, grid, kThreads, kSmemBytes, stream, a);
  check_cuda(cudaGetLastError(), "mla decode kernel");
}

}  // namespace ds::cuda
