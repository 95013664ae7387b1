// Metric bookkeeping and rendering of the HTTP server: histograms, counters, the scheduler's
// gauges, MoE expert load; the Prometheus text is checked by a strict parser written here.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include "server/metrics.h"

namespace ds {
namespace {

using Json = nlohmann::json;
using Labels = std::map<std::string, std::string>;

// The text exposition format (version 0.0.4), parsed strictly: every line is HELP, TYPE or a
// sample; each sample belongs to the family declared last, with the suffixes its type allows.
struct Exposition {
  std::map<std::string, std::string> types;                  // family -> type
  std::map<std::pair<std::string, Labels>, double> samples;  // (name, labels) -> value
  double at(const std::string& name, const Labels& labels) const {
    auto it = samples.find({name, labels});
    if (it == samples.end()) {
      ADD_FAILURE() << "no sample " << name;
      return NAN;
    }
    return it->second;
  }
  bool has_prefix(const std::string& prefix) const {
    for (const auto& [name, type] : types)
      if (name.rfind(prefix, 0) == 0) return true;
    return false;
  }
};

double parse_value(const std::string& s) {
  if (s == "+Inf") return INFINITY;
  if (s == "-Inf") return -INFINITY;
  if (s == "NaN") return NAN;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  EXPECT_TRUE(!s.empty() && *end == '\0') << "bad value '" << s << "'";
  return v;
}

Exposition parse_exposition(const std::string& text) {
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) \S.*)");
  static const std::regex type(
      R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped))");
  static const std::regex sample(R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+))");
  static const std::regex label(R"(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)\"(,|$))");
  Exposition ex;
  std::string family, family_type;
  EXPECT_TRUE(text.empty() || text.back() == '\n');
  std::istringstream in(text);
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_match(line, m, help)) continue;
    if (std::regex_match(line, m, type)) {
      family = m[1];
      family_type = m[2];
      EXPECT_TRUE(ex.types.emplace(family, family_type).second) << "declared twice: " << family;
      continue;
    }
    if (!std::regex_match(line, m, sample)) {
      ADD_FAILURE() << "not a sample line: '" << line << "'";
      continue;
    }
    const std::string name = m[1], value = m[3];
    std::string rest = m[2];
    Labels labels;
    while (!rest.empty()) {
      std::smatch lm;
      if (!std::regex_search(rest, lm, label, std::regex_constants::match_continuous)) {
        ADD_FAILURE() << "bad labels in '" << line << "'";
        break;
      }
      EXPECT_TRUE(labels.emplace(lm[1], lm[2]).second) << "label twice in '" << line << "'";
      rest = lm.suffix();
    }
    std::set<std::string> allowed = {family};
    if (family_type == "counter") allowed = {family + "_total"};
    if (family_type == "histogram") {
      allowed = {family + "_bucket", family + "_sum", family + "_count"};
      if (name == family + "_bucket") {
        EXPECT_TRUE(labels.count("le")) << line;
      }
    }
    EXPECT_TRUE(!family.empty() && allowed.count(name))
        << "'" << name << "' outside its family (" << family << ")";
    EXPECT_TRUE(ex.samples.emplace(std::pair{name, labels}, parse_value(value)).second)
        << "duplicate sample: " << line;
  }
  return ex;
}

// Population variance of the shares, as E[x^2] - E[x]^2 in long double.
double reference_variance(const std::vector<int64_t>& tokens) {
  long double total = 0;
  for (int64_t t : tokens) total += t;
  if (tokens.empty() || total == 0) return 0;
  long double sum = 0, sum_sq = 0;
  for (int64_t t : tokens) {
    const long double x = t / total;
    sum += x;
    sum_sq += x * x;
  }
  const long double n = tokens.size();
  return double(sum_sq / n - (sum / n) * (sum / n));
}

