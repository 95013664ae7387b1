#include "bench/spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "core/error.h"

namespace ds {
namespace {

// Reads one YAML mapping, remembering which keys were used so unknown ones are errors.
class Reader {
 public:
  Reader(const YAML::Node& node, std::string source, std::string prefix)
      : node_(node), source_(std::move(source)), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(const YAML::Node& at, const std::string& msg) const {
    throw Error(source_ + ":" + std::to_string(at.Mark().line + 1) + ": " + msg);
  }
  std::string path(const std::string& key) const { return prefix_ + key; }

  // The value of `key` (or of its one alias present); nullopt when absent or null.
  std::optional<YAML::Node> get(std::initializer_list<const char*> names) {
    std::optional<YAML::Node> found;
    std::string found_name;
    for (const char* n : names) {
      known_.insert(n);
      const YAML::Node v = node_[n];  // const: a lookup never adds the key
      if (!v.IsDefined() || v.IsNull()) continue;
      if (found)
        fail(v, "'" + path(n) + "' and '" + path(found_name) + "' are the same setting: give one");
      found = v;
      found_name = n;
    }
    return found;
  }

  std::string scalar(const YAML::Node& v, const std::string& key, const char* what) const {
    if (!v.IsScalar()) fail(v, "'" + path(key) + "' must be " + what);
    return v.Scalar();
  }

  std::optional<int64_t> integer(std::initializer_list<const char*> names, int64_t lo, int64_t hi) {
    const auto v = get(names);
    if (!v) return std::nullopt;
    return to_int(*v, *names.begin(), lo, hi);
  }

  int64_t to_int(const YAML::Node& v, const std::string& key, int64_t lo, int64_t hi) const {
    const std::string what =
        "an integer between " + std::to_string(lo) + " and " + std::to_string(hi);
    const std::string s = scalar(v, key, what.c_str());
    int64_t x = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    if (ec != std::errc() || end != s.data() + s.size() || x < lo || x > hi)
      fail(v, "'" + path(key) + "' must be " + what + ", got '" + s + "'");
    return x;
  }

  std::optional<double> number(std::initializer_list<const char*> names, double lo, double hi) {
    const auto v = get(names);
    if (!v) return std::nullopt;
    return to_number(*v, *names.begin(), lo, hi);
  }

  double to_number(const YAML::Node& v, const std::string& key, double lo, double hi) const {
    std::ostringstream what;
    what << "a number between " << lo << " and " << hi;
    const std::string s = scalar(v, key, what.str().c_str());
    double x = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    if (ec != std::errc() || end != s.data() + s.size() || !std::isfinite(x) || x < lo || x > hi)
      fail(v, "'" + path(key) + "' must be " + what.str() + ", got '" + s + "'");
    return x;
  }

  std::optional<bool> boolean(std::initializer_list<const char*> names) {
    const auto v = get(names);
    if (!v) return std::nullopt;
    const std::string s = scalar(*v, *names.begin(), "true or false");
    if (s == "true" || s == "True" || s == "yes" || s == "on") return true;
    if (s == "false" || s == "False" || s == "no" || s == "off") return false;
    fail(*v, "'" + path(*names.begin()) + "' must be true or false, got '" + s + "'");
  }

  std::optional<std::string> string(std::initializer_list<const char*> names) {
    const auto v = get(names);
    if (!v) return std::nullopt;
    return scalar(*v, *names.begin(), "a string");
  }

  std::optional<std::string> choice(std::initializer_list<const char*> names,
                                    std::initializer_list<const char*> allowed) {
    const auto v = get(names);
    if (!v) return std::nullopt;
    std::string list;
    for (const char* a : allowed) list += std::string(list.empty() ? "" : ", ") + a;
    const std::string s = scalar(*v, *names.begin(), ("one of " + list).c_str());
    for (const char* a : allowed)
      if (s == a) return s;
    fail(*v, "'" + path(*names.begin()) + "' must be one of " + list + ", got '" + s + "'");
  }

