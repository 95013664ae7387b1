// Llama-family forward (GQA attention, SwiGLU MLP, RMSNorm, RoPE), any backend.
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "model/model.h"

namespace ds {
namespace {

struct LlamaLayer {
  TensorView attn_norm;             // [hidden] F32
  TensorView wq, wk, wv, wo;        // [heads*hd, hidden], [kv*hd, hidden] x2, [hidden, heads*hd]
  TensorView ffn_norm;              // [hidden] F32
  TensorView w_gate, w_up, w_down;  // [ffn, hidden] x2, [hidden, ffn]
  // Row-concatenated copies (one matmul instead of several) when the parts share a dtype:
  std::optional<TensorView> wqkv;       // [q + 2 kv, hidden]
  std::optional<TensorView> w_gate_up;  // [2 ffn, hidden]
};

// Columns [begin, begin + n) of a 2-D F32 view.
TensorView cols(const TensorView& t, int64_t begin, int64_t n) {
  TensorView v = t;
  v.data = static_cast<uint8_t*>(t.data) + begin * 4;
  v.shape[1] = n;
  return v;
}

// A [rows, heads * hd] F32 view as [rows, heads, hd].
TensorView heads_view(const TensorView& t, int heads, int hd) {
  TensorView v = t;
  v.ndim = 3;
  v.shape = {t.shape[0], heads, hd, 0};
  v.stride = {t.stride[0], int64_t(hd) * 4, 4, 0};
  return v;
}

class Llama final : public Model {
 public:
  Llama(const ModelConfig& cfg, const WeightSource& w, Backend& be) : cfg_(cfg), be_(be) {
    tok_embd_ = w.get("token_embd.weight");
    output_norm_ = f32_vector(w.get("output_norm.weight"), "output_norm.weight");
    output_ = cfg.tied_embeddings ? tok_embd_ : w.get("output.weight");
    check_shape(tok_embd_, cfg.vocab, cfg.hidden, "token_embd.weight");
    check_shape(output_, cfg.vocab, cfg.hidden, "output.weight");
    const int q_dim = cfg.heads * cfg.head_dim, kv_dim = cfg.kv_heads * cfg.head_dim;
    for (int l = 0; l < cfg.layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      LlamaLayer L;
      L.attn_norm = f32_vector(w.get(p + "attn_norm.weight"), p + "attn_norm.weight");
      L.ffn_norm = f32_vector(w.get(p + "ffn_norm.weight"), p + "ffn_norm.weight");
      L.wq = linear(w, p + "attn_q.weight", q_dim, cfg.hidden);
      L.wk = linear(w, p + "attn_k.weight", kv_dim, cfg.hidden);
      L.wv = linear(w, p + "attn_v.weight", kv_dim, cfg.hidden);
      L.wo = linear(w, p + "attn_output.weight", cfg.hidden, q_dim);
      L.w_gate = linear(w, p + "ffn_gate.weight", cfg.intermediate, cfg.hidden);
      L.w_up = linear(w, p + "ffn_up.weight", cfg.intermediate, cfg.hidden);
      L.w_down = linear(w, p + "ffn_down.weight", cfg.hidden, cfg.intermediate);
      L.wqkv = fuse_rows({L.wq, L.wk, L.wv});
      L.w_gate_up = fuse_rows({L.w_gate, L.w_up});
      layers_.push_back(L);
    }
    if (!be_.supports(Op::Embed, tok_embd_.dtype))
      throw UnsupportedError(be_.name() + ": embedding of " +
                             std::string(dtype_name(tok_embd_.dtype)));
  }

  const ModelConfig& config() const override { return cfg_; }
  WeightBytes weight_bytes() const override {
    WeightBytes b;
    auto add = [&](const TensorView& t) { b.total += t.nbytes(); };
    add(tok_embd_);
    if (!cfg_.tied_embeddings) add(output_);
    for (const auto& L : layers_)
      for (const TensorView* t :
           {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_norm, &L.w_gate, &L.w_up, &L.w_down})
        add(*t);
    // A decode step reads every layer and the output projection, but only its tokens' rows
    // of the embedding table.
    b.dense = b.total - (cfg_.tied_embeddings ? 0 : tok_embd_.nbytes());
    return b;
  }
  uint64_t kv_bytes_per_token(DType kv_dtype) const override {
    return uint64_t(cfg_.layers) * 2 *
           dtype_bytes(kv_dtype, int64_t(cfg_.kv_heads) * cfg_.head_dim);
  }

