#include "core/thread_pool.h"

#include <chrono>

#if defined(__x86_64__)
#include <immintrin.h>
#define DS_PAUSE() _mm_pause()
#else
#define DS_PAUSE() ((void)0)
#endif

namespace ds {

ThreadPool::ThreadPool(int threads) : nth_(threads < 1 ? 1 : threads) {
  for (int i = 1; i < nth_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (nth_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(nth_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  fn(0, nth_);
  // Spin first (jobs are short), then yield so an oversubscribed machine still progresses.
  for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
    if (spin < 4000)
      DS_PAUSE();
    else
      std::this_thread::yield();
  }
  job_ = nullptr;
}

void ThreadPool::worker(int ith) {
  uint64_t seen = 0;
  for (;;) {
    // Spin for a while (~100 us) before sleeping: decode issues jobs back to back.
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < 20000; ++spin) {
      if (spin < 4000)
        DS_PAUSE();
      else
        std::this_thread::yield();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lock, [&] { return generation_.load() != seen; });
      sleepers_.fetch_sub(1);
      gen = generation_.load();
    }
    seen = gen;
    if (stop_.load()) return;
    (*job_)(ith, nth_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace ds
