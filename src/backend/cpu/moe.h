// CPU mixture-of-experts ops (DeepSeek-V2): MoEGate routing, and the routed-expert SwiGLU
// FFN, which gathers the tokens of each expert so its weights stream once per call.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_features.h"
#include "backend/cpu/matmul.h"

namespace ds {
class ThreadPool;
}

namespace ds::cpu {

// backend.h's moe_route. Per token: softmax in double, rounded to F32 scores; the selection
// compares those F32 scores (ties to the lower group / expert index); the chosen experts are
// written in decreasing score order. Counts are added after all rows are routed.
void moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
               TensorView weights, ThreadPool& pool);

// How moe_ffn runs its matmuls.
struct MatmulContext {
  ThreadPool* pool = nullptr;
  Isa isa = Isa::Scalar;
  ActPrecision act = ActPrecision::F32;
};

// Buffers moe_ffn reuses across calls; they grow on demand.
struct MoeScratch {
  std::vector<int32_t> offsets;  // [experts + 1] start of each expert's assignments
  std::vector<int32_t> assign;   // [T * top_k] token * top_k + slot, grouped by expert
  std::vector<float> x, gate, up, down;
};

// backend.h's moe_ffn. Each expert's rows (in increasing token order, at most a fixed chunk
// at a time) are gathered, multiplied by gate and up, silu-multiplied, multiplied by down
// and added into out. A token's contributions are added in increasing expert id (for equal
// ids, increasing slot) to out = 0: out[t] = (((0 + w_a y_a) + w_b y_b) + ...), y rounded to
// F32 as the matmul leaves it. Matmul rows are independent, so no token's result depends on
// the other tokens of the batch.
void moe_ffn(const MoeFfnParams& p, const MatmulContext& mm, MoeScratch& scratch);

}  // namespace ds::cpu
