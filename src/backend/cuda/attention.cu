// Paged attention launchers: the kernel choice and the launches. Parameter building and the
// work plan are in attention_setup.h (shared with the host simulator); kernel bodies in
// attention_simt.cuh (F32, any shape) and attention_mma.cuh (tensor cores).
#include <array>
#include <atomic>
#include <string>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_mla_decode.cuh"
#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/attention_setup.h"
#include "backend/cuda/attention_simt.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"

namespace ds::cuda {
namespace {

std::atomic<int64_t> g_mla_merge_launches{0};

template <int kNI>
__global__ void __launch_bounds__(kern::kSimtThreads) simt_kernel(const kern::AttnParams p) {
  pdl::enter();
  extern __shared__ __align__(16) uint8_t smem[];
  kern::simt_attention<kNI>(p, kern::this_thread(), smem);
}

template <bool kLo, bool kSepV>
__global__ void __launch_bounds__(kern::kMmaThreads) mma_kernel(const kern::AttnParams p) {
  pdl::enter();
  extern __shared__ __align__(16) uint8_t smem[];
  kern::mma_attention<kLo, kSepV>(p, kern::this_thread(), smem);
}

__global__ void __launch_bounds__(128) merge_kernel(const kern::MergeParams m) {
  pdl::enter();
  kern::merge_splits(m, kern::this_thread());
}

int device_attribute(cudaDeviceAttr attr) {
  int dev = 0, value = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&value, attr, dev), "cudaDeviceGetAttribute");
  return value;
}

int sm_count_of(const Context& ctx) {
  return ctx.sm_count > 0 ? ctx.sm_count : device_attribute(cudaDevAttrMultiProcessorCount);
}

// Shared memory of each kernel family for parameters with the plan applied.
int simt_bytes(const kern::AttnParams& a) {
  return kern::simt_layout(a.dim, a.dvc, a.v != nullptr).bytes;
}
int mma_bytes(const kern::AttnParams& a) {
  return kern::mma_layout(a.dim, a.dvc, a.cache_type != kern::kCacheBF16, a.v != nullptr).bytes;
}

template <auto kKernel>
void launch(const Context& ctx, const kern::AttnParams& a, const WorkPlan& w, int threads,
            int smem_bytes) {
  allow_smem<kKernel>(smem_bytes);
  const dim3 grid(w.tiles, unsigned(a.splits), unsigned(a.kv_heads * a.nhc * a.ndv));
  pdl::launch(kKernel, grid, threads, size_t(smem_bytes), ctx.stream, a);
  check_cuda(cudaGetLastError(), "attention kernel");
}

// Plans and runs one kernel family, then the split merge, for an unplanned parameter block.
void run(const Context& ctx, int scratch_slot, kern::AttnParams a, bool tensor_cores) {
  const int sms = sm_count_of(ctx);
  const WorkPlan w = tensor_cores ? plan_for(a, kern::kMmaRows, kern::kMmaKeys, sms)
                                  : plan_for(a, kern::kSimtRows, kern::kSimtKeys, sms);
  apply_plan(w, a);
  const int bytes = tensor_cores ? mma_bytes(a) : simt_bytes(a);
  DS_CHECK(bytes <= device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin),
           "cuda attention: rows of " + std::to_string(a.dim) + " values need " +
               std::to_string(bytes) + " bytes of shared memory, more than the device has");
  if (a.splits > 1) {
    void* scratch = ctx.scratch(scratch_slot, split_scratch_bytes(a));
    DS_CHECK(scratch != nullptr, "cuda attention: no scratch memory for the split partials");
    bind_split_scratch(a, scratch);
  }
  if (tensor_cores) {
    const bool lo = a.cache_type != kern::kCacheBF16, sep = a.v != nullptr;
    const int n = kern::kMmaThreads;
    if (lo && sep) launch<mma_kernel<true, true>>(ctx, a, w, n, bytes);
    if (lo && !sep) launch<mma_kernel<true, false>>(ctx, a, w, n, bytes);
    if (!lo && sep) launch<mma_kernel<false, true>>(ctx, a, w, n, bytes);
    if (!lo && !sep) launch<mma_kernel<false, false>>(ctx, a, w, n, bytes);
  } else {
    const int n = kern::kSimtThreads;
    if (a.dvc <= 64)
      launch<simt_kernel<2>>(ctx, a, w, n, bytes);
    else if (a.dvc <= 128)
      launch<simt_kernel<4>>(ctx, a, w, n, bytes);
    else if (a.dvc <= 256)
      launch<simt_kernel<8>>(ctx, a, w, n, bytes);
    else
      launch<simt_kernel<16>>(ctx, a, w, n, bytes);
  }
  if (a.splits > 1) {
    pdl::launch(merge_kernel, unsigned(a.num_tokens) * unsigned(a.heads), 128, 0, ctx.stream,
                merge_params(a));
    check_cuda(cudaGetLastError(), "attention merge kernel");
  }
}

