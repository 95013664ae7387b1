// Grouped-path experts: tensor-core GEMMs over per-expert tiles of tokens, with no host sync
// (graph capturable). The token lists give every touched expert a run of sorted positions;
// the tile table cuts each run into TM-row tiles, and a CTA owns (tile, block of output
// columns). x is converted to BF16 once ([T, hidden], not per assignment); the A tiles are
// staged through the sorted positions' token indices, the weights stream through the same
// cp.async pipeline, fragments come from ldmatrix and the products from mma.sync m16n8k16
// with F32 accumulators.
//   gate_up: h[p, f] = bf16(silu(x_p . gate_f) * (x_p . up_f))   (CTA: TM rows x 64 f)
//   down:    y[p, r] = h_p . down_r                              (CTA: TM rows x 128 r)
// Two sizes: TM = 64 with 4 stages (decode-sized steps, Grouped) and TM = 128 with 3 stages
// (the wide path for prefill: a warp owns 64 rows, so each B fragment feeds four mma).
// Each row's result depends only on its own activations and a fixed k order.
#include <cuda_bf16.h>

#include <string>

#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"
#include "core/error.h"

namespace ds::cuda::moe {
namespace {

constexpr int kThreads = 128;     // 4 warps, 2 x 2 over the CTA tile
constexpr int kBK = 64;           // k per pipeline stage: 128 bytes of BF16 per row
constexpr int kChunks = kBK / 8;  // 16-byte chunks per staged row

// Byte offset of 16-byte chunk c of staged row r: chunks are XOR-swizzled by the row so
// that ldmatrix's eight row reads of one phase hit eight different bank groups.
__device__ __forceinline__ uint32_t tile_offset(int r, int c) {
  return uint32_t(r * kBK * 2 + ((c ^ (r & 7)) << 4));
}

// Stages `rows` rows of [*, K] BF16 (row stride ld elements) starting at src into one
// swizzled [rows][kBK] stage; rows >= valid_rows and k >= K are zero-filled. With `index`,
// staged row r is source row index[r] (the tokens of a tile's sorted positions).
template <int Rows>
__device__ __forceinline__ void stage_rows(uint32_t dst, const __nv_bfloat16* src, int64_t ld,
                                           int valid_rows, int k0, int K,
                                           const int* index = nullptr) {
  for (int i = threadIdx.x; i < Rows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int k = k0 + c * 8;
    const bool ok = r < valid_rows && k < K;
    const int64_t row = ok ? (index ? index[r] : r) : 0;
    const __nv_bfloat16* p = ok ? src + row * ld + k : src;
    ptx::cp_async16(dst + tile_offset(r, c), p, ok);
  }
}

// ldmatrix row addresses of this lane for a 16 x 16 A block at (row0, kk) and for two n8 x k16
// B blocks at (n0, kk): matrices ordered as the mma fragments want them.
__device__ __forceinline__ uint32_t a_frag_addr(uint32_t base, int row0, int kk) {
  const int lane = threadIdx.x & 31, m = lane >> 3, i = lane & 7;
  return base + tile_offset(row0 + (m & 1) * 8 + i, kk / 8 + (m >> 1));
}
__device__ __forceinline__ uint32_t b_frag_addr(uint32_t base, int n0, int kk) {
  const int lane = threadIdx.x & 31, m = lane >> 3, i = lane & 7;
  return base + tile_offset(n0 + (m >> 1) * 8 + i, kk / 8 + (m & 1));
}

// The k loop of both kernels: a Stages-deep cp.async pipeline over KT tiles of kBK columns;
// load(stage, kt) issues one tile's copies, compute(stage) consumes the tile in that stage.
template <int Stages, typename Load, typename Compute>
__device__ __forceinline__ void run_pipeline(int KT, Load&& load, Compute&& compute) {
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) {
    if (s < KT) load(s, s);
    ptx::cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    ptx::cp_async_wait<Stages - 2>();
    __syncthreads();
    if (kt + Stages - 1 < KT) load((kt + Stages - 1) % Stages, kt + Stages - 1);
    ptx::cp_async_commit();
    compute(kt % Stages);
  }
  ptx::cp_async_wait<0>();
}

// A fragments of the warp's MI 16-row blocks (rows wm * 16 * MI..) at column kk of a stage.
template <int MI>
__device__ __forceinline__ void load_a_frags(uint32_t (&af)[MI][4], uint32_t s, int wm, int kk) {
#pragma unroll
  for (int i = 0; i < MI; ++i) ptx::ldmatrix_x4(af[i], a_frag_addr(s, (wm * MI + i) * 16, kk));
}

// Tile shapes: TM rows per CTA (each warp TM / 2 rows: TM / 32 blocks of 16), Stages.
template <int TM, int Stages>
struct Shape {
  static constexpr int tm = TM;
  static constexpr int stages = Stages;
  static constexpr size_t gate_up_smem = size_t(Stages) * (TM + 2 * 64) * kBK * 2;
  static constexpr size_t down_smem = size_t(Stages) * (TM + 128) * kBK * 2;
};
using Narrow = Shape<kTileM, 4>;
using Small = Shape<kSmallTileM, 4>;  // warps of 16 rows (g_moe_tile32, A/B)
// 96 KB of shared memory, 2 CTAs per SM (4 stages, 1 CTA per SM, was slower on the H200:
// 8,552 vs 5,508 us at T = 8192 of V2-Lite + 2 shared, bench/results/...-cb1d80d-moebench.txt).
using Wide = Shape<kWideTileM, 3>;

// Grid (ceil(F / 64), max tiles). Warp (wm, wn) owns rows wm * TM / 2.. and f columns wn*32.. of
// both gate and up.
template <int TM, int Stages>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(GroupedFfnArgs a) {
  pdl::enter();
  constexpr int BN = 64, MI = TM / 32;
  extern __shared__ __align__(128) uint8_t smem[];
  const Tile t = tile_of<TM>(a.lists, blockIdx.y);
  if (t.e < 0) return;
  const ExpertPtrs ex = a.experts[t.e];
  const int H = a.hidden, F = a.inter;
  const int f0 = blockIdx.x * BN;
  const int valid_f = min(BN, F - f0);
  const auto* xa = static_cast<const __nv_bfloat16*>(a.xa);
  const int* rows = a.lists.sorted_token + t.begin;
  const auto* gate = static_cast<const __nv_bfloat16*>(ex.gate) + int64_t(f0) * ex.gate_ld;
  const auto* up = static_cast<const __nv_bfloat16*>(ex.up) + int64_t(f0) * ex.up_ld;
  constexpr uint32_t kA = TM * kBK * 2, kB = BN * kBK * 2, kStage = kA + 2 * kB;
  const uint32_t s0 = ptx::smem_u32(smem);
  auto load = [&](int stage, int kt) {
    const uint32_t s = s0 + stage * kStage;
    const int k0 = kt * kBK;
    stage_rows<TM>(s, xa, H, t.rows, k0, H, rows);
    stage_rows<BN>(s + kA, gate, ex.gate_ld, valid_f, k0, H);
    stage_rows<BN>(s + kA + kB, up, ex.up_ld, valid_f, k0, H);
  };
  const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
  float g[MI][4][4] = {}, u[MI][4][4] = {};
  run_pipeline<Stages>((H + kBK - 1) / kBK, load, [&](int stage) {
    const uint32_t s = s0 + stage * kStage;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[MI][4];
      load_a_frags<MI>(af, s, wm, kk);
#pragma unroll
      for (int j = 0; j < 2; ++j) {  // pairs of n8 tiles
        uint32_t bg[4], bu[4];
        ptx::ldmatrix_x4(bg, b_frag_addr(s + kA, wn * 32 + j * 16, kk));
        ptx::ldmatrix_x4(bu, b_frag_addr(s + kA + kB, wn * 32 + j * 16, kk));
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          ptx::mma_bf16(g[i][2 * j], af[i], bg[0], bg[1]);
          ptx::mma_bf16(g[i][2 * j + 1], af[i], bg[2], bg[3]);
          ptx::mma_bf16(u[i][2 * j], af[i], bu[0], bu[1]);
          ptx::mma_bf16(u[i][2 * j + 1], af[i], bu[2], bu[3]);
        }
      }
    }
  });
  // Accumulator (i, n): rows (wm*MI + i)*16 + lane/4 (+8), columns wn*32 + n*8 + 2*(lane%4) (+1).
  const int lane = threadIdx.x & 31;
  auto* h = static_cast<__nv_bfloat16*>(a.h);
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = (wm * MI + i) * 16 + (lane >> 2) + half * 8;
        const int c = wn * 32 + n * 8 + 2 * (lane & 3);
        if (r >= t.rows || c >= valid_f) continue;
        const float g0 = g[i][n][2 * half], g1 = g[i][n][2 * half + 1];
        const float v0 = g0 / (1.0f + expf(-g0)) * u[i][n][2 * half];
        const float v1 = g1 / (1.0f + expf(-g1)) * u[i][n][2 * half + 1];
        *reinterpret_cast<__nv_bfloat162*>(h + int64_t(t.begin + r) * F + f0 + c) =
            __floats2bfloat162_rn(v0, v1);
      }
}

