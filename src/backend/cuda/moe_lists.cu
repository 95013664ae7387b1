// The MoE's device token lists (one CTA: per-expert counts, offsets, the active list and each
// assignment's position) and its deterministic combine (each token's expert outputs summed in
// slot order), shared by the decode and prefill paths of moe_ffn (moe.cu).
#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"

namespace ds::cuda::moe {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kListThreads = 1024;  // block_exclusive_scan assumes 32 full warps

// Exclusive prefix sum of v over the 1024 threads of the block; *total gets the sum.
__device__ int block_exclusive_scan(int v, int* sums /* [33] */, int* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int inc = v;
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(kFull, inc, off);
    if (lane >= off) inc += o;
  }
  if (lane == 31) sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int w = sums[lane];
    int winc = w;
    for (int off = 1; off < 32; off <<= 1) {
      const int o = __shfl_up_sync(kFull, winc, off);
      if (lane >= off) winc += o;
    }
    sums[lane] = winc - w;
    if (lane == 31) sums[32] = winc;
  }
  __syncthreads();
  const int result = sums[warp] + inc - v;
  *total = sums[32];
  __syncthreads();  // sums may be reused right away
  return result;
}

// One CTA: per-expert counts (shared atomics: order-free), offsets, the active list, then a
// stable scatter in chunks of 1024 assignments: rank = earlier chunks + earlier warps of this
// chunk + earlier lanes of this warp with the same expert (__match_any_sync).
__global__ void __launch_bounds__(kListThreads)
    token_lists_kernel(const int32_t* __restrict__ ids, int64_t n, int top_k, int shared, int E,
                       int expert_base, TokenLists l) {
  pdl::enter();
  __shared__ int cnt[kMaxExperts];
  __shared__ int running[kMaxExperts];
  __shared__ int warp_cnt[32][kMaxExperts];
  __shared__ int sums[33];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  for (int i = tid; i < kMaxExperts; i += kListThreads) cnt[i] = 0;
  for (int i = tid; i < 32 * kMaxExperts; i += kListThreads) (&warp_cnt[0][0])[i] = 0;
  __syncthreads();
  for (int64_t i = tid; i < n; i += kListThreads) {
    const int e = expert_of(ids, i, top_k, shared, E, expert_base);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  const int c = tid < E ? cnt[tid] : 0;
  int total = 0;
  int n_active = 0;
  const int off = block_exclusive_scan(c, sums, &total);
  const int act = block_exclusive_scan(c > 0 ? 1 : 0, sums, &n_active);
  if (tid < E) {
    l.offsets[tid] = off;
    running[tid] = off;
    if (c > 0) l.active[act] = tid;
  }
  if (tid == 0) {
    l.offsets[E] = total;
    *l.n_active = n_active;
  }
  if (l.tile_expert) {
    const int tiles = (c + l.tile_rows - 1) / l.tile_rows;
    int n_tiles = 0;
    const int first = block_exclusive_scan(tiles, sums, &n_tiles);
    for (int j = 0; j < tiles; ++j) {
      l.tile_expert[first + j] = tid;
      l.tile_begin[first + j] = off + j * l.tile_rows;
    }
    if (tid == 0) *l.n_tiles = n_tiles;
    if (l.sched)
      for (int i = tid; i <= n_tiles; i += kListThreads) l.sched[i] = 0;
  }
  __syncthreads();

  for (int64_t chunk = 0; chunk < n; chunk += kListThreads) {
    const int64_t i = chunk + tid;
    const int e = i < n ? expert_of(ids, i, top_k, shared, E, expert_base) : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (e >= 0 && rank == 0) warp_cnt[warp][e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int p = running[e] + rank;
      for (int w = 0; w < warp; ++w) p += warp_cnt[w][e];
      l.pos[i] = p;
      l.sorted_token[p] = int(i / (top_k + shared));
    } else if (i < n) {
      l.pos[i] = -1;
    }
    __syncthreads();
    if (tid < E) {
      int s = 0;
      for (int w = 0; w < 32; ++w) {
        s += warp_cnt[w][tid];
        warp_cnt[w][tid] = 0;
      }
      running[tid] += s;
    }
    __syncthreads();
  }
}

// out[t] = sum over routed slots j (ascending) of w[t, j] * y[pos[t, j]], then + y of each
// shared slot (combine_cols, moe.cuh). Grid (T, column blocks); a thread owns V consecutive
// columns.
constexpr int kCombineThreads = 128;

template <int V>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const float* __restrict__ y, int64_t y_stride, const int* __restrict__ pos,
                   const float* __restrict__ w, int top_k, int shared, int hidden,
                   float* __restrict__ out, int64_t out_stride) {
  pdl::enter();
  const int64_t t = blockIdx.x;
  const int col = (blockIdx.y * kCombineThreads + threadIdx.x) * V;
  if (col >= hidden) return;
  const int slots = top_k + shared;
  float acc[V];
  combine_cols<V, false>(y, y_stride, pos + t * slots, w + t * top_k, top_k, slots, col, acc);
  float* orow = out + t * out_stride + col;
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(orow) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else {
    orow[0] = acc[0];
  }
}

}  // namespace

void launch_token_lists(const int32_t* ids, int64_t num_tokens, int top_k, int shared,
                        int num_experts, const TokenLists& lists, cudaStream_t stream,
                        int expert_base) {
  const int64_t n = num_tokens * (top_k + shared);
  pdl::launch(token_lists_kernel, 1, kListThreads, 0, stream, ids, n, top_k, shared, num_experts,
              expert_base, lists);
  check(cudaGetLastError(), "token lists");
}

void launch_combine(const float* y, const int* pos, const float* weights, int64_t num_tokens,
                    int top_k, int shared, int hidden, float* out, int64_t out_stride,
                    cudaStream_t stream, int64_t y_stride) {
  if (y_stride == 0) y_stride = hidden;
  // float4 columns when every row start is 16-byte aligned.
  const bool vec = hidden % 4 == 0 && y_stride % 4 == 0 && out_stride % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int V = vec ? 4 : 1;
  const dim3 grid(unsigned(num_tokens),
                  unsigned((hidden / V + kCombineThreads - 1) / kCombineThreads));
  if (vec)
    pdl::launch(combine_kernel<4>, grid, kCombineThreads, 0, stream, y, y_stride, pos, weights,
                top_k, shared, hidden, out, out_stride);
  else
    pdl::launch(combine_kernel<1>, grid, kCombineThreads, 0, stream, y, y_stride, pos, weights,
                top_k, shared, hidden, out, out_stride);
  check(cudaGetLastError(), "combine");
}

}  // namespace ds::cuda::moe
