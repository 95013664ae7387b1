// MLA decode attention, the register-Q kernel (BF16 cache, 64 rope dims). The first kernel
// (attention_mla_decode.cu, whose launcher tries this one first) re-reads Q's 16 x 576
// fragments (18 KB, 36 with lo) from shared memory in every warp for every tile, about twice the
// tile's own bytes, and runs its S loop over a run-time dim. Here Q lives in registers as
// mma A fragments: warp w takes dim group w / 2 (9 of the 36 16-dim k-steps: 36 registers, 72
// with lo) and key half w % 2 (32 keys), so a tile's keys are read from shared memory once. The
// four dim groups' partial scores meet in shared memory (summed in group order), and warp w
// then owns rows 2w, 2w + 1 for the softmax, so the row max and sum need no exchange between
// warps. P . V is the first kernel's (each warp 64 value dims). Three barriers per tile.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

#include "backend/cuda/attention_mla_decode_tiles.cuh"
#include "backend/cuda/device_log.h"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"

namespace ds::cuda::mla_decode {
namespace {

namespace regq {
constexpr int kDim = kR + 64;                     // 576 score dims
constexpr int kGroups = 4;                        // dim groups
constexpr int kGroupSteps = kDim / 16 / kGroups;  // 9 k-steps per group
constexpr int kSStride = kKeys + 8;  // floats per partial-score row: float2 stores conflict-free
// kH: 16-row halves per CTA (2: 32 heads, BF16 Q / P only; mla_decode_rows).
template <int kH>
constexpr int kRedBytes = 4 * (kGroups * kH * kRows * kSStride);
// Two cache stages, partial scores, P hi / lo (kH = 2: P of both halves, hi only), per-row
// alpha / max / sum, two tiles' slots.
template <int kH>
constexpr int kSmemBytes = 2 * kTileBytes + kRedBytes<kH> + 2 * kPBytes + 4 * (3 * kH * kRows) +
                           2 * kSlotBytes;
static_assert(kDim == kMaxDim && kDim % (16 * kGroups) == 0, "dim groups of whole k-steps");
// The in-cluster merge's parts ([kH][kRows][kR] F32) and scratch (merge_gathered) in the stages.
static_assert((2 * kRows * kR + (3 * kMaxClusterSize + 1) * kRows) * 4 <= 2 * kTileBytes,
              "the merge's shared memory fits the stages");
static_assert(kGroups * 2 == kWarps && kRows == 2 * kWarps, "warp roles");
}  // namespace regq

// Each 16-row half's splits merged in the cluster, one half after the other: part holds
// [kH][kRows][kR] F32 (stash_rows), row_m / row_l [kH][kRows]; the scratch follows the parts.
template <int kH>
__device__ __forceinline__ void merge_halves(const kern::AttnParams& p, int token, int h0,
                                             float* part, const float* row_m, const float* row_l) {
#pragma unroll 1
  for (int hf = 0; hf < kH; ++hf)
    merge_in_cluster(p, token, h0 + hf * kRows, part + hf * kRows * kR, row_m + hf * kRows,
                     row_l + hf * kRows, part + kH * kRows * kR);
}

// Grid (num_seqs, splits, ceil(heads / (16 kH))). With p.early_cache the split's keys, their
// cache slots and the first tile's copies are issued before the dependent-launch wait (none of
// them is the previous kernel's output); Q is read after it. kCl: the splits of a (sequence, head
// chunk) are one cluster and merge there (merge_in_cluster), writing the output; no partials.
// kH = 2 (BF16 Q / P only): 32 heads a CTA, two 16-row halves that share each K fragment and V
// fragment a warp loads (twice the mma per staged tile, half the CTAs per sequence and so half
// the cache reads: many-head models, W5's 128 heads); the halves' rows are the 16-row kernel's.
template <bool kLo, bool kCl, int kH>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_regq_kernel(const kern::AttnParams p) {
  static_assert(kH == 1 || (kH == 2 && !kLo), "two halves with BF16 Q / P only (registers)");
  PhaseLog plog;
  plog.open(p);
  if (!p.early_cache) pdl::enter();
  using namespace regq;
  constexpr int kRowsH = kH * kRows;  // heads per CTA
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* stage0 = smem;
  float* red_s = reinterpret_cast<float*>(stage0 + 2 * kTileBytes);  // [group][row][kSStride]
  uint8_t* p_hi = stage0 + 2 * kTileBytes + kRedBytes<kH>;           // kH = 2: rows 16-31 at p_lo
  uint8_t* p_lo = p_hi + kPBytes;
  float* row_alpha = reinterpret_cast<float*>(p_lo + kPBytes);  // [kRowsH]
  float* row_m = row_alpha + kRowsH;                            // [kRowsH]
  float* row_l = row_m + kRowsH;                                // [kRowsH]
  auto* slots = reinterpret_cast<int64_t*>(row_l + kRowsH);     // [2 tiles][kKeys]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int seq = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * kRowsH;
  SplitKeys sk;
  if (!split_keys(p, seq, split, h0, tid, sk, !kCl, kRowsH)) {
    if constexpr (kCl) {  // no keys: the cluster still counts this CTA, as an empty split
      if (p.early_cache) pdl::enter();  // the merge writes the output
      if (tid < kRowsH) {
        row_m[tid] = -INFINITY;
        row_l[tid] = 0.0f;
      }
      merge_halves<kH>(p, sk.token, h0, reinterpret_cast<float*>(stage0), row_m, row_l);
    }
    plog.close(seq, split, 0);
    return;
  }
  const int token = sk.token, key_begin = sk.key_begin, key_end = sk.key_end;
  const int n_tiles = (key_end - key_begin + kKeys - 1) / kKeys;
  // Cache slot of key k of tile t (-1 past the split).
  auto slot_at = [&](int t, int k) -> int64_t {
    const int j = key_begin + t * kKeys + k;
    return j < key_end ? kern::slot_of(p, seq, j) : -1;
  };
  // Warp w copies key rows w * 8 .. + 8 of a tile; lane l chunks l, l + 32 (and l + 64 < 72).
  constexpr int kChunks = kDim / 8;
  static_assert(kChunks > 64 && kChunks <= 96, "three chunks a lane, the third for some lanes");
  const uint8_t* row0 = p.k + lane * 16;  // this lane's first chunk of cache row (slot) 0
  const uint32_t slot_bytes = uint32_t(p.slot_bytes);
  auto load_tile = [&](int stage, int t) {
    const uint32_t base = smem_u32(stage0 + stage * kTileBytes);
    const int64_t* ts = slots + (t & 1) * kKeys;
    // A row's addresses are formed once: row r = warp * 8 + i has (r & 7) = i, so chunk
    // c = lane + 32 m lands at swz(r, lane) + 512 m, and a key past the split reads (nothing
    // from) row 0; the third chunk is a predicated copy, not a branch. (Per chunk, with the
    // row's 64-bit product and the select redone each time and the third chunk a divergent
    // branch, a tile's copies took ~50 instructions a row, ~400 of the ~1,000 a tile took; on
    // the H200 this form with Q pairs took W3 2.79 -> 2.73 ms, docs/PERFORMANCE.md.)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = warp * 8 + i;
      const int64_t slot = ts[r];
      const bool ok = slot >= 0;
      // Slots and row sizes fit 32 bits (kern::slot_of's block * block_size + offset is formed
      // from int32 block ids; mla_decode_fits bounds slot_bytes): one wide product.
      const uint8_t* src = row0 + uint64_t(ok ? uint32_t(slot) : 0u) * slot_bytes;
      const uint32_t dst =
          base + uint32_t(r * kRowBytes) + uint32_t(((lane & ~7) | ((lane ^ i) & 7)) << 4);
      ptx::cp_async16_x3<512>(dst, src, !ok, lane + 64 < kChunks);
    }
  };
  if (tid < 2 * kKeys && tid / kKeys < n_tiles) slots[tid] = slot_at(tid / kKeys, tid % kKeys);
  __syncthreads();  // tiles 0 and 1's slots visible
  plog.mark(1);
  load_tile(0, 0);
  ptx::cp_async_commit();
  plog.mark(2);
  if (p.early_cache) pdl::enter();
  plog.mark(3);

