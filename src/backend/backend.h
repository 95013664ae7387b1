// The ops a model may call, implemented once per device (cpu/, cuda/).
//
// A model says *what* to compute by calling these on TensorViews; a backend decides how.
// Ops are enqueued on the backend's stream in call order; synchronize() waits for them.
// On the CPU every op runs to completion before it returns.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/sampling.h"
#include "core/error.h"
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
  BatchedMatMul,
  MlaAttention,
  MoeRoute,
  MoeFfn,
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
  float freq_scale = 1.0f;   // linear position scaling (1 = none)
  float attn_factor = 1.0f;  // multiplies cos/sin (YaRN: mscale / mscale_all_dim)
  // YaRN (DeepSeek-V2): 0 = off. Frequencies blend between the original and the factor-scaled
  // ones over the dims whose wavelength lies between beta_fast and beta_slow rotations of the
  // original context; see rope_inv_freq().
  float yarn_factor = 0.0f;
  int yarn_original_max_position = 0;
  float yarn_beta_fast = 32.0f;
  float yarn_beta_slow = 1.0f;
  bool operator==(const RopeParams&) const = default;
};

// Inverse frequency of each rotated pair [rotary_dim / 2], shared by every backend so they
// rotate by identical angles (YaRN included).
std::vector<float> rope_inv_freq(const RopeParams& p);
// DeepSeek's yarn_get_mscale: 0.1 * mscale * ln(factor) + 1 for factor > 1, else 1.
float yarn_mscale(float factor, float mscale);

// A paged KV cache of one layer. Block b holds block_size tokens of every kv head:
// k[b][slot][head][0..head_dim), likewise v. A token's cache slot is block * block_size +
// offset, so the flat view [num_blocks * block_size, kv_heads, head_dim] addresses it too.
// A latent (MLA) cache has v == nullptr, kv_heads == 1 and head_dim == kv_lora_rank +
// rope_dim: each slot holds the normalized compressed KV followed by the rotated shared key.
struct PagedKv {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::F16;
  int num_blocks = 0;
  int block_size = 16;
  int kv_heads = 0;
  int head_dim = 0;
  // FP8 cache (dtype F8_E4M3): k / v hold e4m3 codes (fp8w::encode of x / scale) and every
  // slot has F32 scales apart from the codes, indexed like the slots (so paging moves them
  // together): k_scale[slot * k_scale_parts() + part], v_scale[slot * kv_heads + head].
  // Parts are per kv head; with rope_split > 0 (MLA) head dims [0, rope_split) (the latent)
  // and [rope_split, head_dim) (the rope key) have a scale each. scale = absmax / 448.
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  int rope_split = 0;
  int64_t slot_stride() const { return int64_t(kv_heads) * head_dim; }  // elements
  bool fp8() const { return dtype == DType::F8_E4M3; }
  int k_scale_parts() const { return kv_heads * (rope_split > 0 ? 2 : 1); }
  // Index into k_scale of element i of head h in a slot.
  int64_t k_scale_index(int64_t slot, int h, int i) const {
    return slot * k_scale_parts() + (rope_split > 0 ? 2 * h + (i >= rope_split ? 1 : 0) : h);
  }
};

// Bytes one token takes in one layer's cache (codes plus FP8 scales).
inline uint64_t paged_kv_bytes_per_token(DType dtype, int kv_heads, int head_dim, bool has_v,
                                         int rope_split) {
  const uint64_t row = dtype_bytes(dtype, int64_t(kv_heads) * head_dim);
  uint64_t bytes = row * (has_v ? 2 : 1);
  if (dtype == DType::F8_E4M3)
    bytes += 4 * uint64_t(kv_heads) * ((rope_split > 0 ? 2 : 1) + (has_v ? 1 : 0));
  return bytes;
}

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
  // Host-side bounds for sizing launches without reading the arrays back. A CUDA graph is
  // captured per (num_seqs, num_tokens) bucket, so kernels must size their grids from
  // num_seqs, num_tokens and max_blocks_per_seq only; these two are upper bounds that may be
  // used for early exits or workspace sizing but not baked into a captured launch.
  int max_query_len = 0;    // longest query (this step's tokens) of any sequence
  int max_context_len = 0;  // longest context_lens entry
};

struct AttentionParams {
  TensorView q;    // [num_tokens, heads, head_dim]
  TensorView out;  // [num_tokens, heads, head_dim]
  PagedKv kv;
  float scale = 1.0f;
  bool causal = true;  // token i of a sequence sees cache positions <= its own
};

