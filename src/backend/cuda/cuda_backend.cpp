// The CUDA backend: device memory, one stream per backend, host<->device copies.
// Model ops arrive with the CUDA issue; until then supports() says no for them, so a model
// refuses to load on this backend with a clear error instead of running a wrong path.
#include <cuda_runtime.h>

#include "backend/backend.h"
#include "backend/cuda/elementwise.cuh"
#include "core/error.h"

namespace ds {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

class DeviceBuffer final : public Buffer {
 public:
  DeviceBuffer(size_t bytes, int device) : size_(bytes), device_(device) {
    check(cudaMalloc(&data_, std::max<size_t>(bytes, 1)), "cudaMalloc");
  }
  ~DeviceBuffer() override { cudaFree(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return {DeviceKind::CUDA, device_}; }

 private:
  void* data_ = nullptr;
  size_t size_;
  int device_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    name_ = std::string("cuda:") + std::to_string(device) + " (" + prop.name + ")";
  }
  ~CudaBackend() override { cudaStreamDestroy(stream_); }

  Device device() const override { return {DeviceKind::CUDA, device_}; }
  std::string name() const override { return name_; }
  bool supports(Op op, DType t) const override { return op == Op::Add && t == DType::F32; }
  std::unique_ptr<Buffer> alloc(size_t bytes) override {
    return std::make_unique<DeviceBuffer>(bytes, device_);
  }
  void upload(const TensorView& dst, const void* host, size_t bytes) override {
    check(cudaMemcpyAsync(dst.data, host, bytes, cudaMemcpyHostToDevice, stream_), "upload");
  }
  void download(void* host, const TensorView& src, size_t bytes) override {
    check(cudaMemcpyAsync(host, src.data, bytes, cudaMemcpyDeviceToHost, stream_), "download");
    synchronize();
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "synchronize"); }

  void add(TensorView x, const TensorView& y) override {
    DS_CHECK(x.is_contiguous() && y.is_contiguous() && x.numel() == y.numel(), "add shapes");
    cuda::launch_add_f32(x.ptr<float>(), y.ptr<float>(), x.numel(), stream_);
    check(cudaGetLastError(), "add kernel");
  }
  void copy(const TensorView& src, TensorView dst) override {
    DS_CHECK(src.dtype == dst.dtype && src.rows() == dst.rows(), "copy shapes");
    check(cudaMemcpy2DAsync(dst.data, size_t(dst.row_stride()), src.data, size_t(src.row_stride()),
                            src.row_bytes(), size_t(src.rows()), cudaMemcpyDeviceToDevice, stream_),
          "copy");
  }

  void embed(const TensorView&, const int32_t*, int, TensorView) override { missing(Op::Embed); }
  void rms_norm(const TensorView&, const TensorView&, float, TensorView) override {
    missing(Op::RmsNorm);
  }
  void matmul(const TensorView&, const TensorView&, TensorView) override { missing(Op::MatMul); }
  void rope(TensorView, const int32_t*, const RopeParams&) override { missing(Op::Rope); }
  void store_kv(const TensorView&, const TensorView&, const PagedKv&,
                const AttentionMeta&) override {
    missing(Op::StoreKv);
  }
  void attention(const AttentionParams&, const AttentionMeta&) override { missing(Op::Attention); }
  void silu_mul(const TensorView&, TensorView) override { missing(Op::SiluMul); }
  void batched_matmul(const TensorView&, const TensorView&, TensorView) override {
    missing(Op::BatchedMatMul);
  }
  void mla_attention(const MlaAttentionParams&, const AttentionMeta&) override {
    missing(Op::MlaAttention);
  }
  void moe_route(const TensorView&, const MoeRouteParams&, TensorView, TensorView) override {
    missing(Op::MoeRoute);
  }
  void moe_ffn(const MoeFfnParams&) override { missing(Op::MoeFfn); }

 private:
  [[noreturn]] void missing(Op op) const {
    throw UnsupportedError(name_ + ": op " + std::string(op_name(op)) +
                           " is not implemented on CUDA yet");
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::string name_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions&, int device_index) {
  return std::make_unique<CudaBackend>(device_index);
}

}  // namespace ds
