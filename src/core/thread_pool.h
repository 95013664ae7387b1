// A fixed pool of worker threads for data-parallel kernels.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ds {

// run(fn, tasks) calls fn(task, tasks) once for every task in [0, tasks) and returns when all
// are done. Tasks are claimed one at a time by whichever thread is free, the caller included:
// a worker that the OS has descheduled (a machine with more runnable threads than cores)
// delays only a task it has already claimed, never the whole call. Work is split by the
// callee from (task, tasks) alone, so the split, and therefore every reduction order, is the
// same on every call whichever thread runs a task. A task runs entirely on one thread.
// Workers spin briefly between jobs (decode runs hundreds of short jobs per token), then
// sleep.
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return nth_; }
  // One task per thread: fn(ith, size()).
  void run(const std::function<void(int ith, int nth)>& fn) { run(fn, nth_); }
  void run(const std::function<void(int task, int tasks)>& fn, int tasks);

  // Splits [0, n) into nth contiguous ranges; returns thread ith's [begin, end).
  static std::pair<int64_t, int64_t> split(int64_t n, int ith, int nth) {
    const int64_t per = n / nth, rem = n % nth;
    const int64_t begin = ith * per + std::min<int64_t>(ith, rem);
    return {begin, begin + per + (ith < rem ? 1 : 0)};
  }

 private:
  void worker();
  // Claims and runs tasks of job `gen` until none is left.
  void work(uint32_t gen);

  int nth_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  uint32_t last_gen_ = 0;  // the caller's job counter
  // (job generation << 32) | (task count << 16) | next unclaimed task: one word, so a late
  // worker's claim fails once the job it saw is over.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};  // tasks of the current job finished
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

}  // namespace ds