// The MLA decode kernel, then the shared split merge unless the kernel merged in clusters.
void run_mla_decode(const Context& ctx, kern::AttnParams a, bool bf16_qp) {
  a.mla_rows = mla_decode_rows(a, bf16_qp);
  a.splits = mla_decode_splits(a, sm_count_of(ctx));
  // DEEPSERVE_MLA_CLUSTER_FIT=1: W1's 8 clusters of 16 do not all fit the H200 at once.
  if (g_mla_cluster_fit.on()) a.splits = mla_decode_cluster_fit(a);
  if (a.splits > 1) {
    void* scratch = ctx.scratch(kScratchMla, split_scratch_bytes(a));
    DS_CHECK(scratch != nullptr, "cuda mla_attention: no scratch memory for the split partials");
    bind_split_scratch(a, scratch);
  }
  const bool merged = launch_mla_decode(a, ctx.stream, bf16_qp);
  if (a.splits > 1 && !merged) {
    g_mla_merge_launches.fetch_add(1, std::memory_order_relaxed);
    pdl::launch(merge_kernel, unsigned(a.num_tokens) * unsigned(a.heads), 128, 0, ctx.stream,
                merge_params(a));
    check_cuda(cudaGetLastError(), "attention merge kernel");
  }
}

// The kernel family for `path`: Auto takes tensor cores wherever their shared memory fits.
bool use_tensor_cores(const Context& ctx, const kern::AttnParams& a, AttentionPath path) {
  if (path == AttentionPath::Simt) return false;
  kern::AttnParams b = a;
  apply_plan(plan_for(a, kern::kMmaRows, kern::kMmaKeys, sm_count_of(ctx)), b);
  const bool fits = mma_bytes(b) <= device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  DS_CHECK(fits || path == AttentionPath::Auto,
           "cuda attention: the tensor-core kernel does not fit rows of " + std::to_string(a.dim) +
               " values");
  return fits;
}

}  // namespace

int64_t mla_merge_launches() {
  return g_mla_merge_launches.load(std::memory_order_relaxed);
}

void paged_attention(const Context& ctx, const AttentionParams& p, const AttentionMeta& meta) {
  paged_attention_on(ctx, p, meta, AttentionPath::Auto);
}

void paged_attention_on(const Context& ctx, const AttentionParams& p, const AttentionMeta& meta,
                        AttentionPath path) {
  if (meta.num_tokens <= 0 || meta.num_seqs <= 0) return;
  const kern::AttnParams a = gqa_params(p, meta);
  run(ctx, kScratchAttention, a, use_tensor_cores(ctx, a, path));
}

void mla_attention(const Context& ctx, const MlaAttentionParams& p, const AttentionMeta& meta) {
  mla_attention_on(ctx, p, meta, AttentionPath::Auto);
}

void mla_attention_on(const Context& ctx, const MlaAttentionParams& p, const AttentionMeta& meta,
                      AttentionPath path) {
  if (meta.num_tokens <= 0 || meta.num_seqs <= 0) return;
  const kern::AttnParams a = mla_params(p, meta);
  const bool decode = mla_decode_fits(a);
  const bool forced = path == AttentionPath::MlaDecode || path == AttentionPath::MlaDecodeBf16;
  DS_CHECK(decode || !forced,
           "cuda mla_attention: the decode kernel needs a BF16 or FP8 cache, R 512, rope dims a "
           "multiple of 16 up to 64 and one query per sequence");
  if (decode && (path == AttentionPath::Auto || forced)) {
    run_mla_decode(ctx, a,
                   path == AttentionPath::MlaDecodeBf16 ||
                       (path == AttentionPath::Auto && mla_decode_bf16_auto(a)));
    return;
  }
  run(ctx, kScratchMla, a, use_tensor_cores(ctx, a, path));
}

}  // namespace ds::cuda
