#include "bench/plots.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/self_path.h"

namespace ds {
namespace fs = std::filesystem;
namespace {

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs a shell command; returns (exit status, stdout + stderr).
std::pair<int, std::string> run(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "cannot start: " + cmd};
  std::array<char, 4096> buf{};
  std::string out;
  while (fgets(buf.data(), int(buf.size()), p)) out += buf.data();
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

}  // namespace

std::vector<std::string> python_candidates(const std::string& virtual_env) {
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path exe = executable_dir();
  for (const fs::path& base : {exe, exe.parent_path(), fs::current_path()}) {
    const fs::path py = base / ".venv" / "bin" / "python";
    if (fs::exists(py, ec)) out.push_back(py.string());
  }
  if (!virtual_env.empty()) {
    const fs::path py = fs::path(virtual_env) / "bin" / "python";
    if (fs::exists(py, ec)) out.push_back(py.string());
  }
  out.emplace_back("python3");
  return out;
}

std::optional<std::string> plot_script_path() {
  std::vector<fs::path> tries;
#ifdef DEEPSERVE_SOURCE_DIR
  tries.push_back(fs::path(DEEPSERVE_SOURCE_DIR) / "tools" / "plot_bench.py");
#endif
  const fs::path exe = executable_dir();
  tries.push_back(exe / "tools" / "plot_bench.py");
  tries.push_back(exe.parent_path() / "tools" / "plot_bench.py");
  std::error_code ec;
  for (const auto& t : tries)
    if (fs::is_regular_file(t, ec)) return t.string();
  return std::nullopt;
}

std::string draw_plots(const PlotOptions& o) {
  const auto script = plot_script_path();
  if (!script) throw Error("--plots: tools/plot_bench.py was not found next to the binary");
  std::string tried;
  for (const std::string& py : python_candidates(o.virtual_env)) {
    // Exit status 3: the script ran but matplotlib is not importable in that Python.
    auto [rc, out] = run(quote(py) + " " + quote(*script) + " " + quote(o.json_path) + " --out " +
                         quote(o.out_dir));
    if (rc == 0) return out;
    tried += "\n  " + py + ": " + (rc == 3 ? "no matplotlib" : out);
    if (rc != 3 && rc != 127) throw Error("--plots: " + py + " " + *script + " failed:\n" + out);
  }
  throw Error("--plots needs matplotlib in one of these Pythons:" + tried +
              "\nInstall it with `.venv/bin/pip install matplotlib` (or `pip install matplotlib` "
              "in the active virtualenv).");
}

}  // namespace ds
