// Per-op timing of model steps: a Backend decorator that forwards every op to an inner
// backend and brackets it with the inner backend's timing marks (mark()).
//
// Ops are grouped into steps: every model forward begins with embed, so a step runs from one
// embed call to the next; in the engine its last ops are therefore the next step's block
// copies and input upload (the same shapes in a steady decode), and its wall time covers the
// host's sampling and scheduling between steps. Steps are pooled by (token count, decode),
// where a decode step is one whose attention metadata has one token per sequence.
//
// Graphs are switched off (supports_graphs() is false), so the model runs eagerly: op times
// exclude graph replay, and a GPU op the host issues more slowly than the device runs it is
// timed from when the host began issuing it.
#pragma once

#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace ds {

// One label's (or one op kind's) part of a step, averaged over the group's steps.
struct OpTimingRow {
  std::string label;  // "matmul [8,576]x[1536,576] q4_1"; for kinds, the op name
  std::string kind;   // op_name(), or "upload", "download", "copy", "argmax", "sample"
  double calls = 0;   // per step
  double us = 0;      // microseconds per step
  double share = 0;   // of the step's summed op time, 0..1
};

// The steps of one (token count, decode) group, averaged.
struct StepProfile {
  int tokens = 0;       // tokens per step (embed rows)
  bool decode = false;  // one token per sequence
  int64_t steps = 0;
  double seqs = 0;                 // sequences per step (0 when no attention ran)
  double context = 0;              // the longest context per step (AttentionMeta::max_context_len)
  double op_ms = 0;                // summed op time per step
  double wall_ms = 0;              // first mark to last mark per step
  std::vector<OpTimingRow> ops;    // per label, most time first
  std::vector<OpTimingRow> kinds;  // per op kind, most time first
};

struct StepGroupCount {
  int tokens = 0;
  bool decode = false;
  int64_t steps = 0;
};

struct OpProfile {
  std::string backend;                 // the inner backend's name
  int64_t steps = 0;                   // every recorded step
  std::vector<StepGroupCount> groups;  // most steps first
  std::optional<StepProfile> step;     // the chosen group; unset without steps
};

class ProfilingBackend final : public Backend {
 public:
  // `inner` must outlive this backend.
  explicit ProfilingBackend(Backend& inner);

  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }
  bool supports(Op op, DType dtype) const override { return inner_.supports(op, dtype); }
  std::unique_ptr<Buffer> alloc(size_t bytes) override { return inner_.alloc(bytes); }
  void upload(const TensorView& dst, const void* host, size_t bytes) override;
  void download(void* host, const TensorView& src, size_t bytes) override;
  void synchronize() override { inner_.synchronize(); }

  void embed(const TensorView& table, const int32_t* ids, int n, TensorView out) override;
  void rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out) override;
  void matmul(const TensorView& x, const TensorView& w, TensorView out) override;
  void rope(TensorView x, const int32_t* positions, const RopeParams& p) override;
  void store_kv(const TensorView& k, const TensorView& v, const PagedKv& kv,
                const AttentionMeta& meta) override;
  void attention(const AttentionParams& p, const AttentionMeta& meta) override;
  void silu_mul(const TensorView& gate_up, TensorView out) override;
  void add(TensorView x, const TensorView& y) override;
  void add_rms_norm(TensorView x, const TensorView& y, const TensorView& w, float eps,
                    TensorView out) override;
  void norm_matmul(const NormMatmulParams& p) override;
  void matmul_add_norm(const MatmulNormParams& p) override;
  void batched_matmul(const TensorView& x, const TensorView& w, TensorView out) override;
  void mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta) override;
  bool mla_prefill(const MlaPrefillParams& p, const AttentionMeta& meta) override;
  void mla_prepare(const MlaPrepareParams& p, const AttentionMeta& meta) override;
  void moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                 TensorView weights) override;
  void moe_ffn(const MoeFfnParams& p) override;
  void moe_routed_ffn(const TensorView& logits, const MoeRouteParams& route,
                      const MoeFfnParams& ffn) override;
  void moe_routed_ffn_add_norm(const TensorView& logits, const MoeRouteParams& route,
                               const MoeFfnParams& ffn, const AddNormParams& add_norm) override;
  void argmax(const TensorView& logits, TensorView ids) override;
  void sample(const TensorView& logits, const SampleRow* rows, TensorView ids) override;
  void copy(const TensorView& src, TensorView dst) override;
  // Load time, not a step op: passed through untimed (the device generates in place).
  void fill_random(TensorView dst, const RandomFill& p) override { inner_.fill_random(dst, p); }

  // Eager only: a captured graph would hide the ops.
  bool supports_graphs() const override { return false; }
  uint64_t alloc_epoch() const override { return inner_.alloc_epoch(); }

  // Forgets every recorded step (e.g. the warm-up's); the open step is dropped too.
  void reset();
  // Closes the open step and summarizes. `tokens` picks the group with that token count
  // (decode preferred); unset: the decode group with the most steps, else the group with the
  // most steps (ties: more tokens).
  OpProfile profile(std::optional<int> tokens = std::nullopt);

 private:
  struct OpRecord {
    int label = 0;
    int begin = 0, end = 0;  // mark indices
  };
  struct LabelStat {
    int64_t calls = 0;
    double ms = 0;
  };
  struct Group {
    int64_t steps = 0;
    double seqs = 0, context = 0, op_ms = 0, wall_ms = 0;  // sums over steps
    std::map<int, LabelStat> labels;                       // by label id
  };
  using GroupKey = std::pair<int, bool>;  // (tokens, decode)

  // Runs `op` between two marks when a step is open; else just runs it.
  template <class F>
  void timed(const char* kind, const std::string& label, F&& op);
  int label_id(const char* kind, const std::string& label);
  void note_meta(const AttentionMeta& meta);
  void close_step();  // resolves the open step's marks into its group
  StepProfile summarize(const GroupKey& key, const Group& g) const;

  Backend& inner_;
  std::mutex mu_;  // ops come from the engine thread, reports from another
  std::unordered_map<std::string, int> label_ids_;
  std::vector<std::string> labels_, label_kinds_;  // by label id
  bool step_open_ = false;
  int step_tokens_ = 0, step_seqs_ = 0, step_context_ = 0;
  bool step_decode_ = true;
  std::vector<OpRecord> step_ops_;
  std::map<GroupKey, Group> groups_;
};

// The chosen step's `rows` most expensive labels and its op kinds as a table.
void print_op_profile(std::FILE* out, const OpProfile& p, int rows = 25);

}  // namespace ds