  // Q fragments of this warp's dim group (rows g / g + 8 = heads h0 + g (+ 8); zeros past the
  // heads), as hi (and lo) BF16 pairs; every load is issued before the first conversion. Element
  // d = step * 16 + 8 * (e >> 1) + c2 of a row is latent (q) for step < kR / 16, else rope (q2):
  // each row's two bases are found once, each step picks one, the rest is an immediate offset
  // (per element, the choice took ~37 instructions of 64-bit arithmetic and a branch).
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int grp = warp >> 1, half = warp & 1;
  uint32_t qh[kH][kGroupSteps][4], ql[kGroupSteps][4];
  // Half hf's rows: heads h0 + 16 hf + g (+ 8). kH = 2 loads and converts one half at a time.
#pragma unroll
  for (int hf = 0; hf < kH; ++hf) {
    const uint8_t* q_lat[2];
    const uint8_t* q_rope[2];
    bool q_ok[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int head = h0 + hf * kRows + g + 8 * hh;
      q_ok[hh] = head < p.heads;
      // p.q_split2: a padding row (past the heads) reads the chunk's first head and is zeroed
      // after: every load unconditional (each load under a branch took its own branch region).
      const int hc = p.q_split2 && !q_ok[hh] ? h0 : head;
      q_lat[hh] = p.q + token * p.q_ts + hc * p.q_hs + c2 * 4;
      q_rope[hh] = p.q2 + token * p.q2_ts + hc * p.q2_hs + c2 * 4;
    }
    float qv[kGroupSteps][4][2];
    // Each element pair (c2, c2 + 1) in one 8-byte load where every Q row is 8-byte aligned
    // (p.q_pairs), else two.
    auto q_src = [&](int s, int e) {
      const int step = grp * kGroupSteps + s;
      const bool lat = step < kR / 16;
      const int64_t off = int64_t(lat ? step : step - kR / 16) * 64;
      return reinterpret_cast<const float*>((lat ? q_lat[e & 1] : q_rope[e & 1]) + off +
                                            32 * (e >> 1));
    };
    if (p.q_split2) {
      // DEEPSERVE_MLA_Q_SPLIT2: unconditional loads, then each pair split into hi + lo at once
      // (split_bf16x2: the same roundings).
#pragma unroll
      for (int s = 0; s < kGroupSteps; ++s)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float* src = q_src(s, e);
          if (p.q_pairs) {
            const float2 v = *reinterpret_cast<const float2*>(src);
            qv[s][e][0] = v.x;
            qv[s][e][1] = v.y;
          } else {
            qv[s][e][0] = src[0];
            qv[s][e][1] = src[1];
          }
        }
#pragma unroll
      for (int s = 0; s < kGroupSteps; ++s)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool ok = q_ok[e & 1];
          split_bf16x2(ok ? qv[s][e][0] : 0.0f, ok ? qv[s][e][1] : 0.0f, qh[hf][s][e], ql[s][e]);
        }
    } else {
      if (p.q_pairs) {
#pragma unroll
        for (int s = 0; s < kGroupSteps; ++s)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 v = q_ok[e & 1] ? *reinterpret_cast<const float2*>(q_src(s, e))
                                         : make_float2(0.0f, 0.0f);
            qv[s][e][0] = v.x;
            qv[s][e][1] = v.y;
          }
      } else {
#pragma unroll
        for (int s = 0; s < kGroupSteps; ++s)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float* src = q_src(s, e);
            qv[s][e][0] = q_ok[e & 1] ? src[0] : 0.0f;
            qv[s][e][1] = q_ok[e & 1] ? src[1] : 0.0f;
          }
      }
