#include "backend/profiling_backend.h"

#include <algorithm>

namespace ds {
namespace {

// "[8,576]": the compact form keeps labels short in the table.
std::string dims(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? "," : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string dt(DType t) {
  return std::string(dtype_name(t));
}

std::vector<OpTimingRow> rows_by_time(std::vector<OpTimingRow> rows) {
  std::sort(rows.begin(), rows.end(), [](const OpTimingRow& a, const OpTimingRow& b) {
    return a.us != b.us ? a.us > b.us : a.label < b.label;
  });
  return rows;
}

}  // namespace

ProfilingBackend::ProfilingBackend(Backend& inner) : inner_(inner) {}

int ProfilingBackend::label_id(const char* kind, const std::string& label) {
  auto [it, added] = label_ids_.try_emplace(label, int(labels_.size()));
  if (added) {
    labels_.push_back(label);
    label_kinds_.emplace_back(kind);
  }
  return it->second;
}

template <class F>
void ProfilingBackend::timed(const char* kind, const std::string& label, F&& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!step_open_) {
    op();
    return;
  }
  const int id = label_id(kind, label);  // before the first mark: not part of the op's time
  OpRecord r;
  r.label = id;
  r.begin = inner_.mark();
  op();
  r.end = inner_.mark();
  step_ops_.push_back(r);
}

void ProfilingBackend::note_meta(const AttentionMeta& meta) {
  // Called under mu_ from inside an op; the first attention-side op of a step fixes its kind.
  if (!step_open_ || step_seqs_ > 0) return;
  step_seqs_ = meta.num_seqs;
  step_context_ = meta.max_context_len;
  step_decode_ = meta.num_seqs > 0 && meta.num_seqs == meta.num_tokens;
}

void ProfilingBackend::close_step() {
  if (!step_open_) return;
  step_open_ = false;
  const std::vector<double> t = inner_.mark_times_ms();
  inner_.clear_marks();
  if (step_ops_.empty()) return;
  Group& g = groups_[{step_tokens_, step_decode_}];
  double sum = 0;
  for (const OpRecord& r : step_ops_) {
    const double ms = std::max(0.0, t[size_t(r.end)] - t[size_t(r.begin)]);
    LabelStat& s = g.labels[r.label];
    s.calls += 1;
    s.ms += ms;
    sum += ms;
  }
  g.steps += 1;
  g.seqs += step_seqs_;
  g.context += step_context_;
  g.op_ms += sum;
  g.wall_ms += t[size_t(step_ops_.back().end)] - t[size_t(step_ops_.front().begin)];
  step_ops_.clear();
}

void ProfilingBackend::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  if (step_open_) inner_.clear_marks();
  step_open_ = false;
  step_ops_.clear();
  groups_.clear();
}

StepProfile ProfilingBackend::summarize(const GroupKey& key, const Group& g) const {
  StepProfile p;
  p.tokens = key.first;
  p.decode = key.second;
  p.steps = g.steps;
  const double n = double(std::max<int64_t>(g.steps, 1));
  p.seqs = g.seqs / n;
  p.context = g.context / n;
  p.op_ms = g.op_ms / n;
  p.wall_ms = g.wall_ms / n;
  const double total = g.op_ms > 0 ? g.op_ms : 1;
  std::map<std::string, OpTimingRow> kinds;
  for (const auto& [id, s] : g.labels) {
    const std::string& kind = label_kinds_[size_t(id)];
    OpTimingRow r{labels_[size_t(id)], kind, double(s.calls) / n, s.ms * 1e3 / n, s.ms / total};
    OpTimingRow& k = kinds[kind];
    k.label = k.kind = kind;
    k.calls += r.calls;
    k.us += r.us;
    k.share += r.share;
    p.ops.push_back(std::move(r));
  }
  for (auto& [name, r] : kinds) p.kinds.push_back(r);
  p.ops = rows_by_time(std::move(p.ops));
  p.kinds = rows_by_time(std::move(p.kinds));
  return p;
}

OpProfile ProfilingBackend::profile(std::optional<int> tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  close_step();
  OpProfile out;
  out.backend = inner_.name();
  const std::pair<const GroupKey, Group>* best = nullptr;
  // Decode first, then more steps, then more tokens.
  auto better = [](const auto& a, const auto& b) {
    if (a.first.second != b.first.second) return a.first.second;
    if (a.second.steps != b.second.steps) return a.second.steps > b.second.steps;
    return a.first.first > b.first.first;
  };
  for (const auto& kv : groups_) {
    out.steps += kv.second.steps;
    out.groups.push_back({kv.first.first, kv.first.second, kv.second.steps});
    if (tokens && kv.first.first != *tokens) continue;
    if (!best || better(kv, *best)) best = &kv;
  }
  std::sort(out.groups.begin(), out.groups.end(),
            [](const StepGroupCount& a, const StepGroupCount& b) {
              if (a.steps != b.steps) return a.steps > b.steps;
              if (a.tokens != b.tokens) return a.tokens > b.tokens;
              return a.decode > b.decode;
            });
  if (best) out.step = summarize(best->first, best->second);
  return out;
}

