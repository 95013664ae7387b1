// Llama-family forward (GQA attention, SwiGLU MLP, RMSNorm, RoPE), any backend.
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "model/binder.h"
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

class Llama final : public Model {
 public:
  Llama(const ModelConfig& cfg, const WeightSource& w, Backend& be, WeightQuant quantize)
      : cfg_(cfg), be_(be) {
    WeightBinder b(w, be, quantize);
    b.set_int4(cfg.int4);
    tok_embd_ = b.table("token_embd.weight", cfg.vocab, cfg.hidden);
    output_norm_ = b.norm("output_norm.weight", cfg.hidden);
    output_ = cfg.tied_embeddings
                  ? tok_embd_
                  : b.linear("output.weight", cfg.vocab, cfg.hidden, Op::MatMul, Quantizable::No);
    if (cfg.tied_embeddings && !be.supports(Op::MatMul, tok_embd_.dtype))
      throw UnsupportedError(be.name() + " has no matmul for " +
                             std::string(dtype_name(tok_embd_.dtype)) + " (tied output)");
    const int q_dim = cfg.heads * cfg.head_dim, kv_dim = cfg.kv_heads * cfg.head_dim;
    for (int l = 0; l < cfg.layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      LlamaLayer L;
      L.attn_norm = b.norm(p + "attn_norm.weight", cfg.hidden);
      L.ffn_norm = b.norm(p + "ffn_norm.weight", cfg.hidden);
      const TensorView wq = b.checked(p + "attn_q.weight", q_dim, cfg.hidden);
      const TensorView wk = b.checked(p + "attn_k.weight", kv_dim, cfg.hidden);
      const TensorView wv = b.checked(p + "attn_v.weight", kv_dim, cfg.hidden);
      const TensorView wg = b.checked(p + "ffn_gate.weight", cfg.intermediate, cfg.hidden);
      const TensorView wu = b.checked(p + "ffn_up.weight", cfg.intermediate, cfg.hidden);
      L.wo = b.linear(p + "attn_output.weight", cfg.hidden, q_dim);
      L.w_down = b.linear(p + "ffn_down.weight", cfg.hidden, cfg.intermediate);
      // Fused copies replace the parts (on a GPU only the fused copy is uploaded).
      L.wqkv = b.fuse_rows({wq, wk, wv});
      if (!L.wqkv) {
        L.wq = b.place(wq);
        L.wk = b.place(wk);
        L.wv = b.place(wv);
      }
      L.w_gate_up = b.fuse_rows({wg, wu});
      if (!L.w_gate_up) {
        L.w_gate = b.place(wg);
        L.w_up = b.place(wu);
      }
      layers_.push_back(L);
    }
    owned_ = std::move(b.buffers());
    weight_bytes_ = b.bytes();
    formats_ = b.formats();
  }

  const ModelConfig& config() const override { return cfg_; }
  WeightBytes weight_bytes() const override {
    WeightBytes b;
    b.total = weight_bytes_;
    // A decode step reads every layer and the output projection, but only its tokens' rows
    // of the embedding table.
    b.dense = b.total - (cfg_.tied_embeddings ? 0 : tok_embd_.nbytes());
    return b;
  }
  uint64_t kv_bytes_per_token(DType kv_dtype) const override {
    return uint64_t(cfg_.layers) * kv_bytes_per_token_layer(cfg_, kv_dtype);
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

    be_.embed(tok_embd_, in.token_ids(), int(T), x);
    dump("token_embd", x);
    be_.rms_norm(x, layers_.front().attn_norm, cfg_.rms_eps, xn);
    for (int l = 0; l < cfg_.layers; ++l) {
      const LlamaLayer& W = layers_[size_t(l)];
      if (l > 0) be_.capture_cut();  // a graph being recorded may end a piece here
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
      all_reduce(xn);  // tensor parallel: o_proj is row-split
      be_.add_rms_norm(x, xn, W.ffn_norm, cfg_.rms_eps, xn);
      dump(l, "ffn_norm", xn);
      if (W.w_gate_up) {
        be_.matmul(xn, *W.w_gate_up, gate_up);
      } else {
        be_.matmul(xn, W.w_gate, cols(gate_up, 0, ffn));
        be_.matmul(xn, W.w_up, cols(gate_up, ffn, ffn));
      }
      be_.silu_mul(gate_up, act);
      be_.matmul(act, W.w_down, xn);
      all_reduce(xn);  // tensor parallel: down_proj is row-split
      // The residual add, fused with the next layer's input norm.
      if (l + 1 < cfg_.layers) {
        be_.add_rms_norm(x, xn, layers_[size_t(l) + 1].attn_norm, cfg_.rms_eps, xn);
      } else {
        be_.add(x, xn);
      }
      dump(l, "out", x);
    }
    output_logits(be_, x, in.logit_rows, last_->view(DType::F32, {L, cfg_.hidden}), output_norm_,
                  cfg_.rms_eps, output_, logits);
  }

 private:
  void reserve(int64_t T, int64_t L) {
    const int64_t hd = cfg_.head_dim, q_dim = cfg_.heads * hd, kv_dim = cfg_.kv_heads * hd;
    auto grow = [&](std::unique_ptr<Buffer>& b, int64_t n) { ensure_scratch(be_, b, n); };
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
  uint64_t weight_bytes_ = 0;
  std::unique_ptr<Buffer> x_, xn_, qkv_, attn_, gate_up_, act_, last_;
};

}  // namespace

std::unique_ptr<Model> make_llama(const ModelConfig& cfg, const WeightSource& weights,
                                  Backend& backend, WeightQuant quantize) {
  return std::make_unique<Llama>(cfg, weights, backend, quantize);
}

}  // namespace ds
