// Host-side pieces the wq kernels' launchers share (gemm_wq.cu: dense; moe_wq.cu: MoE experts):
// the token-block variant of a step, the kernels' shared-memory limit, the pipeline order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_kernel.cuh"

namespace ds::cuda::wqk {

// Tokens per CTA for a step of m tokens (rows of x, or the most one expert can get): decode
// steps take the small variants. A token's bits do not depend on it (same groups, same order).
inline int tokens_per_cta(int64_t m) {
  return m <= 8 ? 8 : m <= 16 ? 16 : kBT;
}

// Calls f.template operator()<BT>() with BT = tokens_per_cta(m) as a constant.
template <typename Fn>
void with_bt(int64_t m, Fn&& f) {
  switch (tokens_per_cta(m)) {
    case 8:
      return f.template operator()<8>();
    case 16:
      return f.template operator()<16>();
    default:
      return f.template operator()<kBT>();
  }
}

// Lets kernel k take `bytes` of dynamic shared memory.
template <typename Kernel>
void set_smem_bytes(Kernel k, size_t bytes) {
  check_cuda(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             "wq kernel smem limit");
}
template <WqFormat F, int BT, bool XF, typename Kernel>
void set_smem_limit(Kernel k) {
  set_smem_bytes(k, kSmem<F, BT, XF>);
}

// Whether the wq pipeline of format f issues a stage's next copies before its wait
// (CtaJob::issue_first): every format's with DEEPSERVE_WQ_ISSUE_FIRST=1, FP8W's by default
// (DEEPSERVE_WQ_ISSUE_FIRST_FP8W=0 turns that off; switches.cpp has the figures).
inline bool issue_first_of(WqFormat f) {
  return g_wq_issue_first.on() || (f == WqFormat::FP8W && g_wq_issue_first_fp8w.on());
}

}  // namespace ds::cuda::wqk
