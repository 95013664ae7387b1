// `deepserve accuracy`: loads the model as stored, takes its greedy continuation of each
// prompt, then compares each variant (another --quantize and/or KV cache dtype) with it,
// teacher-forced on that continuation; one JSON object on stdout (and in --output).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/session.h"
#include "core/build_info.h"
#include "core/error.h"
#include "model/accuracy.h"

namespace ds {
namespace {

struct Variant {
  std::string spec, quantize = "none", kv;
};

Variant parse_variant(const std::string& spec) {
  Variant v;
  v.spec = spec;
  std::stringstream ss(spec);
  for (std::string kv; std::getline(ss, kv, ',');) {
    const auto eq = kv.find('=');
    const std::string key = kv.substr(0, eq), val = eq == kv.npos ? "" : kv.substr(eq + 1);
    if (key == "quantize")
      v.quantize = val;
    else if (key == "kv")
      v.kv = val;
    else
      throw Error("--variant '" + spec + "': keys are quantize= and kv=");
  }
  weight_quant_from_name(v.quantize);  // validates
  return v;
}

const char* const kPrompts[] = {
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Explain why the sky is blue in one paragraph:",
};

}  // namespace

int run_accuracy(const AccuracyOptions& o) {
  std::vector<Variant> variants;
  for (const auto& s : o.variants) variants.push_back(parse_variant(s));
  auto be = make_session_backend(o.model);
  const DeviceKind device = be->device().kind;
  LoadOptions lo;
  lo.threads = std::max(1, o.model.threads);
  lo.dummy = load_format_is_dummy(o.model.load_format);
  const std::string path = resolve_model_path(o.model.model);
  auto load = [&](const std::string& quantize) {
    LoadOptions l = lo;
    l.quantize = weight_quant_from_name(quantize);
    return load_model(path, *be, l);
  };

  // The reference: greedy continuations, then its teacher-forced logits of each sequence.
  std::vector<std::vector<int32_t>> seqs;
  std::vector<std::vector<float>> ref_logits;
  nlohmann::json out;
  {
    LoadedModel ref = load(o.model.quantize);
    const ModelConfig& cfg = ref.config;
    const DType kv = kv_cache_dtype(o.kv_dtype, device, o.model.precision);
    std::vector<std::vector<int32_t>> prompts;
    if (ref.tokenizer) {
      std::vector<std::string> texts = o.prompts;
      if (texts.empty()) texts.assign(std::begin(kPrompts), std::end(kPrompts));
      for (const auto& t : texts) prompts.push_back(ref.tokenizer->encode(t, true, false));
    } else {  // token ids only: fixed pseudo-random ids below the vocabulary
      for (int p = 0; p < 4; ++p) {
        std::vector<int32_t> ids;
        for (int j = 0; j < 12; ++j)
          ids.push_back(int32_t((p * 7919 + j * 104729 + 13) % cfg.vocab));
        prompts.push_back(ids);
      }
    }
    for (const auto& p : prompts) {
      seqs.push_back(greedy_sequence(*ref.model, *be, cfg, p, o.gen_tokens, kv));
      ref_logits.push_back(prefill_logits(*ref.model, *be, cfg, seqs.back(), kv));
    }
    out["model"] = path;
    out["device"] = be->name();
    out["commit"] = build_commit();  // the tree the binary was built from
    out["reference"] = {{"quantize", o.model.quantize},
                        {"kv_cache_dtype", std::string(dtype_name(kv))},
                        {"weights", describe_weight_formats(*ref.model)}};
    out["prompts"] = prompts.size();
    out["gen_tokens"] = o.gen_tokens;
  }
  out["variants"] = nlohmann::json::array();
  for (const auto& v : variants) {
    LoadedModel var = load(v.quantize);
    const DType kv = kv_cache_dtype(v.kv.empty() ? o.kv_dtype : v.kv, device, o.model.precision);
    AccuracyStats s;
    for (size_t i = 0; i < seqs.size(); ++i)
      compare_logits(ref_logits[i], prefill_logits(*var.model, *be, var.config, seqs[i], kv),
                     var.config.vocab, s);
    out["variants"].push_back({{"variant", v.spec},
                               {"quantize", v.quantize},
                               {"kv_cache_dtype", std::string(dtype_name(kv))},
                               {"weights", describe_weight_formats(*var.model)},
                               {"positions", s.positions},
                               {"top1_agreement", s.top1()},
                               {"max_abs_logit_diff", s.max_abs_diff},
                               {"max_logit_diff_over_range", s.max_rel_diff}});
  }
  const std::string text = out.dump(2);
  std::printf("%s\n", text.c_str());
  if (!o.output.empty()) {
    std::ofstream f(o.output);
    if (!f) throw Error(o.output + ": cannot write");
    f << text << "\n";
  }
  return 0;
}

}  // namespace ds