  void forward(const ForwardInput& in, KvCache& cache, TensorView logits) override {
    const int64_t T = int64_t(in.tokens.size());
    const int64_t L = int64_t(in.logit_rows.size());
    DS_CHECK(T > 0 && T == in.meta.num_tokens, "batch token count mismatch");
    DS_CHECK(logits.ndim == 2 && logits.shape[0] == L && logits.shape[1] == cfg_.vocab,
             "logits must be [logit rows, vocab]");
    reserve(T, L);
    const int hd = cfg_.head_dim, q_dim = cfg_.heads * hd, kv_dim = cfg_.kv_heads * hd;
    const int ffn = cfg_.intermediate;
    TensorView x = x_->view(DType::F32, {T, cfg_.hidden});
    TensorView xn = xn_->view(DType::F32, {T, cfg_.hidden});
    TensorView qkv = qkv_->view(DType::F32, {T, q_dim + 2 * kv_dim});
    TensorView attn = attn_->view(DType::F32, {T, q_dim});
    TensorView gate_up = gate_up_->view(DType::F32, {T, 2 * int64_t(ffn)});
    TensorView act = act_->view(DType::F32, {T, ffn});
    const float scale = 1.0f / std::sqrt(float(hd));

    be_.embed(tok_embd_, in.tokens.data(), int(T), x);
    dump("token_embd", x);
    for (int l = 0; l < cfg_.layers; ++l) {
      const LlamaLayer& W = layers_[size_t(l)];
      be_.rms_norm(x, W.attn_norm, cfg_.rms_eps, xn);
      dump(l, "attn_norm", xn);
      TensorView q = cols(qkv, 0, q_dim), k = cols(qkv, q_dim, kv_dim),
                 v = cols(qkv, q_dim + kv_dim, kv_dim);
      if (W.wqkv) {
        be_.matmul(xn, *W.wqkv, qkv);
      } else {
        be_.matmul(xn, W.wq, q);
        be_.matmul(xn, W.wk, k);
        be_.matmul(xn, W.wv, v);
      }
      TensorView qh = heads_view(q, cfg_.heads, hd), kh = heads_view(k, cfg_.kv_heads, hd),
                 vh = heads_view(v, cfg_.kv_heads, hd);
      be_.rope(qh, in.meta.positions, cfg_.rope);
      be_.rope(kh, in.meta.positions, cfg_.rope);
      dump(l, "q_rope", q);
      dump(l, "k_rope", k);
      be_.store_kv(kh, vh, cache.layer(l), in.meta);
      AttentionParams ap;
      ap.q = qh;
      ap.out = heads_view(attn, cfg_.heads, hd);
      ap.kv = cache.layer(l);
      ap.scale = scale;
      be_.attention(ap, in.meta);
      dump(l, "attn_out", attn);
      be_.matmul(attn, W.wo, xn);
      be_.add(x, xn);
      be_.rms_norm(x, W.ffn_norm, cfg_.rms_eps, xn);
      dump(l, "ffn_norm", xn);
      if (W.w_gate_up) {
        be_.matmul(xn, *W.w_gate_up, gate_up);
      } else {
        be_.matmul(xn, W.w_gate, cols(gate_up, 0, ffn));
        be_.matmul(xn, W.w_up, cols(gate_up, ffn, ffn));
      }
      be_.silu_mul(gate_up, act);
      be_.matmul(act, W.w_down, xn);
      be_.add(x, xn);
      dump(l, "out", x);
    }
    // Only the rows that need logits go through the final norm and the vocabulary projection.
    TensorView h = last_->view(DType::F32, {L, cfg_.hidden});
    for (int64_t r = 0; r < L; ++r) {
      const int32_t row = in.logit_rows[size_t(r)];
      DS_CHECK(row >= 0 && row < T, "logit row out of range");
      be_.copy(x.slice_rows(row, row + 1), h.slice_rows(r, r + 1));
    }
    be_.rms_norm(h, output_norm_, cfg_.rms_eps, h);
    dump("output_norm", h);
    be_.matmul(h, output_, logits);
  }

