#include "engine/generator.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "engine/output.h"

namespace ds {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

double GenerateResult::prompt_tokens_per_s() const {
  const int computed = prompt_tokens - cached_prompt_tokens;
  return prompt_seconds > 0 ? computed / prompt_seconds : 0;
}

double GenerateResult::decode_tokens_per_s() const {
  return decode_seconds > 0 && tokens.size() > 1 ? double(tokens.size() - 1) / decode_seconds : 0;
}

Generator::Generator(Model& model, Backend& backend, const Tokenizer* tokenizer, KvCache& cache,
                     const GeneratorOptions& opts)
    : model_(model), backend_(backend), tok_(tokenizer), cache_(cache), opts_(opts) {
  DS_CHECK(opts_.prefill_chunk > 0, "prefill chunk must be positive");
  // One sequence owns every block, in order.
  block_table_.resize(size_t(cache_.num_blocks()));
  for (int b = 0; b < cache_.num_blocks(); ++b) block_table_[size_t(b)] = b;
  const int vocab = model_.config().vocab;
  logits_buf_ = backend_.alloc(size_t(vocab) * 4);
  logits_.resize(size_t(vocab));
}

int64_t Generator::context_capacity() const {
  return std::min<int64_t>(cache_.capacity_tokens(), model_.config().max_context);
}

void Generator::run(std::span<const int32_t> tokens, int start_pos, bool want_logits) {
  const int n = int(tokens.size());
  positions_.resize(size_t(n));
  slots_.resize(size_t(n));
  for (int i = 0; i < n; ++i) positions_[size_t(i)] = slots_[size_t(i)] = start_pos + i;
  query_start_ = {0, n};
  context_lens_ = {start_pos + n};
  ForwardInput in;
  in.tokens = tokens;
  in.meta.num_seqs = 1;
  in.meta.num_tokens = n;
  in.meta.query_start = query_start_.data();
  in.meta.context_lens = context_lens_.data();
  in.meta.block_tables = block_table_.data();
  in.meta.max_blocks_per_seq = int(block_table_.size());
  in.meta.slot_mapping = slots_.data();
  in.meta.positions = positions_.data();
  const int32_t last = n - 1;
  in.logit_rows = want_logits ? std::span<const int32_t>(&last, 1) : std::span<const int32_t>();
  TensorView logits = logits_buf_->view(DType::F32, {want_logits ? 1 : 0, model_.config().vocab});
  model_.forward(in, cache_, logits);
  if (want_logits) backend_.download(logits_.data(), logits, logits_.size() * 4);
}

GenerateResult Generator::generate(const GenerateRequest& req, const TokenCallback& on_token) {
  GenerateResult res;
  res.prompt_tokens = int(req.prompt.size());
  if (req.prompt.empty()) throw Error("the prompt is empty");
  if (req.max_tokens < 0) throw Error("max_tokens must be >= 0");
  const int64_t cap = context_capacity();
  if (int64_t(req.prompt.size()) >= cap)
    throw Error("the prompt has " + std::to_string(req.prompt.size()) +
                " tokens; the context holds " + std::to_string(cap) +
                " (prompt plus at least one generated token)");
  for (int32_t id : req.prompt)
    if (id < 0 || id >= model_.config().vocab)
      throw Error("prompt token id " + std::to_string(id) + " is outside the vocabulary");

  // Reuse the cached prefix, but always recompute the last prompt token for its logits.
  size_t reuse = 0;
  while (reuse < cached_.size() && reuse + 1 < req.prompt.size() &&
         cached_[reuse] == req.prompt[reuse])
    ++reuse;
  cached_.resize(reuse);
  res.cached_prompt_tokens = int(reuse);

  const double t0 = now_seconds();
  for (size_t pos = reuse; pos < req.prompt.size(); pos += size_t(opts_.prefill_chunk)) {
    const size_t n = std::min(size_t(opts_.prefill_chunk), req.prompt.size() - pos);
    run(std::span(req.prompt).subspan(pos, n), int(pos), pos + n == req.prompt.size());
    cached_.insert(cached_.end(), req.prompt.begin() + long(pos),
                   req.prompt.begin() + long(pos + n));
  }
  res.prompt_seconds = now_seconds() - t0;

  Sampler sampler(req.sampling);
  std::vector<int32_t> history = req.prompt;
  OutputProcessor out(tok_, req.stop, req.ignore_eos, model_.config().eos_id);
  res.finish_reason = "length";
  double t_first = 0;
  for (int i = 0; i < req.max_tokens; ++i) {
    const int32_t id = sampler.sample(logits_, history);
    if (i == 0) t_first = now_seconds();
    res.tokens.push_back(id);
    history.push_back(id);
    const auto delta = out.push(id);
    if (on_token && !on_token(id, delta.text)) {
      res.finish_reason = "cancelled";
      break;
    }
    if (delta.finished) {
      res.finish_reason = "stop";
      break;
    }
    if (i + 1 == req.max_tokens) break;
    if (int64_t(cached_.size()) + 1 >= cap) break;  // context full: finish with "length"
    run(std::span(&res.tokens.back(), 1), int(cached_.size()), true);
    cached_.push_back(id);
  }
  if (!out.finished()) {
    const std::string_view rest = out.close();
    if (on_token && !rest.empty() && res.finish_reason != "cancelled") on_token(-1, rest);
  }
  res.text = out.text();
  res.decode_seconds = res.tokens.empty() ? 0 : now_seconds() - t_first;
  return res;
}

}  // namespace ds
