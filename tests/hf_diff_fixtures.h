// The differential Hugging Face fixtures (tests/fixtures/hf_diff, made by
// tools/make_hf_differential.py): many tiny random DeepSeek-V2 / Llama checkpoints, each with
// transformers' float32 logits at every prompt position of 5 token-id prompts, 32 greedy
// tokens and the top-2 margin (as a fraction of the logit range) of each greedy step. Shared
// by the CPU test (tests/unit/lib) and the GPU one (tests/gpu).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/safetensors.h"

namespace ds::test {

inline std::filesystem::path hf_diff_root() {
  return std::filesystem::path(DS_FIXTURES_DIR) / "hf_diff";
}

struct DiffPrompt {
  std::vector<int32_t> ids, generated;  // prompt; 32 greedy tokens
  std::vector<float> logits;            // [ids.size(), vocab]
  std::vector<float> margin_frac;       // [32] top-2 margin / logit range at each greedy step
  // [32] smallest router-logit gap (last chosen vs first rejected expert or group) in each
  // greedy step's forward, over every token so far; inf without routers.
  std::vector<float> route_gap;
};

struct DiffCase {
  std::string name, arch, layout, dtype;
  int vocab = 0;
  std::vector<DiffPrompt> prompts;
};

// The configurations index.json lists, in order (empty when the folder is absent); `root` is
// hf_diff or another folder in its schema (hf_fp8, tools/make_fp8_fixture.py).
inline std::vector<nlohmann::json> hf_diff_index(
    const std::filesystem::path& root = hf_diff_root()) {
  std::ifstream in(root / "index.json");
  if (!in) return {};
  const auto j = nlohmann::json::parse(in);
  return j.at("configs").get<std::vector<nlohmann::json>>();
}

template <typename T>
std::vector<T> tensor_values(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsTensor* t = f.find(name);
  if (!t) throw std::runtime_error(f.path() + ": no tensor " + name);
  std::vector<T> out(t->nbytes / sizeof(T));
  std::memcpy(out.data(), f.view(*t).data, t->nbytes);  // the file need not align data
  return out;
}

inline DiffCase read_diff_case(const nlohmann::json& entry,
                               const std::filesystem::path& root = hf_diff_root()) {
  DiffCase c;
  c.name = entry.at("name");
  c.arch = entry.at("arch");
  c.layout = entry.at("layout");
  c.dtype = entry.at("dtype");
  c.vocab = entry.at("vocab");
  const auto f = SafetensorsFile::open(root / c.name / "reference.safetensors");
  for (int i = 0; f.find("p" + std::to_string(i) + ".ids"); ++i) {
    const std::string p = "p" + std::to_string(i) + ".";
    DiffPrompt q;
    q.ids = tensor_values<int32_t>(f, p + "ids");
    q.logits = tensor_values<float>(f, p + "logits");
    q.generated = tensor_values<int32_t>(f, p + "generated");
    q.margin_frac = tensor_values<float>(f, p + "margin_frac");
    q.route_gap = tensor_values<float>(f, p + "route_gap");
    c.prompts.push_back(std::move(q));
  }
  return c;
}

// The largest |got - want| over each row of `vocab` logits as a fraction of that row's range
// in `want`, over all rows; NaN counts as infinitely far. `row` gets where it is.
inline double max_diff_over_range(const std::vector<float>& got, const std::vector<float>& want,
                                  int vocab, size_t* row = nullptr) {
  if (got.size() != want.size()) return INFINITY;
  double worst = 0;
  for (size_t r = 0; r * size_t(vocab) < want.size(); ++r) {
    const auto* w = want.data() + r * size_t(vocab);
    const auto* g = got.data() + r * size_t(vocab);
    const auto [lo, hi] = std::minmax_element(w, w + vocab);
    const double range = std::max(double(*hi) - double(*lo), 1e-30);
    for (int v = 0; v < vocab; ++v) {
      const double d = std::fabs(double(g[v]) - double(w[v])) / range;
      if (!(d <= worst)) {
        worst = std::isnan(d) ? INFINITY : d;
        if (row) *row = r;
      }
    }
  }
  return worst;
}

// max_diff_over_range of prompt i's logits `got`, failing the test (with the prompt's length and
// the worst position, also put in worst_row) above tol.
inline double expect_prompt_logits(const std::vector<float>& got, const DiffPrompt& p, int vocab,
                                   size_t i, double tol, size_t* worst_row = nullptr) {
  size_t row = 0;
  const double d = max_diff_over_range(got, p.logits, vocab, &row);
  EXPECT_LE(d, tol) << "prompt " << i << " (" << p.ids.size() << " tokens), position " << row;
  if (worst_row) *worst_row = row;
  return d;
}

struct GreedyCheck {
  int compared = 0;    // steps checked with the same history as the reference
  int first_bad = -1;  // a different token where the reference margin exceeds the threshold
};

// Walks a greedy continuation along the reference's. A different token fails where the
// reference's top-2 margin exceeds `min_frac` of the logit range and every routing so far
// had a router-logit gap of at least `min_route_gap`; otherwise it ends the comparison: past
// a near-tie (of tokens, or of experts, which moves logits far more than rounding) a correct
// engine may take the other branch.
inline GreedyCheck check_greedy(const std::vector<int32_t>& got, const DiffPrompt& p,
                                double min_frac, double min_route_gap) {
  GreedyCheck c;
  for (size_t i = 0; i < p.generated.size(); ++i) {
    if (i < got.size() && got[i] == p.generated[i]) {
      ++c.compared;
      continue;
    }
    if (p.margin_frac[i] > min_frac && p.route_gap[i] >= min_route_gap) c.first_bad = int(i);
    break;
  }
  return c;
}

// Checks the greedy continuations `got` (one per prompt of `c`) with check_greedy and prints
// the case's line; returns the number of tokens compared.
inline int expect_greedy_matches(const DiffCase& c, const std::vector<std::vector<int32_t>>& got,
                                 double min_frac, double min_route_gap, double logit_worst) {
  int compared = 0;
  for (size_t i = 0; i < c.prompts.size(); ++i) {
    const DiffPrompt& p = c.prompts[i];
    const GreedyCheck g = check_greedy(got[i], p, min_frac, min_route_gap);
    EXPECT_EQ(g.first_bad, -1) << "prompt " << i << ": greedy token " << g.first_bad
                               << " differs where the reference margin is "
                               << p.margin_frac[size_t(std::max(g.first_bad, 0))]
                               << " of the range (router gap "
                               << p.route_gap[size_t(std::max(g.first_bad, 0))] << ")";
    compared += g.compared;
  }
  std::printf("  %s %-11s %-13s %-8s max |diff|/range %.2e, %3d greedy tokens compared\n",
              c.name.c_str(), c.arch.c_str(), c.layout.c_str(), c.dtype.c_str(), logit_worst,
              compared);
  return compared;
}

}  // namespace ds::test
