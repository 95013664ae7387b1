// The ops a model may call, implemented once per device (cpu/, cuda/).
//
// A model says *what* to compute by calling these on TensorViews; a backend decides how.
// Ops are enqueued on the backend's stream in call order; synchronize() waits for them.
// On the CPU every op runs to completion before it returns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace ds {

enum class Op {
  Embed,
  RmsNorm,
  MatMul,
  Rope,
  StoreKv,
  Attention,
  SiluMul,
  Add,
};
std::string_view op_name(Op op);

// Device memory owned by a backend; freed when the buffer is destroyed.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
  virtual Device device() const = 0;
  TensorView view(DType dtype, std::initializer_list<int64_t> dims) {
    return TensorView::contiguous(data(), dtype, dims, device());
  }
};

enum class RopeStyle : uint8_t {
  Adjacent,    // pairs (2i, 2i+1): GGUF llama, whose Q/K rows were permuted at conversion
  RotateHalf,  // pairs (i, i + d/2): Hugging Face checkpoints
};

struct RopeParams {
  RopeStyle style = RopeStyle::RotateHalf;
  int rotary_dim = 0;  // leading dims of each head that rotate (== head_dim for llama)
  float theta = 10000.0f;
  // Frequency scaling hooks (YaRN and friends) come with the architectures that use them.
  float freq_scale = 1.0f;
  float attn_factor = 1.0f;  // multiplies cos/sin (YaRN mscale)
};

// A paged KV cache of one layer. Block b holds block_size tokens of every kv head:
// k[b][slot][head][0..head_dim), likewise v. A token's cache slot is block * block_size +
// offset, so the flat view [num_blocks * block_size, kv_heads, head_dim] addresses it too.
struct PagedKv {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::F16;
  int num_blocks = 0;
  int block_size = 16;
  int kv_heads = 0;
  int head_dim = 0;
  int64_t slot_stride() const { return int64_t(kv_heads) * head_dim; }  // elements
};

// Step metadata shared by all layers: which tokens belong to which sequence, where each
// sequence's cache lives. Built once per step (pointers in the backend's memory space).
struct AttentionMeta {
  int num_seqs = 0;
  int num_tokens = 0;
  const int32_t* query_start = nullptr;   // [num_seqs + 1] token offsets of each sequence
  const int32_t* context_lens = nullptr;  // [num_seqs] cached tokens incl. this step's
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* slot_mapping = nullptr;  // [num_tokens] cache slot each new token writes
  const int32_t* positions = nullptr;     // [num_tokens]
};

struct AttentionParams {
  TensorView q;    // [num_tokens, heads, head_dim]
  TensorView out;  // [num_tokens, heads, head_dim]
  PagedKv kv;
  float scale = 1.0f;
  bool causal = true;  // token i of a sequence sees cache positions <= its own
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // e.g. "cpu (avx512-vnni, 2 threads)"
  // Whether `op` runs natively with weights (or cache) of `dtype`. Callers check first and
  // fail loudly or fall back explicitly; ops throw UnsupportedError otherwise.
  virtual bool supports(Op op, DType dtype) const = 0;

  virtual std::unique_ptr<Buffer> alloc(size_t bytes) = 0;
  // Copies between host memory and this backend's memory (same device = memcpy).
  virtual void upload(const TensorView& dst, const void* host, size_t bytes) = 0;
  virtual void download(void* host, const TensorView& src, size_t bytes) = 0;
  virtual void synchronize() = 0;

  // out[t, :] = table[ids[t], :] as F32. table: [vocab, hidden] any supported dtype.
  virtual void embed(const TensorView& table, const int32_t* ids, int n, TensorView out) = 0;
  // out = x / rms(x) * w, per row. x, out: [rows, n] F32; w: [n] F32.
  virtual void rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out) = 0;
  // out[m, n] = sum_k x[m, k] * w[n, k]. x: [M, K] F32, w: [N, K] any supported dtype,
  // out: [M, N] F32. Each row's result depends on that row alone (batch-invariant).
  virtual void matmul(const TensorView& x, const TensorView& w, TensorView out) = 0;
  // Rotates x: [num_tokens, heads, head_dim] in place at positions[t].
  virtual void rope(TensorView x, const int32_t* positions, const RopeParams& p) = 0;
  // Writes this step's k, v ([num_tokens, kv_heads, head_dim] F32) into the cache slots.
  virtual void store_kv(const TensorView& k, const TensorView& v, const PagedKv& kv,
                        const AttentionMeta& meta) = 0;
  virtual void attention(const AttentionParams& p, const AttentionMeta& meta) = 0;
  // out[t, i] = silu(gate_up[t, i]) * gate_up[t, n + i]; gate_up: [T, 2n], out: [T, n].
  virtual void silu_mul(const TensorView& gate_up, TensorView out) = 0;
  // x += y elementwise, both [rows, n] F32.
  virtual void add(TensorView x, const TensorView& y) = 0;
  // dst = src, same dtype and shape; either may be strided in its outer dimensions.
  virtual void copy(const TensorView& src, TensorView dst) = 0;
};

// How CPU matmuls treat activations against block-quantized weights: F32 keeps them exact
// (weights are dequantized in the kernel); Q8 quantizes each activation row to 8-bit blocks
// first, as llama.cpp does (faster prompt processing, ~1 logit of noise on small models).
enum class ActivationPrecision : uint8_t { F32, Q8 };

struct BackendOptions {
  int threads = 0;           // CPU threads; 0 = all cores
  std::string isa = "auto";  // CPU kernels: auto, scalar, avx2, avx512-vnni
  ActivationPrecision precision = ActivationPrecision::F32;
};

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& opts);
#ifdef DEEPSERVE_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opts, int device_index);
#endif

}  // namespace ds
