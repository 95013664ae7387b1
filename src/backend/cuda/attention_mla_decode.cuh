// MLA decode attention on tensor cores for a BF16 or FP8 latent cache (attention_mla_decode.cu):
// one query per sequence, 16 heads per CTA sharing every cache row, split-K over the context.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/common.cuh"

namespace ds::cuda {

constexpr int kMlaDecodeRank = 512;    // kv_lora_rank the kernel is built for (DeepSeek-V2/V3)
constexpr int kMlaDecodeMaxRope = 64;  // rope dims: a multiple of 16 up to this

// Whether the parameter block (plan not applied) suits the kernel: BF16 or FP8 cache, R = 512, rope
// dims a multiple of 16 up to 64, every sequence decoding one token, 16-byte aligned rows.
bool mla_decode_fits(const kern::AttnParams& a);
// Heads per CTA for `a` (set a.mla_rows before the splits): 32 where the register-Q kernel runs
// it with BF16 Q / P (bf16_qp) and the model has 32 heads or more, DEEPSERVE_MLA_ROWS32 on;
// else 16.
int mla_decode_rows(const kern::AttnParams& a, bool bf16_qp);
// Auto's choice of Q / P form: BF16 (bf16_qp) with DEEPSERVE_MLA_DECODE=bf16, or where the model
// has at least DEEPSERVE_MLA_BF16_MIN_HEADS heads (64; 0: never); else hi + lo.
bool mla_decode_bf16_auto(const kern::AttnParams& a);
// Context splits for the grid: one unless the sequences leave SMs idle; host-known sizes only
// (num_seqs, heads, mla_rows, max_blocks_per_seq), so graphs replay with new metadata.
int mla_decode_splits(const kern::AttnParams& a, int sm_count);
// Grid (num_seqs, a.splits, head chunks); with splits > 1 it writes a.part_o / a.part_ml for
// the shared merge kernel, else the normalized output. bf16_qp: Q and P rounded to BF16 once
// (half the products of the default hi + lo split, which keeps them to ~16 bits). Returns true
// when the splits were merged in the kernel (thread-block clusters, DEEPSERVE_MLA_CLUSTER=1):
// the output is written and no merge kernel must follow.
bool launch_mla_decode(const kern::AttnParams& a, cudaStream_t stream, bool bf16_qp = false);
// Whether the register-Q kernel merges a's splits (a.splits set) in clusters: asked for
// (DEEPSERVE_MLA_CLUSTER=1), sm_90+, 2 to 16 splits, 16-byte aligned output rows, and every
// cluster of the grid resident at once.
bool mla_decode_merges_in_cluster(const kern::AttnParams& a);
// The split count DEEPSERVE_MLA_CLUSTER_FIT=1 launches with: a.splits where its clusters merge in
// the kernel (or it is 2 or fewer), else the largest count down to half of it whose clusters all
// fit at once (so they merge in the kernel, a split perhaps taking one tile more), else a.splits.
int mla_decode_cluster_fit(const kern::AttnParams& a);

// DEEPSERVE_MLA_PHASES=path: every CTA of the register-Q kernel logs when it reached each of its
// phases (attention_mla_decode_tiles.cuh, PhaseLog; up to DEEPSERVE_MLA_PHASES_MAX records,
// default 400,000, after the first DEEPSERVE_MLA_PHASES_SKIP CTAs, on the device that started
// the log), and the log is written to path as a
// table (tools/mla_phase_table.py summarizes it). start: a CUDA backend's constructor, on its
// device, before the pool takes the free memory; write: its destructor (the whole log each time).
// No-ops without the variable.
void mla_phase_log_start();
void mla_phase_log_write();

}  // namespace ds::cuda
