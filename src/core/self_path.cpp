#include "core/self_path.h"

#include <unistd.h>

#include <array>
#include <string>

namespace ds {

std::filesystem::path executable_dir() {
  std::array<char, 4096> buf{};
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return std::filesystem::current_path();
  return std::filesystem::path(std::string(buf.data(), size_t(n))).parent_path();
}

}  // namespace ds