// ---- forwarded ops ------------------------------------------------------------------------

void ProfilingBackend::upload(const TensorView& dst, const void* host, size_t bytes) {
  timed("upload", "upload", [&] { inner_.upload(dst, host, bytes); });
}

void ProfilingBackend::download(void* host, const TensorView& src, size_t bytes) {
  timed("download", "download", [&] { inner_.download(host, src, bytes); });
}

void ProfilingBackend::embed(const TensorView& table, const int32_t* ids, int n, TensorView out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    close_step();  // every forward starts here
    step_open_ = true;
    step_tokens_ = n;
    step_seqs_ = 0;
    step_context_ = 0;
    step_decode_ = false;
  }
  const std::string label =
      "embed T=" + std::to_string(n) + " " + dims(table) + " " + dt(table.dtype);
  timed("embed", label, [&] { inner_.embed(table, ids, n, out); });
}

void ProfilingBackend::rms_norm(const TensorView& x, const TensorView& w, float eps,
                                TensorView out) {
  timed("rms_norm", "rms_norm " + dims(x), [&] { inner_.rms_norm(x, w, eps, out); });
}

void ProfilingBackend::add_rms_norm(TensorView x, const TensorView& y, const TensorView& w,
                                    float eps, TensorView out) {
  timed("add_rms_norm", "add_rms_norm " + dims(x), [&] { inner_.add_rms_norm(x, y, w, eps, out); });
}

void ProfilingBackend::norm_matmul(const NormMatmulParams& p) {
  timed("norm_matmul",
        std::string(p.y.data ? "add_" : "") + "norm_matmul " + dims(p.x) + "x" + dims(p.w) + " " +
            dt(p.w.dtype),
        [&] { inner_.norm_matmul(p); });
}

void ProfilingBackend::matmul_add_norm(const MatmulNormParams& p) {
  timed("matmul_add_norm", "matmul_add_norm " + dims(p.x) + "x" + dims(p.w) + " " + dt(p.w.dtype),
        [&] { inner_.matmul_add_norm(p); });
}

void ProfilingBackend::matmul(const TensorView& x, const TensorView& w, TensorView out) {
  timed("matmul", "matmul " + dims(x) + "x" + dims(w) + " " + dt(w.dtype),
        [&] { inner_.matmul(x, w, out); });
}

void ProfilingBackend::rope(TensorView x, const int32_t* positions, const RopeParams& p) {
  timed("rope", "rope " + dims(x), [&] { inner_.rope(x, positions, p); });
}

void ProfilingBackend::store_kv(const TensorView& k, const TensorView& v, const PagedKv& kv,
                                const AttentionMeta& meta) {
  timed("store_kv", "store_kv " + dims(k) + " " + dt(kv.dtype), [&] {
    note_meta(meta);
    inner_.store_kv(k, v, kv, meta);
  });
}

void ProfilingBackend::attention(const AttentionParams& p, const AttentionMeta& meta) {
  const std::string label = "attention " + dims(p.q) + " kv[" + std::to_string(p.kv.kv_heads) +
                            "," + std::to_string(p.kv.head_dim) + "] " + dt(p.kv.dtype);
  timed("attention", label, [&] {
    note_meta(meta);
    inner_.attention(p, meta);
  });
}

void ProfilingBackend::silu_mul(const TensorView& gate_up, TensorView out) {
  timed("silu_mul", "silu_mul " + dims(out), [&] { inner_.silu_mul(gate_up, out); });
}

void ProfilingBackend::add(TensorView x, const TensorView& y) {
  timed("add", "add " + dims(x), [&] { inner_.add(x, y); });
}

void ProfilingBackend::batched_matmul(const TensorView& x, const TensorView& w, TensorView out) {
  timed("batched_matmul", "batched_matmul " + dims(x) + "x" + dims(w) + " " + dt(w.dtype),
        [&] { inner_.batched_matmul(x, w, out); });
}

void ProfilingBackend::mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta) {
  const std::string label = "mla_attention " + dims(p.q_latent) + " rope " +
                            std::to_string(p.q_rope.cols()) + " " + dt(p.cache.dtype);
  timed("mla_attention", label, [&] {
    note_meta(meta);
    inner_.mla_attention(p, meta);
  });
}

bool ProfilingBackend::mla_prefill(const MlaPrefillParams& p, const AttentionMeta& meta) {
  bool done = false;
  timed("mla_prefill", "mla_prefill " + dims(p.q_nope) + " " + dt(p.cache.dtype), [&] {
    note_meta(meta);
    done = inner_.mla_prefill(p, meta);
  });
  return done;
}

