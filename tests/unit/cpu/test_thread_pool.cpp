// ThreadPool: every task of every job runs exactly once, whichever thread claims it, even
// with more tasks than threads and jobs issued back to back.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace ds {
namespace {

TEST(ThreadPool, EveryTaskRunsOnceAndJobsDoNotOverlap) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int tasks : {1, 2, 5, 64}) {
      for (int job = 0; job < 200; ++job) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(tasks));
        std::atomic<int> bad_count{0};
        pool.run(
            [&](int task, int n) {
              if (n != tasks || task < 0 || task >= n) bad_count.fetch_add(1);
              hits[size_t(task)].fetch_add(1);
              if (job % 50 == 0) std::this_thread::yield();
            },
            tasks);
        for (int t = 0; t < tasks; ++t)
          ASSERT_EQ(hits[size_t(t)].load(), 1) << threads << " threads, task " << t;
        ASSERT_EQ(bad_count.load(), 0);
      }
    }
  }
}

TEST(ThreadPool, DefaultRunGivesOneTaskPerThread) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(3);
  pool.run([&](int ith, int nth) {
    EXPECT_EQ(nth, 3);
    hits[size_t(ith)].fetch_add(1);
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

}  // namespace
}  // namespace ds