TEST(ServerMetrics, CountsAndRenders) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.1);
  h.observe(5);
  EXPECT_EQ(h.counts(), (std::vector<uint64_t>{2, 0, 1}));
  EXPECT_DOUBLE_EQ(h.sum(), 5.15);

  ServerMetrics m("m");
  m.token(Priority::LatencyCritical, -1.0);
  m.token(Priority::LatencyCritical, 0.2);
  RequestRecord r;
  r.priority = Priority::LatencyCritical;
  r.finish_reason = "length";
  r.prompt_tokens = 3;
  r.completion_tokens = 2;
  r.timings.total_s = 0.5;
  r.timings.decode_s = 0.2;
  m.request_finished(r);
  EngineStats st;  // the running / waiting gauges are the scheduler's
  st.running = 3;
  st.waiting = 2;
  const Json j = m.json(st);
  EXPECT_EQ(j["prompt_tokens_total"], 3);
  EXPECT_EQ(j["generation_tokens_total"], 2);
  EXPECT_EQ(j["requests_total"]["length"], 1);
  EXPECT_EQ(j["num_requests_running"], 3);
  EXPECT_EQ(j["num_requests_waiting"], 2);
  EXPECT_GT(j["tokens_per_second_1m_avg"].get<double>(), 0);
  EXPECT_EQ(j["latency"]["latency-critical"]["inter_token_latency_seconds"]["count"], 1);
  EXPECT_DOUBLE_EQ(j["latency"]["latency-critical"]["inter_token_latency_seconds"]["sum"], 0.2);

  const Exposition ex = parse_exposition(m.prometheus(st));
  const Labels model = {{"model_name", "m"}};
  EXPECT_EQ(ex.types.at("deepserve:requests"), "counter");
  EXPECT_EQ(ex.at("deepserve:requests_total", {{"model_name", "m"}, {"finish_reason", "length"}}),
            1);
  EXPECT_EQ(ex.at("deepserve:e2e_request_latency_seconds_count",
                  {{"model_name", "m"}, {"priority", "latency-critical"}}),
            1);
  EXPECT_EQ(ex.at("deepserve:e2e_request_latency_seconds_bucket",
                  {{"model_name", "m"}, {"priority", "latency-critical"}, {"le", "+Inf"}}),
            1);
  EXPECT_EQ(ex.types.at("deepserve:num_requests_running"), "gauge");
  EXPECT_EQ(ex.at("deepserve:num_requests_running", model), 3);
  EXPECT_EQ(ex.at("deepserve:num_requests_waiting", model), 2);
  EXPECT_EQ(ex.at("deepserve:http_connections_open", model), 0);
  EXPECT_EQ(ex.at("deepserve:requests_total", {{"model_name", "m"}, {"finish_reason", "error"}}),
            0);

  m.set_open_connections(7);
  EXPECT_EQ(parse_exposition(m.prometheus(st)).at("deepserve:http_connections_open", model), 7);
  EXPECT_EQ(m.json(st)["http_connections_open"], 7);
}

TEST(ServerMetrics, ExpertUtilizationVariance) {
  EXPECT_EQ(expert_utilization_variance({}), 0);
  EXPECT_EQ(expert_utilization_variance({0, 0, 0}), 0);  // nothing routed yet
  EXPECT_EQ(expert_utilization_variance({5, 5, 5, 5}), 0);
  EXPECT_DOUBLE_EQ(expert_utilization_variance({10, 0}), 0.25);  // shares 1, 0 around 0.5
  EXPECT_DOUBLE_EQ(expert_utilization_variance({1, 0, 0, 0}), 0.1875);
  EXPECT_DOUBLE_EQ(expert_utilization_variance({7}), 0);
  // Only the shares matter, not the scale.
  EXPECT_NEAR(expert_utilization_variance({3, 1, 4, 1}),
              expert_utilization_variance({300, 100, 400, 100}), 1e-15);

  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> tokens(1 + rng() % 160);
    for (auto& t : tokens) t = int64_t(rng() % 100000);
    EXPECT_NEAR(expert_utilization_variance(tokens), reference_variance(tokens), 1e-12);
  }
}