#pragma unroll
      for (int s = 0; s < kGroupSteps; ++s)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          __nv_bfloat16 hi[2], lo[2];
          split_bf16(qv[s][e][0], hi[0], lo[0]);
          split_bf16(qv[s][e][1], hi[1], lo[1]);
          const __nv_bfloat162 h2 = __halves2bfloat162(hi[0], hi[1]);
          const __nv_bfloat162 l2 = __halves2bfloat162(lo[0], lo[1]);
          qh[hf][s][e] = *reinterpret_cast<const uint32_t*>(&h2);
          ql[s][e] = *reinterpret_cast<const uint32_t*>(&l2);
        }
    }
  }
  plog.mark(4);

  // Softmax row of this lane in each half (its warp's rows 2w, 2w + 1) and its 4 keys.
  const int ro = 2 * warp + (lane >> 4), kq = (lane & 15) * 4;
  float m_run[kH], l_run[kH];
#pragma unroll
  for (int hf = 0; hf < kH; ++hf) m_run[hf] = -INFINITY, l_run[hf] = 0.0f;
  float o[kH][8][4] = {};  // value dims warp*64 + n*8 + c2 (+1), rows 16 hf + g / + 8
  const int lm = lane >> 3, li = lane & 7;  // ldmatrix: matrix and row of this lane's address

  for (int t = 0; t < n_tiles; ++t) {
    const int k0 = key_begin + t * kKeys;
    ptx::cp_async_wait<0>();
    // Tile t visible to every warp; every warp is past tile t - 1, so the other stage, the
    // partial scores and P are free.
    __syncthreads();
    if (t == 0) plog.mark(5);
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
    float sa[kH][4][4] = {}, sl[4][4] = {};
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
      for (int hf = 0; hf < kH; ++hf)
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          ptx::mma_bf16(sa[hf][2 * np], qh[hf][s], b[np][0], b[np][1]);
          ptx::mma_bf16(sa[hf][2 * np + 1], qh[hf][s], b[np][2], b[np][3]);
        }
      if constexpr (kLo) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          ptx::mma_bf16(sl[2 * np], ql[s], b[np][0], b[np][1]);
          ptx::mma_bf16(sl[2 * np + 1], ql[s], b[np][2], b[np][3]);
        }
      }
    }
    float* rs = red_s + grp * kRowsH * kSStride;