// Grid (ceil(hidden / 128), max tiles). Warp (wm, wn) owns rows wm * TM / 2.. and columns
// wn*64..
template <int TM, int Stages>
__global__ void __launch_bounds__(kThreads) down_kernel(GroupedFfnArgs a) {
  constexpr int BN = 128, MI = TM / 32;
  const int H = a.hidden, F = a.inter;
  const int n0 = blockIdx.x * BN;
  const int valid_n = min(BN, H - n0);
  const Tile t = down_start(
      a.prefetch, [&](auto l2) { return tile_of<TM, l2.value>(a.lists, blockIdx.y); },
      [&](const Tile& found) {                     // the tile's rows of down
        const ExpertPtrs ex = a.experts[found.e];  // the expert table is constant
        pdl::prefetch_l2(static_cast<const __nv_bfloat16*>(ex.down) + int64_t(n0) * ex.down_ld,
                         min(a.prefetch, ((valid_n - 1) * ex.down_ld + F) * 2));
      });
  extern __shared__ __align__(128) uint8_t smem[];
  if (t.e < 0) return;
  const ExpertPtrs ex = a.experts[t.e];
  const auto* ha = static_cast<const __nv_bfloat16*>(a.h) + int64_t(t.begin) * F;
  const auto* down = static_cast<const __nv_bfloat16*>(ex.down) + int64_t(n0) * ex.down_ld;
  constexpr uint32_t kA = TM * kBK * 2, kB = BN * kBK * 2, kStage = kA + kB;
  const uint32_t s0 = ptx::smem_u32(smem);
  auto load = [&](int stage, int kt) {
    const uint32_t s = s0 + stage * kStage;
    const int k0 = kt * kBK;
    stage_rows<TM>(s, ha, F, t.rows, k0, F);
    stage_rows<BN>(s + kA, down, ex.down_ld, valid_n, k0, F);
  };
  const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
  float acc[MI][8][4] = {};
  run_pipeline<Stages>((F + kBK - 1) / kBK, load, [&](int stage) {
    const uint32_t s = s0 + stage * kStage;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[MI][4];
      load_a_frags<MI>(af, s, wm, kk);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[4];
        ptx::ldmatrix_x4(b, b_frag_addr(s + kA, wn * 64 + j * 16, kk));
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          ptx::mma_bf16(acc[i][2 * j], af[i], b[0], b[1]);
          ptx::mma_bf16(acc[i][2 * j + 1], af[i], b[2], b[3]);
        }
      }
    }
  });
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = (wm * MI + i) * 16 + (lane >> 2) + half * 8;
        const int c = wn * 64 + n * 8 + 2 * (lane & 3);
        if (r >= t.rows || c >= valid_n) continue;
        *reinterpret_cast<float2*>(a.y + int64_t(t.begin + r) * H + n0 + c) =
            make_float2(acc[i][n][2 * half], acc[i][n][2 * half + 1]);
      }
}

