// Binding a model without a device: what `inspect --quantize / --load-format dummy` reports.
// A backend that allocates no memory (each buffer a distinct, never-dereferenced address)
// and runs nothing; binding on it leaves the model's weight_formats() exact.
#include <cstdint>

#include "model/loader.h"

namespace ds {
namespace {

class PlanBuffer final : public Buffer {
 public:
  PlanBuffer(void* at, size_t bytes) : at_(at), bytes_(bytes) {}
  void* data() override { return at_; }
  size_t size() const override { return bytes_; }
  Device device() const override { return {DeviceKind::CUDA, -1}; }

 private:
  void* at_;
  size_t bytes_;
};

class PlanBackend final : public Backend {
 public:
  Device device() const override { return {DeviceKind::CUDA, -1}; }
  std::string name() const override { return "plan (no device)"; }
  bool supports(Op, DType) const override { return true; }
  std::unique_ptr<Buffer> alloc(size_t bytes) override {
    next_ += (bytes + 255) / 256 * 256 + 256;
    return std::make_unique<PlanBuffer>(reinterpret_cast<void*>(next_), bytes);
  }
  void upload(const TensorView&, const void*, size_t) override {}
  void download(void*, const TensorView&, size_t) override {}
  void synchronize() override {}
  void embed(const TensorView&, const int32_t*, int, TensorView) override {}
  void rms_norm(const TensorView&, const TensorView&, float, TensorView) override {}
  void matmul(const TensorView&, const TensorView&, TensorView) override {}
  void rope(TensorView, const int32_t*, const RopeParams&) override {}
  void store_kv(const TensorView&, const TensorView&, const PagedKv&,
                const AttentionMeta&) override {}
  void attention(const AttentionParams&, const AttentionMeta&) override {}
  void silu_mul(const TensorView&, TensorView) override {}
  void add(TensorView, const TensorView&) override {}
  void batched_matmul(const TensorView&, const TensorView&, TensorView) override {}
  void mla_attention(const MlaAttentionParams&, const AttentionMeta&) override {}
  void moe_route(const TensorView&, const MoeRouteParams&, TensorView, TensorView) override {}
  void moe_ffn(const MoeFfnParams&) override {}
  void copy(const TensorView&, TensorView) override {}
  void fill_random(TensorView, const RandomFill&) override {}

 private:
  uintptr_t next_ = uintptr_t(1) << 40;
};

}  // namespace

std::map<std::string, std::pair<uint64_t, uint64_t>> plan_weight_formats(
    const std::filesystem::path& path, const LoadOptions& opts) {
  PlanBackend be;
  const LoadedModel m = load_model(path, be, opts);
  return m.model->weight_formats();
}

}  // namespace ds