#pragma unroll
    for (int hf = 0; hf < kH; ++hf)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = half * 32 + j * 8 + c2, r = hf * kRows + g;
        *reinterpret_cast<float2*>(rs + r * kSStride + key) =
            make_float2(sa[hf][j][0] + sl[j][0], sa[hf][j][1] + sl[j][1]);
        *reinterpret_cast<float2*>(rs + (r + 8) * kSStride + key) =
            make_float2(sa[hf][j][2] + sl[j][2], sa[hf][j][3] + sl[j][3]);
      }
    __syncthreads();  // partial scores visible

#pragma unroll
    for (int hf = 0; hf < kH; ++hf) {
      const int r = hf * kRows + ro;  // this lane's softmax row of the CTA's kRowsH

      // Row r, keys kq .. kq + 3: the four groups' sums, base-2 scores, -inf past the split.
      float sv[4];
      {
        float4 x[kGroups];
#pragma unroll
        for (int q = 0; q < kGroups; ++q)
          x[q] = *reinterpret_cast<const float4*>(red_s + (q * kRowsH + r) * kSStride + kq);
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
      const float m_new = fmaxf(m_run[hf], tmax);  // finite: every tile holds a key of the split
      const float alpha = exp2f(m_run[hf] - m_new);
      float pv[4], psum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pv[i] = exp2f(sv[i] - m_new);
        psum += pv[i];
      }
#pragma unroll
      for (int x = 1; x < 16; x <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, x);
      l_run[hf] = l_run[hf] * alpha + psum;
      m_run[hf] = m_new;
      {
        __nv_bfloat16 hi[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) split_bf16(pv[i], hi[i], lo[i]);
        const uint32_t off = swz(r, kq / 8, kKeys * 2) + (kq % 8) * 2;
        const __nv_bfloat162 h01 = __halves2bfloat162(hi[0], hi[1]);
        const __nv_bfloat162 h23 = __halves2bfloat162(hi[2], hi[3]);
        *reinterpret_cast<uint2*>(p_hi + off) = make_uint2(
            *reinterpret_cast<const uint32_t*>(&h01), *reinterpret_cast<const uint32_t*>(&h23));
        if constexpr (kLo) {
          const __nv_bfloat162 l01 = __halves2bfloat162(lo[0], lo[1]);
          const __nv_bfloat162 l23 = __halves2bfloat162(lo[2], lo[3]);
          *reinterpret_cast<uint2*>(p_lo + off) = make_uint2(
              *reinterpret_cast<const uint32_t*>(&l01), *reinterpret_cast<const uint32_t*>(&l23));
        }
      }
      if ((lane & 15) == 0) row_alpha[r] = alpha;
    }
    __syncthreads();  // P and the rows' alpha visible

