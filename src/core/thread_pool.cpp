#include "core/thread_pool.h"

#include "core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DS_PAUSE() _mm_pause()
#else
#define DS_PAUSE() ((void)0)
#endif

namespace ds {

ThreadPool::ThreadPool(int threads) : nth_(threads < 1 ? 1 : threads) {
  for (int i = 1; i < nth_; ++i) threads_.emplace_back([this] { worker(); });
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

void ThreadPool::run(const std::function<void(int, int)>& fn, int tasks) {
  if (nth_ == 1 || tasks <= 1) {
    for (int t = 0; t < tasks; ++t) fn(t, tasks);
    return;
  }
  DS_CHECK(tasks < (1 << 16), "thread pool: too many tasks in one job");
  job_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  const uint32_t gen = ++last_gen_;
  claim_.store(uint64_t(gen) << 32 | uint64_t(tasks) << 16, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.store(gen, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  work(gen);
  // Tasks claimed by workers may still run. Spin first (they are short), then yield so an
  // oversubscribed machine still progresses.
  for (int spin = 0; done_.load(std::memory_order_acquire) != tasks; ++spin) {
    if (spin < 4000)
      DS_PAUSE();
    else
      std::this_thread::yield();
  }
  job_ = nullptr;
}

void ThreadPool::work(uint32_t gen) {
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    const int tasks = int(c >> 16 & 0xffff), next = int(c & 0xffff);
    if (uint32_t(c >> 32) != gen || next >= tasks) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
    // The job stays alive until this task is counted done.
    (*job_)(next, tasks);
    done_.fetch_add(1, std::memory_order_acq_rel);
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker() {
  uint32_t seen = 0;
  for (;;) {
    // Spin for a while (~100 us) before sleeping: decode issues jobs back to back.
    uint32_t gen = generation_.load(std::memory_order_acquire);
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
    work(gen);
  }
}

}  // namespace ds
