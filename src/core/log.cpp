#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace ds {
namespace {
std::atomic<int> g_level{int(LogLevel::Warn)};
std::mutex g_mu;
}  // namespace

void set_log_level(LogLevel level) {
  g_level = int(level);
}
LogLevel log_level() {
  return LogLevel(g_level.load());
}

void log(LogLevel level, const std::string& msg) {
  if (int(level) < g_level.load()) return;
  static const char* names[] = {"debug", "info", "warning", "error"};
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "deepserve %s: %s\n", names[int(level)], msg.c_str());
}

}  // namespace ds
