// The CUDA backend: a device memory pool, one stream, cuBLAS GEMMs and the per-op kernels.
// Ops only enqueue work (no synchronous calls, no cudaMalloc), so a decode step can be
// captured in a CUDA graph; bad inputs found on the device are reported at synchronize().
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/argmax.cuh"
#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_mla_decode.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/context.cuh"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_log.h"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/embed.cuh"
#include "backend/cuda/fill_random.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_gguf.cuh"
#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/graphs.h"
#include "backend/cuda/kernel_trace.h"
#include "backend/cuda/kv_store.cuh"
#include "backend/cuda/memory_pool.h"
#include "backend/cuda/mla_prefill.cuh"
#include "backend/cuda/mla_prepare.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cuda/sample.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_dequant.cuh"
#include "core/error.h"
#include "core/log.h"

namespace ds {
namespace {

using cuda::check_cuda;

constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // cuBLAS's advice for Hopper
constexpr size_t kMiB = size_t(1) << 20;

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", double(bytes) / double(size_t(1) << 30));
  return buf;
}

// A range of the pool, returned to it on destruction. Holds the pool alive, so buffers may
// outlive the backend.
class PoolBuffer final : public Buffer {
 public:
  PoolBuffer(std::shared_ptr<cuda::DevicePool> pool, size_t bytes, int device)
      : pool_(std::move(pool)), data_(pool_->allocate(bytes)), size_(bytes), device_(device) {}
  ~PoolBuffer() override { pool_->release(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return {DeviceKind::CUDA, device_}; }

 private:
  std::shared_ptr<cuda::DevicePool> pool_;
  void* data_;
  size_t size_;
  int device_;
};

bool plain_float(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

// A byte stride in elements of t.
int64_t elements(int64_t bytes, DType t, const char* what) {
  const int64_t es = dtype_info(t).type_size;
  DS_CHECK(bytes % es == 0, std::string(what) + ": stride not a whole number of elements");
  return bytes / es;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const BackendOptions& o, int device) : device_(device) {
    DS_CHECK(o.gpu_memory_utilization > 0.0 && o.gpu_memory_utilization <= 1.0,
             "--gpu-memory-utilization must be in (0, 1]");
    cuda::kernel_trace_start();  // DEEPSERVE_KERNEL_TRACE: before the first CUDA call
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    cuda::mla_phase_log_start();   // DEEPSERVE_MLA_PHASES: before the pool takes the memory
    cuda::moe_item_log().start();  // DEEPSERVE_MOE_ITEMS: likewise
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    // The kernels use Ampere's instructions (mma.sync BF16, cp.async, ldmatrix) at least.
    if (prop.major < 8)
      throw UnsupportedError(
          std::string("CUDA device ") + prop.name + " is sm_" +
          std::to_string(prop.major * 10 + prop.minor) +
          "; deepserve's CUDA backend needs sm_80 or newer (Ampere, Ada, Hopper)");
    size_t free = 0, total = 0;
    check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    const size_t pool_bytes =
        size_t(double(free) * o.gpu_memory_utilization) / (2 * kMiB) * 2 * kMiB;
    pool_ = std::make_shared<cuda::DevicePool>(pool_bytes, o.gpu_memory_utilization);
    name_ = "cuda:" + std::to_string(device) + " (" + prop.name + ", pool " +
            gib(pool_->info().capacity_bytes) + " of " + gib(free) + " free)";
    log_info("CUDA backend " + name_ + ", " + std::to_string(prop.multiProcessorCount) + " SMs");
    // Mapped host words: kernels flag bad inputs without a device->host copy per op.
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&errors_host_), sizeof(cuda::DeviceErrors),
                             cudaHostAllocMapped),
               "cudaHostAlloc");
    *errors_host_ = {};
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&errors_dev_), errors_host_, 0),
               "cudaHostGetDevicePointer");
    workspace_ = alloc(kCublasWorkspaceBytes);
    // matmul_add_norm's arrival counter: zero between launches (the last CTA puts it back).
    add_norm_counter_ = alloc(sizeof(int));
    check_cuda(cudaMemsetAsync(add_norm_counter_->data(), 0, sizeof(int), stream_),
               "counter reset");
    check_cuda(cudaStreamSynchronize(stream_), "counter reset");
    gemm_ = std::make_unique<cuda::CublasGemm>(stream_, workspace_->data(), kCublasWorkspaceBytes);
    ctx_.stream = stream_;
    ctx_.sm_count = prop.multiProcessorCount;
    ctx_.scratch = [this](int slot, size_t bytes) { return scratch(slot, bytes); };
    ctx_.scratch_room = [this](int slot) { return scratch_room(slot); };
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    try {
      cuda::kernel_trace_write();   // DEEPSERVE_KERNEL_TRACE: every kernel so far
      cuda::mla_phase_log_write();  // DEEPSERVE_MLA_PHASES: every logged CTA so far
      cuda::moe_item_log_write();   // DEEPSERVE_MOE_ITEMS: every logged item so far
    } catch (const std::exception& e) {
      log_error(e.what());
    }
    reset_graphs();
    for (cudaEvent_t e : mark_events_) cudaEventDestroy(e);
    gemm_.reset();
    scratch_.clear();
    rope_tables_.clear();
    workspace_.reset();
    add_norm_counter_.reset();
    cudaStreamDestroy(stream_);
    cudaFreeHost(errors_host_);
  }

  Device device() const override { return {DeviceKind::CUDA, device_}; }
  std::string name() const override { return name_; }
  void* stream_handle() const { return stream_; }

  bool supports(Op op, DType t) const override {
    switch (op) {
      case Op::MatMul:
      case Op::MoeFfn:
        return plain_float(t) || cuda::wq_dtype(t) ||  // W4A16, FP8W: gemm_wq.cu
               cuda::is_gguf_block_type(t);            // GGUF: gemm_gguf.cu, moe_gguf.cu
      case Op::Embed:
        return plain_float(t) || cuda::is_gguf_block_type(t);
      case Op::BatchedMatMul:
        return plain_float(t);
      case Op::StoreKv:
      case Op::Attention:
      case Op::MlaAttention:
        return plain_float(t) || t == DType::F8_E4M3;  // F8_E4M3: the FP8 KV cache
      default:
        return t == DType::F32;
    }
  }

  std::unique_ptr<Buffer> alloc(size_t bytes) override {
    ++alloc_epoch_;  // during a capture this makes the caller discard the graph
    return std::make_unique<PoolBuffer>(pool_, bytes, device_);
  }

  void argmax(const TensorView& logits, TensorView ids) override {
    DS_CHECK(logits.dtype == DType::F32 && logits.ndim == 2 && ids.dtype == DType::I32 &&
                 ids.numel() >= logits.rows(),
             "argmax takes F32 logits [R, V] and I32 ids [R]");
    cuda::launch_argmax(logits.ptr<float>(), logits.rows(), logits.cols(), logits.row_stride() / 4,
                        ids.ptr<int32_t>(), stream_);
    check_cuda(cudaGetLastError(), "argmax");
  }

  void sample(const TensorView& logits, const SampleRow* rows, TensorView ids) override {
    DS_CHECK(logits.dtype == DType::F32 && logits.ndim == 2 && logits.row_stride() % 4 == 0 &&
                 ids.dtype == DType::I32 && ids.numel() >= logits.rows(),
             "sample takes F32 logits [R, V] (rows may be strided) and I32 ids [R]");
    DS_CHECK(logits.cols() > 0 && logits.cols() < (int64_t(1) << 21),
             "sample: vocab must be in [1, 2^21) (fixed-point mass)");
    cuda::launch_sample({logits.ptr<float>(), logits.rows(), logits.cols(), logits.row_stride() / 4,
                         rows, ids.ptr<int32_t>()},
                        stream_);
    check_cuda(cudaGetLastError(), "sample");
  }

  // CUDA graphs: the stream's work between begin and end is recorded into an executable
  // graph; replay launches it on the same stream.
  bool supports_graphs() const override { return true; }
  void begin_capture() override { graphs_.begin(stream_, cuda::g_graph_piece_layers.get()); }
  int end_capture() override { return graphs_.end(); }
  void capture_cut() override { graphs_.cut(); }
  void replay(int g) override { graphs_.replay(g, stream_); }
  int graph_pieces(int g) const override { return int(graphs_.pieces(g)); }
  void reset_graphs() override { graphs_.reset(); }
  uint64_t alloc_epoch() const override { return alloc_epoch_; }

  // Timing marks: pooled events recorded on the stream; the host waits only in mark_times_ms.
  int mark() override {
    DS_CHECK(!graphs_.capturing(), "timing marks cannot be recorded during a graph capture");
    if (marks_used_ == mark_events_.size()) {
      cudaEvent_t e = nullptr;
      check_cuda(cudaEventCreate(&e), "cudaEventCreate");
      mark_events_.push_back(e);
    }
    check_cuda(cudaEventRecord(mark_events_[marks_used_], stream_), "cudaEventRecord");
    return int(marks_used_++);
  }
  std::vector<double> mark_times_ms() override {
    std::vector<double> t(marks_used_, 0.0);
    if (marks_used_ == 0) return t;
    check_cuda(cudaEventSynchronize(mark_events_[marks_used_ - 1]), "cudaEventSynchronize");
    for (size_t i = 1; i < marks_used_; ++i) {
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, mark_events_[0], mark_events_[i]),
                 "cudaEventElapsedTime");
      t[i] = ms;
    }
    return t;
  }
  void clear_marks() override { marks_used_ = 0; }
  void upload(const TensorView& dst, const void* host, size_t bytes) override {
    if (bytes == 0) return;
    check_cuda(cudaMemcpyAsync(dst.data, host, bytes, cudaMemcpyHostToDevice, stream_), "upload");
  }
  void download(void* host, const TensorView& src, size_t bytes) override {
    if (bytes > 0)
      check_cuda(cudaMemcpyAsync(host, src.data, bytes, cudaMemcpyDeviceToHost, stream_),
                 "download");
    synchronize();
  }
  void synchronize() override {
    check_cuda(cudaStreamSynchronize(stream_), "synchronize");
    report_device_errors();
  }

  void embed(const TensorView& table, const int32_t* ids, int n, TensorView out) override {
    require(Op::Embed, table.dtype);
    if (cuda::is_gguf_block_type(table.dtype))
      return cuda::launch_gguf_embed(table, ids, n, out, errors_dev_, stream_);
    cuda::launch_embed({table, ids, n, out, errors_dev_}, stream_);
  }

  void rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out) override {
    cuda::launch_rms_norm({x, w, eps, out}, stream_);
  }
  void add_rms_norm(TensorView x, const TensorView& y, const TensorView& w, float eps,
                    TensorView out) override {
    cuda::RmsNormArgs a{x, w, eps, out};
    a.residual = y;
    cuda::launch_rms_norm(a, stream_);
  }

  // Skinny-sized products take the norm inside the GEMM's CTAs (launch_skinny_norm_gemm);
  // the rest run the norm kernel (x + y written to x_out), then matmul.
  void norm_matmul(const NormMatmulParams& p) override {
    if (cuda::g_norm_fuse.on() && fused_norm_matmul(p)) return;
    cuda::RmsNormArgs a{p.x, p.norm, p.eps, p.xn};
    if (p.y.data != nullptr) {
      a.residual = p.y;
      a.x_out = p.x_out;
    }
    cuda::launch_rms_norm(a, stream_);
    matmul(p.xn, p.w, p.out);
  }

  // norm_matmul in one launch where the skinny kernel takes the product; false: nothing ran.
  bool fused_norm_matmul(const NormMatmulParams& p) {
    const bool add = p.y.data != nullptr;
    const auto same = [&](const TensorView& v) {
      return v.dtype == DType::F32 && v.rows() == p.x.rows() && v.cols() == p.x.cols() &&
             cuda::rows_uniform(v);
    };
    if (cuda::wq_dtype(p.w.dtype) || cuda::is_gguf_block_type(p.w.dtype) || !same(p.x) ||
        !same(p.xn) || (add && (!same(p.y) || !same(p.x_out))) || p.norm.dtype != DType::F32 ||
        !p.norm.is_contiguous() || p.norm.numel() != p.x.cols() || p.w.cols() != p.x.cols() ||
        p.out.dtype != DType::F32 || p.out.rows() != p.x.rows() || p.out.cols() != p.w.rows() ||
        !cuda::rows_uniform(p.w) || !cuda::rows_uniform(p.out))
      return false;
    for (const TensorView* v : {&p.x, &p.xn, &p.w, &p.out})
      cuda::check_inner_dense(*v, "norm_matmul");
    if (add) {
      cuda::check_inner_dense(p.y, "norm_matmul");
      cuda::check_inner_dense(p.x_out, "norm_matmul");
    }
    require(Op::MatMul, p.w.dtype);
    const cuda::SkinnyGemmArgs sk = cuda::skinny_matmul_args(p.x, p.w, p.out);
    if (!cuda::use_skinny_gemm(sk) || !cuda::skinny_norm_fits(sk)) return false;
    cuda::SkinnyNormArgs nrm;
    nrm.g = p.norm.ptr<float>();
    nrm.eps = p.eps;
    nrm.xn = p.xn.ptr<float>();
    nrm.xn_row = p.xn.row_stride();
    if (add) {
      nrm.y = p.y.ptr<float>();
      nrm.y_row = p.y.row_stride();
      nrm.x_out = p.x_out.ptr<float>();
      nrm.x_out_row = p.x_out.row_stride();
    }
    cuda::launch_skinny_norm_gemm(sk, nrm, ctx_.sm_count, stream_);
    return true;
  }

  // Skinny-sized products with DEEPSERVE_ADD_NORM_LAST=1 add and normalize in the GEMM's last
  // CTA (launch_skinny_gemm_add_norm); the rest run the GEMM, then the norm kernel.
  void matmul_add_norm(const MatmulNormParams& p) override {
    if (cuda::g_add_norm_last.on() && fused_matmul_add_norm(p)) return;
    matmul(p.x, p.w, p.out);
    norm_after(p.out, p.add_norm);
  }

  // The MoE's down kernel adds and normalizes in its last CTA (DEEPSERVE_ADD_NORM_LAST=1, where it
  // also does the combine); else the norm kernel after the MoE.
  void moe_routed_ffn_add_norm(const TensorView& logits, const MoeRouteParams& route,
                               const MoeFfnParams& ffn, const AddNormParams& an) override {
    moe_route(logits, route, ffn.ids, ffn.weights);
    if (!ffn.experts.empty()) require(Op::MoeFfn, ffn.experts.front().gate.dtype);
    if (cuda::g_add_norm_last.on() && cuda::add_norm_fits(ffn.out, an)) {
      const cuda::AddNormArgs post =
          cuda::add_norm_args(an, static_cast<int*>(add_norm_counter_->data()));
      if (cuda::moe_ffn(ctx_, ffn, &post)) return;
    } else {
      cuda::moe_ffn(ctx_, ffn);
    }
    norm_after(ffn.out, an);
  }

  // The norm kernel's add and norm after y (AddNormParams).
  void norm_after(const TensorView& y, const AddNormParams& an) {
    cuda::RmsNormArgs a{an.r, an.norm, an.eps, an.rn};
    a.residual = y;
    a.x_out = an.r_out;
    cuda::launch_rms_norm(a, stream_);
  }

  // matmul_add_norm in one launch where the skinny kernel takes the product; false: nothing ran.
  bool fused_matmul_add_norm(const MatmulNormParams& p) {
    if (cuda::wq_dtype(p.w.dtype) || cuda::is_gguf_block_type(p.w.dtype) ||
        p.x.dtype != DType::F32 || !cuda::rows_uniform(p.x) || p.x.rows() != p.out.rows() ||
        p.w.cols() != p.x.cols() || p.out.cols() != p.w.rows() || !cuda::rows_uniform(p.w) ||
        !cuda::add_norm_fits(p.out, p.add_norm))
      return false;
    for (const TensorView* v : {&p.x, &p.w}) cuda::check_inner_dense(*v, "matmul_add_norm");
    require(Op::MatMul, p.w.dtype);
    const cuda::SkinnyGemmArgs sk = cuda::skinny_matmul_args(p.x, p.w, p.out);
    if (!cuda::use_skinny_gemm(sk) || !cuda::skinny_add_norm_fits(sk)) return false;
    cuda::launch_skinny_gemm_add_norm(
        sk, cuda::add_norm_args(p.add_norm, static_cast<int*>(add_norm_counter_->data())),
        ctx_.sm_count, stream_);
    return true;
  }

  void matmul(const TensorView& x, const TensorView& w, TensorView out) override {
    require(Op::MatMul, w.dtype);
    DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "matmul takes F32 activations");
    if (cuda::is_gguf_block_type(w.dtype))
      return cuda::launch_gguf_gemm(cuda::gguf_matmul_args(x, w, out), stream_);
    if (cuda::wq_dtype(w.dtype)) {
      if (!cuda::wq_dequant_dense(x.rows(), w, stream_)) return cuda::wq_matmul(ctx_, x, w, out);
      return matmul(x, expanded(w), out);  // prefill-sized: BF16 through cuBLAS below
    }
    DS_CHECK(x.cols() == w.cols() && out.cols() == w.rows() && out.rows() == x.rows(),
             "matmul shapes " + x.shape_str() + " x " + w.shape_str() + " -> " + out.shape_str());
    DS_CHECK(cuda::rows_uniform(x) && cuda::rows_uniform(w) && cuda::rows_uniform(out),
             "matmul: rows must be evenly spaced");
    cuda::check_inner_dense(x, "matmul");
    cuda::check_inner_dense(w, "matmul");
    cuda::check_inner_dense(out, "matmul");
    const int64_t m = x.rows(), k = x.cols(), n = w.rows();
    if (m == 0 || n == 0) return;
    DS_CHECK(k > 0, "matmul with K = 0");
    // Decode-sized M: one bandwidth-bound launch on the F32 x (no conversion pass).
    const cuda::SkinnyGemmArgs sk = cuda::skinny_matmul_args(x, w, out);
    if (cuda::use_skinny_gemm(sk)) {
      cuda::launch_skinny_gemm(sk, ctx_.sm_count, stream_);
      return;
    }
    // Decode-sized steps past the skinny kernel's range on BF16 weights: the streamed
    // tensor-core kernel (weights as the 16-row mma operand, 8 or 16 tokens per CTA, split-K).
    if (m <= cuda::kWqBf16MaxTokens && cuda::wq_bf16_fits(w) &&
        n * w.row_stride() <= cuda::kWqBf16MaxWeightBytes) {
      cuda::wq_matmul(ctx_, x, w, out);
      return;
    }
    cuda::GemmArgs g;
    g.dtype = w.dtype;
    g.m = m;
    g.n = n;
    g.k = k;
    set_x_operand(x, x.row_stride(), 0, w.dtype, g);
    g.w = w.data;
    g.ldw = n == 1 ? k : elements(w.row_stride(), w.dtype, "matmul w");
    g.out = out.ptr<float>();
    g.ldo = m == 1 ? n : elements(out.row_stride(), DType::F32, "matmul out");
    gemm_->run(g);
  }

  void batched_matmul(const TensorView& x, const TensorView& w, TensorView out) override {
    require(Op::BatchedMatMul, w.dtype);
    DS_CHECK(x.ndim == 3 && w.ndim == 3 && out.ndim == 3, "batched_matmul takes 3-D views");
    DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "batched_matmul takes F32 x/out");
    const int64_t b = x.shape[0], m = x.shape[1], k = x.shape[2], n = w.shape[1];
    DS_CHECK(w.shape[0] == b && w.shape[2] == k && out.shape[0] == b && out.shape[1] == m &&
                 out.shape[2] == n,
             "batched_matmul shapes " + x.shape_str() + " x " + w.shape_str() + " -> " +
                 out.shape_str());
    cuda::check_inner_dense(x, "batched_matmul");
    cuda::check_inner_dense(w, "batched_matmul");
    cuda::check_inner_dense(out, "batched_matmul");
    if (b == 0 || m == 0 || n == 0) return;
    DS_CHECK(k > 0, "batched_matmul with K = 0");
    const cuda::SkinnyGemmArgs sk = cuda::skinny_batched_args(x, w, out);
    if (cuda::use_skinny_gemm(sk)) {
      cuda::launch_skinny_gemm(sk, ctx_.sm_count, stream_);
      return;
    }
    if (cuda::wq_batched_fits(x, w, out) && b * n * w.stride[1] <= cuda::kWqBf16MaxWeightBytes &&
        cuda::g_wq_batched.on()) {
      cuda::wq_batched_matmul(ctx_, x, w, out);
      return;
    }
    cuda::GemmArgs g;
    g.dtype = w.dtype;
    g.batch = b;
    g.m = m;
    g.n = n;
    g.k = k;
    set_x_operand(x, x.stride[1], x.stride[0], w.dtype, g);
    g.w = w.data;
    g.ldw = n == 1 ? k : elements(w.stride[1], w.dtype, "batched_matmul w");
    g.stride_w = b == 1 ? 0 : elements(w.stride[0], w.dtype, "batched_matmul w");
    g.out = out.ptr<float>();
    g.ldo = m == 1 ? n : elements(out.stride[1], DType::F32, "batched_matmul out");
    g.stride_out = b == 1 ? 0 : elements(out.stride[0], DType::F32, "batched_matmul out");
    gemm_->run(g);
  }

  void rope(TensorView x, const int32_t* positions, const RopeParams& p) override {
    cuda::RopeArgs a;
    a.x = x;
    a.positions = positions;
    a.inv_freq = rope_table(p);
    a.rotary_dim = p.rotary_dim;
    a.style = p.style;
    a.attn_factor = p.attn_factor;
    cuda::launch_rope(a, stream_);
  }

  void store_kv(const TensorView& k, const TensorView& v, const PagedKv& kv,
                const AttentionMeta& meta) override {
    require(Op::StoreKv, kv.dtype);
    cuda::launch_store_kv({k, v, kv, meta.slot_mapping, meta.num_tokens, errors_dev_}, stream_);
  }

  void attention(const AttentionParams& p, const AttentionMeta& meta) override {
    require(Op::Attention, p.kv.dtype);
    cuda::paged_attention(ctx_, p, meta);
  }
  void mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta) override {
    require(Op::MlaAttention, p.cache.dtype);
    cuda::mla_attention(ctx_, p, meta);
  }
  bool mla_prefill(const MlaPrefillParams& p, const AttentionMeta& meta) override {
    if (!cuda::mla_prefill_wanted(p, meta)) return false;
    if (!logged_mla_prefill_) {
      log_info("mla: expanded BF16 prefill path (flash attention, mma.sync) for prefill steps");
      logged_mla_prefill_ = true;
    }
    cuda::mla_prefill(ctx_, *gemm_, p, meta);
    return true;
  }
  void mla_prepare(const MlaPrepareParams& p, const AttentionMeta& meta) override {
    // FP8 caches (per-slot scales) and non-F32 activations take the four separate ops.
    // DEEPSERVE_MLA_PREPARE=0 (g_mla_prepare) takes the four ops too (A/B runs).
    if (!cuda::g_mla_prepare.on() || !cuda::mla_prepare_supported(p.cache.dtype) ||
        p.kva.dtype != DType::F32 || p.norm.dtype != DType::F32)
      return Backend::mla_prepare(p, meta);
    require(Op::StoreKv, p.cache.dtype);
    DS_CHECK(p.norm.numel() == p.kv_lora_rank && (p.norm.ndim == 1 || p.norm.is_contiguous()),
             "mla_prepare: norm weight " + p.norm.shape_str());
    cuda::MlaPrepareArgs a;
    a.kva = p.kva;
    a.norm = p.norm.ptr<float>();
    a.eps = p.eps;
    a.q_rope = p.q_rope;
    a.positions = meta.positions;
    a.inv_freq = rope_table(p.rope);
    a.rotary_dim = p.rope.rotary_dim;
    a.style = p.rope.style;
    a.attn_factor = p.rope.attn_factor;
    a.cache = p.cache;
    a.kv_lora_rank = p.kv_lora_rank;
    a.slot_mapping = meta.slot_mapping;
    a.num_tokens = meta.num_tokens;
    a.errors = errors_dev_;
    cuda::launch_mla_prepare(a, stream_);
  }
  void moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                 TensorView weights) override {
    cuda::moe_route(ctx_, logits, p, ids, weights);
  }
  void moe_ffn(const MoeFfnParams& p) override {
    if (!p.experts.empty()) require(Op::MoeFfn, p.experts.front().gate.dtype);
    cuda::moe_ffn(ctx_, p);
  }

  void silu_mul(const TensorView& gate_up, TensorView out) override {
    cuda::launch_silu_mul(gate_up, out, stream_);
  }
  void add(TensorView x, const TensorView& y) override { cuda::launch_add(x, y, stream_); }
  void fill_random(TensorView dst, const RandomFill& p) override {
    cuda::launch_fill_random(dst, p, stream_);
  }

  void copy(const TensorView& src, TensorView dst) override {
    cuda::launch_copy(src, dst, stream_);
  }

  CudaPoolInfo pool_info() const { return pool_->info(); }

 private:
  void require(Op op, DType t) const {
    if (!supports(op, t))
      throw UnsupportedError(name_ + ": " + std::string(op_name(op)) + " with " +
                             std::string(dtype_name(t)) + " is not supported on CUDA");
  }

  // x as cuBLAS's B operand, its rows ld_bytes apart and batches batch_bytes apart: F32 x
  // against F32 weights is used in place when cuBLAS can address it; otherwise it is rounded to
  // the weights' dtype into dense scratch rows (ld a multiple of 8 elements so tensor-core
  // kernels stay eligible).
  void set_x_operand(const TensorView& x, int64_t ld_bytes, int64_t batch_bytes, DType wtype,
                     cuda::GemmArgs& g) {
    if (wtype == DType::F32 && ld_bytes % 4 == 0 && batch_bytes % 4 == 0 &&
        (ld_bytes / 4 >= g.k || g.m == 1)) {
      g.x = x.data;
      g.ldx = g.m == 1 ? g.k : ld_bytes / 4;
      g.stride_x = g.batch == 1 ? 0 : batch_bytes / 4;
      return;
    }
    const int64_t ld = (g.k + 7) / 8 * 8, es = dtype_info(wtype).type_size;
    void* buf = scratch(cuda::kScratchMatmul, size_t(g.batch * g.m * ld * es));
    cuda::launch_convert_rows(x, wtype, buf, ld, stream_);
    g.x = buf;
    g.ldx = ld;
    g.stride_x = g.m * ld;
  }

  // A quantized weight expanded to BF16 rows (wq_dequant.cuh) in its scratch slot, valid until
  // the next expansion.
  TensorView expanded(const TensorView& w) {
    const int64_t n = w.rows(), k = w.cols();
    void* buf = scratch(cuda::kScratchDequant, size_t(n * k * 2));
    const cuda::WqDequantJob job{w.data, w.row_stride(), n, k, buf};
    cuda::launch_wq_dequant(w.dtype, &job, 1, stream_);
    return TensorView::contiguous(buf, DType::BF16, {n, k}, w.device);
  }

  // Per-slot device scratch from the pool; grows (never shrinks) to the largest request, by
  // half again where the pool has that much in one range. A pointer stays valid until the same
  // slot is asked for more.
  void* scratch(int slot, size_t bytes) {
    DS_CHECK(slot >= 0 && slot < 64, "scratch slot out of range");
    if (size_t(slot) >= scratch_.size()) scratch_.resize(size_t(slot) + 1);
    std::unique_ptr<Buffer>& b = scratch_[size_t(slot)];
    if (!b || b->size() < bytes) {
      const auto whole_mib = [](size_t n) { return (n + kMiB - 1) / kMiB * kMiB; };
      size_t grown = whole_mib(std::max(bytes, b ? b->size() + b->size() / 2 : size_t(0)));
      b.reset();  // back to the pool first, so the grown buffer may reuse its range
      if (grown > whole_mib(bytes) && pool_->info().largest_free_bytes < grown)
        grown = whole_mib(bytes);
      b = alloc(grown);
    }
    return b->data();
  }
  size_t scratch_room(int slot) const {
    const size_t have = size_t(slot) < scratch_.size() && scratch_[size_t(slot)]
                            ? scratch_[size_t(slot)]->size()
                            : 0;
    return std::max(have, pool_->info().largest_free_bytes);
  }

  // Inverse frequencies on the device, uploaded once per distinct parameter set.
  const float* rope_table(const RopeParams& p) {
    for (const auto& [params, buf] : rope_tables_)
      if (params == p) return static_cast<const float*>(buf->data());
    const std::vector<float> inv = rope_inv_freq(p);
    const size_t n = std::max<size_t>(inv.size(), 1);
    std::unique_ptr<Buffer> buf = alloc(n * sizeof(float));
    upload(buf->view(DType::F32, {int64_t(n)}), inv.data(), inv.size() * sizeof(float));
    rope_tables_.emplace_back(p, std::move(buf));
    return static_cast<const float*>(rope_tables_.back().second->data());
  }

  // Input errors kernels flagged since the last check (the stream is idle when called).
  void report_device_errors() {
    volatile cuda::DeviceErrors* e = errors_host_;
    if (e->bad_token) {
      const int token = e->token, vocab = e->vocab;
      e->bad_token = 0;
      throw Error("token id " + std::to_string(token) + " is outside the vocabulary of " +
                  std::to_string(vocab));
    }
    if (e->bad_slot) {
      const int slot = e->slot, capacity = e->capacity;
      e->bad_slot = 0;
      throw Error("KV slot " + std::to_string(slot) + " out of range (the cache holds " +
                  std::to_string(capacity) + " slots)");
    }
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::string name_;
  std::shared_ptr<cuda::DevicePool> pool_;
  cuda::DeviceErrors* errors_host_ = nullptr;  // mapped; errors_dev_ is its device address
  cuda::DeviceErrors* errors_dev_ = nullptr;
  std::unique_ptr<Buffer> workspace_;         // cuBLAS's
  std::unique_ptr<Buffer> add_norm_counter_;  // one int (cuda::AddNormArgs::counter)
  std::unique_ptr<cuda::CublasGemm> gemm_;
  bool logged_mla_prefill_ = false;
  std::vector<std::unique_ptr<Buffer>> scratch_;  // by ScratchSlot
  std::vector<std::pair<RopeParams, std::unique_ptr<Buffer>>> rope_tables_;
  cuda::Context ctx_;
  cuda::GraphSet graphs_;
  uint64_t alloc_epoch_ = 0;  // allocations so far (captured graphs hold raw pointers)
  // Timing marks: events reused after clear_marks().
  std::vector<cudaEvent_t> mark_events_;
  size_t marks_used_ = 0;
};

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the "no driver / no device" error
    return 0;
  }
  return n;
}

CudaPoolInfo cuda_pool_info(const Backend& backend) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (!b) throw Error("cuda_pool_info: backend " + backend.name() + " is not a CUDA backend");
  return b->pool_info();
}

namespace {
const CudaBackend& cuda_of(const Backend& backend) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (!b) throw Error("backend " + backend.name() + " is not a CUDA backend");
  return *b;
}
}  // namespace

void* cuda_stream_of(const Backend& backend) {
  return cuda_of(backend).stream_handle();
}
int cuda_device_of(const Backend& backend) {
  return cuda_of(backend).device().index;
}
void cuda_bind_thread(const Backend& backend) {
  check_cuda(cudaSetDevice(cuda_of(backend).device().index), "cudaSetDevice");
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opts, int device_index) {
  return std::make_unique<CudaBackend>(opts, device_index);
}

}  // namespace ds
