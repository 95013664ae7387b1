#include "backend/cuda/device_log.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace ds::cuda {

void DeviceLog::start() {
  const char* path = std::getenv(var_);
  if (path == nullptr || *path == '\0') return;
  const std::string name(var_);
  const char* max = std::getenv((name + "_MAX").c_str());
  const char* skip = std::getenv((name + "_SKIP").c_str());
  const long long cap = max ? std::atoll(max) : default_cap_;
  DS_CHECK(cap > 0 && cap < (1ll << 31), name + "_MAX must be a positive count");
  open(cap, skip ? std::max(0ll, std::atoll(skip)) : 0, path);
}

void DeviceLog::open(long long cap, long long skip, const std::string& path) {
  DS_CHECK(cap > 0 && cap < (1ll << 31), std::string(var_) + ": a positive record count");
  std::lock_guard<std::mutex> lock(mu_);
  if (buf_.load(std::memory_order_relaxed) != nullptr) return;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  const size_t bytes = size_t(cap + 1) * size_t(words_) * sizeof(unsigned long long);
  unsigned long long* buf = nullptr;
  check_cuda(cudaMalloc(&buf, bytes), var_);
  check_cuda(cudaMemset(buf, 0, bytes), var_);
  cap_ = int(cap);
  skip_ = skip;
  device_ = dev;
  path_ = path;
  buf_.store(buf, std::memory_order_release);
}

DeviceLogView DeviceLog::view() const {
  if (buf_.load(std::memory_order_acquire) == nullptr) return {};
  std::lock_guard<std::mutex> lock(mu_);
  unsigned long long* const buf = buf_.load(std::memory_order_relaxed);
  if (buf == nullptr) return {};
  int dev = -1;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev != device_) return {};
  return {buf, cap_, skip_};
}

void DeviceLog::synced(const std::function<void(unsigned long long*)>& fn) {
  int prev = 0;
  check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
  check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  check_cuda(cudaDeviceSynchronize(), var_);
  fn(buf_.load(std::memory_order_relaxed));
  check_cuda(cudaSetDevice(prev), "cudaSetDevice");
}

std::vector<unsigned long long> DeviceLog::records() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<unsigned long long> rec;
  if (buf_.load(std::memory_order_relaxed) == nullptr) return rec;
  synced([&](unsigned long long* buf) {
    unsigned long long count = 0;
    check_cuda(cudaMemcpy(&count, buf, sizeof(count), cudaMemcpyDeviceToHost), var_);
    const auto skip = static_cast<unsigned long long>(skip_);
    const size_t n = size_t(std::min<unsigned long long>(count > skip ? count - skip : 0, cap_));
    rec.resize(n * size_t(words_));
    if (n > 0)
      check_cuda(
          cudaMemcpy(rec.data(), buf + words_, rec.size() * sizeof(rec[0]), cudaMemcpyDeviceToHost),
          var_);
  });
  return rec;
}

void DeviceLog::write(const std::string& header,
                      const std::function<bool(std::ostream&, const unsigned long long*)>& row) {
  std::string path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    path = path_;
  }
  if (path.empty()) return;
  const std::vector<unsigned long long> rec = records();
  std::ofstream f(path);
  DS_CHECK(f.good(), std::string(var_) + ": cannot write " + path);
  f << header << "\n";
  for (size_t r = 0; r + size_t(words_) <= rec.size(); r += size_t(words_))
    if (row(f, rec.data() + r)) f << '\n';
  DS_CHECK(f.good(), std::string(var_) + ": cannot write " + path);
}

void DeviceLog::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (buf_.load(std::memory_order_relaxed) == nullptr) return;
  synced([&](unsigned long long* buf) { check_cuda(cudaFree(buf), var_); });
  buf_.store(nullptr, std::memory_order_release);
  path_.clear();
}

}  // namespace ds::cuda
