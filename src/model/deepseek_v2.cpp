// DeepSeek-V2 forward: multi-head latent attention (MLA) over a latent KV cache, DeepSeekMoE
// (softmax router, greedy or group-limited top-k, shared experts), YaRN RoPE. Any backend.
//
// Weights by their names in published Hugging Face checkpoints (model.layers.N.self_attn.
// kv_a_proj_with_mqa.weight, model.layers.N.mlp.experts.E.gate_proj.weight, ...).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "model/binder.h"
#include "model/model.h"

namespace ds {
namespace {

struct DsMlp {
  std::optional<TensorView> gate_up;  // [2F, hidden] when gate and up share a dtype
  TensorView gate, up;                // [F, hidden] otherwise
  TensorView down;                    // [hidden, F]
  int64_t ffn = 0;                    // F
};

struct DsLayer {
  TensorView attn_norm, ffn_norm;  // [hidden] F32
  // Queries: plain q_proj, or the LoRA q_a_proj -> q_a_layernorm -> q_b_proj.
  TensorView wq;                     // [H * qk, hidden] (no LoRA)
  TensorView wq_a, q_a_norm;         // [q_lora, hidden], [q_lora]
  TensorView wq_b;                   // [H * qk, q_lora]
  TensorView wkv_a;                  // [R + P, hidden]
  std::optional<TensorView> wqkv_a;  // [q_lora + R + P, hidden]: q_a_proj and kv_a_proj fused,
                                     // or [H * qk + R + P, hidden]: q_proj and kv_a_proj
  TensorView kv_a_norm;              // [R]
  TensorView wkv_b;                  // [H * (nope + v), R]
  TensorView w_uk_t;                 // [H, R, nope]: per head, the key up-projection transposed
  TensorView w_uv;                   // [H, v, R]: per head, the value up-projection (view of wkv_b)
  TensorView wo;                     // [hidden, H * v]
  bool moe = false;
  DsMlp mlp;                           // dense layers: the MLP; MoE layers: the shared experts
  TensorView router;                   // [E, hidden]
  std::vector<ExpertWeights> experts;  // routed, then num_shared slices of the shared MLP
  int num_shared = 0;                  // 0: the shared MLP runs on its own (mlp)
  int moe_index = -1;                  // row of the expert counters
};

// q_a_layernorm and kv_a_layernorm are built without the config's eps in DeepSeek's code and
// in transformers, so they keep RMSNorm's default.
constexpr float kLatentNormEps = 1e-6f;

class DeepseekV2 final : public Model {
 public:
  DeepseekV2(const ModelConfig& cfg, const WeightSource& w, Backend& be,
             const DeepseekOptions& opts)
      : cfg_(cfg), be_(be), opts_(opts) {
    WeightBinder b(w, be, opts.quantize);
    b.set_int4(cfg.int4);
    const int64_t hidden = cfg.hidden, H = cfg.heads, R = cfg.kv_lora_rank, P = cfg.qk_rope_dim;
    const int64_t nope = cfg.qk_nope_dim, v = cfg.v_head_dim, qk = nope + P;
    tok_embd_ = b.table("model.embed_tokens.weight", cfg.vocab, hidden);
    output_norm_ = b.norm("model.norm.weight", hidden);
    if (cfg.tied_embeddings) {
      output_ = tok_embd_;
      if (!be.supports(Op::MatMul, output_.dtype))
        throw UnsupportedError(be.name() + " has no matmul for tied embeddings of " +
                               std::string(dtype_name(output_.dtype)));
    } else {
      output_ = b.linear("lm_head.weight", cfg.vocab, hidden, Op::MatMul, Quantizable::No);
    }
    for (int l = 0; l < cfg.layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      const std::string a = p + "self_attn.";
      DsLayer L;
      L.attn_norm = b.norm(p + "input_layernorm.weight", hidden);
      L.ffn_norm = b.norm(p + "post_attention_layernorm.weight", hidden);
      const TensorView kv_a = b.checked(a + "kv_a_proj_with_mqa.weight", R + P, hidden);
      if (cfg.q_lora_rank > 0) {
        const TensorView q_a = b.checked(a + "q_a_proj.weight", cfg.q_lora_rank, hidden);
        L.wqkv_a = b.fuse_rows({q_a, kv_a});
        if (!L.wqkv_a) {
          L.wq_a = b.place(q_a);
          L.wkv_a = b.place(kv_a);
        }
        L.q_a_norm = b.norm(a + "q_a_layernorm.weight", cfg.q_lora_rank);
        L.wq_b = b.linear(a + "q_b_proj.weight", H * qk, cfg.q_lora_rank);
      } else {
        // q_proj and kv_a_proj read the same normed x: one product where the formats agree.
        const TensorView q = b.checked(a + "q_proj.weight", H * qk, hidden);
        L.wqkv_a = b.fuse_rows({q, kv_a});
        if (!L.wqkv_a) {
          L.wq = b.place(q);
          L.wkv_a = b.place(kv_a);
        }
      }
      L.kv_a_norm = b.norm(a + "kv_a_layernorm.weight", R);
      const TensorView kv_b =
          b.checked(a + "kv_b_proj.weight", H * (nope + v), R, Op::MatMul, Quantizable::No);
      L.wkv_b = b.place(kv_b);
      bind_absorbed(b, a + "kv_b_proj.weight", L);
      L.wo = b.linear(a + "o_proj.weight", hidden, H * v);
      L.moe = cfg.is_moe_layer(l);
      if (L.moe) {
        L.moe_index = num_moe_layers_++;
        // F32 like the reference's gate (F.linear on float32 copies): on a GPU the router's
        // choices must not depend on BF16 rounding of the activations.
        L.router = b.linear_f32(p + "mlp.gate.weight", cfg.moe_experts, hidden);
        // Expert parallel: this rank's routed experts only (all of them otherwise).
        for (int e = cfg.moe_expert_begin; e < cfg.moe_expert_begin + cfg.local_experts(); ++e) {
          const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
          ExpertWeights ew;
          ew.gate = b.linear(x + "gate_proj.weight", cfg.moe_intermediate, hidden, Op::MoeFfn);
          ew.up = b.linear(x + "up_proj.weight", cfg.moe_intermediate, hidden, Op::MoeFfn);
          ew.down = b.linear(x + "down_proj.weight", hidden, cfg.moe_intermediate, Op::MoeFfn);
          L.experts.push_back(ew);
        }
        if (cfg.moe_shared_experts > 0) {
          const int64_t F = cfg.moe_intermediate, shared = cfg.shared_ffn();
          L.mlp = bind_mlp(b, p + "mlp.shared_experts.", hidden, shared);
          // Slices of the routed width (a tensor-parallel rank may hold a fraction of one).
          if (shared % F == 0) L.num_shared = fold_shared(b, L, int(shared / F), F);
        }
      } else {
        L.mlp = bind_mlp(b, p + "mlp.", hidden, cfg.intermediate);
      }
      layers_.push_back(std::move(L));
    }
    owned_ = std::move(b.buffers());
    total_bytes_ = b.bytes();
    formats_ = b.formats();
    if (num_moe_layers_ > 0) {
      const size_t n = size_t(num_moe_layers_) * size_t(cfg.moe_experts);
      counts_buf_ = be.alloc(n * 8);
      const std::vector<int64_t> zeros(n, 0);
      be.upload(counts_buf_->view(DType::I32, {int64_t(n) * 2}), zeros.data(), n * 8);
    }
  }