TEST(ServerMetrics, MoeExpertLoadExported) {
  ServerMetrics m("m");
  EngineStats st;
  st.expert_load = {{1, {3, 1, 0, 0}}, {2, {2, 2, 2, 2}}, {5, {0, 0, 0, 0}}};
  const Exposition ex = parse_exposition(m.prometheus(st));
  EXPECT_EQ(ex.types.at("deepserve:moe_expert_tokens"), "counter");
  EXPECT_EQ(ex.types.at("deepserve:moe_expert_utilization_variance"), "gauge");
  for (const auto& l : st.expert_load) {
    const std::string layer = std::to_string(l.layer);
    for (size_t e = 0; e < l.tokens.size(); ++e)
      EXPECT_EQ(ex.at("deepserve:moe_expert_tokens_total",
                      {{"model_name", "m"}, {"layer", layer}, {"expert", std::to_string(e)}}),
                double(l.tokens[e]));
    EXPECT_NEAR(
        ex.at("deepserve:moe_expert_utilization_variance", {{"model_name", "m"}, {"layer", layer}}),
        reference_variance(l.tokens), 1e-12);
  }
  size_t moe_samples = 0;
  for (const auto& [key, v] : ex.samples) moe_samples += key.first.rfind("deepserve:moe_", 0) == 0;
  EXPECT_EQ(moe_samples, 4u + 4u + 4u + 3u);

  const Json j = m.json(st);
  ASSERT_TRUE(j.contains("moe"));
  ASSERT_EQ(j["moe"]["layers"].size(), 3u);
  EXPECT_EQ(j["moe"]["layers"][0]["layer"], 1);
  EXPECT_EQ(j["moe"]["layers"][0]["tokens"], Json({3, 1, 0, 0}));
  double sum = 0;
  for (size_t i = 0; i < st.expert_load.size(); ++i) {
    const double ref = reference_variance(st.expert_load[i].tokens);
    EXPECT_NEAR(j["moe"]["layers"][i]["utilization_variance"].get<double>(), ref, 1e-12);
    sum += ref;
  }
  EXPECT_NEAR(j["moe"]["mean_utilization_variance"].get<double>(), sum / 3, 1e-12);
}

TEST(ServerMetrics, DenseModelsExportNoMoe) {
  ServerMetrics m("m");
  const EngineStats st;  // empty expert_load
  const std::string text = m.prometheus(st);
  const Exposition ex = parse_exposition(text);
  EXPECT_FALSE(ex.has_prefix("deepserve:moe"));
  EXPECT_EQ(text.find("moe"), std::string::npos);
  EXPECT_FALSE(m.json(st).contains("moe"));
}

TEST(ServerMetrics, ParserRejectsMalformedText) {
  // The parser above must be able to fail, or the tests using it prove nothing.
  auto failures = [](const std::string& text) {
    ::testing::TestPartResultArray results;
    {
      ::testing::ScopedFakeTestPartResultReporter reporter(
          ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
      parse_exposition(text);
    }
    return results.size();
  };
  EXPECT_EQ(failures("# TYPE a counter\na_total{x=\"1\"} 2\n"), 0);
  EXPECT_GT(failures("# TYPE a counter\na_total{x=1} 2\n"), 0);      // unquoted label
  EXPECT_GT(failures("# TYPE a gauge\nb 2\n"), 0);                   // outside its family
  EXPECT_GT(failures("# TYPE a gauge\na two\n"), 0);                 // not a number
  EXPECT_GT(failures("# TYPE a gauge\n# TYPE a gauge\na 1\n"), 0);   // declared twice
  EXPECT_GT(failures("# TYPE a histogram\na_bucket 1\n"), 0);        // bucket without le
  EXPECT_GT(failures("# TYPE a gauge\na{x=\"1\",x=\"2\"} 1\n"), 0);  // repeated label
}

}  // namespace
}  // namespace ds
