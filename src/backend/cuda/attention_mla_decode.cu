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
// The register-Q kernel for BF16 caches is in attention_mla_decode_regq.cu; what both share is in
// attention_mla_decode_tiles.cuh.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "backend/cuda/attention_mla_decode.cuh"
#include "backend/cuda/attention_mla_decode_tiles.cuh"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"

namespace ds::cuda {
namespace {

using namespace mla_decode;

constexpr int kMaxLongSplits = 128;
constexpr int kQBytes = kRows * kRowBytes;
constexpr int kScaleBytes = kKeys * 2 * 4;  // FP8: (latent, rope) scale of each key of a stage
// Q hi, Q lo, two cache stages, P hi, P lo, row max / sum exchange, two stages of scales, two
// tiles' slots.
constexpr int kSmemBytes = 2 * kQBytes + 2 * kTileBytes + 2 * kPBytes + 2 * kWarps * kRows * 4 +
                           2 * kScaleBytes + 2 * kSlotBytes;
// Q elements (pairs) each thread stages.
constexpr int kQPairs = kRows * (kMaxDim / 2) / kThreads;
static_assert(kRows * (kMaxDim / 2) % kThreads == 0, "Q pairs spread evenly over the threads");
static_assert(kR == kWarps * 64, "each warp owns 64 value dims");
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
         a.slot_bytes <= INT32_MAX && reinterpret_cast<uintptr_t>(a.k) % align == 0;
}

bool mla_decode_bf16_auto(const kern::AttnParams& a) {
  const long long min_heads = g_mla_bf16_min_heads.get();
  return g_mla_decode_bf16.on() || (min_heads > 0 && a.heads >= min_heads);
}

int mla_decode_splits(const kern::AttnParams& a, int sm_count) {
  const int ctas = a.num_seqs * ((a.heads + a.mla_rows - 1) / a.mla_rows);
  if (ctas >= sm_count) return 1;
  const int64_t capacity = int64_t(a.max_blocks_per_seq) * a.block_size;
  const int64_t by_capacity = std::max<int64_t>(1, (capacity + kKeys - 1) / kKeys);
  // At most 16 (DEEPSERVE_MLA_SPLITS) while the context is short (the merge reads every split's
  // partial, and a split of a few tiles already streams well); long contexts may take one split
  // per 4 tiles, up to 128, so a lone 32k-token sequence streams from most SMs instead of 16
  // (H200: a 32k TPOT of 11.5 ms against 4.2 ms at 1k with 16 splits).
  const int64_t short_cap = std::clamp<int64_t>(g_mla_max_splits.get(), 1, kMaxLongSplits);
  const int64_t cap = std::clamp<int64_t>(by_capacity / 4, short_cap, kMaxLongSplits);
  // One CTA fits an SM (its shared memory), so the grid should be one wave: rounding the split
  // count up would start a second, mostly idle wave (W5's 8 x 128 heads: 64 CTAs x 3 splits =
  // 192 on 132 SMs took two waves of 7 tiles each; 2 splits take one of 10).
  return int(std::min<int64_t>({sm_count / ctas, by_capacity, cap}));
}

bool launch_mla_decode(const kern::AttnParams& a, cudaStream_t stream, bool bf16_qp) {
  bool merged = false;
  if (launch_regq(a, stream, bf16_qp, merged)) return merged;
  DS_CHECK(a.mla_rows == kRows, "mla decode: the first kernel takes 16 rows a CTA");
  const dim3 grid(unsigned(a.num_seqs), unsigned(a.splits),
                  unsigned((a.heads + kRows - 1) / kRows));
  const bool fp8 = a.cache_type == kern::kCacheFP8;
  auto go = [&]<bool kFp8, bool kLo>() {
    allow_smem<mla_decode_kernel<kFp8, kLo>>(kSmemBytes);
    pdl::launch(mla_decode_kernel<kFp8, kLo>, grid, kThreads, kSmemBytes, stream, a);
  };
  if (fp8 && !bf16_qp)
    go.template operator()<true, true>();
  else if (!bf16_qp)
    go.template operator()<false, true>();
  else if (fp8)
    go.template operator()<true, false>();
  else
    go.template operator()<false, false>();
  check_cuda(cudaGetLastError(), "mla decode kernel");
  return false;
}

}  // namespace ds::cuda