#pragma unroll
    for (int hf = 0; hf < kH; ++hf) {
      const float a0 = row_alpha[hf * kRows + g], a1 = row_alpha[hf * kRows + g + 8];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        o[hf][n][0] *= a0;
        o[hf][n][1] *= a0;
        o[hf][n][2] *= a1;
        o[hf][n][3] *= a1;
      }
    }
    // O[:, warp*64 .. +64] += P . V: A = P (16 x 16 keys), B = 16 keys x 16 dims (.trans).
    // Per 16 keys: every fragment load first, then the hi products of the 8 accumulators, then
    // the lo ones (each accumulator still takes hi before lo, as in the first kernel).
    const uint32_t ph = smem_u32(p_hi), pl = smem_u32(p_lo);
#pragma unroll
    for (int kk = 0; kk < kKeys; kk += 16) {
      // b[n / 2]: (keys 0-7, dims n), (keys 8-15, dims n), n + 1; ah[hf]: half hf's P.
      uint32_t ah[kH][4], al[4], b[4][4];
      const uint32_t a_off = swz((lm & 1) * 8 + li, kk / 8 + (lm >> 1), kKeys * 2);
#pragma unroll
      for (int hf = 0; hf < kH; ++hf) ptx::ldmatrix_x4(ah[hf], ph + a_off + hf * kPBytes);
      if constexpr (kLo) ptx::ldmatrix_x4(al, pl + a_off);
#pragma unroll
      for (int n = 0; n < 8; n += 2)
        ptx::ldmatrix_x4_trans(b[n / 2], kv + swz(kk + (lm & 1) * 8 + li,
                                                  (warp * 64 + n * 8) / 8 + (lm >> 1), kRowBytes));
#pragma unroll
      for (int hf = 0; hf < kH; ++hf)
#pragma unroll
        for (int n = 0; n < 8; n += 2) {
          ptx::mma_bf16(o[hf][n], ah[hf], b[n / 2][0], b[n / 2][1]);
          ptx::mma_bf16(o[hf][n + 1], ah[hf], b[n / 2][2], b[n / 2][3]);
        }
      if constexpr (kLo) {
#pragma unroll
        for (int n = 0; n < 8; n += 2) {
          ptx::mma_bf16(o[0][n], al, b[n / 2][0], b[n / 2][1]);
          ptx::mma_bf16(o[0][n + 1], al, b[n / 2][2], b[n / 2][3]);
        }
      }
    }
    if (tid < kKeys && t + 2 < n_tiles) slots[(t & 1) * kKeys + tid] = next_slot;
    if (t == 0) plog.mark(6);
  }
  ptx::cp_async_wait<0>();
  if ((lane & 15) == 0)