  // An integer or a list of integers, each in [lo, hi].
  std::optional<std::vector<int>> int_list(std::initializer_list<const char*> names, int lo,
                                           int hi) {
    const auto v = get(names);
    if (!v) return std::nullopt;
    const std::string key = *names.begin();
    std::vector<int> out;
    if (v->IsSequence()) {
      if (v->size() == 0) fail(*v, "'" + path(key) + "' must not be an empty list");
      for (const auto& x : *v) out.push_back(int(to_int(x, key, lo, hi)));
    } else {
      out.push_back(int(to_int(*v, key, lo, hi)));
    }
    return out;
  }

  std::optional<YAML::Node> map(std::initializer_list<const char*> names) {
    const auto v = get(names);
    if (v && !v->IsMap()) fail(*v, "'" + path(*names.begin()) + "' must be a mapping");
    return v;
  }

  // Every key the caller did not ask for is an error.
  void check_unknown() const {
    for (const auto& kv : node_) {
      const std::string key = kv.first.Scalar();
      if (known_.count(key)) continue;
      std::string list;
      for (const auto& k : known_) list += std::string(list.empty() ? "" : ", ") + k;
      fail(kv.first, "unknown key '" + path(key) + "' (known: " + list + ")");
    }
  }

 private:
  const YAML::Node node_;
  std::string source_;
  std::string prefix_;
  std::set<std::string> known_;
};

// ${NAME} -> the variable's value; an unset one is an error naming the key it was in.
std::string expand_env(const std::string& s, const EnvLookup& env, const std::string& where) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t open = s.find("${", i);
    if (open == std::string::npos) break;
    const size_t close = s.find('}', open);
    if (close == std::string::npos) throw Error(where + ": unterminated '${' in '" + s + "'");
    out += s.substr(i, open - i);
    const std::string name = s.substr(open + 2, close - open - 2);
    const auto value = env ? env(name) : std::nullopt;
    if (!value || value->empty())
      throw Error(where + ": '" + s + "' needs the environment variable " + name +
                  ", which is not set (export it, or edit the value in the YAML)");
    out += *value;
    i = close + 1;
  }
  return out + s.substr(i);
}

std::string number_text(double x) {
  std::ostringstream o;
  o << x;
  return o.str();
}

// The `classes:` list of a mixed scenario.
std::vector<BenchClass> parse_classes(const YAML::Node& list, const std::string& source) {
  if (!list.IsSequence() || list.size() == 0)
    throw Error(source + ":" + std::to_string(list.Mark().line + 1) +
                ": 'classes' must be a non-empty list of request classes");
  std::vector<BenchClass> out;
  bool foreground = false;
  for (size_t i = 0; i < list.size(); ++i) {
    const YAML::Node& node = list[i];
    const std::string at = "classes[" + std::to_string(i) + "].";
    if (!node.IsMap())
      throw Error(source + ":" + std::to_string(node.Mark().line + 1) + ": '" +
                  at.substr(0, at.size() - 1) + "' must be a mapping");
    Reader r(node, source, at);
    BenchClass c;
    c.name = r.string({"name"}).value_or("class" + std::to_string(i));
    if (auto v = r.choice({"priority"}, {"latency-critical", "standard", "batch"})) c.priority = *v;
    const auto in = r.integer({"input_len"}, 1, 1 << 24);
    const auto outl = r.integer({"output_len"}, 1, 1 << 24);
    if (!in || !outl) r.fail(node, "'" + at + "input_len' and '" + at + "output_len' are required");
    c.input_len = int(*in);
    c.output_len = int(*outl);
    c.concurrency = int(r.integer({"concurrency"}, 1, 1 << 16).value_or(1));
    c.num_prompts = int(r.integer({"num_prompts"}, 1, 1 << 24).value_or(c.concurrency));
    c.rate = r.number({"rate"}, 1e-6, 1e9);
    c.start_s = r.number({"start_s"}, 0, 1e6).value_or(0);
    c.background = r.boolean({"background"}).value_or(false);
    foreground = foreground || !c.background;
    for (const auto& other : out)
      if (other.name == c.name) r.fail(node, "two classes are named '" + c.name + "'");
    r.check_unknown();
    out.push_back(c);
  }
  if (!foreground)
    throw Error(source +
                ": 'classes' needs one class that is not 'background' (it ends the scenario)");
  return out;
}

}  // namespace