// Multi-head latent attention in the absorbed form, over a latent cache (PagedKv with
// v == nullptr). For token t, head h and cached position j of t's sequence (j <= position
// of t when causal), with c_j = cache[j][0..R) and r_j = cache[j][R..R+P):
//   s_j = scale * (q_latent[t,h] . c_j + q_rope[t,h] . r_j)
//   out[t,h] = sum_j softmax(s)_j * c_j
// The key up-projection is already folded into q_latent; the value up-projection is applied
// by the caller to out (batched_matmul).
struct MlaAttentionParams {
  TensorView q_latent;   // [num_tokens, heads, R] F32, R = kv_lora_rank
  TensorView q_rope;     // [num_tokens, heads, P] F32, rotated; P = qk_rope_head_dim
  TensorView out;        // [num_tokens, heads, R] F32
  PagedKv cache;         // latent cache, head_dim == R + P
  int kv_lora_rank = 0;  // R
  float scale = 1.0f;
  bool causal = true;
  // The caller wrote this step's cache rows (mla_prepare / store_kv) before the op ahead of
  // this one, not by it: a device may then read the cache before waiting for that op.
  bool cache_settled = false;
};

// The same attention in the expanded form, for prefill: every cached latent c_j of a step's
// sequences is up-projected per head, [k_nope | v] = kv_b c_j, then plain attention runs with
// head dims nope + P (keys [k_nope | r_j]) and v:
//   s_j = scale * (q_nope[t,h] . k_nope[j,h] + q_rope[t,h] . r_j)
//   out[t,h] = sum_j softmax(s)_j * v[j,h]
// out is the value-space result (what mla_attention's out times W_uv gives).
struct MlaPrefillParams {
  TensorView q_nope;  // [num_tokens, heads, nope] F32
  TensorView q_rope;  // [num_tokens, heads, P] F32, rotated
  TensorView kv_b;    // [heads * (nope + v), R]: kv_b_proj, per head nope key rows then v rows
  TensorView out;     // [num_tokens, heads, v] F32
  PagedKv cache;      // latent cache, head_dim == R + P
  int kv_lora_rank = 0;
  float scale = 1.0f;
  bool causal = true;
};

// The MLA layer's small ops between the projections and attention, one launch on devices.
// In place: kva's latent columns [0, R) are RMS-normalized (times norm), its rope key columns
// [R, R + P) and every head of q_rope are rotated at meta.positions; then kva's first
// meta.num_tokens rows are stored into the latent cache (as store_kv). The base version runs
// rms_norm, rope (q_rope), rope (k) and store_kv in that order; a device version must give the
// same bits. q_rope must not overlap kva.
struct MlaPrepareParams {
  TensorView kva;     // [T, R + P] F32, rows may be strided: compressed KV, then the rope key
  TensorView norm;    // [R] F32: kv_a_layernorm weight
  float eps = 1e-6f;  // of the latent RMS norm
  TensorView q_rope;  // [T, H, P] F32, strided in T and heads (the rope dims of q)
  RopeParams rope;
  PagedKv cache;         // latent cache, head_dim == R + P
  int kv_lora_rank = 0;  // R
};

// A layer's norm and the first product that reads it (Backend::norm_matmul): with y,
// x_out = x + y (the residual add) and xn = rms_norm(x_out) * norm; without, xn =
// rms_norm(x) * norm. Then out = xn . w (as matmul). A device may run all of it in one launch
// whose every CTA reads all of x and y, so x_out and xn must not overlap x or y (nor each other),
// and out must not overlap any of them. Same bits as add_rms_norm (or rms_norm), then matmul.
struct NormMatmulParams {
  TensorView x;     // [T, n] F32: the residual stream
  TensorView y;     // [T, n] F32, optional: the sublayer output added to x
  TensorView norm;  // [n] F32
  float eps = 1e-6f;
  TensorView x_out;  // [T, n] F32: x + y (with y; unused without)
  TensorView xn;     // [T, n] F32: the normed rows, always written
  TensorView w;      // [N, n] weights, as matmul's
  TensorView out;    // [T, N] F32
};

// The residual add and norm after an op's output y (the next sublayer's input norm): r_out =
// r + y and rn = rms_norm(r_out) * norm, as norm_matmul's (add_rms_norm's bits). A device may do
// them in the op's own launch (its last CTA to finish), so r_out and rn must not overlap r, y,
// the op's inputs or each other.
struct AddNormParams {
  TensorView r;     // [T, n] F32: the residual stream
  TensorView norm;  // [n] F32
  float eps = 1e-6f;
  TensorView r_out;  // [T, n] F32: r + y
  TensorView rn;     // [T, n] F32: the normed rows
};