  const ModelConfig& config() const override { return cfg_; }

  WeightBytes weight_bytes() const override {
    WeightBytes w;
    w.total = total_bytes_;
    w.moe_layers = num_moe_layers_;
    w.experts = cfg_.local_experts();
    w.top_k = cfg_.moe_top_k;
    if (num_moe_layers_ > 0) {
      const auto& e = layers_[size_t(first_moe_layer())].experts[0];
      w.per_expert = e.gate.nbytes() + e.up.nbytes() + e.down.nbytes();
    }
    const uint64_t routed = w.per_expert * uint64_t(w.experts) * uint64_t(w.moe_layers);
    // Every step reads all non-expert weights except the embedding table's untouched rows.
    w.dense = total_bytes_ - routed - (cfg_.tied_embeddings ? 0 : tok_embd_.nbytes());
    return w;
  }

  uint64_t kv_bytes_per_token(DType kv_dtype) const override {
    return uint64_t(cfg_.layers) * kv_bytes_per_token_layer(cfg_, kv_dtype);
  }

  std::vector<ExpertLoad> expert_load() override {
    std::vector<ExpertLoad> out;
    if (num_moe_layers_ == 0) return out;
    const size_t E = size_t(cfg_.moe_experts);
    std::vector<int64_t> host(size_t(num_moe_layers_) * E);
    be_.download(host.data(), counts_buf_->view(DType::I32, {int64_t(host.size()) * 2}),
                 host.size() * 8);
    for (const auto& L : layers_) {
      if (!L.moe) continue;
      ExpertLoad el;
      el.layer = int(&L - layers_.data());
      el.tokens.assign(host.begin() + ptrdiff_t(size_t(L.moe_index) * E),
                       host.begin() + ptrdiff_t(size_t(L.moe_index + 1) * E));
      out.push_back(std::move(el));
    }
    return out;
  }