#pragma unroll
    for (int hf = 0; hf < kH; ++hf) {
      row_m[hf * kRows + ro] = m_run[hf];
      row_l[hf * kRows + ro] = l_run[hf];
    }
  __syncthreads();  // every row's max and sum visible
  plog.mark(7);

  if constexpr (kCl) {
    // The barrier above: every warp is past its last tile, so the stages are free for part.
    float* part = reinterpret_cast<float*>(stage0);
#pragma unroll
    for (int hf = 0; hf < kH; ++hf) stash_rows(part + hf * kRows * kR, warp, lane, o[hf]);
    merge_halves<kH>(p, token, h0, part, row_m, row_l);
  } else {
#pragma unroll
    for (int hf = 0; hf < kH; ++hf) {
      const float* m = row_m + hf * kRows;
      const float* l = row_l + hf * kRows;
      const float m_rows[2] = {m[g], m[g + 8]}, l_rows[2] = {l[g], l[g + 8]};
      store_rows(p, sk, split, h0 + hf * kRows, warp, lane, o[hf], m_rows, l_rows);
    }
  }
  plog.close(seq, split, n_tiles);
}

// The kernel's shared-memory limit (allow_smem: per device, as every launch did before the
// cluster variants) and, for those, non-portable cluster sizes (once per process, as
// gemm_wq.cu's prepare_dense sets them).
template <bool kLo, bool kCl, int kH>
void prepare_regq() {
  allow_smem<mla_decode_regq_kernel<kLo, kCl, kH>>(regq::kSmemBytes<kH>);
  if constexpr (kCl) {
    static const bool ready = [] {
      check_cuda(cudaFuncSetAttribute(mla_decode_regq_kernel<kLo, kCl, kH>,
                                      cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                 "mla decode cluster size");
      return true;
    }();
    (void)ready;
  }
}

// How many clusters of `size` CTAs (one split each) of the kernel with kH halves the device
// holds at once (asked once per size; 0 if it cannot tell).
template <int kH>
int max_active_clusters(int size) {
  static std::atomic<int> known[kMaxClusterSize + 1] = {};  // count + 1; 0: not asked
  const int k = known[size].load(std::memory_order_relaxed);
  if (k > 0) return k - 1;
  constexpr bool kLo = kH == 1;  // the 16-row kernel's hi + lo form (the same shared memory)
  prepare_regq<kLo, true, kH>();
  const int n =
      cuda::max_active_clusters(mla_decode_regq_kernel<kLo, true, kH>, dim3(1, unsigned(size), 1),
                                kThreads, regq::kSmemBytes<kH>);
  known[size].store(n + 1, std::memory_order_relaxed);
  return n;
}

// Whether the register-Q kernel takes `a` (BF16 cache, 64 rope dims, the latent from q, not
// switched off).
bool regq_takes(const kern::AttnParams& a) {
  return a.cache_type != kern::kCacheFP8 && a.dim == regq::kDim && a.q_dims == kR &&
         g_mla_decode_regq.on();
}

// DEEPSERVE_MLA_PHASES (attention_mla_decode.cuh).
DeviceLog g_phase_log{"DEEPSERVE_MLA_PHASES", kMlaPhaseWords, 400000};

}  // namespace

