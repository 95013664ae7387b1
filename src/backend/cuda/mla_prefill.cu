// MLA prefill, expanded form (see mla_prefill.cuh): gather latents -> kv_b GEMM -> BF16 K/V
// -> flash attention. One CTA = kBlockM query rows of one head of one sequence; warp w owns
// rows [16w, 16w + 16) and keeps its Q fragments, scores and output in registers.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_port.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/mla_prefill.cuh"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/kv_fp8.h"

namespace ds::cuda {
namespace {

using namespace mla_prefill_detail;
using bf16 = __nv_bfloat16;

constexpr int kMinQuery = 32;  // shorter steps (decode, small chunks) keep the absorbed kernels
constexpr size_t kF32ChunkBytes = size_t(512) << 20;  // the kv_b GEMM's F32 output per chunk

// The one place this path reads the latent cache: 8 elements from dim d of slot `slot`.
__device__ __forceinline__ void load_cache8(const PagedKv& kv, int64_t slot, int d, float (&x)[8]) {
  const int64_t e = slot * (int64_t(kv.kv_heads) * kv.head_dim) + d;
  if (kv.dtype == DType::F32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(kv.k) + e);
    const float4 a = p[0], b = p[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else if (kv.dtype == DType::BF16) {
    const bf16* p = static_cast<const bf16*>(kv.k) + e;
    DS_UNROLL for (int i = 0; i < 8; ++i) x[i] = __bfloat162float(p[i]);
  } else if (kv.dtype == DType::F8_E4M3) {  // codes + a scale per slot and part (kv_fp8.h)
    const uint8_t* p = static_cast<const uint8_t*>(kv.k) + e;
    const int parts = kv.kv_heads * (kv.rope_split > 0 ? 2 : 1);  // PagedKv::k_scale_parts
    const float sc = kv.k_scale[slot * parts + (kv.rope_split > 0 && d >= kv.rope_split ? 1 : 0)];
    DS_UNROLL for (int i = 0; i < 8; ++i) x[i] = kvfp8::dequant(p[i], sc);
  } else {  // F16 (mla_prefill_wanted admits nothing else)
    const __half* p = static_cast<const __half*>(kv.k) + e;
    DS_UNROLL for (int i = 0; i < 8; ++i) x[i] = __half2float(p[i]);
  }
}

__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  uint4 u;
  uint32_t* w = reinterpret_cast<uint32_t*>(&u);
  DS_UNROLL for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return u;
}

struct GatherArgs {
  PagedKv kv;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int max_blocks_per_seq, max_context_len, num_rows, latent;  // latent = R
  bf16* lat;                                                  // [num_rows, R]
  bf16* krope;                                                // [num_rows, kRope]
};

// Row (s, j) of the padded buffers <- cache position j of sequence s (zeros past its context).
__global__ void gather_latent_kernel(GatherArgs a) {
  pdl::enter();
  const int per_row = (a.latent + kRope) / 8;
  const int64_t total = int64_t(a.num_rows) * per_row;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < total;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int row = int(u / per_row), d = int(u % per_row) * 8;
    const int s = row / a.max_context_len, j = row % a.max_context_len;
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (j < a.context_lens[s]) {
      const int bs = a.kv.block_size;
      const int64_t slot =
          int64_t(a.block_tables[int64_t(s) * a.max_blocks_per_seq + j / bs]) * bs + j % bs;
      load_cache8(a.kv, slot, d, x);
    }
    const uint4 v = pack8(x);
    if (d < a.latent) {
      *reinterpret_cast<uint4*>(a.lat + int64_t(row) * a.latent + d) = v;
    } else {
      *reinterpret_cast<uint4*>(a.krope + int64_t(row) * kRope + (d - a.latent)) = v;
    }
  }
}

// K [rows, H, 192] = [k_nope | k_rope], V [rows, H, 128] from the GEMM's F32 [n, H * 256]
// (per head nope key dims then value dims) for rows [r0, r0 + n).
__global__ void pack_kv_kernel(const float* kv, const bf16* krope, bf16* k, bf16* v, int64_t r0,
                               int64_t n, int heads) {
  pdl::enter();
  constexpr int kUnits = kQk / 8 + kV / 8;  // 16-byte outputs per (row, head)
  const int64_t total = n * heads * kUnits;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < total;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(u % kUnits);
    const int64_t rh = u / kUnits, r = rh / heads;
    const int h = int(rh % heads);
    const int64_t row = r0 + r;
    const float* src = kv + r * heads * (kNope + kV) + h * (kNope + kV);
    float x[8];
    if (c < kNope / 8) {
      DS_UNROLL for (int i = 0; i < 8; ++i) x[i] = src[c * 8 + i];
      *reinterpret_cast<uint4*>(k + (row * heads + h) * kQk + c * 8) = pack8(x);
    } else if (c < kQk / 8) {
      const int d = (c - kNope / 8) * 8;
      *reinterpret_cast<uint4*>(k + (row * heads + h) * kQk + kNope + d) =
          *reinterpret_cast<const uint4*>(krope + row * kRope + d);
    } else {
      const int d = (c - kQk / 8) * 8;
      DS_UNROLL for (int i = 0; i < 8; ++i) x[i] = src[kNope + d + i];
      *reinterpret_cast<uint4*>(v + (row * heads + h) * kV + d) = pack8(x);
    }
  }
}