  void forward(const ForwardInput& in, KvCache& cache, TensorView logits) override {
    const int64_t T = int64_t(in.tokens.size());
    const int64_t NL = int64_t(in.logit_rows.size());
    DS_CHECK(T > 0 && T == in.meta.num_tokens, "batch token count mismatch");
    DS_CHECK(logits.ndim == 2 && logits.shape[0] == NL && logits.shape[1] == cfg_.vocab,
             "logits must be [logit rows, vocab]");
    reserve(T, NL);
    const int64_t hidden = cfg_.hidden;
    // The residual stream alternates between x_ and x2_: each norm with a residual add writes
    // x + y to the other buffer (norm_matmul: a device may fuse the add, the norm and the
    // product that reads it into one launch, whose CTAs all read x).
    TensorView x = x_->view(DType::F32, {T, hidden}), x2 = x2_->view(DType::F32, {T, hidden});
    TensorView xn = xn_->view(DType::F32, {T, hidden});
    TensorView y = tmp_->view(DType::F32, {T, hidden});
    mixed_ok_ = split_mixed(in, mixed_);
    be_.embed(tok_embd_, in.token_ids(), int(T), x);
    dump("token_embd", x);
    // The norm in front of the next product: x (+ y, then x and x2 swap) through `norm`.
    auto norm_into = [&](bool add, const TensorView& norm, const TensorView& w, TensorView out) {
      NormMatmulParams np;
      np.x = x;
      if (add) {
        np.y = y;
        np.x_out = x2;
      }
      np.norm = norm;
      np.eps = cfg_.rms_eps;
      np.xn = xn;
      np.w = w;
      np.out = out;
      be_.norm_matmul(np);
      if (add) std::swap(x, x2);
    };
    // The add and norm after a sublayer's output y (written to x2 and xn; then x and x2 swap) go
    // with the op that writes y (matmul_add_norm, moe_routed_ffn_add_norm: a device may do them
    // in its last launch) where no rank sums y in between: after o_proj (the FFN norm) and after
    // the FFN (the next layer's input norm).
    const bool add_norm_after = comm_ == nullptr;
    auto add_norm_of = [&](const TensorView& norm) {
      AddNormParams p;
      p.r = x;
      p.norm = norm;
      p.eps = cfg_.rms_eps;
      p.r_out = x2;
      p.rn = xn;
      return p;
    };
    bool attn_normed = false;  // the last FFN's op did this layer's input norm
    for (int l = 0; l < cfg_.layers; ++l) {
      const DsLayer& W = layers_[size_t(l)];
      if (l > 0) be_.capture_cut();  // a graph being recorded may end a piece here
      bool ffn_normed = false;
      // Layer 0's input norm has no residual add before it; the others add the last FFN's y.
      attention(
          l, W, in, cache,
          [&](const TensorView& w, TensorView out) {
            if (attn_normed)
              be_.matmul(xn, w, out);
            else
              norm_into(l > 0, W.attn_norm, w, out);
            if (l > 0) dump(l - 1, "out", x);
            dump(l, "attn_norm", xn);
          },
          [&](const TensorView& o, const TensorView& wo, TensorView out) {
            if (!add_norm_after) return be_.matmul(o, wo, out);
            MatmulNormParams mp;
            mp.x = o;
            mp.w = wo;
            mp.out = out;
            mp.add_norm = add_norm_of(W.ffn_norm);
            be_.matmul_add_norm(mp);
            std::swap(x, x2);
            ffn_normed = true;
          },
          y);         // y <- attention output
      all_reduce(y);  // tensor parallel: o_proj is row-split
      auto ffn_in = [&](const TensorView& w, TensorView out) {
        if (ffn_normed)
          be_.matmul(xn, w, out);
        else
          norm_into(true, W.ffn_norm, w, out);
        dump(l, "ffn_norm", xn);
      };
      // The next layer's input norm with the FFN's last op (none after the last layer).
      const bool next_norm = add_norm_after && l + 1 < cfg_.layers;
      auto after = [&]() -> std::optional<AddNormParams> {
        if (!next_norm) return std::nullopt;
        return add_norm_of(layers_[size_t(l) + 1].attn_norm);
      };
      attn_normed = W.moe ? moe(W, ffn_in, xn, y, after) : mlp(W.mlp, xn, y, ffn_in, after);
      if (attn_normed) std::swap(x, x2);
      all_reduce(y);  // tensor parallel: down_proj row-split; expert parallel: experts by rank
    }
    be_.add(x, y);  // the last residual add; the others went with the next layer's input norm
    dump(cfg_.layers - 1, "out", x);
    output_logits(be_, x, in.logit_rows, last_->view(DType::F32, {NL, hidden}), output_norm_,
                  cfg_.rms_eps, output_, logits);
  }

 private:
  int first_moe_layer() const {
    for (int l = 0; l < cfg_.layers; ++l)
      if (cfg_.is_moe_layer(l)) return l;
    return -1;
  }