void ProfilingBackend::mla_prepare(const MlaPrepareParams& p, const AttentionMeta& meta) {
  const std::string label =
      "mla_prepare " + dims(p.kva) + " q_rope " + dims(p.q_rope) + " " + dt(p.cache.dtype);
  timed("mla_prepare", label, [&] {
    note_meta(meta);
    inner_.mla_prepare(p, meta);
  });
}

void ProfilingBackend::moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                                 TensorView weights) {
  timed("moe_route", "moe_route " + dims(logits) + " k=" + std::to_string(p.top_k),
        [&] { inner_.moe_route(logits, p, ids, weights); });
}

namespace {
std::string moe_ffn_label(const MoeFfnParams& p) {
  std::string label = "moe_ffn T=" + std::to_string(p.x.rows()) +
                      " E=" + std::to_string(p.experts.size()) +
                      " k=" + std::to_string(p.ids.cols());
  if (!p.experts.empty())
    label += " " + dims(p.experts[0].gate) + " " + dt(p.experts[0].gate.dtype);
  return label;
}
}  // namespace

void ProfilingBackend::moe_ffn(const MoeFfnParams& p) {
  timed("moe_ffn", moe_ffn_label(p), [&] { inner_.moe_ffn(p); });
}

// One op (the router's choice included), as the inner backend may run it in one kernel chain.
void ProfilingBackend::moe_routed_ffn(const TensorView& logits, const MoeRouteParams& route,
                                      const MoeFfnParams& ffn) {
  timed("moe_ffn", moe_ffn_label(ffn) + " +route",
        [&] { inner_.moe_routed_ffn(logits, route, ffn); });
}

void ProfilingBackend::moe_routed_ffn_add_norm(const TensorView& logits,
                                               const MoeRouteParams& route, const MoeFfnParams& ffn,
                                               const AddNormParams& add_norm) {
  timed("moe_ffn", moe_ffn_label(ffn) + " +route +add_norm",
        [&] { inner_.moe_routed_ffn_add_norm(logits, route, ffn, add_norm); });
}

void ProfilingBackend::argmax(const TensorView& logits, TensorView ids) {
  timed("argmax", "argmax " + dims(logits), [&] { inner_.argmax(logits, ids); });
}

void ProfilingBackend::sample(const TensorView& logits, const SampleRow* rows, TensorView ids) {
  timed("sample", "sample " + dims(logits), [&] { inner_.sample(logits, rows, ids); });
}

void ProfilingBackend::copy(const TensorView& src, TensorView dst) {
  timed("copy", "copy " + dims(src) + " " + dt(src.dtype), [&] { inner_.copy(src, dst); });
}

// ---- the table ----------------------------------------------------------------------------

void print_op_profile(std::FILE* out, const OpProfile& p, int rows) {
  if (!p.step) {
    if (p.groups.empty()) {
      std::fprintf(out, "op profile: no steps recorded\n");
      return;
    }
    // A token count was asked for (--profile-step-tokens) that no step had: say which there were.
    std::fprintf(out, "op profile: no step of the requested token count; steps by tokens:");
    for (const StepGroupCount& g : p.groups)
      std::fprintf(out, " %d%s x %lld", g.tokens, g.decode ? " (decode)" : "",
                   static_cast<long long>(g.steps));
    std::fprintf(out, "\n");
    return;
  }
  const StepProfile& s = *p.step;
  std::fprintf(out,
               "op profile (%s): %lld %s step(s) of %d tokens (%.1f seqs, context %.0f) of %lld; "
               "ops %.3f ms, wall %.3f ms per step\n",
               p.backend.c_str(), static_cast<long long>(s.steps), s.decode ? "decode" : "mixed",
               s.tokens, s.seqs, s.context, static_cast<long long>(p.steps), s.op_ms, s.wall_ms);
  std::fprintf(out, "  %-56s %7s %10s %7s\n", "op", "calls", "us/step", "share");
  const size_t n = std::min(s.ops.size(), size_t(std::max(rows, 0)));
  for (size_t i = 0; i < n; ++i) {
    const OpTimingRow& r = s.ops[i];
    std::fprintf(out, "  %-56s %7.1f %10.1f %6.1f%%\n", r.label.c_str(), r.calls, r.us,
                 r.share * 100);
  }
  if (s.ops.size() > n) std::fprintf(out, "  (%zu more labels)\n", s.ops.size() - n);
  std::fprintf(out, "  by kind:");
  for (const OpTimingRow& r : s.kinds)
    std::fprintf(out, " %s %.1f%%", r.label.c_str(), r.share * 100);
  std::fprintf(out, "\n");
}

}  // namespace ds