// Q [T, H, 192] BF16 = [q_nope | q_rope] from F32 views with byte strides (token, head).
struct PackQArgs {
  const uint8_t* nope;
  int64_t nope_t, nope_h;
  const uint8_t* rope;
  int64_t rope_t, rope_h;
  bf16* q;
  int tokens, heads;
};
__global__ void pack_q_kernel(PackQArgs a) {
  pdl::enter();
  constexpr int kUnits = kQk / 8;
  const int64_t total = int64_t(a.tokens) * a.heads * kUnits;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < total;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(u % kUnits);
    const int64_t th = u / kUnits, t = th / a.heads;
    const int h = int(th % a.heads);
    const float* src =
        c < kNope / 8 ? reinterpret_cast<const float*>(a.nope + t * a.nope_t + h * a.nope_h) + c * 8
                      : reinterpret_cast<const float*>(a.rope + t * a.rope_t + h * a.rope_h) +
                            (c * 8 - kNope);
    float x[8];
    DS_UNROLL for (int i = 0; i < 8; ++i) x[i] = src[i];
    *reinterpret_cast<uint4*>(a.q + th * kQk + c * 8) = pack8(x);
  }
}

struct FlashArgs {
  const bf16* q;  // [T, H, 192]
  const bf16* k;  // [rows, H, 192]
  const bf16* v;  // [rows, H, 128]
  float* out;     // element strides below
  int64_t out_t, out_h;
  const int32_t* query_start;
  const int32_t* context_lens;
  int heads, max_context_len;
  float scale_log2;
  bool causal;
};