  // The shared MLP (intermediate n * F) is n experts of F: slices of its gate/up rows and down
  // columns, appended to the routed ones so moe_ffn runs them in the same launches. Only when
  // the slices look like the routed experts (dtype, 16-byte aligned rows); returns n, or 0.
  // W4A16 / FP8W rows end in their scales, so down's column slices are repacked copies (F a
  // multiple of their 128-groups) and the unsliced down is freed.
  static int fold_shared(WeightBinder& b, DsLayer& L, int n, int64_t F) {
    DsMlp& m = L.mlp;
    const DType t = L.experts.front().gate.dtype;
    const TensorView g = m.gate_up ? *m.gate_up : m.gate;
    if (g.dtype != t || m.down.dtype != t || (m.gate_up ? false : m.up.dtype != t)) return 0;
    const bool packed = row_scaled_dtype(t);
    const int64_t esize = int64_t(dtype_info(t).type_size);
    if (packed ? F % 128 != 0 : dtype_info(t).block_size != 1 || (F * esize) % 16 != 0) return 0;
    const std::vector<TensorView> downs = b.split_cols(m.down, n);
    for (int i = 0; i < n; ++i) {
      ExpertWeights w;
      w.gate = g.slice_rows(i * F, (i + 1) * F);
      w.up = m.gate_up ? g.slice_rows((n + i) * F, (n + i + 1) * F)
                       : m.up.slice_rows(i * F, (i + 1) * F);
      w.down = downs[size_t(i)];
      L.experts.push_back(w);
    }
    if (packed) {
      b.drop(m.down);
      m.down = TensorView{};
    }
    return n;
  }

  // hidden from the config: a 4-bit checkpoint has no gate_proj.weight to read it from.
  static DsMlp bind_mlp(WeightBinder& b, const std::string& prefix, int64_t hidden, int64_t ffn) {
    DsMlp m;
    m.ffn = ffn;
    const TensorView g = b.checked(prefix + "gate_proj.weight", ffn, hidden);
    const TensorView u = b.checked(prefix + "up_proj.weight", ffn, hidden);
    m.gate_up = b.fuse_rows({g, u});
    if (!m.gate_up) {
      m.gate = b.place(g);
      m.up = b.place(u);
    }
    m.down = b.linear(prefix + "down_proj.weight", hidden, ffn);
    return m;
  }

  // The absorbed-form weights: W_uk^T per head ([H, R, nope], a transposed copy in the
  // checkpoint's dtype, so q_nope . k_nope = (q_nope W_uk) . c) and W_uv as a strided view
  // of kv_b_proj's value rows ([H, v, R]).
  void bind_absorbed(WeightBinder& b, const std::string& kv_b_name, DsLayer& L) {
    const int64_t H = cfg_.heads, R = cfg_.kv_lora_rank, nope = cfg_.qk_nope_dim;
    const int64_t v = cfg_.v_head_dim;
    const DType dt = L.wkv_b.dtype;
    if (dt != DType::F32 && dt != DType::F16 && dt != DType::BF16)
      throw UnsupportedError("kv_b_proj must be F32, F16 or BF16 for MLA, not " +
                             std::string(dtype_name(dt)));
    if (!be_.supports(Op::BatchedMatMul, dt))
      throw UnsupportedError(be_.name() + " has no batched matmul for " +
                             std::string(dtype_name(dt)));
    const size_t es = dtype_info(dt).type_size;
    // w_uk_t[h, c, i] = kv_b[h * (nope + v) + i, c]
    L.w_uk_t = b.permuted(kv_b_name, {H, R, nope}, {(nope + v) * R, 1, R});
    TensorView uv = L.wkv_b;
    uv.data = static_cast<uint8_t*>(L.wkv_b.data) + nope * L.wkv_b.row_stride();
    uv.ndim = 3;
    uv.shape = {H, v, R, 0};
    uv.stride = {(nope + v) * L.wkv_b.row_stride(), L.wkv_b.row_stride(), int64_t(es), 0};
    L.w_uv = uv;
  }

