// Where the Hugging Face golden fixtures live (tests/fixtures/hf, made by
// tools/make_hf_fixtures.py), shared by the CPU golden tests and the GPU model tests.
#pragma once

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

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

}  // namespace ds::test
