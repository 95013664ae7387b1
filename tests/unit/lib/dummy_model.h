// A `--load-format dummy` model on the CPU backend (tests of dummy weights and load-time
// quantization), with a KV cache sized for the test harness.
#pragma once

#include <filesystem>

#include "../../hf_fixtures.h"
#include "model/loader.h"

namespace ds::test {

inline std::filesystem::path dummy_dir() {
  return std::filesystem::path(DS_FIXTURES_DIR) / "dummy" / "deepseek_v2_w4";
}

inline CpuModel load_dummy(const std::filesystem::path& path, uint64_t seed,
                           WeightQuant q = WeightQuant::None) {
  CpuModel l;
  BackendOptions bo;
  bo.threads = 2;
  l.backend = make_cpu_backend(bo);
  LoadOptions lo;
  lo.dummy = true;
  lo.dummy_seed = seed;
  lo.quantize = q;
  l.m = load_model(path, *l.backend, lo);
  KvCacheConfig kvc;
  kvc.num_blocks = kHarnessBlocks;
  l.cache = std::make_unique<KvCache>(*l.backend, l.m.config, kvc);
  return l;
}

}  // namespace ds::test