  // Multi-head latent attention of layer l into out [T, hidden]. project(w, out): the layer's
  // input norm and the first product that reads it (out = xn . w, xn written too); the other
  // projections of the normed rows read xn.
  // o_proj(o, wo, out): the output projection (with what follows it, in forward).
  template <typename Project, typename OutProject>
  void attention(int l, const DsLayer& W, const ForwardInput& in, KvCache& cache, Project&& project,
                 OutProject&& o_proj, TensorView out) {
    const int64_t T = out.shape[0], H = cfg_.heads, R = cfg_.kv_lora_rank, P = cfg_.qk_rope_dim;
    const int64_t nope = cfg_.qk_nope_dim, v = cfg_.v_head_dim, qk = nope + P;
    const int64_t qlr = cfg_.q_lora_rank;
    // The projections of the normed x, [T, lead + R + P] (fused at load where the formats agree,
    // else two products into the same columns): q_a with a q LoRA, else q itself (rows strided),
    // then kva, the compressed KV and the shared rope key.
    const int64_t lead = qlr > 0 ? qlr : H * qk;
    TensorView both = qkv_a_->view(DType::F32, {T, lead + R + P});
    TensorView head = cols(both, 0, lead), kva = cols(both, lead, R + P);
    const TensorView xn = xn_->view(DType::F32, {T, cfg_.hidden});
    if (W.wqkv_a) {
      project(*W.wqkv_a, both);
    } else {
      project(qlr > 0 ? W.wq_a : W.wq, head);
      be_.matmul(xn, W.wkv_a, kva);
    }
    TensorView q = head;
    if (qlr > 0) {
      TensorView qa_n = qa_n_->view(DType::F32, {T, qlr});
      q = q_->view(DType::F32, {T, H * qk});
      be_.rms_norm(head, W.q_a_norm, kLatentNormEps, qa_n);
      be_.matmul(qa_n, W.wq_b, q);
    }
    TensorView qh = heads_view(q, int(H), int(qk));
    TensorView q_pe = sub_heads(qh, nope, P), q_nope = sub_heads(qh, 0, nope);
    // Latent norm, rope of q and k, and the cache store: one launch on devices.
    MlaPrepareParams prep;
    prep.kva = kva;
    prep.norm = W.kv_a_norm;
    prep.eps = kLatentNormEps;
    prep.q_rope = q_pe;
    prep.rope = cfg_.rope;
    prep.cache = cache.layer(l);
    prep.kv_lora_rank = int(R);
    be_.mla_prepare(prep, in.meta);
    dump(l, "q", q);  // rotated, as attention reads them
    dump(l, "kv_latent", kva);

    TensorView o = o_->view(DType::F32, {T, H * v});
    TensorView oh = heads_view(o, int(H), int(v));
    MlaPrefillParams pp;
    pp.q_nope = q_nope;
    pp.q_rope = q_pe;
    pp.kv_b = W.wkv_b;
    pp.out = oh;
    pp.cache = cache.layer(l);
    pp.kv_lora_rank = int(R);
    pp.scale = cfg_.attn_scale;
    if (opts_.mla_expanded) {
      expanded_attention(l, W, in, cache, qh, oh);
    } else if (be_.mla_prefill(pp, in.meta)) {
      // The backend's expanded prefill path wrote oh (value space) directly.
    } else if (mixed_ok_ && be_.mla_prefill(pp, mixed_.prefill)) {
      // The prefill sequences' rows of oh are written; the decodes (rows [0, decodes)) take
      // the absorbed form.
      const int64_t D = mixed_.decode.num_tokens;
      absorbed_attention(l, W, cache, q_nope.slice_rows(0, D), q_pe.slice_rows(0, D),
                         oh.slice_rows(0, D), mixed_.decode);
    } else {
      absorbed_attention(l, W, cache, q_nope, q_pe, oh, in.meta);
    }
    dump(l, "attn_out", o);
    o_proj(o, W.wo, out);
  }

  // The absorbed form over [T, H, *] views: q_latent = q_nope . W_uk, attention over the latent
  // cache, then the value up-projection into oh.
  void absorbed_attention(int l, const DsLayer& W, KvCache& cache, const TensorView& q_nope,
                          const TensorView& q_pe, TensorView oh, const AttentionMeta& meta) {
    const int64_t T = q_nope.shape[0], H = cfg_.heads, R = cfg_.kv_lora_rank;
    // Past reserve()'s kMaxDecodeGraphBatch (a backend without the expanded prefill kernel).
    ensure_scratch(be_, q_lat_, T * H * R);
    ensure_scratch(be_, o_lat_, T * H * R);
    TensorView q_lat = heads_view(q_lat_->view(DType::F32, {T, H * R}), int(H), int(R));
    TensorView o_lat = heads_view(o_lat_->view(DType::F32, {T, H * R}), int(H), int(R));
    be_.batched_matmul(heads_first(q_nope), W.w_uk_t, heads_first(q_lat));
    MlaAttentionParams mp;
    mp.q_latent = q_lat;
    mp.q_rope = q_pe;
    mp.out = o_lat;
    mp.cache = cache.layer(l);
    mp.kv_lora_rank = int(R);
    mp.scale = cfg_.attn_scale;
    mp.cache_settled = true;  // mla_prepare wrote the cache before the W_uk product above
    be_.mla_attention(mp, meta);
    be_.batched_matmul(heads_first(o_lat), W.w_uv, heads_first(oh));
  }

