// Where the Hugging Face golden fixtures live (tests/fixtures/hf, made by
// tools/make_hf_fixtures.py), shared by the CPU golden tests and the GPU model tests.
#pragma once

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "request_tokens.h"

namespace ds::test {

inline std::filesystem::path hf_root() {
  return std::filesystem::path(DS_FIXTURES_DIR) / "hf";
}

// Folder names of the fixtures that have a reference.json, sorted.
inline std::vector<std::string> hf_fixture_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(hf_root(), ec))
    if (std::filesystem::exists(e.path() / "reference.json"))
      names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Greedy continuations (EOS ignored) of `prompts` on `engine`: submitted all at once
// (concurrent) or one after another.
inline std::vector<std::vector<int32_t>> greedy_generate(
    Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
    bool concurrent) {
  auto request = [&](const std::vector<int32_t>& p) {
    EngineRequest r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    return r;
  };
  const auto collect = [](RequestHandle& h) { return test::collect_tokens(h); };
  std::vector<std::vector<int32_t>> out(prompts.size());
  if (concurrent) {
    std::vector<std::shared_ptr<RequestHandle>> hs;
    for (const auto& p : prompts) hs.push_back(engine.submit(request(p)));
    for (size_t i = 0; i < hs.size(); ++i) out[i] = collect(*hs[i]);
  } else {
    for (size_t i = 0; i < prompts.size(); ++i)
      out[i] = collect(*engine.submit(request(prompts[i])));
  }
  return out;
}

}  // namespace ds::test
