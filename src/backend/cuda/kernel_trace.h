// The kernels a process runs on its GPUs, each with its start and end as the device saw them
// (CUPTI's activity records), written as a table when the CUDA backend goes away. Nsight
// Compute times a kernel alone; Nsight Systems is not on the H200 machine. This is what a kernel
// costs inside a replayed decode graph, where dependent launch overlaps its start with the
// kernel ahead: tools/kernel_trace_table.py turns the table into each kernel's share of a step.
//
//   DEEPSERVE_KERNEL_TRACE=path        on: the table goes to path (tab-separated, one kernel a
//   line) DEEPSERVE_KERNEL_TRACE_SKIP=N      the first N kernels are not kept (warm-up, prefill)
//   DEEPSERVE_KERNEL_TRACE_MAX=N       at most N kernels are kept (default 400,000)
//   DEEPSERVE_CUPTI_LIB=path           libcupti to load (else libcupti.so.13 and the toolkit's)
//
// CUPTI is loaded at run time (dlopen), so nothing links against it; without the variable no
// CUPTI call is made. Plain C++ (no CUDA headers): the pure part (a record's row) is testable
// without a GPU.
#pragma once

#include <cstdint>
#include <string>

namespace ds::cuda {

// One kernel execution.
struct TracedKernel {
  uint64_t start_ns = 0, end_ns = 0;  // device timestamps
  uint32_t correlation = 0;  // the launching API call's id: a graph launch's kernels share it
  uint32_t graph_id = 0;     // 0 outside a graph
  uint64_t graph_node = 0;
  int grid[3] = {0, 0, 0}, block[3] = {0, 0, 0}, cluster[3] = {0, 0, 0};
  int dynamic_smem = 0, registers = 0;
  std::string name;  // demangled
};

// The table's first line, and a kernel's line (both end in '\n'). The name comes last: it is
// the only column with spaces and commas.
std::string kernel_trace_header();
std::string kernel_trace_row(const TracedKernel& k);

// Starts tracing when DEEPSERVE_KERNEL_TRACE is set (once per process; every CUDA backend calls
// it before its first CUDA call). Throws ds::Error when the variable is set but CUPTI cannot be
// loaded or started: a run asked to be traced does not go on untraced.
void kernel_trace_start();
// Flushes CUPTI's buffers and writes every kept kernel so far to the path (the whole table each
// time, so the last backend to go writes all). A no-op when tracing is off.
void kernel_trace_write();

// The row a CUPTI record gives (a CUpti_Activity*): false for any record but a kernel's, and
// always false in a build without CUPTI's headers (DEEPSERVE_HAVE_CUPTI undefined).
bool kernel_from_cupti_record(const void* record, TracedKernel& out);

}  // namespace ds::cuda