  // A step that decodes some sequences and prefills others, in the scheduler's order (the
  // decoding sequences first): `decode` covers sequences [0, D) and tokens [0, D), `prefill`
  // the rest, with its arrays offset by D sequences and its token indices absolute (so it keeps
  // num_tokens = all of the step's tokens; kernels index q and out by query_start). Without the
  // split such a step took the absorbed form for every sequence, whose attention over the
  // prompts is the generic tensor-core kernel (W2's steps that mixed 248 decodes with a 7,944-
  // token prefill chunk: ~345 ms, against ~125 ms for a prefill step alone).
  struct MixedStep {
    AttentionMeta decode, prefill;
  };
  static bool split_mixed(const ForwardInput& in, MixedStep& m) {
    const AttentionMeta& h = in.host_meta;
    if (h.query_start == nullptr || h.context_lens == nullptr || in.meta.query_start == nullptr)
      return false;
    const int S = in.meta.num_seqs;
    int D = 0;
    while (D < S && h.query_start[D + 1] - h.query_start[D] == 1) ++D;
    if (D == 0 || D == S || h.query_start[D] != D) return false;
    m.decode = in.meta;
    m.decode.num_seqs = D;
    m.decode.num_tokens = D;
    m.decode.max_query_len = 1;
    m.decode.max_context_len = 0;
    for (int i = 0; i < D; ++i)
      m.decode.max_context_len = std::max(m.decode.max_context_len, h.context_lens[i]);
    m.prefill = in.meta;
    m.prefill.num_seqs = S - D;
    m.prefill.query_start = in.meta.query_start + D;
    m.prefill.context_lens = in.meta.context_lens + D;
    m.prefill.block_tables = in.meta.block_tables + int64_t(D) * in.meta.max_blocks_per_seq;
    m.prefill.max_query_len = 0;
    m.prefill.max_context_len = 0;
    for (int i = D; i < S; ++i) {
      m.prefill.max_query_len =
          std::max(m.prefill.max_query_len, h.query_start[i + 1] - h.query_start[i]);
      m.prefill.max_context_len = std::max(m.prefill.max_context_len, h.context_lens[i]);
    }
    return true;
  }
  MixedStep mixed_;        // this forward's split (split_mixed, once per step)
  bool mixed_ok_ = false;  // whether mixed_ holds one

  // Dims [begin, begin + n) of every head of a [T, H, d] F32 view.
  static TensorView sub_heads(const TensorView& t, int64_t begin, int64_t n) {
    TensorView v = t;
    v.data = static_cast<uint8_t*>(t.data) + begin * 4;
    v.shape[2] = n;
    return v;
  }

