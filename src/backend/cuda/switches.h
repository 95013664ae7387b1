// The CUDA backend's run-time switches for A/B runs: read once from the environment, and
// overridable by tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

namespace ds::cuda {

class EnvSwitch {
 public:
  // default_on, flipped when the variable `name` equals `flip_value`.
  constexpr EnvSwitch(const char* name, const char* flip_value, bool default_on)
      : name_(name), flip_(flip_value), default_on_(default_on) {}
  bool on() const;       // the forced value, else the environment's
  void force(int mode);  // 1 on, 0 off, -1 back to the environment

 private:
  const char* name_;
  const char* flip_;
  bool default_on_;
  mutable std::once_flag read_;
  mutable bool env_ = false;
  std::atomic<int> forced_{-1};
};

// A positive count from the environment (a threshold for A/B runs), overridable by tests.
class EnvCount {
 public:
  constexpr EnvCount(const char* name, long long default_value)
      : name_(name), default_(default_value) {}
  long long get() const;        // the forced value, else the environment's, else the default
  void force(long long value);  // > 0 that value, else back to the environment

 private:
  const char* name_;
  long long default_;
  mutable std::once_flag read_;
  mutable long long env_ = 0;
  std::atomic<long long> forced_{0};
};

// The switches (each documented where it acts).
extern EnvSwitch g_pdl;                  // on; DEEPSERVE_PDL=0 turns it off
extern EnvCount g_graph_piece_layers;    // DEEPSERVE_GRAPH_PIECE_LAYERS (graphs.h)
extern EnvSwitch g_prefetch;             // off; DEEPSERVE_PREFETCH=1 turns it on
extern EnvCount g_prefetch_kinds;        // DEEPSERVE_PREFETCH_KINDS (pdl.h)
extern EnvCount g_prefetch_cap;          // DEEPSERVE_PREFETCH_CAP (pdl.h)
extern EnvSwitch g_mla_prepare;          // on; DEEPSERVE_MLA_PREPARE=0 turns it off
extern EnvCount g_mla_prepare_pairs;     // DEEPSERVE_MLA_PREPARE_PAIRS (mla_prepare.cu; 512)
extern EnvSwitch g_mla_decode_bf16;      // off; DEEPSERVE_MLA_DECODE=bf16 turns it on
extern EnvSwitch g_mla_decode_regq;      // on; DEEPSERVE_MLA_DECODE_REGQ=0 turns it off
extern EnvSwitch g_moe_prefill_wide;     // off; DEEPSERVE_MOE_PREFILL=wide turns it on
extern EnvSwitch g_moe_tile32;           // on; DEEPSERVE_MOE_TILE=64 turns it off
extern EnvSwitch g_moe_prefill_timing;   // off; DEEPSERVE_MOE_PREFILL_TIMING=1 turns it on
extern EnvSwitch g_wq_stage_f32;         // on; DEEPSERVE_WQ_XF32=0 turns it off
extern EnvSwitch g_wq_cluster;           // on; DEEPSERVE_WQ_CLUSTER=0 turns it off
extern EnvSwitch g_wq_batched;           // on; DEEPSERVE_WQ_BATCHED=0 turns it off
extern EnvSwitch g_norm_fuse;            // off; DEEPSERVE_NORM_FUSE=1 turns it on
extern EnvSwitch g_add_norm_last;        // on; DEEPSERVE_ADD_NORM_LAST=0 turns it off
extern EnvSwitch g_skinny_one_wave;      // on; DEEPSERVE_SKINNY_ONE_WAVE=0 turns it off
extern EnvSwitch g_skinny_early;         // on; DEEPSERVE_SKINNY_EARLY=0 turns it off
extern EnvSwitch g_mla_early;            // on; DEEPSERVE_MLA_EARLY=0 turns it off
extern EnvSwitch g_wq_early;             // on; DEEPSERVE_WQ_EARLY=0 turns it off
extern EnvSwitch g_wq_issue_first;       // off; DEEPSERVE_WQ_ISSUE_FIRST=1 turns it on
extern EnvSwitch g_wq_issue_first_fp8w;  // on; DEEPSERVE_WQ_ISSUE_FIRST_FP8W=0 turns it off
extern EnvSwitch g_wq_skip_scales;       // off; a probe (wrong sums): switches.cpp
extern EnvSwitch g_moe_wq_stage_f32;     // on; DEEPSERVE_MOE_WQ_XF32=0 turns it off
extern EnvSwitch g_moe_wq_fused;         // on; DEEPSERVE_MOE_WQ_FUSED=0 turns it off
extern EnvSwitch g_moe_bf16_fused;       // off; DEEPSERVE_MOE_BF16_FUSED=1 turns it on
extern EnvSwitch g_moe_wq_shared_first;  // off; DEEPSERVE_MOE_WQ_SHARED_FIRST=1 turns it on
extern EnvSwitch g_moe_wq_halves;        // off; DEEPSERVE_MOE_WQ_HALVES=1 turns it on
extern EnvSwitch g_wq_dequant;           // on; DEEPSERVE_WQ_DEQUANT=0 turns it off
extern EnvCount g_wq_dequant_min_rows;   // DEEPSERVE_WQ_DEQUANT_MIN_ROWS (wq_dequant.cuh)
extern EnvCount g_moe_wq_dequant_min;    // DEEPSERVE_MOE_WQ_DEQUANT_MIN (wq_dequant.cuh)
extern EnvCount g_moe_wq_expand_max_mb;  // DEEPSERVE_MOE_WQ_EXPAND_MAX_MB (wq_dequant.cuh)
extern EnvCount g_wq_split_ctas;         // DEEPSERVE_WQ_SPLIT_CTAS (gemm_wq.cu)
extern EnvCount g_moe_decode_upw;        // DEEPSERVE_MOE_DECODE_UPW (moe_decode.cu)
extern EnvCount g_moe_decode_unroll;     // DEEPSERVE_MOE_DECODE_UNROLL (moe_decode.cu)
extern EnvSwitch g_moe_fused_combine;    // on; DEEPSERVE_MOE_FUSED_COMBINE=0 turns it off
extern EnvSwitch g_moe_warp_lists;       // on; DEEPSERVE_MOE_WARP_LISTS=0 turns it off
extern EnvSwitch g_moe_split;            // off; DEEPSERVE_MOE_SPLIT=1 turns it on
extern EnvSwitch g_moe_split_prefetch;   // off; DEEPSERVE_MOE_SPLIT_PREFETCH=1 turns it on
extern EnvSwitch g_moe_down_early;       // on; DEEPSERVE_MOE_DOWN_EARLY=0 turns it off
extern EnvSwitch g_moe_shared_early;     // on; DEEPSERVE_MOE_SHARED_EARLY=0 turns it off
extern EnvCount g_mla_max_splits;        // DEEPSERVE_MLA_SPLITS (attention_mla_decode.cu)
extern EnvSwitch g_mla_cluster;          // on; DEEPSERVE_MLA_CLUSTER=0 turns it off
extern EnvSwitch g_row_regs;             // on; DEEPSERVE_ROW_REGS=0 turns it off
extern EnvSwitch g_mla_q_pairs;          // on; DEEPSERVE_MLA_Q_PAIRS=0 turns it off
extern EnvSwitch g_mla_merge_gather;     // on; DEEPSERVE_MLA_MERGE_GATHER=0 turns it off
extern EnvSwitch g_mla_q_split2;         // on; DEEPSERVE_MLA_Q_SPLIT2=0 turns it off
extern EnvSwitch g_mla_cluster_fit;      // off; DEEPSERVE_MLA_CLUSTER_FIT=1 turns it on
extern EnvSwitch g_mla_rows32;           // off; DEEPSERVE_MLA_ROWS32=1 turns it on
extern EnvCount g_mla_bf16_min_heads;    // DEEPSERVE_MLA_BF16_MIN_HEADS (64; 0: never)
// Launches DEEPSERVE_ROW_REGS has reached so far (the register-row norm kernels, the skinny
// GEMM's norm, the decode MoE's staging; tests check that the switch took effect), and one more.
int64_t row_regs_launches();
void note_row_regs_launch();
// One-launch FFNs (DEEPSERVE_MOE_WQ_FUSED) launched so far, and one more.
int64_t moe_wq_fused_launches();
void note_moe_wq_fused_launch();
// Those of them with W4A16's stages in halves (DEEPSERVE_MOE_WQ_HALVES), and one more.
int64_t moe_wq_halves_launches();
void note_moe_wq_halves_launch();

}  // namespace ds::cuda
