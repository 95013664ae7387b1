// Records that kernels append to device memory for off-line study (DEEPSERVE_MLA_PHASES: the
// MLA decode's phases; DEEPSERVE_MOE_ITEMS: the one-launch MoE's items), switched on by an
// environment variable that names the table to write. Host side; the kernels' side is
// device_log.cuh.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

namespace ds::cuda {

// What a kernel needs of a log: word 0 counts the records claimed; record r (counted from 0,
// after `skip` unlogged ones) is `words` words from word (r + 1) x words; at most `cap` records.
// buf is null where the log is off (or on another device).
struct DeviceLogView {
  unsigned long long* buf = nullptr;
  int cap = 0;
  long long skip = 0;
};

class DeviceLog {
 public:
  // var=path turns the log on (var_MAX records, default default_cap, after var_SKIP).
  DeviceLog(const char* var, int words, long long default_cap)
      : var_(var), words_(words), default_cap_(default_cap) {}
  // From the environment, on the current device; a no-op without var or when already open.
  void start();
  // As start() with these values (tests): a log of `cap` records after `skip`, written nowhere.
  void open(long long cap, long long skip, const std::string& path = "");
  // The records logged so far (after a device sync), `words` words each; none when off.
  std::vector<unsigned long long> records();
  // Writes `header` and a line per record to the path (row(out, record) writes the record's
  // fields, or nothing and returns false to skip it); a no-op when off or opened without a path.
  void write(const std::string& header,
             const std::function<bool(std::ostream&, const unsigned long long*)>& row);
  // Frees the buffer: the log is off again.
  void close();
  // For a launch on the current device (off: one atomic load, no lock).
  DeviceLogView view() const;

 private:
  // fn(buffer) on the log's device after its work so far, the caller's device restored (mu_ held).
  void synced(const std::function<void(unsigned long long*)>& fn);

  const char* var_;
  int words_;
  long long default_cap_;
  mutable std::mutex mu_;
  std::atomic<unsigned long long*> buf_{nullptr};  // set last when opened, cleared first on close
  int cap_ = 0;
  long long skip_ = 0;
  int device_ = -1;
  std::string path_;
};

}  // namespace ds::cuda