  // The reference form: each sequence's cached latents are gathered and up-projected into
  // per-head keys [k_nope | k_pe] and values, then ordinary causal attention runs over them.
  // Needs an F32 cache (the gathered latents feed a matmul directly).
  void expanded_attention(int l, const DsLayer& W, const ForwardInput& in, KvCache& cache,
                          const TensorView& qh, TensorView oh) {
    const AttentionMeta& hm = in.host_meta.query_start ? in.host_meta : in.meta;
    const PagedKv& kv = cache.layer(l);
    if (kv.dtype != DType::F32) throw UnsupportedError("expanded MLA needs an F32 KV cache");
    const int64_t H = cfg_.heads, R = cfg_.kv_lora_rank, P = cfg_.qk_rope_dim;
    const int64_t nope = cfg_.qk_nope_dim, v = cfg_.v_head_dim, qk = nope + P;
    const TensorView flat = TensorView::contiguous(
        kv.k, DType::F32, {int64_t(kv.num_blocks) * kv.block_size, R + P}, be_.device());
    for (int s = 0; s < hm.num_seqs; ++s) {
      const int q0 = hm.query_start[s], nq = hm.query_start[s + 1] - q0;
      const int64_t C = hm.context_lens[s];
      auto grow = [&](std::unique_ptr<Buffer>& buf, int64_t n) { ensure_scratch(be_, buf, n); };
      grow(x_lat_, C * (R + P));
      grow(x_kv_, C * H * (nope + v));
      grow(x_k_, C * H * qk);
      grow(x_v_, C * H * qk);
      grow(x_o_, int64_t(nq) * H * qk);
      TensorView lat = x_lat_->view(DType::F32, {C, R + P});
      for (int64_t j0 = 0; j0 < C; j0 += kv.block_size) {
        const int64_t n = std::min<int64_t>(kv.block_size, C - j0);
        const int64_t blk =
            hm.block_tables[int64_t(s) * hm.max_blocks_per_seq + j0 / kv.block_size];
        be_.copy(flat.slice_rows(blk * kv.block_size, blk * kv.block_size + n),
                 lat.slice_rows(j0, j0 + n));
      }
      TensorView kvx = x_kv_->view(DType::F32, {C, H * (nope + v)});
      be_.matmul(cols(lat, 0, R), W.wkv_b, kvx);
      // Keys [C, H, qk] = [k_nope | k_pe]; values padded to qk dims so one attention op with
      // a single head size serves (the padding is zero and dropped afterwards).
      TensorView k = x_k_->view(DType::F32, {C, H * qk});
      TensorView vv = x_v_->view(DType::F32, {C, H * qk});
      const std::vector<float> zeros(size_t(C * H * qk), 0.0f);
      be_.upload(vv, zeros.data(), zeros.size() * 4);
      for (int64_t h = 0; h < H; ++h) {
        be_.copy(cols(kvx, h * (nope + v), nope), cols(k, h * qk, nope));
        be_.copy(cols(lat, R, P), cols(k, h * qk + nope, P));
        be_.copy(cols(kvx, h * (nope + v) + nope, v), cols(vv, h * qk, v));
      }
      // One sequence, one block holding its whole context.
      const int32_t small[4] = {0, nq, int32_t(C), 0};  // query_start[2], context_lens, table
      if (!x_meta_) x_meta_ = be_.alloc(sizeof small);
      be_.upload(x_meta_->view(DType::I32, {4}), small, sizeof small);
      const int32_t* dm = static_cast<const int32_t*>(x_meta_->data());
      AttentionMeta m;
      m.num_seqs = 1;
      m.num_tokens = nq;
      m.query_start = dm;
      m.context_lens = dm + 2;
      m.block_tables = dm + 3;
      m.max_blocks_per_seq = 1;
      m.positions = in.meta.positions + q0;
      m.max_query_len = nq;
      m.max_context_len = int(C);
      AttentionParams ap;
      ap.q = qh.slice_rows(q0, q0 + nq);
      ap.out = heads_view(x_o_->view(DType::F32, {int64_t(nq), H * qk}), int(H), int(qk));
      ap.kv.k = k.data;
      ap.kv.v = vv.data;
      ap.kv.dtype = DType::F32;
      ap.kv.num_blocks = 1;
      ap.kv.block_size = int(C);
      ap.kv.kv_heads = int(H);
      ap.kv.head_dim = int(qk);
      ap.scale = cfg_.attn_scale;
      be_.attention(ap, m);
      const TensorView o2 = x_o_->view(DType::F32, {int64_t(nq), H * qk});
      TensorView dst = oh.slice_rows(q0, q0 + nq);
      const TensorView dst2 = TensorView::contiguous(dst.data, DType::F32, {nq, H * v}, dst.device);
      for (int64_t h = 0; h < H; ++h) be_.copy(cols(o2, h * qk, v), cols(dst2, h * v, v));
    }
  }

  // project(w, out): out = xn . w, with the norm that writes xn in front where the caller has
  // one (the dense layers' FFN norm).
  // after(): the add and norm to run with the down product (matmul_add_norm), or none; returns
  // whether it ran.
  template <typename Project, typename After>
  bool mlp(const DsMlp& m, const TensorView& xn, TensorView out, Project&& project, After&& after) {
    const int64_t T = xn.shape[0], F = m.ffn;
    TensorView gu = gate_up_->view(DType::F32, {T, 2 * F});
    TensorView act = act_->view(DType::F32, {T, F});
    if (m.gate_up) {
      project(*m.gate_up, gu);
    } else {
      project(m.gate, cols(gu, 0, F));
      be_.matmul(xn, m.up, cols(gu, F, F));
    }
    be_.silu_mul(gu, act);
    const std::optional<AddNormParams> an = after();
    if (!an) {
      be_.matmul(act, m.down, out);
      return false;
    }
    MatmulNormParams mp;
    mp.x = act;
    mp.w = m.down;
    mp.out = out;
    mp.add_norm = *an;
    be_.matmul_add_norm(mp);
    return true;
  }

