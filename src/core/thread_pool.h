// A fixed pool of worker threads for data-parallel kernels.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ds {

// run(fn) calls fn(ith, nth) once on each of nth threads (the caller is thread 0) and
// returns when all are done. Work is split by the callee from (ith, nth) alone, so the
// split, and therefore every reduction order, is the same on every call.
// Workers spin briefly between jobs (decode runs hundreds of short jobs per token),
// then sleep.
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return nth_; }
  void run(const std::function<void(int ith, int nth)>& fn);

  // Splits [0, n) into nth contiguous ranges; returns thread ith's [begin, end).
  static std::pair<int64_t, int64_t> split(int64_t n, int ith, int nth) {
    const int64_t per = n / nth, rem = n % nth;
    const int64_t begin = ith * per + std::min<int64_t>(ith, rem);
    return {begin, begin + per + (ith < rem ? 1 : 0)};
  }

 private:
  void worker(int ith);

  int nth_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

}  // namespace ds