// A product and the add and norm after it (Backend::matmul_add_norm): out = x . w (as matmul),
// then add_norm with y = out.
struct MatmulNormParams {
  TensorView x;    // [T, k] F32
  TensorView w;    // [n, k] weights, as matmul's
  TensorView out;  // [T, n] F32: the product
  AddNormParams add_norm;
};

// DeepSeek-V2 MoE routing (MoEGate): scores = softmax(logits) over experts, then top_k.
// GroupLimitedGreedy first keeps the topk_group groups (experts split into n_group equal
// consecutive groups) with the highest max score and takes top_k among their experts.
// With norm_topk_prob (and top_k > 1) the chosen weights are divided by their sum (+1e-20);
// otherwise they are multiplied by routed_scaling_factor (DeepSeek's own modeling code).
enum class MoeTopk : uint8_t { Greedy, GroupLimitedGreedy };
struct MoeRouteParams {
  int top_k = 1;
  MoeTopk method = MoeTopk::Greedy;
  int n_group = 1;
  int topk_group = 1;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  // Optional [num_experts] counters in backend memory: += 1 for every (token, chosen expert).
  int64_t* expert_counts = nullptr;
};

// One routed expert's SwiGLU MLP: down(silu(gate x) * up x).
struct ExpertWeights {
  TensorView gate;  // [F, hidden]
  TensorView up;    // [F, hidden]
  TensorView down;  // [hidden, F]
};

struct MoeFfnParams {
  TensorView x;        // [T, hidden] F32
  TensorView ids;      // [T, top_k] I32, from moe_route
  TensorView weights;  // [T, top_k] F32, from moe_route
  // [num_experts] on the host; the views point to backend memory. A backend may cache
  // per-expert pointer tables keyed by experts.data(), so the span must stay alive and
  // unchanged for the model's lifetime.
  std::span<const ExpertWeights> experts;
  // The last num_shared experts are shared ones: every token goes through them with weight 1,
  // added after its routed experts; ids name only the others.
  int num_shared = 0;
  // Expert parallelism: the routed experts here are global experts expert_base.. of the
  // router's set; with skip_foreign, ids outside that range (other ranks' experts) add
  // nothing instead of being an error.
  int expert_base = 0;
  bool skip_foreign = false;
  // [T, hidden] F32, overwritten: sum_k weights[t,k] * expert_{ids[t,k]}(x[t]) + shared(x[t])
  TensorView out;
};

// Deterministic pseudo-random contents for dummy weights (--load-format dummy): the element
// with logical index i gets mean + std * r(seed, i), r roughly N(0, 1) (w4a16::random_value),
// rounded through round_as (the dtype a checkpoint would hold), then stored as dst.dtype:
// F32, F16, BF16, W4A16 or FP8W (quantized per row and group of 128, the same bits as
// quantizing the values on the host). dst is 1-, 2- or 3-D and contiguous; the logical index of
// element (a, b, c) of a 3-D dst is a * map[0] + b * map[1] + c * map[2] (all zero: row-major), so
// a permuted copy of a generated tensor can be generated directly.
struct RandomFill {
  uint64_t seed = 0;
  float mean = 0.0f;
  float std = 1.0f;
  DType round_as = DType::BF16;
  std::array<int64_t, 3> map{};
};

// W4A16 and FP8W: packed rows that end in their scales (row_stride covers codes, scales and
// padding), so a range of columns is not a tensor of the format.
inline bool row_scaled_dtype(DType t) {
  return t == DType::W4A16 || t == DType::FP8W;
}
// A [rows, cols] W4A16 view (backend/w4a16.h layout) and the bytes it takes.
TensorView w4a16_view(void* data, int64_t rows, int64_t cols, Device device = {});
size_t w4a16_bytes(int64_t rows, int64_t cols);
// One row of K floats (K a multiple of 128) as a W4A16 row of w4a16::row_stride(K) bytes,
// and back.
void quantize_w4a16_row(const float* x, int64_t K, uint8_t* dst);
void dequantize_w4a16_row(const uint8_t* row, int64_t K, float* out);
// A [rows, cols] FP8W view (backend/fp8w.h layout, any cols) and the bytes it takes; one row
// of K floats as an FP8W row of fp8w::row_stride(K) bytes, and back.
TensorView fp8w_view(void* data, int64_t rows, int64_t cols, Device device = {});
size_t fp8w_bytes(int64_t rows, int64_t cols);
void quantize_fp8w_row(const float* x, int64_t K, uint8_t* dst);
void dequantize_fp8w_row(const uint8_t* row, int64_t K, float* out);
// Columns [begin, begin + n) of one W4A16 or FP8W row of K columns as a row of that format
// with n columns (begin and n multiples of 128: whole scale groups), bit for bit: dst holds
// row_stride(n) bytes.
void slice_packed_row(DType dt, const uint8_t* row, int64_t K, int64_t begin, int64_t n,
                      uint8_t* dst);

