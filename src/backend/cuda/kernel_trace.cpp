#include "backend/cuda/kernel_trace.h"

#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#ifdef DEEPSERVE_HAVE_CUPTI
#include <cupti_activity.h>
#endif

#include "backend/cuda/switches.h"
#include "core/error.h"
#include "core/log.h"

namespace ds::cuda {

std::string kernel_trace_header() {
  return "start_ns\tend_ns\tcorrelation\tgraph_id\tgraph_node\tgrid\tblock\tcluster\tdynamic_smem"
         "\tregisters\tname\n";
}

std::string kernel_trace_row(const TracedKernel& k) {
  char buf[320];
  std::snprintf(buf, sizeof buf, "%llu\t%llu\t%u\t%u\t%llu\t%d,%d,%d\t%d,%d,%d\t%d,%d,%d\t%d\t%d\t",
                static_cast<unsigned long long>(k.start_ns),
                static_cast<unsigned long long>(k.end_ns), k.correlation, k.graph_id,
                static_cast<unsigned long long>(k.graph_node), k.grid[0], k.grid[1], k.grid[2],
                k.block[0], k.block[1], k.block[2], k.cluster[0], k.cluster[1], k.cluster[2],
                k.dynamic_smem, k.registers);
  std::string row = buf;
  row.reserve(row.size() + k.name.size() + 1);
  for (const char c : k.name) row += c == '\t' || c == '\n' || c == '\r' ? ' ' : c;
  row += '\n';
  return row;
}

namespace {

[[maybe_unused]] std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : name;
  std::free(d);
  return s;
}

EnvCount g_trace_skip{"DEEPSERVE_KERNEL_TRACE_SKIP", 0};
EnvCount g_trace_max{"DEEPSERVE_KERNEL_TRACE_MAX", 400000};

#ifdef DEEPSERVE_HAVE_CUPTI
// The CUPTI entry points, from the library loaded at run time.
struct Cupti {
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiActivityGetNumDroppedRecords) dropped = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
};

struct Trace {
  std::mutex mu;
  std::string path;
  long long skip = 0, max = 0, seen = 0;
  size_t dropped = 0;  // records CUPTI could not buffer
  std::vector<TracedKernel> kept;
  Cupti api;
};
// Set once and never freed: CUPTI may call back until the process ends.
Trace* g_trace = nullptr;
std::mutex g_start_mu;

constexpr size_t kBufferBytes = size_t(8) << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t,
                               size_t valid) {
  Trace& t = *g_trace;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    CUpti_Activity* rec = nullptr;
    while (t.api.next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
      TracedKernel k;
      if (!kernel_from_cupti_record(rec, k)) continue;
      if (t.seen++ < t.skip || static_cast<long long>(t.kept.size()) >= t.max) continue;
      t.kept.push_back(std::move(k));
    }
    size_t d = 0;
    if (t.api.dropped(ctx, stream, &d) == CUPTI_SUCCESS) t.dropped += d;
  }
  std::free(buffer);
}

void* open_cupti() {
  std::vector<std::string> names;
  if (const char* p = std::getenv("DEEPSERVE_CUPTI_LIB"); p != nullptr && *p != '\0')
    names.emplace_back(p);
  for (const char* n :
       {"libcupti.so.13", "libcupti.so", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13",
        "/usr/local/cuda/lib64/libcupti.so.13", "/usr/local/cuda/lib/libcupti.so.13",
        "/usr/local/cuda/targets/x86_64-linux/lib/libcupti.so.13"})
    names.emplace_back(n);
  std::string tried;
  for (const std::string& n : names) {
    if (void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    const char* why = dlerror();
    tried += "\n  " + n + ": " + (why != nullptr ? why : "not loaded");
  }
  throw Error("DEEPSERVE_KERNEL_TRACE: cannot load CUPTI; set DEEPSERVE_CUPTI_LIB to libcupti.so:" +
              tried);
}

template <typename F>
void resolve(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (f == nullptr) throw Error(std::string("DEEPSERVE_KERNEL_TRACE: CUPTI lacks ") + name);
}

void check_cupti(const Cupti& api, CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* s = nullptr;
  api.result_string(r, &s);
  throw Error(std::string("DEEPSERVE_KERNEL_TRACE: ") + what + ": " +
              (s != nullptr ? s : "CUPTI error " + std::to_string(int(r))));
}
#endif

}  // namespace