bool launch_regq(const kern::AttnParams& a, cudaStream_t stream, bool bf16_qp, bool& merged) {
  merged = false;
  if (!regq_takes(a)) return false;
  const int rows = a.mla_rows;  // mla_decode_rows: 32 only for BF16 Q / P
  DS_CHECK(rows == kRows || (rows == 2 * kRows && bf16_qp),
           "mla decode: 32 rows a CTA take BF16 Q / P");
  const dim3 grid(unsigned(a.num_seqs), unsigned(a.splits), unsigned((a.heads + rows - 1) / rows));
  kern::AttnParams k = a;
  k.early_cache = a.early_cache && g_mla_early.on() ? 1 : 0;
  k.merge_gather = g_mla_merge_gather.on() ? 1 : 0;
  k.q_split2 = g_mla_q_split2.on() ? 1 : 0;
  const uint64_t q_bits = reinterpret_cast<uintptr_t>(a.q) | reinterpret_cast<uintptr_t>(a.q2) |
                          uint64_t(a.q_ts | a.q_hs | a.q2_ts | a.q2_hs);
  k.q_pairs = g_mla_q_pairs.on() && q_bits % 8 == 0 ? 1 : 0;
  const DeviceLogView log = g_phase_log.view();
  k.phase_log = log.buf;
  k.phase_cap = log.cap;
  k.phase_skip = log.skip;
  merged = mla_decode_merges_in_cluster(a);
  auto go = [&]<bool kLo, bool kCl, int kH>() {
    prepare_regq<kLo, kCl, kH>();
    const dim3 cluster(1, kCl ? unsigned(a.splits) : 1u, 1);
    pdl::launch_clusters(mla_decode_regq_kernel<kLo, kCl, kH>, grid, kThreads, regq::kSmemBytes<kH>,
                         stream, cluster, k);
  };
  if (rows == 2 * kRows && merged)
    go.template operator()<false, true, 2>();
  else if (rows == 2 * kRows)
    go.template operator()<false, false, 2>();
  else if (bf16_qp && merged)
    go.template operator()<false, true, 1>();
  else if (bf16_qp)
    go.template operator()<false, false, 1>();
  else if (merged)
    go.template operator()<true, true, 1>();
  else
    go.template operator()<true, false, 1>();
  check_cuda(cudaGetLastError(), "mla decode kernel");
  return true;
}

}  // namespace ds::cuda::mla_decode

namespace ds::cuda {

void mla_phase_log_start() {
  mla_decode::g_phase_log.start();
}

void mla_phase_log_write() {
  using mla_decode::kMlaPhases;
  std::string header = "seq\tsplit\ttiles\tsm\tchunk\tstart_ns\tend_ns";
  for (int i = 0; i < kMlaPhases; ++i) header += "\tc" + std::to_string(i);
  mla_decode::g_phase_log.write(header, [](std::ostream& f, const unsigned long long* w) {
    if (w[3] == 0)
      return false;  // a CTA still running when the copy was taken (none, after a sync)
    f << (w[0] & 0xffffff) << '\t' << ((w[0] >> 24) & 0xffff) << '\t' << (w[0] >> 40) << '\t'
      << (w[1] & 0xffff) << '\t' << (w[1] >> 16) << '\t' << w[2] << '\t' << w[3];
    for (int i = 0; i < kMlaPhases; ++i) f << '\t' << w[4 + i];
    return true;
  });
}

// Asked for (DEEPSERVE_MLA_CLUSTER=1), sm_90+, 2..16 splits, 16-byte aligned output rows, and
// every cluster of the grid resident at once (each waits at a cluster barrier for all of its CTAs).
bool mla_decode_merges_in_cluster(const kern::AttnParams& a) {
  using namespace mla_decode;
  if (!g_mla_cluster.on() || a.splits <= 1 || a.splits > kMaxClusterSize || !pdl::hopper())
    return false;
  if ((reinterpret_cast<uintptr_t>(a.out) | uintptr_t(a.out_ts) | uintptr_t(a.out_hs)) % 16 != 0)
    return false;
  const int64_t clusters = int64_t(a.num_seqs) * ((a.heads + a.mla_rows - 1) / a.mla_rows);
  return clusters <= (a.mla_rows == 2 * kRows ? max_active_clusters<2>(a.splits)
                                              : max_active_clusters<1>(a.splits));
}

int mla_decode_rows(const kern::AttnParams& a, bool bf16_qp) {
  using namespace mla_decode;
  return g_mla_rows32.on() && bf16_qp && a.heads >= 2 * kRows && regq_takes(a) ? 2 * kRows : kRows;
}

int mla_decode_cluster_fit(const kern::AttnParams& a) {
  if (a.splits <= 2 || mla_decode_merges_in_cluster(a)) return a.splits;
  kern::AttnParams b = a;
  for (int s = a.splits - 1; s >= std::max(2, a.splits / 2); --s) {
    b.splits = s;
    if (mla_decode_merges_in_cluster(b)) return s;
  }
  return a.splits;
}

}  // namespace ds::cuda