std::vector<BenchScenario> BenchSpec::scenarios() const {
  std::vector<BenchScenario> out;
  if (!classes.empty()) {
    BenchScenario s;
    s.name = name;
    s.concurrency = s.num_prompts = 0;
    for (const auto& c : classes) {
      s.concurrency += c.concurrency;
      if (!c.background) s.num_prompts += c.num_prompts;
    }
    s.classes = classes;
    s.mixed = true;
    out.push_back(s);
    return out;
  }
  for (int in : input_len)
    for (int outl : output_len)
      for (int c : concurrency) {
        BenchScenario s;
        s.concurrency = c;
        s.input_len = in;
        s.output_len = outl;
        s.num_prompts = num_prompts.value_or(c);
        s.name =
            "c" + std::to_string(c) + "_in" + std::to_string(in) + "_out" + std::to_string(outl);
        if (rate) s.name += "_r" + number_text(*rate);
        s.classes.push_back({.priority = priority,
                             .input_len = in,
                             .output_len = outl,
                             .concurrency = c,
                             .num_prompts = s.num_prompts,
                             .rate = rate});
        out.push_back(s);
      }
  return out;
}

BenchSpec parse_bench_spec(const std::string& yaml, const std::string& source,
                           const EnvLookup& env) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::ParserException& e) {
    throw Error(source + ":" + std::to_string(e.mark.line + 1) + ": YAML syntax: " + e.msg);
  }
  if (!root.IsMap()) throw Error(source + ": a bench config must be a YAML mapping of settings");
  Reader r(root, source, "");
  BenchSpec s;
  s.name = std::filesystem::path(source).stem().string();
  if (auto v = r.string({"name"})) s.name = *v;
  if (auto v = r.string({"description"})) s.description = *v;
  if (auto v = r.string({"model"})) {
    s.model = expand_env(*v, env, source + ": model");
    if (s.model == "default") s.model.clear();
  }

  if (auto v = r.choice({"load_format"}, {"auto", "dummy"})) s.load_format = *v;
  if (auto v = r.choice({"quantize"}, {"none", "bf16", "w4a16", "fp8"})) s.quantize = *v;
  if (auto v = r.choice({"device"}, {"auto", "cpu", "cuda"})) s.device = *v;
  if (auto v = r.number({"gpu_memory_utilization"}, 1e-3, 1)) s.gpu_memory_utilization = *v;
  if (auto v = r.integer({"threads"}, 0, 4096)) s.threads = int(*v);
  if (auto v = r.integer({"tensor_parallel_size"}, 1, 64)) s.tensor_parallel_size = int(*v);
  if (auto v = r.boolean({"enable_expert_parallel"})) s.expert_parallel = *v;
  if (auto v = r.choice({"precision"}, {"f32", "q8"})) s.precision = *v;
  if (auto v = r.choice({"isa"}, {"auto", "scalar", "avx2", "avx512-vnni"})) s.isa = *v;

  if (const auto e = r.map({"engine"})) {
    Reader er(*e, source, "engine.");
    auto& en = s.engine;
    if (auto v = er.integer({"kv_cache_tokens", "ctx_size"}, 1, int64_t(1) << 40))
      en.kv_cache_tokens = *v;
    if (auto v = er.integer({"block_size"}, 1, 4096)) en.block_size = int(*v);
    if (auto v = er.choice({"kv_mode"}, {"dynamic", "static"})) en.kv_mode = *v;
    if (auto v = er.boolean({"prefix_cache"})) en.prefix_cache = *v;
    if (auto v = er.integer({"max_num_seqs", "max_batch_size"}, 1, 1 << 20))
      en.max_num_seqs = int(*v);
    if (auto v = er.integer({"max_num_batched_tokens"}, 1, 1 << 24))
      en.max_num_batched_tokens = int(*v);
    if (auto v = er.integer({"lower_class_prefill_tokens"}, -1, 1 << 24))
      en.lower_class_prefill_tokens = int(*v);
    if (auto v = er.integer({"warmup_tokens"}, -1, 1 << 24)) en.warmup_tokens = *v;
    if (auto v = er.integer({"batch_prefill_tokens"}, -1, 1 << 24))
      en.batch_prefill_tokens = int(*v);
    if (auto v = er.integer({"prefill_first_steps"}, 0, 1 << 20)) en.prefill_first_steps = int(*v);
    if (auto v = er.integer({"defer_wakeups"}, -1, 1)) en.defer_wakeups = int(*v);
    er.check_unknown();
  }

  if (auto v = r.int_list({"concurrency", "batch_sizes", "batch_size"}, 1, 1 << 16))
    s.concurrency = *v;
  if (auto v = r.int_list({"input_len", "seq_lengths"}, 1, 1 << 24)) s.input_len = *v;
  if (auto v = r.int_list({"output_len"}, 1, 1 << 24)) s.output_len = *v;
  if (auto v = r.integer({"num_prompts"}, 1, 1 << 24)) s.num_prompts = int(*v);
  if (const auto v = r.get({"rate"})) {
    const std::string t = r.scalar(*v, "rate", "'burst' or requests per second");
    if (t != "burst" && t != "inf") s.rate = r.to_number(*v, "rate", 1e-6, 1e9);
  }
  if (auto v = r.choice({"priority"}, {"latency-critical", "standard", "batch"})) s.priority = *v;
  if (auto v = r.boolean({"ignore_eos"})) s.ignore_eos = *v;
  if (const auto v = r.get({"classes"})) s.classes = parse_classes(*v, source);
  if (!s.classes.empty()) {
    for (const char* k : {"input_len", "seq_lengths", "output_len", "concurrency", "batch_sizes",
                          "batch_size", "num_prompts", "rate", "priority"})
      if (const YAML::Node v = std::as_const(root)[k]; v.IsDefined())
        throw Error(source + ":" + std::to_string(v.Mark().line + 1) + ": '" + k +
                    "' is set per class when 'classes' is given");
  } else {
    if (s.input_len.empty()) throw Error(source + ": 'input_len' (or 'seq_lengths') is required");
    if (s.output_len.empty()) throw Error(source + ": 'output_len' is required");
  }
  if (auto v = r.number({"temperature"}, 0, 2)) s.temperature = *v;
  if (auto v = r.integer({"warmup"}, 0, 1 << 20)) s.warmup = int(*v);
  if (auto v = r.choice({"prompt"}, {"random", "text"})) s.prompt = *v;
  if (auto v = r.integer({"seed"}, 0, INT64_MAX)) s.seed = uint64_t(*v);

  if (auto v = r.number({"bandwidth_gbps"}, 1e-3, 1e7)) s.bandwidth_gbps = *v;
  if (auto v = r.choice({"kv_dtype", "kv_cache_dtype"}, {"f32", "f16", "bf16", "fp8"}))
    s.kv_dtype = *v;
  if (auto v = r.number({"gpu_hour_price"}, 0, 1e6)) s.gpu_hour_price = *v;

  if (auto v = r.string({"url"})) s.url = expand_env(*v, env, source + ": url");
  if (auto v = r.string({"served_model_name"})) s.served_model_name = *v;
  if (auto v = r.string({"api_key"})) s.api_key = expand_env(*v, env, source + ": api_key");
  if (auto v = r.choice({"count_tokens"}, {"chunks", "logprobs"})) s.count_tokens = *v;
  if (auto v = r.number({"request_timeout_s"}, 1e-3, 1e6)) s.request_timeout_s = *v;
  if (auto v = r.integer({"vocab_size"}, 1, 1 << 30)) s.vocab_size = int(*v);
  r.check_unknown();
  return s;
}

BenchSpec load_bench_spec(const std::string& path, const EnvLookup& env) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open the bench config");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_bench_spec(ss.str(), path, env);
}

}  // namespace ds
