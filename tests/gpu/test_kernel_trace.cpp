// DEEPSERVE_KERNEL_TRACE's rows (kernel_trace.h): host only, no GPU. A CUPTI kernel record built
// here becomes the row tools/kernel_trace_table.py reads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#ifdef DEEPSERVE_HAVE_CUPTI
#include <cupti_activity.h>
#endif

#include "backend/cuda/kernel_trace.h"

namespace ds::cuda {
namespace {

int count(const std::string& s, char c) {
  return int(std::count(s.begin(), s.end(), c));
}

#ifdef DEEPSERVE_HAVE_CUPTI  // (a build without CUPTI's headers reads no records)
// A CUPTI record of `kind`, zeroed but for it.
template <typename R>
R record_of(CUpti_ActivityKind kind) {
  R r;
  std::memset(&r, 0, sizeof r);
  r.kind = kind;
  return r;
}

TEST(KernelTraceRows, KernelRecordBecomesOneRow) {
  auto r = record_of<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  r.start = 1'000'000'123;
  r.end = 1'000'031'456;
  r.correlationId = 77;
  r.graphId = 3;
  r.graphNodeId = 12345678901ULL;
  r.gridX = 88, r.gridY = 8, r.gridZ = 1;
  r.blockX = 128, r.blockY = 1, r.blockZ = 1;
  r.clusterX = 1, r.clusterY = 16, r.clusterZ = 1;
  r.dynamicSharedMemory = 61440;
  r.registersPerThread = 119;
  r.name = "_ZN2ds4cuda3moe14gate_up_kernelILi0ELi1EEEvNS1_4ArgsE";
  TracedKernel k;
  ASSERT_TRUE(kernel_from_cupti_record(&r, k));
  EXPECT_EQ(kernel_trace_row(k),
            "1000000123\t1000031456\t77\t3\t12345678901\t88,8,1\t128,1,1\t1,16,1\t61440\t119\t"
            "void ds::cuda::moe::gate_up_kernel<0, 1>(ds::cuda::moe::Args)\n");
  // The legacy (serialized) kernel kind reads the same; a name that does not demangle stays.
  r.kind = CUPTI_ACTIVITY_KIND_KERNEL;
  r.name = "plain_c_kernel";
  ASSERT_TRUE(kernel_from_cupti_record(&r, k));
  EXPECT_EQ(k.name, "plain_c_kernel");
  EXPECT_EQ(k.end_ns - k.start_ns, 31'333u);
}

TEST(KernelTraceRows, OtherRecordsAreNotKernels) {
  const auto m = record_of<CUpti_ActivityMemcpy6>(CUPTI_ACTIVITY_KIND_MEMCPY);
  TracedKernel k;
  k.name = "untouched";
  EXPECT_FALSE(kernel_from_cupti_record(&m, k));
  EXPECT_EQ(k.name, "untouched");
}
#endif

TEST(KernelTraceRows, EveryRowHasTheHeadersColumns) {
  const std::string head = kernel_trace_header();
  ASSERT_EQ(head.back(), '\n');
  TracedKernel k;
  k.name = "void f<1>(int, float)";
  EXPECT_EQ(count(kernel_trace_row(k), '\t'), count(head, '\t'));
  // A name cannot split a row or add a column.
  k.name = "a\tb\nc\rd";
  const std::string row = kernel_trace_row(k);
  EXPECT_EQ(count(row, '\t'), count(head, '\t'));
  EXPECT_EQ(count(row, '\n'), 1);
  EXPECT_EQ(row.substr(row.size() - 8), "a b c d\n");
}

}  // namespace
}  // namespace ds::cuda