template <typename S>
void prepare_shape() {
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  check(cudaFuncSetAttribute(gate_up_kernel<S::tm, S::stages>, attr, int(S::gate_up_smem)),
        "grouped smem limit");
  check(cudaFuncSetAttribute(down_kernel<S::tm, S::stages>, attr, int(S::down_smem)),
        "grouped smem limit");
}

template <typename S>
void launch_shape(const GroupedFfnArgs& a, int64_t n, cudaStream_t stream) {
  const unsigned tiles = unsigned(max_tiles(n, a.num_experts, S::tm));
  pdl::launch(gate_up_kernel<S::tm, S::stages>, dim3(unsigned((a.inter + 63) / 64), tiles),
              kThreads, S::gate_up_smem, stream, a);
  check(cudaGetLastError(), "grouped gate_up");
  pdl::launch(down_kernel<S::tm, S::stages>, dim3(unsigned((a.hidden + 127) / 128), tiles),
              kThreads, S::down_smem, stream, a);
  check(cudaGetLastError(), "grouped down");
}

}  // namespace

void prepare_grouped_kernels() {
  prepare_shape<Narrow>();
  prepare_shape<Small>();
  prepare_shape<Wide>();
}

int64_t max_tiles(int64_t assignments, int num_experts, int tile_rows) {
  return assignments / tile_rows + std::min<int64_t>(num_experts, assignments);
}

void launch_grouped_ffn(const GroupedFfnArgs& a, cudaStream_t stream) {
  const int64_t n = a.num_tokens * a.top_k;
  if (a.hidden % 8 != 0 || a.inter % 8 != 0)
    throw UnsupportedError("cuda moe_ffn: the grouped path needs hidden and F multiples of 8");
  if (n == 0) return;
  DS_CHECK(a.lists.tile_rows == kTileM || a.lists.tile_rows == kWideTileM ||
               a.lists.tile_rows == kSmallTileM,
           "grouped moe: tile table of " + std::to_string(a.lists.tile_rows) + " rows");
  // x once in BF16, row t for token t (the kernels index it through sorted_token).
  launch_gather_act(a.x, a.x_stride, nullptr, nullptr, a.num_tokens, a.hidden, a.xa, stream);
  if (a.lists.tile_rows == kWideTileM)
    launch_shape<Wide>(a, n, stream);
  else if (a.lists.tile_rows == kSmallTileM)
    launch_shape<Small>(a, n, stream);
  else
    launch_shape<Narrow>(a, n, stream);
}

}  // namespace ds::cuda::moe
