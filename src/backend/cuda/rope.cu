#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/rope.cuh"

namespace ds::cuda {
namespace {

// One block per token: cos/sin of each pair once in shared memory, then every head.
__global__ void rope_kernel(void* x, int64_t stride_t, int64_t stride_h, int heads,
                            const int32_t* __restrict__ positions,
                            const float* __restrict__ inv_freq, int half, bool adjacent,
                            float attn_factor) {
  pdl::enter();
  extern __shared__ float cs_sn[];  // [2 * half]: cos then sin
  const int64_t t = blockIdx.x;
  const int32_t pos = positions[t];
  for (int i = int(threadIdx.x); i < half; i += int(blockDim.x))
    rope_cos_sin(pos, inv_freq[i], attn_factor, cs_sn[i], cs_sn[half + i]);
  __syncthreads();
  rope_heads(static_cast<char*>(x) + t * stride_t, stride_h, heads, half, adjacent, cs_sn,
             int(threadIdx.x), int(blockDim.x));
}

}  // namespace

void launch_rope(const RopeArgs& a, cudaStream_t stream) {
  DS_CHECK(a.x.dtype == DType::F32 && a.x.ndim == 3, "rope takes [T, heads, head_dim] F32");
  DS_CHECK(a.rotary_dim > 0 && a.rotary_dim % 2 == 0 && a.rotary_dim <= a.x.shape[2],
           "rope: rotary_dim " + std::to_string(a.rotary_dim) + " for head_dim " +
               std::to_string(a.x.shape[2]));
  check_inner_dense(a.x, "rope");
  const int64_t tokens = a.x.shape[0], heads = a.x.shape[1];
  if (tokens == 0 || heads == 0) return;
  DS_CHECK(tokens < (int64_t(1) << 31), "rope: too many tokens");
  const int half = a.rotary_dim / 2;
  const int threads = int(std::clamp<int64_t>((heads * half + 31) / 32 * 32, 32, 256));
  pdl::launch(rope_kernel, unsigned(tokens), threads, size_t(2 * half) * sizeof(float), stream,
              a.x.data, a.x.stride[0], a.x.stride[1], int(heads), a.positions, a.inv_freq, half,
              a.style == RopeStyle::Adjacent, a.attn_factor);
  check_cuda(cudaGetLastError(), "rope");
}

}  // namespace ds::cuda
