// Offline mode: requests go straight to an in-process Engine; token times are the engine's
// own timestamps, so step times are exact.
#pragma once

#include <atomic>
#include <functional>
#include <string>

#include "bench/target.h"
#include "engine/engine.h"

namespace ds {

struct OfflineTargetConfig {
  std::string device = "cpu";   // "cuda": device memory is sampled (CUDA builds)
  DType kv_dtype = DType::F32;  // what the roofline counts per cached token
  // Bytes the backend's memory pool holds in live buffers; unset: the whole device's use.
  std::function<double()> device_memory_used;
  // Set with --profile-ops: the decorator the model and engine run on (not owned).
  ProfilingBackend* profiler = nullptr;
  // The steps the profile reports: those of this many tokens (0: the most common decode step).
  int profile_step_tokens = 0;
};

class OfflineTarget : public BenchTarget {
 public:
  OfflineTarget(Engine& engine, Model& model, OfflineTargetConfig cfg);
  std::string mode() const override { return "offline"; }
  BenchResult run(const BenchRequest& req) override;
  TargetSnapshot snapshot() override;
  std::optional<RooflineModel> roofline() const override;
  bool engine_timestamps() const override { return true; }
  void reset_op_profile() override;
  std::optional<OpProfile> op_profile() override;
  // Holds the engine's admission until n submissions are in (Engine::hold_admission).
  void begin_wave(int n) override;
  void end_wave() override;

 private:
  void submitted();  // one submission (or failed attempt) of the wave is done

  Engine& engine_;
  Model& model_;
  OfflineTargetConfig cfg_;
  std::atomic<int> wave_left_{0};
};

// This process's peak resident set (VmHWM in /proc/self/status), in bytes.
std::optional<double> peak_rss_bytes();
// Device memory in use (total - free, the whole device) on CUDA builds; nullopt otherwise.
std::optional<double> gpu_memory_used_bytes();

}  // namespace ds
