// The CUDA backend's run-time switches for A/B runs: read once from the environment, and
// overridable by tests.
#pragma once

#include <atomic>
#include <mutex>

namespace ds::cuda {

class EnvSwitch {
 public:
  // On when the variable `name` equals `on_value`; with on_value null, on unless it is "0".
  constexpr EnvSwitch(const char* name, const char* on_value) : name_(name), on_(on_value) {}
  bool on() const;       // the forced value, else the environment's
  void force(int mode);  // 1 on, 0 off, -1 back to the environment

 private:
  const char* name_;
  const char* on_;
  mutable std::once_flag read_;
  mutable bool env_ = false;
  std::atomic<int> forced_{-1};
};

// The switches (each documented where it acts).
extern EnvSwitch g_pdl;                  // DEEPSERVE_PDL (on unless "0")
extern EnvSwitch g_mla_prepare;          // DEEPSERVE_MLA_PREPARE=1
extern EnvSwitch g_mla_decode_bf16;      // DEEPSERVE_MLA_DECODE=bf16
extern EnvSwitch g_moe_prefill_batched;  // DEEPSERVE_MOE_PREFILL=batched
extern EnvSwitch g_moe_prefill_timing;   // DEEPSERVE_MOE_PREFILL_TIMING=1

}  // namespace ds::cuda