  // Routed experts plus shared experts, into out [T, hidden]. route_in(w, logits): the FFN norm
  // (writing xn) and the router product. after(): the add and norm to run with the experts
  // (moe_routed_ffn_add_norm), or none; returns whether it ran (not where the shared experts
  // are a separate MLP).
  template <typename Project, typename After>
  bool moe(const DsLayer& W, Project&& route_in, const TensorView& xn, TensorView out,
           After&& after) {
    const int64_t T = xn.shape[0], E = cfg_.moe_experts, K = cfg_.moe_top_k;
    TensorView logits = router_->view(DType::F32, {T, E});
    route_in(W.router, logits);
    TensorView ids = ids_->view(DType::I32, {T, K});
    TensorView wts = wts_->view(DType::F32, {T, K});
    MoeRouteParams rp;
    rp.top_k = int(K);
    rp.method = cfg_.moe_topk_method;
    rp.n_group = cfg_.moe_n_group;
    rp.topk_group = cfg_.moe_topk_group;
    rp.norm_topk_prob = cfg_.moe_norm_topk_prob;
    rp.routed_scaling_factor = cfg_.moe_routed_scaling;
    rp.expert_counts = static_cast<int64_t*>(counts_buf_->data()) + int64_t(W.moe_index) * E;
    MoeFfnParams fp;
    fp.x = xn;
    fp.ids = ids;
    fp.weights = wts;
    fp.experts = W.experts;
    fp.num_shared = W.num_shared;
    fp.expert_base = cfg_.moe_expert_begin;
    fp.skip_foreign = cfg_.local_experts() != cfg_.moe_experts;
    fp.out = out;
    if (cfg_.moe_shared_experts > 0 && W.num_shared == 0) {
      be_.moe_routed_ffn(logits, rp, fp);
      TensorView shared = shared_->view(DType::F32, {T, cfg_.hidden});
      mlp(
          W.mlp, xn, shared, [&](const TensorView& w, TensorView o) { be_.matmul(xn, w, o); },
          [] { return std::nullopt; });
      be_.add(out, shared);
      return false;
    }
    const std::optional<AddNormParams> an = after();
    if (!an) {
      be_.moe_routed_ffn(logits, rp, fp);
      return false;
    }
    be_.moe_routed_ffn_add_norm(logits, rp, fp, *an);
    return true;
  }

  void reserve(int64_t T, int64_t NL) {
    const int64_t H = cfg_.heads, R = cfg_.kv_lora_rank, P = cfg_.qk_rope_dim;
    const int64_t qk = cfg_.qk_nope_dim + P, v = cfg_.v_head_dim;
    const int64_t ffn = std::max<int64_t>(cfg_.intermediate, cfg_.shared_ffn());
    auto grow = [&](std::unique_ptr<Buffer>& b, int64_t n) { ensure_scratch(be_, b, n); };
    grow(x_, T * cfg_.hidden);
    grow(x2_, T * cfg_.hidden);
    grow(xn_, T * cfg_.hidden);
    grow(tmp_, T * cfg_.hidden);
    grow(shared_, T * cfg_.hidden);
    // q_a (or, without a q LoRA, q itself) and kva; q_ holds q_b's output.
    grow(qkv_a_, T * ((cfg_.q_lora_rank > 0 ? cfg_.q_lora_rank : H * qk) + R + P));
    grow(qa_n_, T * std::max(cfg_.q_lora_rank, 1));
    grow(q_, cfg_.q_lora_rank > 0 ? T * H * qk : 1);
    // The absorbed form's latents (V2.5: 512 KB a token), for a step's decodes only: expanded
    // prefills never touch them. Up to the largest decode graph's batch, so none regrows them.
    grow(q_lat_, std::min<int64_t>(T, kMaxDecodeGraphBatch) * H * R);
    grow(o_lat_, std::min<int64_t>(T, kMaxDecodeGraphBatch) * H * R);
    grow(o_, T * H * v);
    grow(gate_up_, T * 2 * ffn);
    grow(act_, T * ffn);
    grow(router_, T * std::max(cfg_.moe_experts, 1));
    grow(ids_, T * std::max(cfg_.moe_top_k, 1));
    grow(wts_, T * std::max(cfg_.moe_top_k, 1));
    grow(last_, std::max<int64_t>(NL, 1) * cfg_.hidden);
  }

  ModelConfig cfg_;
  Backend& be_;
  DeepseekOptions opts_;
  TensorView tok_embd_, output_norm_, output_;
  std::vector<DsLayer> layers_;
  std::vector<std::unique_ptr<Buffer>> owned_;
  uint64_t total_bytes_ = 0;
  int num_moe_layers_ = 0;
  std::unique_ptr<Buffer> counts_buf_;  // [moe layers, E] int64 tokens routed per expert
  std::unique_ptr<Buffer> x_, x2_, xn_, tmp_, shared_, qkv_a_, qa_n_, q_, q_lat_, o_lat_, o_,
      gate_up_, act_, router_, ids_, wts_, last_;
  std::unique_ptr<Buffer> x_lat_, x_kv_, x_k_, x_v_, x_o_, x_meta_;  // expanded-form scratch
};

}  // namespace

std::unique_ptr<Model> make_deepseek_v2(const ModelConfig& cfg, const WeightSource& weights,
                                        Backend& backend, const DeepseekOptions& opts) {
  if (!cfg.is_mla()) throw Error("deepseek_v2 config without kv_lora_rank");
  return std::make_unique<DeepseekV2>(cfg, weights, backend, opts);
}

}  // namespace ds
