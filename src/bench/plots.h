// PNG plots of a bench JSON, drawn by tools/plot_bench.py (matplotlib) in a Python found the
// way the default model is: the .venv next to the binary, then $VIRTUAL_ENV, then python3.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace ds {

struct PlotOptions {
  std::string json_path;
  std::string out_dir;
  std::string virtual_env;  // $VIRTUAL_ENV, "" when unset
};

// Candidate Python interpreters, most specific first.
std::vector<std::string> python_candidates(const std::string& virtual_env);
// tools/plot_bench.py of the source tree (or next to the binary); nullopt when not found.
std::optional<std::string> plot_script_path();

// Runs the script; throws ds::Error with what to install when matplotlib is missing.
// Returns the script's output (the files written).
std::string draw_plots(const PlotOptions& o);

}  // namespace ds
