// Where the running executable lives (to find files installed or built beside it).
#pragma once

#include <filesystem>

namespace ds {

// The directory of /proc/self/exe; the current directory when that cannot be read.
std::filesystem::path executable_dir();

}  // namespace ds
