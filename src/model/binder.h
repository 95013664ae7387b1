// Shared pieces of every architecture's "bind weights" step: shape checks, support checks,
// moving weights into backend memory, and the F32 views a forward slices its scratch into.
#pragma once

#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/tensor_views.h"
#include "model/config.h"
#include "model/weights.h"

namespace ds {

// Whether a linear weight may be converted to the load-time quantized format (--quantize):
// the big projections may; the output projection and weights used in other ways (MLA's
// kv_b_proj) keep the checkpoint's dtype.
enum class Quantizable : uint8_t { No, Yes };

// An FP8 checkpoint's weight (F8_E4M3 codes) with its scales: `<name>_scale_inv` (DeepSeek-V3,
// F32 [ceil(N/128), ceil(K/128)] blocks) or `<name>_scale` (compressed-tensors: per channel
// [N] / [N, 1], or per tensor); element = code * scale.
struct Fp8Checkpoint {
  TensorView codes;
  TensorView scales;
  int64_t block_rows = 0;  // rows per scale row: 128 (blocks), 1 (per channel), 0 (one scale)
  // Finds the scales beside `name`; throws UnsupportedError naming other layouts.
  static Fp8Checkpoint of(const WeightSource& w, const std::string& name, const TensorView& t);
  float scale(int64_t n, int64_t group) const;   // of row n, 128-group `group`
  void row(int64_t n, float* out) const;         // row n dequantized
  void fp8w_row(int64_t n, uint8_t* dst) const;  // row n as an FP8W row, exactly
};

// Generated (dummy) and quantized weights are made in backend memory as they are bound
// (on a GPU: generated in place, never materialized on the host); `checked` then returns
// that placed view, which place() passes through and fuse_rows() copies on the device.
class WeightBinder {
 public:
  WeightBinder(const WeightSource& w, Backend& be, WeightQuant quant = WeightQuant::None)
      : w_(w), be_(be), quant_(quant) {}

  // A [rows, cols] weight in backend memory that the backend can run `op` on.
  TensorView linear(const std::string& name, int64_t rows, int64_t cols, Op op = Op::MatMul,
                    Quantizable q = Quantizable::Yes) {
    return place(checked(name, rows, cols, op, q));
  }
  // The same checks, but the host view (for fuse_rows or load-time transforms), or the placed
  // view of a generated or quantized weight.
  TensorView checked(const std::string& name, int64_t rows, int64_t cols, Op op = Op::MatMul,
                     Quantizable q = Quantizable::Yes);
  // A [d0, d1, d2] copy of the weight `name` ([rows, cols], F32/F16/BF16, its own dtype) in
  // backend memory whose element (a, b, c) is the weight's flat element a*s0 + b*s1 + c*s2
  // (load-time transposes); generated directly for dummy weights.
  TensorView permuted(const std::string& name, std::array<int64_t, 3> dims,
                      std::array<int64_t, 3> strides);
  // An embedding table [rows, cols] the backend can embed from.
  TensorView table(const std::string& name, int64_t rows, int64_t cols);
  // A [rows, cols] weight converted to F32 in backend memory (small weights whose products
  // must not see 16-bit activations on a GPU, such as the MoE router).
  TensorView linear_f32(const std::string& name, int64_t rows, int64_t cols);
  // A norm weight [n] as F32 in backend memory (checkpoints store F32, F16 or BF16).
  TensorView norm(const std::string& name, int64_t n);
  // One weight in backend memory whose rows are the (host) parts' rows in order (one matmul
  // for several outputs); nullopt when the parts' dtypes or widths differ.
  std::optional<TensorView> fuse_rows(std::initializer_list<TensorView> parts);
  // A host tensor's bytes in backend memory (the same view on the CPU, a copy elsewhere).
  TensorView place(const TensorView& host);
  // A bound [rows, cols] weight as `parts` weights of cols / parts columns each: views for
  // plain dtypes; W4A16 / FP8W rows end in their scales, so theirs are repacked copies in
  // backend memory (whole groups of 128 per part), bit for bit the same values.
  std::vector<TensorView> split_cols(const TensorView& w, int parts);
  // Frees a bound weight the model no longer uses (a no-op for one it does not own).
  void drop(const TensorView& w) { release(w.data); }
  // A new backend buffer holding `host` as a contiguous tensor of `dtype` and `dims`.
  TensorView upload(const void* host, DType dtype, std::initializer_list<int64_t> dims);

  // A GPTQ / AWQ checkpoint's format: `<x>.weight` may then be `<x>.qweight` and friends.
  void set_int4(const std::optional<Int4Format>& f) { int4_ = f; }
  bool has(const std::string& name) const {
    return w_.find(name).has_value() || int4_stem(name).has_value();
  }
  // The raw (host) view of a weight, for load-time transforms.
  TensorView host(const std::string& name) const { return w_.get(name); }
  Backend& backend() { return be_; }
  // Buffers the bound weights live in; the model keeps them.
  std::vector<std::unique_ptr<Buffer>>& buffers() { return owned_; }
  uint64_t bytes() const { return bytes_; }  // bytes of the bound weights
  // Bytes and parameters bound per format ("BF16", "W4A16", ...), for logs and inspect.
  const std::map<std::string, std::pair<uint64_t, uint64_t>>& formats() const { return formats_; }

 private:
  TensorView dummy_f32(const std::string& name, const TensorView& t, const DummyInit& init);
  // The weight `name` as stored, or dequantized to F32 into `keep` when it is FP8.
  TensorView host_plain(const std::string& name, std::vector<float>& keep) const;
  // "<x>." when `name` ("<x>.weight") is absent but "<x>.qweight" is there (GPTQ / AWQ).
  std::optional<std::string> int4_stem(const std::string& name) const;
  // checked() of a GPTQ / AWQ weight: W4A16 as stored when exact, else dequantized.
  TensorView checked_int4(const std::string& stem, int64_t rows, int64_t cols, Op op,
                          Quantizable q);
  // A new placed [rows, cols] weight of dt (W4A16 and FP8W with their padded rows).
  TensorView alloc_weight(DType dt, int64_t rows, int64_t cols);
  // A new buffer of `bytes`, kept; marked placed.
  void* alloc_placed(size_t bytes);
  // Drops an owned placed buffer (a part copied into a fused weight).
  void release(const void* data);

  const WeightSource& w_;
  Backend& be_;
  WeightQuant quant_;
  std::optional<Int4Format> int4_;
  std::set<std::string> int4_notes_;  // reasons already logged
  std::vector<std::unique_ptr<Buffer>> owned_;
  std::vector<const void*> placed_;  // data pointers of weights made in backend memory
  uint64_t bytes_ = 0;
  std::map<std::string, std::pair<uint64_t, uint64_t>> formats_;  // dtype -> (bytes, params)
  void count(const TensorView& t);                                // adds t to bytes_, formats_
};

// Makes `buf` hold at least `elems` 4-byte elements (F32 / I32 scratch), reallocating only
// to grow, so a forward's scratch settles at its largest step.
void ensure_scratch(Backend& be, std::unique_ptr<Buffer>& buf, int64_t elems);

void check_shape(const TensorView& t, int64_t rows, int64_t cols, const std::string& name);
// Element i of a 1-D (or flattened contiguous) F32/F16/BF16 host tensor as float.
float host_element(const TensorView& t, int64_t i);

}  // namespace ds