bool kernel_from_cupti_record(const void* record, TracedKernel& out) {
#ifdef DEEPSERVE_HAVE_CUPTI
  const auto* a = static_cast<const CUpti_Activity*>(record);
  if (a->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && a->kind != CUPTI_ACTIVITY_KIND_KERNEL)
    return false;
  const auto* k = static_cast<const CUpti_ActivityKernel10*>(record);
  out.start_ns = k->start;
  out.end_ns = k->end;
  out.correlation = k->correlationId;
  out.graph_id = k->graphId;
  out.graph_node = k->graphNodeId;
  out.grid[0] = k->gridX, out.grid[1] = k->gridY, out.grid[2] = k->gridZ;
  out.block[0] = k->blockX, out.block[1] = k->blockY, out.block[2] = k->blockZ;
  out.cluster[0] = int(k->clusterX), out.cluster[1] = int(k->clusterY);
  out.cluster[2] = int(k->clusterZ);
  out.dynamic_smem = k->dynamicSharedMemory;
  out.registers = k->registersPerThread;
  out.name = demangle(k->name);
  return true;
#else
  (void)record;
  (void)out;
  return false;
#endif
}

void kernel_trace_start() {
  const char* path = std::getenv("DEEPSERVE_KERNEL_TRACE");
  if (path == nullptr || *path == '\0') return;
#ifndef DEEPSERVE_HAVE_CUPTI
  throw UnsupportedError(
      "DEEPSERVE_KERNEL_TRACE: this build found no CUPTI headers (cupti_activity.h)");
#else
  std::lock_guard<std::mutex> lock(g_start_mu);
  if (g_trace != nullptr) return;
  auto t = std::make_unique<Trace>();
  t->path = path;
  t->skip = g_trace_skip.get();
  t->max = g_trace_max.get();
  void* lib = open_cupti();
  Cupti& api = t->api;
  resolve(lib, "cuptiActivityRegisterCallbacks", api.register_callbacks);
  resolve(lib, "cuptiActivityEnable", api.enable);
  resolve(lib, "cuptiActivityFlushAll", api.flush_all);
  resolve(lib, "cuptiActivityGetNextRecord", api.next_record);
  resolve(lib, "cuptiActivityGetNumDroppedRecords", api.dropped);
  resolve(lib, "cuptiGetResultString", api.result_string);
  g_trace = t.release();  // the callbacks read it from here on
  check_cupti(g_trace->api, g_trace->api.register_callbacks(buffer_requested, buffer_completed),
              "cuptiActivityRegisterCallbacks");
  check_cupti(g_trace->api, g_trace->api.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
              "cuptiActivityEnable(CONCURRENT_KERNEL)");
  log_info("kernel trace on (CUPTI): kernels " + std::to_string(g_trace->skip) + " to " +
           std::to_string(g_trace->skip + g_trace->max) + " go to " + g_trace->path);
#endif
}

void kernel_trace_write() {
#ifdef DEEPSERVE_HAVE_CUPTI
  Trace* t = g_trace;
  if (t == nullptr) return;
  check_cupti(t->api, t->api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(t->mu);
  std::ofstream f(t->path, std::ios::trunc);
  f << kernel_trace_header();
  for (const TracedKernel& k : t->kept) f << kernel_trace_row(k);
  f.close();
  if (!f) throw Error("DEEPSERVE_KERNEL_TRACE: cannot write " + t->path);
  log_info("kernel trace: " + std::to_string(t->kept.size()) + " kernels written to " + t->path +
           " (" + std::to_string(t->seen) + " seen, " + std::to_string(t->dropped) +
           " dropped by CUPTI)");
#endif
}

}  // namespace ds::cuda