// fill_random's view of dst as [dims[0], dims[1], dims[2]] with the effective index map and
// the multiplier random_value takes; checks what the op accepts.
struct RandomFillShape {
  std::array<int64_t, 3> dims{};
  std::array<int64_t, 3> map{};
  float mul = 0.0f;
};
RandomFillShape random_fill_shape(const TensorView& dst, const RandomFill& p);
// The value of element (a, b, c), rounded through p.round_as (before any quantization).
float random_fill_value(const RandomFill& p, const RandomFillShape& s, int64_t a, int64_t b,
                        int64_t c);

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

  // Pointer arguments (ids, positions, everything in AttentionMeta) are in the backend's
  // memory (device memory on CUDA); the engine uploads them once per step.
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
  // For a latent cache (kv.v == nullptr) only k ([num_tokens, 1, R + P]) is written.
  // A slot of -1 marks a padding token that is not stored.
  virtual void store_kv(const TensorView& k, const TensorView& v, const PagedKv& kv,
                        const AttentionMeta& meta) = 0;
  virtual void attention(const AttentionParams& p, const AttentionMeta& meta) = 0;
  // out[t, i] = silu(gate_up[t, i]) * gate_up[t, n + i]; gate_up: [T, 2n], out: [T, n].
  virtual void silu_mul(const TensorView& gate_up, TensorView out) = 0;
  // x += y elementwise, both [rows, n] F32.
  virtual void add(TensorView x, const TensorView& y) = 0;
  // x += y, then out = rms_norm(x) * w: a layer's residual add and the next norm, one pass on
  // devices. out may alias y. The base version runs add, then rms_norm.
  virtual void add_rms_norm(TensorView x, const TensorView& y, const TensorView& w, float eps,
                            TensorView out);
  // See NormMatmulParams. The base version copies x to x_out, runs add_rms_norm there (or
  // rms_norm without y), then matmul.
  virtual void norm_matmul(const NormMatmulParams& p);
  // See MatmulNormParams. The base version runs matmul, then add_norm_after.
  virtual void matmul_add_norm(const MatmulNormParams& p);
  // The add and norm of y alone (AddNormParams): r copied to r_out, add_rms_norm there.
  void add_norm_after(const TensorView& y, const AddNormParams& p);
  // out[b, m, n] = sum_k x[b, m, k] * w[b, n, k] for every b. 3-D views with byte strides
  // (x, out F32; w F32, F16 or BF16), so heads of a [T, H, d] buffer are batches of a
  // [H, T, d] view. Each (b, m) result depends on that row alone.
  virtual void batched_matmul(const TensorView& x, const TensorView& w, TensorView out) = 0;
  virtual void mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta) = 0;
  // See MlaPrepareParams; the base version is the four-op reference.
  virtual void mla_prepare(const MlaPrepareParams& p, const AttentionMeta& meta);
  // MLA in the expanded form when the backend has a fast path for this step (prefill-sized
  // queries): returns true once it has written p.out. False means nothing was done and the
  // caller runs the absorbed form (mla_attention); the base version always says false, so
  // the CPU keeps one reference path.
  virtual bool mla_prefill(const MlaPrefillParams& /*p*/, const AttentionMeta& /*meta*/) {
    return false;
  }
  // logits: [T, num_experts] F32 -> ids [T, top_k] I32, weights [T, top_k] F32. Ties go to
  // the lower expert index. The order of the k chosen experts within a row is unspecified.
  virtual void moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                         TensorView weights) = 0;
  virtual void moe_ffn(const MoeFfnParams& p) = 0;
  // moe_route(logits, route, ffn.ids, ffn.weights), then moe_ffn(ffn): the router's choice and
  // the experts in one call, so a backend may fuse them (none does: the CUDA fusions tried,
  // 8efb0c9 and 6e58052, measured slower). ffn.ids and ffn.weights hold moe_route's results
  // afterwards.
  virtual void moe_routed_ffn(const TensorView& logits, const MoeRouteParams& route,
                              const MoeFfnParams& ffn) {
    moe_route(logits, route, ffn.ids, ffn.weights);
    moe_ffn(ffn);
  }
  // moe_routed_ffn, then the add and norm of ffn.out (the next layer's input norm): a device may
  // do them in the MoE's last launch. The base version runs moe_routed_ffn, then add_norm_after.
  virtual void moe_routed_ffn_add_norm(const TensorView& logits, const MoeRouteParams& route,
                                       const MoeFfnParams& ffn, const AddNormParams& add_norm) {
    moe_routed_ffn(logits, route, ffn);
    add_norm_after(ffn.out, add_norm);
  }
  // ids[r] = index of the largest logits[r, :] (the lowest index among equal maxima).
  // logits: [R, V] F32 (contiguous); ids: [R] I32. Greedy sampling without moving the logits
  // to the host. The base version goes through host memory (right for the CPU).
  virtual void argmax(const TensorView& logits, TensorView ids);
  // ids[r] = a token drawn from logits[r, :] with rows[r] (temperature, top-k, top-p, min-p,
  // seed, counter; see SampleRow and cpu::sample_row for the exact rule). logits: [R, V] F32,
  // rows may be strided; rows: [R] in backend memory; ids: [R] I32. The draw is a pure
  // function of (logits, rows), so the op is deterministic and graph-safe. The base version
  // runs the CPU reference on a host copy.
  virtual void sample(const TensorView& logits, const SampleRow* rows, TensorView ids);

  // Graphs (CUDA graphs): ops issued between begin_capture() and end_capture() are recorded,
  // not run; replay(g) reruns them with the same pointers and launch shapes (the memory they
  // read may hold new contents). Callers check supports_graphs() and otherwise run eagerly.
  virtual bool supports_graphs() const { return false; }
  virtual void begin_capture() { throw UnsupportedError(name() + " has no graphs"); }
  virtual int end_capture() { throw UnsupportedError(name() + " has no graphs"); }
  virtual void replay(int /*graph*/) { throw UnsupportedError(name() + " has no graphs"); }
  // A point between two layers where a capture may be cut: the ops before it and after it
  // become separate graphs that replay launches in order, so the device starts on the first
  // while the host still launches the rest (the CUDA backend's DEEPSERVE_GRAPH_PIECE_LAYERS).
  // A no-op outside a capture and by default.
  virtual void capture_cut() {}
  // The graphs replay(g) launches (capture_cut's pieces).
  virtual int graph_pieces(int /*graph*/) const { return 1; }
  // Drops every captured graph (their memory may be reused).
  virtual void reset_graphs() {}
  // Counts device allocations (buffers and internal scratch growth): a graph captured before
  // the count changed may point at memory that has since moved, so callers recapture.
  virtual uint64_t alloc_epoch() const { return 0; }
  // dst = src, same dtype and shape; either may be strided in its outer dimensions.
  virtual void copy(const TensorView& src, TensorView dst) = 0;
  // Fills dst with dummy-weight values (RandomFill). The base version generates them on the
  // host and uploads them (right for the CPU; devices generate in place).
  virtual void fill_random(TensorView dst, const RandomFill& p);

  // Timing marks (per-op profiling, ProfilingBackend): mark() records a point in the op
  // stream and returns its index without waiting; mark_times_ms() waits once and gives every
  // mark's time in ms after the first; clear_marks() forgets them. Not during a graph capture.
  // The base version reads the host clock after synchronize() (exact for synchronous ops).
  virtual int mark();
  virtual std::vector<double> mark_times_ms();
  virtual void clear_marks();

 private:
  std::vector<int64_t> host_marks_ns_;  // the base marks' steady-clock times
};

// How CPU matmuls treat activations against block-quantized weights: F32 keeps them exact
// (weights are dequantized in the kernel); Q8 quantizes each activation row to 8-bit blocks
// first, as llama.cpp does (faster prompt processing, ~1 logit of noise on small models).
enum class ActivationPrecision : uint8_t { F32, Q8 };

struct BackendOptions {
  int threads = 0;  // CPU threads; 0 = all cores
  // CUDA: fraction of the GPU's memory this process may hold (weights, KV cache, scratch).
  double gpu_memory_utilization = 0.9;
  std::string isa = "auto";  // CPU kernels: auto, scalar, avx2, avx512-vnni
  ActivationPrecision precision = ActivationPrecision::F32;
};

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& opts);
#ifdef DEEPSERVE_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opts, int device_index);
#endif

}  // namespace ds
