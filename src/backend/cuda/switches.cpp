#include "backend/cuda/switches.h"

#include <cstdlib>
#include <cstring>

namespace ds::cuda {

bool EnvSwitch::on() const {
  const int forced = forced_.load(std::memory_order_relaxed);
  if (forced >= 0) return forced != 0;
  std::call_once(read_, [this] {
    const char* v = std::getenv(name_);
    env_ = default_on_ != (v != nullptr && std::strcmp(v, flip_) == 0);
  });
  return env_;
}

void EnvSwitch::force(int mode) {
  forced_.store(mode < 0 ? -1 : mode != 0, std::memory_order_relaxed);
}

long long EnvCount::get() const {
  const long long forced = forced_.load(std::memory_order_relaxed);
  if (forced > 0) return forced;
  std::call_once(read_, [this] {
    const char* v = std::getenv(name_);
    char* end = nullptr;
    const long long n = v ? std::strtoll(v, &end, 10) : 0;
    env_ = v && end != v && *end == '\0' && n > 0 ? n : default_;
  });
  return env_;
}

void EnvCount::force(long long value) {
  forced_.store(value > 0 ? value : 0, std::memory_order_relaxed);
}

EnvSwitch g_pdl{"DEEPSERVE_PDL", "0", true};
EnvCount g_graph_piece_layers{"DEEPSERVE_GRAPH_PIECE_LAYERS", 0};
// Weight-streaming kernels ask L2 for their weights before they wait on the kernel ahead of
// them (pdl.cuh, prefetch_l2); off: they fetch only after the wait. The same bits either way.
// Off by default: on the H200 (4beef66) it slowed W3 (3.16 -> 3.28 ms), W1 and W2 and sped up
// only W1q (4.46 -> 4.29 ms); docs/PERFORMANCE.md, thirteenth session.
EnvSwitch g_prefetch{"DEEPSERVE_PREFETCH", "1", false};
// With it on, which kernels prefetch (pdl::PrefetchKind bits: 1 skinny GEMM, 2 dense wq GEMM,
// 4 MoE down kernels) and at most how many bytes each CTA asks for (default: all its rows).
EnvCount g_prefetch_kinds{"DEEPSERVE_PREFETCH_KINDS", 7};
EnvCount g_prefetch_cap{"DEEPSERVE_PREFETCH_CAP", 1LL << 40};
EnvSwitch g_mla_prepare{"DEEPSERVE_MLA_PREPARE", "0", true};
// The MLA prepare kernel's q rope pairs a CTA at most, in decode-sized steps: the token's pairs
// spread over that many more CTAs (a count at least the pairs, e.g. 4096 at 128 heads: one CTA a
// token). The same bits. 512: W5's 4,096 pairs a token in 8 CTAs, V2-Lite's 512 in one as
// before; W5 with 20 layers on an H100 +0.9% (1,001.0 -> 1,010.5 tok/s, two rounds, 6c106f6;
// docs/PERFORMANCE.md, forty-first session).
EnvCount g_mla_prepare_pairs{"DEEPSERVE_MLA_PREPARE_PAIRS", 512};
EnvSwitch g_mla_decode_bf16{"DEEPSERVE_MLA_DECODE", "bf16", false};
EnvSwitch g_mla_decode_regq{"DEEPSERVE_MLA_DECODE_REGQ", "0", true};
EnvSwitch g_moe_prefill_wide{"DEEPSERVE_MOE_PREFILL", "wide", false};
EnvSwitch g_moe_tile32{"DEEPSERVE_MOE_TILE", "64", true};
EnvSwitch g_moe_prefill_timing{"DEEPSERVE_MOE_PREFILL_TIMING", "1", false};
// The dense wq GEMM's decode variants read F32 x in the kernel (off: a conversion launch
// before it) and sum their split-K partials across a thread-block cluster (off: a reduce
// launch after it). The same bits either way.
EnvSwitch g_wq_stage_f32{"DEEPSERVE_WQ_XF32", "0", true};
EnvSwitch g_wq_cluster{"DEEPSERVE_WQ_CLUSTER", "0", true};
// FP8W's decode variants read x's F32 rows through the sorted tokens and round them in the
// kernel (off: a gather launch into BF16 rows first). The same bits either way.
EnvSwitch g_moe_wq_stage_f32{"DEEPSERVE_MOE_WQ_XF32", "0", true};
// The quantized experts' decode variants run gate/up and down in one launch that takes its
// items from a counter (moe_wq.cu, ffn_fused_kernel; DEEPSERVE_MOE_WQ_FUSED=0: two launches).
// H200 (8f94be4), one run each: W1f TPOT 4.55 -> 4.49 ms (1,665.6 -> 1,683.3 tok/s), W5 20.16 ->
// 19.81 (360.0 -> 365.8 tok/s). The same bits either way.
EnvSwitch g_moe_wq_fused{"DEEPSERVE_MOE_WQ_FUSED", "0", true};
// The same for BF16 experts on the Streamed path (W1's decode steps), off until measured.
EnvSwitch g_moe_bf16_fused{"DEEPSERVE_MOE_BF16_FUSED", "1", false};
// The one-launch FFN takes the shared experts' items first, and the CTAs that will find them
// ask L2 for those gate/up weights before the dependent-launch wait (moe_wq.cu; the same bits).
// DEEPSERVE_MOE_WQ_SHARED_FIRST=1; off until measured.
EnvSwitch g_moe_wq_shared_first{"DEEPSERVE_MOE_WQ_SHARED_FIRST", "1", false};
// The one-launch FFN's W4A16 stages at 8 tokens read 256 contiguous bytes of half the CTA's rows
// instead of 128 of all of them (run_cta_halves, moe_wq.cu; the same bits). Off until
// measured: DEEPSERVE_MOE_WQ_HALVES=1.
EnvSwitch g_moe_wq_halves{"DEEPSERVE_MOE_WQ_HALVES", "1", false};
// batched_matmul's decode-sized BF16 products past the skinny kernel (MLA's absorbed W_UK / W_UV
// at 128 heads) run on the dense wq kernel (off: cuBLAS, x rounded to BF16 by a conversion
// launch; the same rounding, not the same bits).
EnvSwitch g_wq_batched{"DEEPSERVE_WQ_BATCHED", "0", true};
// DEEPSERVE_NORM_FUSE=1: norm_matmul on skinny-sized products runs the residual add and RMS norm
// inside the GEMM's CTAs (off: the norm kernel, then the GEMM). The same bits either way. Off
// by default: slower on the H200 (W3 TPOT 3.27 against 3.14 ms, W1 1,092 against 1,199 tok/s;
// docs/PERFORMANCE.md, twentieth session).
EnvSwitch g_norm_fuse{"DEEPSERVE_NORM_FUSE", "1", false};
// matmul_add_norm on skinny-sized products (o_proj at decode) and the MoE's Decode path add and
// normalize in the kernel's last CTA to finish (DEEPSERVE_ADD_NORM_LAST=0: the norm kernel after
// it), a launch and its wait fewer a norm. The same bits either way. On as part of the W3 set
// measured together (2.77 -> 2.48 ms, docs/PERFORMANCE.md, twenty-sixth session); alone it
// measured no change (2.77 ms).
EnvSwitch g_add_norm_last{"DEEPSERVE_ADD_NORM_LAST", "0", true};
// The skinny GEMM splits K only while its grid fits one CTA an SM (skinny::make_plan's
// one_wave; DEEPSERVE_SKINNY_ONE_WAVE=0: until it holds two CTAs an SM): W3's q / kv_a and o_proj
// products ran in ~4 waves of one CTA an SM at ~1-1.5 TB/s (the 255-register one-token kernel).
// Another order of sums. W3 TPOT 2.77 -> 2.52 ms alone (twenty-sixth session).
EnvSwitch g_skinny_one_wave{"DEEPSERVE_SKINNY_ONE_WAVE", "0", true};
// Every skinny GEMM loads its first step of weight chunks into registers before the
// dependent-launch wait (DEEPSERVE_SKINNY_EARLY=0: after it; the fused norm GEMM always does).
// The same bits either way.
EnvSwitch g_skinny_early{"DEEPSERVE_SKINNY_EARLY", "0", true};
// The register-Q MLA decode kernel looks up its cache slots and issues its first tile's copies
// before the dependent-launch wait when the model says the cache was written before the op
// ahead (MlaAttentionParams::cache_settled); DEEPSERVE_MLA_EARLY=0: after it. The same bits.
EnvSwitch g_mla_early{"DEEPSERVE_MLA_EARLY", "0", true};
// The decode variants of the wq kernels (dense; MoE down, and gate/up after a gather launch) ask
// for their first stages' weights before the dependent-launch wait (DEEPSERVE_WQ_EARLY=0: after
// it). The same bits either way.
EnvSwitch g_wq_early{"DEEPSERVE_WQ_EARLY", "0", true};
// The wq kernels' pipeline issues a stage's next copies before waiting for the stage
// (DEEPSERVE_WQ_ISSUE_FIRST=1; wq_kernel.cuh, run_cta): two barriers a stage instead of one,
// and one more stage of weights in flight during the wait. The same bits. Every format's with
// the switch; on an H100 (twenty-seventh session) W1f's TPOT -1.1%, W1's +0.5% (twenty-eighth:
// +0.1%), so only FP8W's is on by default (the next switch); W5 (W4A16) is unmeasured.
EnvSwitch g_wq_issue_first{"DEEPSERVE_WQ_ISSUE_FIRST", "1", false};
// FP8W's alone, on by default: two H100 calls (twenty-seventh and twenty-eighth sessions, two
// machines) gave W1f's TPOT -1.1% each (5.57 -> 5.51, 5.58 -> 5.52 ms; the MoE and the dense
// products of FP8W run two-stage pipelines, where one more stage in flight counts); W1 (BF16
// weights, three stages) moved +0.1% to +0.5% with it, so the other formats keep the default
// order. On an H200 (twenty-ninth session, machine M, one run each) W1f was 4.62 ms with it
// and 4.64 without: no loss there either.
EnvSwitch g_wq_issue_first_fp8w{"DEEPSERVE_WQ_ISSUE_FIRST_FP8W", "0", true};
// A measurement probe, never for serving: the W4A16 / FP8W kernels' scale copies read nothing
// (zero-filled, so every product is zero), with the same instructions as ever. What the scale
// words cost is the difference in WqBench's times with and without it (H100, thirty-fourth
// session: 5% of the V2.5 MoE at T = 8; staging them in blocks, with 4-8x fewer requests, did
// not shrink that, so it is their bytes).
EnvSwitch g_wq_skip_scales{"DEEPSERVE_WQ_PROBE_SKIP_SCALES", "1", false};

// Prefill-sized products on quantized weights go through a BF16 copy of the matrix (or expert)
// and cuBLAS (wq_dequant.cuh); off: always the in-register kernels.
EnvSwitch g_wq_dequant{"DEEPSERVE_WQ_DEQUANT", "0", true};
EnvCount g_wq_dequant_min_rows{"DEEPSERVE_WQ_DEQUANT_MIN_ROWS", 512};
EnvCount g_moe_wq_dequant_min{"DEEPSERVE_MOE_WQ_DEQUANT_MIN", 384};
EnvCount g_moe_wq_expand_max_mb{"DEEPSERVE_MOE_WQ_EXPAND_MAX_MB", 0};  // 0: kMoeWqExpandMaxBytes
// CTAs per SM the dense wq GEMM's split-K count aims for at decode sizes (unset: 4, FP8W 2).
// Another split count sums K in other pieces: not the same bits, still batch-invariant.
EnvCount g_wq_split_ctas{"DEEPSERVE_WQ_SPLIT_CTAS", 0};

// The decode MoE kernels' row units per warp, as a multiple of what the pass size asks for
// (unset: the smallest multiple, up to 4, whose grid fits one wave of resident CTAs; 1: the
// grids before that sizing). The same bits either way: a unit's sums do not depend on which
// warp or CTA runs it.
EnvCount g_moe_decode_upw{"DEEPSERVE_MOE_DECODE_UPW", 0};
// Chunks per weight row a lane of the decode MoE kernels has in flight for passes of up to 2
// tokens: 4 (unset; W3 TPOT 2.99 / 3.02 ms against 3.05 / 3.07 with 2, H200, cef1370), or 2
// (DEEPSERVE_MOE_DECODE_UNROLL=2). The same bits either way (moe_decode.cu).
EnvCount g_moe_decode_unroll{"DEEPSERVE_MOE_DECODE_UNROLL", 4};
// The decode MoE's combine (each token's expert outputs summed in slot order) done by the last
// down CTA of each row tile instead of a launch of its own. The same bits either way.
EnvSwitch g_moe_fused_combine{"DEEPSERVE_MOE_FUSED_COMBINE", "0", true};
// Decode MoE steps of at most 32 assignments (moe::kWarpListMax): the gate/up kernel builds the
// token lists itself, one launch fewer (off: the token-list kernel). The same bits either way.
EnvSwitch g_moe_warp_lists{"DEEPSERVE_MOE_WARP_LISTS", "0", true};
// DEEPSERVE_MOE_SPLIT=1: BF16 decode MoE steps of at most kMoeSplitMaxTokens tokens take the
// Split path (moe.cuh: a CTA streams gate, up and a column strip of down, then a reduce) instead
// of the Decode path's gate/up and down kernels. Not the same bits (another summation order).
// Off by default: W3 measured the same either way (docs/PERFORMANCE.md, 2026-12-04).
EnvSwitch g_moe_split{"DEEPSERVE_MOE_SPLIT", "1", false};
// DEEPSERVE_MOE_SPLIT_PREFETCH=1: each Split CTA asks L2 for its strip of down before it streams
// its gate and up rows (off: it reads the strip when it gets there). The same bits either way.
EnvSwitch g_moe_split_prefetch{"DEEPSERVE_MOE_SPLIT_PREFETCH", "1", false};
// The decode MoE's down CTAs find their expert (from the route kernel's ids or the token-list
// kernel's lists, two launches back) and load the first step of their weight rows before the
// dependent-launch wait, during the gate/up kernel's tail (DEEPSERVE_MOE_DOWN_EARLY=0: after it).
// On since the H200 A/B of 2026-12-05 (W3 -2.5% alone; docs/PERFORMANCE.md). The same bits
// either way (moe_decode.cu).
EnvSwitch g_moe_down_early{"DEEPSERVE_MOE_DOWN_EARLY", "0", true};
// In one-token decode MoE steps (W3) the gate/up kernel computes the shared experts' rows before
// the dependent-launch wait (their token and weights are known before the route kernel ends; x
// was written three launches back), so they overlap the route kernel; routed experts follow the
// wait (DEEPSERVE_MOE_SHARED_EARLY=0: all after it). On since the H200 A/B of 2026-12-05 (W3
// -1.1% alone). The same bits.
EnvSwitch g_moe_shared_early{"DEEPSERVE_MOE_SHARED_EARLY", "0", true};
// The most splits the MLA decode kernels cut a short context into (long ones: up to 128).
EnvCount g_mla_max_splits{"DEEPSERVE_MLA_SPLITS", 16};
// The register-Q MLA decode kernel's splits of a sequence are one thread-block cluster that
// merges them through distributed shared memory (no partials in global memory, no merge
// launch), where every cluster fits at once (DEEPSERVE_MLA_CLUSTER=0: partials and the merge
// kernel). On since the H200 A/B of 2026-12-05 (W3 -0.6% alone). The same bits either way
// (attention_mla_decode_tiles.cuh).
EnvSwitch g_mla_cluster{"DEEPSERVE_MLA_CLUSTER", "0", true};
// Kernels that walk a row a few elements a thread hold a thread's elements
// in registers, so the row's loads issue at once instead of a round trip per element (or per 1,
// 2, 4 of them): the one-CTA-per-row norms (rms_norm, add_rms_norm, mla_prepare), which also
// read their weights (and mla_prepare its rotation angles and cache slot, the step's metadata)
// before the dependent-launch wait, the norm inside the skinny GEMM (DEEPSERVE_NORM_FUSE=1), and
// the decode MoE's staging of x and h into shared memory, and the quantized MoE's gather of token
// rows (DEEPSERVE_ROW_REGS=0: the loops). On since the H200 A/B of 2026-12-05 (W3 -3.4% alone,
// -9.5% with the three above; W1 +2.2% with them). The same bits either way (norm.cu,
// mla_prepare.cu, gemm_skinny.cu, moe_decode.cuh, moe_prefill.cu).
EnvSwitch g_row_regs{"DEEPSERVE_ROW_REGS", "0", true};
// The register-Q MLA decode reads Q's element pairs in one 8-byte load each where the rows allow
// (36 loads a thread after the dependent-launch wait, not 72; DEEPSERVE_MLA_Q_PAIRS=0: two).
// The same values.
EnvSwitch g_mla_q_pairs{"DEEPSERVE_MLA_Q_PAIRS", "0", true};
// The register-Q MLA decode's in-cluster merge reads every split's max and sum in one round, then
// every split's values at once (DEEPSERVE_MLA_MERGE_GATHER=1; off: the shared merge's chunked
// reads, ~8 rounds of remote reads, which DEEPSERVE_MLA_PHASES measured at 7.2 of W3's 15.4 us).
// The same bits (DEEPSERVE_MLA_MERGE_GATHER=0 turns it off). With DEEPSERVE_MLA_Q_SPLIT2, W3
// 2.77 -> 2.75 ms (twenty-sixth session).
EnvSwitch g_mla_merge_gather{"DEEPSERVE_MLA_MERGE_GATHER", "0", true};
// The register-Q MLA decode's Q loads unconditional (a padding row reads the chunk's first head,
// zeroed after) and each element pair split into BF16 hi + lo at once (DEEPSERVE_MLA_Q_SPLIT2=1;
// SASS: 895 -> 657 instructions after the wait). The same values (DEEPSERVE_MLA_Q_SPLIT2=0: off).
EnvSwitch g_mla_q_split2{"DEEPSERVE_MLA_Q_SPLIT2", "0", true};
// Fewer MLA decode splits where that lets their clusters all be resident, so they merge in the
// kernel (attention.cu, run_mla_decode); off until measured.
EnvSwitch g_mla_cluster_fit{"DEEPSERVE_MLA_CLUSTER_FIT", "1", false};
// The register-Q MLA decode with BF16 Q / P takes 32 heads a CTA (two 16-row halves sharing
// each staged tile's fragments) where a model has 32 heads or more (DEEPSERVE_MLA_ROWS32=1;
// attention_mla_decode_regq.cu, mla_decode_rows). Off: at W5's shapes on an H100 it was 0.7%
// slower than the hi + lo 16-row form (1719a42), which is 1.4% slower than the BF16 16-row form
// (7e6a912); no H200 has run it.
EnvSwitch g_mla_rows32{"DEEPSERVE_MLA_ROWS32", "1", false};
// Auto's MLA decode takes BF16 Q / P (FlashMLA's precision) for models of at least this many
// heads (DEEPSERVE_MLA_BF16_MIN_HEADS; 0: never): W5's 128 heads pay for the hi + lo form's
// second product (W5 with 20 layers on an H100, 7e6a912, two rounds: TPOT 7.96 -> 7.84 ms,
// +1.4% tok/s), V2-Lite's 16 keep it (mla_decode_bf16_auto).
EnvCount g_mla_bf16_min_heads{"DEEPSERVE_MLA_BF16_MIN_HEADS", 64};

namespace {
std::atomic<int64_t> g_row_regs_launches{0}, g_moe_wq_fused_launches{0},
    g_moe_wq_halves_launches{0};
}  // namespace
int64_t row_regs_launches() {
  return g_row_regs_launches.load(std::memory_order_relaxed);
}
void note_row_regs_launch() {
  g_row_regs_launches.fetch_add(1, std::memory_order_relaxed);
}
int64_t moe_wq_fused_launches() {
  return g_moe_wq_fused_launches.load(std::memory_order_relaxed);
}
void note_moe_wq_fused_launch() {
  g_moe_wq_fused_launches.fetch_add(1, std::memory_order_relaxed);
}
int64_t moe_wq_halves_launches() {
  return g_moe_wq_halves_launches.load(std::memory_order_relaxed);
}
void note_moe_wq_halves_launch() {
  g_moe_wq_halves_launches.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace ds::cuda