 private:
  static void check_shape(const TensorView& t, int64_t rows, int64_t cols, const std::string& n) {
    if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols)
      throw Error("tensor '" + n + "' has shape " + t.shape_str() + ", expected [" +
                  std::to_string(rows) + ", " + std::to_string(cols) + "]");
  }

  TensorView linear(const WeightSource& w, const std::string& name, int64_t rows, int64_t cols) {
    TensorView t = w.get(name);
    check_shape(t, rows, cols, name);
    if (!be_.supports(Op::MatMul, t.dtype))
      throw UnsupportedError(be_.name() + " has no matmul for " + std::string(dtype_name(t.dtype)) +
                             " weights (" + name + ")");
    return t;
  }

  // One weight whose rows are the parts' rows in order, so a single matmul computes all the
  // parts' outputs side by side. nullopt when the dtypes differ (then each part runs alone).
  std::optional<TensorView> fuse_rows(std::initializer_list<TensorView> parts) {
    const TensorView& first = *parts.begin();
    int64_t rows = 0;
    for (const auto& t : parts) {
      if (t.dtype != first.dtype || t.cols() != first.cols() || !t.is_contiguous())
        return std::nullopt;
      rows += t.rows();
    }
    const size_t row_bytes = first.row_bytes();
    owned_.push_back(be_.alloc(size_t(rows) * row_bytes));
    TensorView fused = owned_.back()->view(first.dtype, {rows, first.cols()});
    int64_t at = 0;
    for (const auto& t : parts) {
      be_.upload(fused.slice_rows(at, at + t.rows()), t.data, t.nbytes());
      at += t.rows();
    }
    return fused;
  }

  // Norm weights as F32 on the backend (checkpoints store them as F32, F16 or BF16).
  TensorView f32_vector(const TensorView& t, const std::string& name) {
    if (t.ndim != 1 || t.shape[0] != cfg_.hidden)
      throw Error("tensor '" + name + "' has shape " + t.shape_str() + ", expected [" +
                  std::to_string(cfg_.hidden) + "]");
    std::vector<float> host(size_t(t.shape[0]));
    for (int64_t i = 0; i < t.shape[0]; ++i) {
      const uint8_t* p = static_cast<const uint8_t*>(t.data) + i * t.stride[0];
      switch (t.dtype) {
        case DType::F32:
          std::memcpy(&host[size_t(i)], p, 4);
          break;
        case DType::F16:
          host[size_t(i)] = fp16_to_f32(uint16_t(p[0] | p[1] << 8));
          break;
        case DType::BF16:
          host[size_t(i)] = bf16_to_f32(uint16_t(p[0] | p[1] << 8));
          break;
        default:
          throw UnsupportedError("tensor '" + name + "' has dtype " +
                                 std::string(dtype_name(t.dtype)) + "; norms must be F32/F16/BF16");
      }
    }
    owned_.push_back(be_.alloc(host.size() * 4));
    TensorView v = owned_.back()->view(DType::F32, {t.shape[0]});
    be_.upload(v, host.data(), host.size() * 4);
    return v;
  }

  void reserve(int64_t T, int64_t L) {
    const int64_t hd = cfg_.head_dim, q_dim = cfg_.heads * hd, kv_dim = cfg_.kv_heads * hd;
    auto grow = [&](std::unique_ptr<Buffer>& b, int64_t floats) {
      if (!b || b->size() < size_t(floats) * 4) b = be_.alloc(size_t(floats) * 4);
    };
    grow(x_, T * cfg_.hidden);
    grow(xn_, T * cfg_.hidden);
    grow(qkv_, T * (q_dim + 2 * kv_dim));
    grow(attn_, T * q_dim);
    grow(gate_up_, T * 2 * cfg_.intermediate);
    grow(act_, T * cfg_.intermediate);
    grow(last_, std::max<int64_t>(L, 1) * cfg_.hidden);
  }

  ModelConfig cfg_;
  Backend& be_;
  TensorView tok_embd_, output_norm_, output_;
  std::vector<LlamaLayer> layers_;
  std::vector<std::unique_ptr<Buffer>> owned_;
  std::unique_ptr<Buffer> x_, xn_, qkv_, attn_, gate_up_, act_, last_;
};

}  // namespace

std::unique_ptr<Model> make_llama(const ModelConfig& cfg, const WeightSource& weights,
                                  Backend& backend) {
  return std::make_unique<Llama>(cfg, weights, backend);
}

}  // namespace ds