__device__ __forceinline__ uint32_t ld_q32(const bf16* row, int col) {
  return row ? *reinterpret_cast<const uint32_t*>(row + col) : 0u;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

__global__ void __launch_bounds__(kThreads) flash_mla_prefill_kernel(FlashArgs a) {
  pdl::enter();
  extern __shared__ __align__(128) uint8_t smem[];
  const int s = blockIdx.z, h = blockIdx.y;
  const int qt = int(gridDim.x) - 1 - int(blockIdx.x);  // longest (causal) tiles first
  const int q0 = a.query_start[s], nq = a.query_start[s + 1] - q0, ctx = a.context_lens[s];
  const QueryTile t = query_tile(qt, nq, ctx, a.causal);
  if (t.q_begin >= nq) return;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, qd = lane % 4;
  const int H = a.heads;
  const int64_t base_row = gathered_row(s, 0, a.max_context_len);

  // This warp's Q rows as A fragments, straight from global memory (read once per CTA).
  const int ra = t.q_begin + warp * 16 + g, rb = ra + 8;
  const bf16* qa = ra < nq ? a.q + (int64_t(q0 + ra) * H + h) * kQk : nullptr;
  const bf16* qb = rb < nq ? a.q + (int64_t(q0 + rb) * H + h) * kQk : nullptr;
  uint32_t qf[kQk / 16][4];
  DS_UNROLL for (int kk = 0; kk < kQk / 16; ++kk) {
    const int col = kk * 16 + 2 * qd;
    qf[kk][0] = ld_q32(qa, col);
    qf[kk][1] = ld_q32(qb, col);
    qf[kk][2] = ld_q32(qa, col + 8);
    qf[kk][3] = ld_q32(qb, col + 8);
  }

  auto load_tile = [&](int kt, int stage) {
    uint8_t* ks = smem + stage * (kKTileBytes + kVTileBytes);
    uint8_t* vs = ks + kKTileBytes;
    for (int i = tid; i < kBlockN * (kQk / 8); i += kThreads) {
      const int r = i / (kQk / 8), c = i % (kQk / 8), j = kt * kBlockN + r;
      const bool ok = j < ctx;
      const bf16* src = ok ? a.k + ((base_row + j) * H + h) * kQk + c * 8 : a.k;
      ptx::cp_async16(ptx::smem_u32(ks + swizzle(r, c, kQk / 8)), src, ok);
    }
    for (int i = tid; i < kBlockN * (kV / 8); i += kThreads) {
      const int r = i / (kV / 8), c = i % (kV / 8), j = kt * kBlockN + r;
      const bool ok = j < ctx;
      const bf16* src = ok ? a.v + ((base_row + j) * H + h) * kV + c * 8 : a.v;
      ptx::cp_async16(ptx::smem_u32(vs + swizzle(r, c, kV / 8)), src, ok);
    }
  };

  float o[kV / 8][4];
  DS_UNROLL for (int i = 0; i < kV / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int pos_a = t.pos0 + warp * 16 + g;  // positions of this thread's two rows
  const int mi = lane / 8, mr = lane % 8;    // ldmatrix: matrix and row this lane addresses

  load_tile(0, 0);
  ptx::cp_async_commit();
  for (int kt = 0; kt < t.n_tiles; ++kt) {
    if (kt + 1 < t.n_tiles) {
      load_tile(kt + 1, (kt + 1) & 1);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
    const uint8_t* ks = smem + (kt & 1) * (kKTileBytes + kVTileBytes);
    const uint8_t* vs = ks + kKTileBytes;

    float sc[kBlockN / 8][4];
    DS_UNROLL for (int i = 0; i < kBlockN / 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0;
    DS_UNROLL for (int kk = 0; kk < kQk / 16; ++kk) {
      DS_UNROLL for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t b[4];
        const int row = np * 16 + (mi >> 1) * 8 + mr, chunk = kk * 2 + (mi & 1);
        ptx::ldmatrix_x4(b, ptx::smem_u32(ks + swizzle(row, chunk, kQk / 8)));
        ptx::mma_bf16(sc[2 * np], qf[kk], b[0], b[1]);
        ptx::mma_bf16(sc[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }
    const bool masked = kt >= t.first_masked;
    DS_UNROLL for (int r = 0; r < 2; ++r) {
      const int pos = pos_a + r * 8;
      float mx = -INFINITY;
      DS_UNROLL for (int nt = 0; nt < kBlockN / 8; ++nt) {
        DS_UNROLL for (int e = 0; e < 2; ++e) {
          float x = sc[nt][2 * r + e] * a.scale_log2;
          const int key = kt * kBlockN + nt * 8 + 2 * qd + e;
          if (masked && (key >= ctx || (a.causal && key > pos))) x = -INFINITY;
          sc[nt][2 * r + e] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet
      const float alpha = exp2f(m[r] - m_use);
      m[r] = m_new;
      float sum = 0.0f;
      DS_UNROLL for (int nt = 0; nt < kBlockN / 8; ++nt) {
        DS_UNROLL for (int e = 0; e < 2; ++e) {
          const float p = exp2f(sc[nt][2 * r + e] - m_use);
          sc[nt][2 * r + e] = p;
          sum += p;
        }
      }
      l[r] = l[r] * alpha + sum;
      DS_UNROLL for (int i = 0; i < kV / 8; ++i) {
        o[i][2 * r] *= alpha;
        o[i][2 * r + 1] *= alpha;
      }
    }
    DS_UNROLL for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t pa[4] = {pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]),
                              pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                              pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
      DS_UNROLL for (int dp = 0; dp < kV / 16; ++dp) {
        uint32_t b[4];
        const int row = kk * 16 + (mi & 1) * 8 + mr, chunk = dp * 2 + (mi >> 1);
        ptx::ldmatrix_x4_trans(b, ptx::smem_u32(vs + swizzle(row, chunk, kV / 8)));
        ptx::mma_bf16(o[2 * dp], pa, b[0], b[1]);
        ptx::mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }

  DS_UNROLL for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  DS_UNROLL for (int r = 0; r < 2; ++r) {
    const int row = r == 0 ? ra : rb;
    if (row >= nq) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    float* dst = a.out + int64_t(q0 + row) * a.out_t + int64_t(h) * a.out_h + 2 * qd;
    DS_UNROLL for (int i = 0; i < kV / 8; ++i) {
      dst[i * 8] = o[i][2 * r] * inv;
      dst[i * 8 + 1] = o[i][2 * r + 1] * inv;
    }
  }
}

int grid_for(int64_t units, int threads) {
  return int(std::min<int64_t>((units + threads - 1) / threads, 65535 * 8));
}

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

}  // namespace

bool mla_prefill_wanted(const MlaPrefillParams& p, const AttentionMeta& meta) {
  if (p.q_nope.ndim != 3 || p.q_rope.ndim != 3 || p.out.ndim != 3 || p.kv_b.ndim != 2) return false;
  const int64_t H = p.q_nope.shape[1], R = p.kv_lora_rank;
  if (p.q_nope.shape[2] != kNope || p.q_rope.shape[2] != kRope || p.out.shape[2] != kV ||
      p.q_rope.shape[1] != H || p.out.shape[1] != H)
    return false;
  if (p.kv_b.dtype != DType::BF16 || p.kv_b.shape[0] != H * (kNope + kV) || p.kv_b.shape[1] != R ||
      R % 8 != 0 || p.kv_b.stride[1] != 2 || p.kv_b.stride[0] % 16 != 0)
    return false;
  if (p.q_nope.dtype != DType::F32 || p.q_rope.dtype != DType::F32 || p.out.dtype != DType::F32 ||
      p.q_nope.stride[2] != 4 || p.q_rope.stride[2] != 4 || p.out.stride[2] != 4 ||
      p.out.stride[0] % 4 != 0 || p.out.stride[1] % 4 != 0)
    return false;
  const PagedKv& kv = p.cache;
  if (kv.v != nullptr || kv.kv_heads != 1 || kv.head_dim != R + kRope ||
      (kv.dtype != DType::F32 && kv.dtype != DType::BF16 && kv.dtype != DType::F16 &&
       kv.dtype != DType::F8_E4M3))
    return false;
  if (meta.max_query_len < kMinQuery || meta.num_seqs <= 0) return false;
  // Buffers are padded to max_context_len per sequence: skip steps where that is mostly waste
  // (long-context decodes batched with a short prefill chunk).
  return meta.num_seqs == 1 ||
         int64_t(meta.num_tokens) * 8 >= int64_t(meta.num_seqs) * meta.max_context_len;
}

void mla_prefill(const Context& ctx, CublasGemm& gemm, const MlaPrefillParams& p,
                 const AttentionMeta& meta) {
  const int S = meta.num_seqs, C = meta.max_context_len, T = meta.num_tokens;
  const int H = int(p.q_nope.shape[1]), R = p.kv_lora_rank;
  DS_CHECK(p.q_nope.shape[0] >= T && p.out.shape[0] >= T, "mla_prefill: fewer rows than tokens");
  const int64_t N = int64_t(S) * C;
  const int64_t wide = int64_t(H) * (kNope + kV);
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(N, kF32ChunkBytes / (wide * 4)));
  if (N == 0 || T == 0) return;
  const size_t lat_b = align256(size_t(N) * R * 2), rope_b = align256(size_t(N) * kRope * 2);
  const size_t k_b = align256(size_t(N) * H * kQk * 2), v_b = align256(size_t(N) * H * kV * 2);
  const size_t q_b = align256(size_t(T) * H * kQk * 2), f_b = align256(size_t(chunk * wide) * 4);
  uint8_t* base = static_cast<uint8_t*>(
      ctx.scratch(kScratchMlaPrefill, lat_b + rope_b + k_b + v_b + q_b + f_b));
  bf16* lat = reinterpret_cast<bf16*>(base);
  bf16* krope = reinterpret_cast<bf16*>(base + lat_b);
  bf16* k = reinterpret_cast<bf16*>(base + lat_b + rope_b);
  bf16* v = reinterpret_cast<bf16*>(base + lat_b + rope_b + k_b);
  bf16* q = reinterpret_cast<bf16*>(base + lat_b + rope_b + k_b + v_b);
  float* f32 = reinterpret_cast<float*>(base + lat_b + rope_b + k_b + v_b + q_b);

  GatherArgs ga{
      p.cache, meta.context_lens, meta.block_tables, meta.max_blocks_per_seq, C, int(N), R, lat,
      krope};
  pdl::launch(gather_latent_kernel, grid_for(N * ((R + kRope) / 8), 256), 256, 0, ctx.stream, ga);
  check_cuda(cudaGetLastError(), "mla_prefill gather");
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    GemmArgs g;
    g.dtype = DType::BF16;
    g.m = n;
    g.n = wide;
    g.k = R;
    g.x = lat + r0 * R;
    g.ldx = R;
    g.w = p.kv_b.data;
    g.ldw = p.kv_b.stride[0] / 2;
    g.out = f32;
    g.ldo = wide;
    gemm.run(g);
    pdl::launch(pack_kv_kernel, grid_for(n * H * (kQk / 8 + kV / 8), 256), 256, 0, ctx.stream, f32,
                krope, k, v, r0, n, H);
    check_cuda(cudaGetLastError(), "mla_prefill pack kv");
  }
  PackQArgs qa{static_cast<const uint8_t*>(p.q_nope.data),
               p.q_nope.stride[0],
               p.q_nope.stride[1],
               static_cast<const uint8_t*>(p.q_rope.data),
               p.q_rope.stride[0],
               p.q_rope.stride[1],
               q,
               T,
               H};
  pdl::launch(pack_q_kernel, grid_for(int64_t(T) * H * (kQk / 8), 256), 256, 0, ctx.stream, qa);
  check_cuda(cudaGetLastError(), "mla_prefill pack q");

  check_cuda(cudaFuncSetAttribute(flash_mla_prefill_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
             "mla_prefill smem attribute");
  FlashArgs fa;
  fa.q = q;
  fa.k = k;
  fa.v = v;
  fa.out = p.out.ptr<float>();
  fa.out_t = p.out.stride[0] / 4;
  fa.out_h = p.out.stride[1] / 4;
  fa.query_start = meta.query_start;
  fa.context_lens = meta.context_lens;
  fa.heads = H;
  fa.max_context_len = C;
  fa.scale_log2 = p.scale * 1.4426950408889634f;
  fa.causal = p.causal;
  const dim3 grid(unsigned((meta.max_query_len + kBlockM - 1) / kBlockM), unsigned(H), unsigned(S));
  pdl::launch(flash_mla_prefill_kernel, grid, kThreads, kSmemBytes, ctx.stream, fa);
  check_cuda(cudaGetLastError(), "mla_prefill attention");
}

}  // namespace ds::cuda
