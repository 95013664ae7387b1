// MoE launchers: routing (softmax + greedy / group-limited top-k) and the routed experts.
//
// moe_ffn's implementations share the device token lists (per-expert assignment ranges built
// by one small kernel); the main two:
//   Decode  — per (expert, tile of weight rows) CTAs stream each touched expert's weights once
//             with 16-byte loads and multiply them against all of its tokens in F32; graph
//             capturable, deterministic and batch-invariant (a token's output does not depend
//             on the other tokens of the step).
//   Grouped — BF16 activations, mma.sync tensor-core kernels over per-expert tiles of tokens
//             (moe_grouped.cu; 64-row tiles, or 128 for the Wide variant); graph capturable,
//             deterministic and batch-invariant too.
// (Streamed and the cuBLAS Prefill path: see MoeFfnPath.) All end in the same deterministic
// combine: out[t] = sum over k (ascending) of w * y.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "backend/backend.h"
#include "backend/cuda/context.cuh"
#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/norm_rows.cuh"
#include "backend/cuda/weight_stream.cuh"
#include "core/error.h"
#if defined(__CUDACC__)
#include "backend/cuda/pdl.cuh"
#endif

namespace ds::cuda {

// Semantics of Backend::moe_route (backend.h). At most 256 experts, top_k <= 32,
// n_group <= 32. One warp per token.
void moe_route(const Context& ctx, const TensorView& logits, const MoeRouteParams& p,
               TensorView ids, TensorView weights);

// Semantics of Backend::moe_ffn (backend.h). Keeps per-expert pointer tables on the device,
// keyed by p.experts.data(); the first call for a table (and for a device) must happen
// outside graph capture. With post (AddNormParams of p.out, at most kAddNormMaxRows tokens),
// the Decode path's down kernel also adds and normalizes where it does the combine: returns
// whether it did (false: the caller runs the norm).
bool moe_ffn(const Context& ctx, const MoeFfnParams& p, const AddNormArgs* post = nullptr);

// Which moe_ffn implementation runs (W4A16 / FP8W experts: always their own tensor-core
// kernels, moe_wq.cu, on the Grouped path's scratch, whatever the path asked). Auto, for BF16
// experts: Decode below kMoeGroupedMinAssignments (token, expert) pairs, Prefill from
// kMoePrefillMinAssignments while the stream is not being captured (Wide when it is), Grouped in
// between; F16 / F32 experts always take Decode. Streamed (BF16): the quantized-weight
// tensor-core kernels (moe_wq.cu) on BF16 rows, any T (8, 16 or 64 tokens per CTA); Auto takes
// it where it would take Grouped with at most kWqBf16MaxTokens tokens (so the steps that ran the
// F32-activation decode kernels still do: a batch of a few sequences decodes bit for bit as each
// alone; past 16 tokens it is not measured against Grouped yet). Tests and benchmarks force one.
// Wide: the grouped kernels with 128-row tiles (a warp owns 64 rows x 64 outputs); graph
// capturable like Grouped, 20-25% faster than it from T = 4096 (H200, V2-Lite + 2 shared:
// 5,508 vs 6,994 us at T = 8192) but slower than Prefill's cuBLAS (3,372 us there), so Auto
// takes it for prefill-sized steps under capture only (DEEPSERVE_MOE_PREFILL=wide: always,
// for A/B runs).
// Split (BF16 or F16 experts): for decode steps of a few tokens, one launch streams each touched
// expert once, a CTA per (expert, strip of kSplitRows F-rows): its gate and up rows, then the
// same F-columns of down against the strip's silu(g) * u kept in shared memory, writing a
// partial output per strip; a small second launch sums the strips and combines (moe_split.cu).
// The Decode path's down kernel waits for every gate/up CTA instead. With DEEPSERVE_MOE_SPLIT=1
// Auto takes Split where it would take Decode for BF16 experts, up to kMoeSplitMaxTokens tokens;
// deterministic and batch-invariant, F32 activations like Decode, in another summation order
// (not Decode's bits). H200, V2-Lite experts + 2 shared, each call after the route kernel
// (MoeBench decode-route / split-route rows): T = 1 50.1 vs 51.0 us, T = 2 86.9 vs 81.6, T = 3
// 130.7 vs 119.6, T = 5 211.9 vs 240.0; W3's TPOT the same (2.86 ms), so it is off by default.
enum class MoeFfnPath : uint8_t { Auto, Decode, Prefill, Grouped, Streamed, Wide, Split };
// From the H200 micro-benchmark (DeepSeek-V2-Lite experts, top-6): decode wins to T = 16,
// grouped from T = 32 (405 vs 438 us) to past T = 1024; cuBLAS per expert at T = 8192.
// With shared experts every one of them holds all T tokens, which the decode kernels stream
// slowly (a tail of CTAs): grouped wins from T = 8 there (260 vs 294 us with 2 shared).
// Streamed against both (H200, the same experts + 2 shared, graph replay): T = 4 117.9 us
// (decode 152.2, grouped 164.8), T = 8 174.6 (grouped 241.2), T = 16 245.7 (grouped 346.5).
constexpr int64_t kMoeGroupedMinAssignments = 160;
constexpr int64_t kMoeGroupedMinSharedTokens = 6;
// The prefill path costs ~2.3 ms of host sync and per-expert launches before its GEMMs (H200,
// V2-Lite experts, no shared: 2404 us at T = 1024, 2890 at 8192; grouped 813 and 5068), so
// grouped wins up to ~4,000 tokens of top-6 (~24,500 assignments).
constexpr int64_t kMoePrefillMinAssignments = 24576;
// The largest step Auto gives the Split path (its partial sums take tokens x slots x strips x
// hidden floats of scratch).
constexpr int64_t kMoeSplitMaxTokens = 8;
// And the most slots per token (routed + shared) it takes: its reduce gives each its own lanes.
constexpr int kMoeSplitMaxSlots = 32;

// What Auto picks for T tokens of top_k routed + `shared` shared experts (wide: Wide instead of
// Prefill outside capture too, DEEPSERVE_MOE_PREFILL=wide; split: Split for BF16 decode steps,
// DEEPSERVE_MOE_SPLIT).
inline MoeFfnPath moe_auto_path(bool bf16, int64_t T, int top_k, int shared, bool capturing,
                                bool wide = false, bool split = false) {
  const int64_t n = T * (top_k + shared);
  if (!bf16) return MoeFfnPath::Decode;
  if (n < kMoeGroupedMinAssignments && (shared == 0 || T < kMoeGroupedMinSharedTokens))
    return split && T <= kMoeSplitMaxTokens && top_k + shared <= kMoeSplitMaxSlots
               ? MoeFfnPath::Split
               : MoeFfnPath::Decode;
  if (T <= kWqBf16MaxTokens) return MoeFfnPath::Streamed;
  if (n < kMoePrefillMinAssignments) return MoeFfnPath::Grouped;
  return capturing || wide ? MoeFfnPath::Wide : MoeFfnPath::Prefill;
}
// stages: which of the Decode and Split paths' two main launches run (bit 0: gate/up, or the
// strip kernel; bit 1: down, or the reduce). For timing each alone (MoeBench): anything but
// kMoeAllStages leaves out wrong. Other paths ignore it.
constexpr int kMoeAllStages = 3;
bool moe_ffn(const Context& ctx, const MoeFfnParams& p, MoeFfnPath path, int stages = kMoeAllStages,
             const AddNormArgs* post = nullptr);

// ---- internals shared by moe*.cu --------------------------------------------------------
class DeviceLog;
// DEEPSERVE_MOE_ITEMS=path: thread 0 of each CTA of the one-launch decode MoE (moe_wq.cu,
// ffn_fused_kernel) logs every item it runs: which item and CTA, its SM, the global timer at its
// start and end, its SM's clock at start, after a down item's wait and at end (up to
// DEEPSERVE_MOE_ITEMS_MAX records, default 400,000, after DEEPSERVE_MOE_ITEMS_SKIP), written to
// path as a table when the backend closes (tools/moe_item_table.py summarizes it): how a
// launch's time splits between items, waits and idle CTAs. The CUDA backend starts it on its
// device; tests open and read it directly.
DeviceLog& moe_item_log();
void moe_item_log_write();  // the table, if DEEPSERVE_MOE_ITEMS named one

namespace moe {

constexpr int kMaxExperts = 256;

// CUDA and cuBLAS errors of the MoE paths, thrown as ds::Error.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA moe ") + what + ": " + cudaGetErrorString(e));
}
inline void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuBLAS moe ") + what + ": " + cublasGetStatusString(s));
}

// One expert's weight matrices in device memory; leading dimensions in elements.
struct ExpertPtrs {
  const void* gate = nullptr;  // [F, hidden]
  const void* up = nullptr;    // [F, hidden]
  const void* down = nullptr;  // [hidden, F]
  int64_t gate_ld = 0;
  int64_t up_ld = 0;
  int64_t down_ld = 0;
  bool operator==(const ExpertPtrs&) const = default;
};

// Assignments (token t, slot j) -> i = t * slots + j with slots = top_k + shared (the shared
// experts' slots follow the routed ones), sorted by expert (then by i).
struct TokenLists {
  int* offsets = nullptr;       // [E + 1] expert e owns sorted positions [offsets[e], offsets[e+1])
  int* active = nullptr;        // [E] experts with at least one assignment, ascending
  int* n_active = nullptr;      // [1] how many entries of `active` are valid
  int* sorted_token = nullptr;  // [N] token of each sorted position
  int* pos = nullptr;           // [N] sorted position of assignment i (-1: expert id out of range)
  // Optional (grouped paths): each expert's run cut into tile_rows-row tiles, experts ascending.
  int* tile_expert = nullptr;  // [max_tiles] expert of tile s
  int* tile_begin = nullptr;   // [max_tiles] first sorted position of tile s
  int* n_tiles = nullptr;      // [1] valid tiles
  int tile_rows = 64;          // kTileM, kSmallTileM or kWideTileM (below)
  // Optional (the wq kernels' one-launch FFN, moe_wq.cu): [1 + max_tiles] work counter, then
  // per tile the gate/up items done; the lists kernel zeroes the counter and the valid tiles'.
  int* sched = nullptr;
};

// Rows per grouped-path tile (kWideTileM: the wide path's; kSmallTileM below), and how many
// tiles N assignments over E experts can need.
constexpr int kTileM = 64;
constexpr int kWideTileM = 128;
// The Grouped path's BF16 kernels take 32-row tiles for steps of up to kSmallTileMaxTokens
// tokens (experts holding a few dozen tokens each: W2's decode left ~24 of 64 rows as padding).
// MoeBench on the H200 (V2-Lite + 2 shared, graph replay): 338 vs 387 us at T = 32, 384 vs 426
// at T = 256. DEEPSERVE_MOE_TILE=64 (g_moe_tile32 off) keeps 64-row tiles.
constexpr int kSmallTileM = 32;
constexpr int64_t kSmallTileMaxTokens = 256;
int64_t max_tiles(int64_t assignments, int num_experts, int tile_rows = kTileM);

// Builds the lists from ids [T, top_k] and `shared` always-on experts (the last ones of
// num_experts) in one CTA; deterministic (no order races). Routed id e is local expert
// e - expert_base (expert parallelism); ids outside the local range are skipped.
void launch_token_lists(const int32_t* ids, int64_t num_tokens, int top_k, int shared,
                        int num_experts, const TokenLists& lists, cudaStream_t stream,
                        int expert_base = 0);

// out[t, :] = sum_{j < top_k, ascending} weights[t, j] * y[pos[t * slots + j], :], then
// + y[pos[t * slots + j], :] for the shared slots j in [top_k, slots).
// y's rows are y_stride floats apart (0: hidden).
void launch_combine(const float* y, const int* pos, const float* weights, int64_t num_tokens,
                    int top_k, int shared, int hidden, float* out, int64_t out_stride,
                    cudaStream_t stream, int64_t y_stride = 0);

// Weight element type of the decode kernels.
using WeightKind = wstream::Elem;

// What every expert implementation gets: the activations, the sizes and the token lists.
struct FfnProblem {
  const float* x = nullptr;  // [T, hidden], row stride x_stride elements
  int64_t x_stride = 0;
  int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 0;  // slots per token: routed + shared
  int hidden = 0;
  int inter = 0;  // F
  TokenLists lists;
  // pdl::prefetch_bytes (opt-in), > 0: down kernels read the lists (written two launches back)
  // before their wait and ask L2 for up to that many bytes of their weight rows
  // (pdl::prefetch_l2); 0: both after the wait.
  int64_t prefetch = 0;
};

#if defined(__CUDACC__)  // device helpers of the moe*.cu kernels
// Reads an int of the token lists; L2: through L2 only (ld.global.cg), for a read made before
// the grid's wait, of lists that a kernel two launches back wrote (the one between waited for
// it, and this grid was launched only after all of that one's CTAs had), so no stale L1 line.
template <bool L2>
__device__ __forceinline__ int list_int(const int* p) {
  if constexpr (L2)
    return __ldcg(p);
  else
    return *p;
}

// A tile of the lists' tile table: expert, first sorted position, valid rows (<= TM); e < 0 for
// slots past the table.
struct Tile {
  int e, begin, rows;
};
template <int TM, bool L2 = false>
__device__ __forceinline__ Tile tile_of(const TokenLists& l, int slot) {
  if (slot >= list_int<L2>(l.n_tiles)) return {-1, 0, 0};
  const int e = list_int<L2>(l.tile_expert + slot);
  const int begin = list_int<L2>(l.tile_begin + slot);
  return {e, begin, min(TM, list_int<L2>(l.offsets + e + 1) - begin)};
}

// Expert of assignment i = t * (top_k + shared) + j: routed slots read ids [T, top_k]; the
// shared slots are the last `shared` experts; -1 for ids out of the routed range. L2: ids read
// through L2 only, as list_int<true> reads the lists (before a wait, ids two launches back).
template <bool L2 = false>
__device__ __forceinline__ int expert_of(const int32_t* ids, int64_t i, int top_k, int shared,
                                         int E, int base) {
  const int slots = top_k + shared;
  const int64_t t = i / slots;
  const int j = int(i - t * slots);
  if (j >= top_k) return E - shared + (j - top_k);
  const int e = list_int<L2>(ids + t * top_k + j) - base;
  return e >= 0 && e < E - shared ? e : -1;
}

// One token's combined output at columns col .. col + V: the sum over its routed slots j
// (ascending) of tw[j] * y[tp[j]], then + y[tp[j]] of each shared slot (tp: the token's sorted
// positions, -1 for none). Each thread issues the loads of kCombineSlots slots before it sums
// them, so a combine costs about one round trip to L2 instead of one per slot. L2: y is read
// through L2 only (ld.global.cg), for a y the calling grid wrote; else read-only loads.
constexpr int kCombineSlots = 16;
template <int V, bool L2>
__device__ __forceinline__ void combine_cols(const float* y, int64_t y_stride, const int* tp,
                                             const float* tw, int top_k, int slots, int col,
                                             float (&acc)[V]) {
  static_assert(V == 1 || V == 4, "1 or 4 columns");
  auto load = [&](const float* src, float(&v)[V]) {
    if constexpr (V == 4) {
      const float4 q =
          L2 ? __ldcg(reinterpret_cast<const float4*>(src)) : wstream::load_float4(src);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      v[0] = L2 ? __ldcg(src) : __ldg(src);
    }
  };
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = 0.0f;
  for (int j0 = 0; j0 < slots; j0 += kCombineSlots) {
    float v[kCombineSlots][V];
#pragma unroll
    for (int i = 0; i < kCombineSlots; ++i) {
      const int j = j0 + i;
      const int p = j < slots ? tp[j] : -1;
      if (p >= 0) {
        load(y + int64_t(p) * y_stride + col, v[i]);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) v[i][e] = 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < kCombineSlots; ++i) {
      const int j = j0 + i;
      if (j >= slots) break;
      if (j < top_k) {
        if (tp[j] >= 0) {
          const float wj = tw[j];
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] = fmaf(wj, v[i][e], acc[e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += v[i][e];
      }
    }
  }
}

// A down kernel's start: its lookup in the token lists (lookup(std::bool_constant<L2>) returns
// something with .e, < 0 for none) and the wait (pdl::enter). With FfnProblem::prefetch the
// lookup comes before the wait, through L2, and thread 0 then runs ask(found) (its weight
// prefetch); without it, the lookup follows the wait.
template <typename Lookup, typename Ask>
__device__ __forceinline__ auto down_start(int64_t prefetch, Lookup lookup, Ask ask) {
  if (prefetch > 0) {
    const auto found = lookup(std::true_type{});
    if (found.e >= 0 && threadIdx.x == 0) ask(found);
    pdl::enter();
    return found;
  }
  pdl::enter();
  return lookup(std::false_type{});
}
#endif

// Row tiles the decode path's fused combine can count arrivals for (the down grid's width; a
// wider grid keeps the combine launch).
constexpr int kTileCounters = 4096;

struct DecodeFfnArgs : FfnProblem {
  const ExpertPtrs* experts = nullptr;  // device [E]
  WeightKind kind = WeightKind::BF16;
  float* h = nullptr;  // [N, F] silu(gate x) * up x per sorted position
  float* y = nullptr;  // [N, hidden] down h per sorted position
  int sm_count = 0;    // sizes the grids to one wave where it can (0: the base sizes)
  // The combine fused into the down kernel (launch_decode_ffn; out null: not asked): out[t] =
  // what launch_combine would write, from weights [T, routed] and the lists' pos.
  float* out = nullptr;
  int64_t out_stride = 0;
  const float* weights = nullptr;
  int routed = 0;            // routed slots per token (top_k - shared)
  int* tile_done = nullptr;  // [kTileCounters] arrival counters, all zero between launches
  // The add and norm after the combine (post.counter non-null; moe_ffn's post): the last row
  // tile's last CTA to finish its combine does it.
  AddNormArgs post;
  // Steps of at most kWarpListMax assignments: with ids [T, routed] the gate/up kernel builds
  // the token lists itself (one warp per CTA; CTA (0, 0) also stores the lists the down kernel
  // and the combine read), in place of the token-list kernel. prefetch must be 0 then: the
  // lists are written one launch before the down kernel, not two.
  const int32_t* ids = nullptr;
  int expert_base = 0;
  // Split: [N, split_strips(F), hidden] each sorted position's partial output per strip, and
  // whether its CTAs ask L2 for their strip of down first (DEEPSERVE_MOE_SPLIT_PREFETCH).
  float* part = nullptr;
  bool prefetch_down = false;
  int stages = kMoeAllStages;  // moe_ffn's stages
  // Activation rows staged a batch of loads at a time (stage_rows' batched; launch_decode_ffn
  // sets it from DEEPSERVE_ROW_REGS).
  bool stage_regs = false;
};
constexpr int64_t kWarpListMax = 32;

// F-rows per Split CTA (its strip of down is kSplitRows columns: 64 bytes of each BF16 row).
constexpr int kSplitRows = 32;
inline int split_strips(int inter) {
  return (inter + kSplitRows - 1) / kSplitRows;
}
// The Split path (MoeFfnPath::Split; BF16 or F16 weights, at most kMoeSplitMaxSlots slots): the
// strip kernel into a.part, then the reduce, which writes a.out from a.weights and the lists.
void launch_split_ffn(const DecodeFfnArgs& a, cudaStream_t stream);

// Gate/up then down over the token lists. Grid sizes depend only on T, top_k, E, shapes and
// sm_count. With a.out (and a.tile_done for the down grid's row tiles) the down kernel also does
// the combine: returns whether it did (false: launch_combine is still to run).
bool launch_decode_ffn(const DecodeFfnArgs& a, cudaStream_t stream);
// Launches of launch_decode_ffn's early variants so far in this process (tests check that the
// switch they turn on is taken): the shared-first gate/up kernel (DEEPSERVE_MOE_SHARED_EARLY)
// and the down kernel's early start (DEEPSERVE_MOE_DOWN_EARLY).
struct EarlyLaunchCounts {
  std::atomic<int64_t> shared_first{0}, down_early{0};
};
EarlyLaunchCounts& early_launch_counts();
// The same for GGUF block-quantized experts (moe_gguf.cu; leading dimensions in bytes, hidden
// and F whole numbers of blocks).
void launch_gguf_ffn(const DecodeFfnArgs& a, DType dtype, cudaStream_t stream);
// Raise the dynamic shared-memory limit of every decode (moe_decode.cu) and split
// (moe_split.cu) kernel (once per device).
void prepare_decode_kernels();
void prepare_split_kernels();
// Shared-memory bytes the decode kernels stage activations in; K (hidden or F) must fit
// at least one token.
constexpr int kDecodeStageBytes = 64 * 1024;

// Experts run concurrently on up to kPrefillStreams side streams (each its own cuBLAS handle),
// so every buffer region is one expert's rows only: gu row p holds gate | up, then y (ld 2F).
constexpr int kPrefillStreams = 8;
constexpr int kExpandChunks = 8;
// How many of them a step uses: DEEPSERVE_MOE_STREAMS (1-8), else 4.
int prefill_streams();
struct PrefillFfnArgs : FfnProblem {
  const ExpertPtrs* experts = nullptr;         // host [E]; BF16 weights, or W4A16 / FP8W (wdtype)
  const cublasHandle_t* cublas = nullptr;      // [kPrefillStreams], handle i bound to streams[i]
  const cudaStream_t* streams = nullptr;       // [kPrefillStreams]
  const cudaEvent_t* events = nullptr;         // [kPrefillStreams + 1]: fork, then one join each
  const cudaEvent_t* expand_events = nullptr;  // [kExpandChunks]: quantized experts expanded
  int num_streams = 1;
  void* xg = nullptr;   // [N, hidden] BF16: gathered x
  void* act = nullptr;  // [N, F] BF16: silu(g) * u
  float* gu = nullptr;  // [N, ld_gu] F32: gate | up, then y in the row's first hidden floats
  int64_t ld_gu = 0;    // max(2F, hidden)
  // Quantized experts (wdtype W4A16 / FP8W): expanded to BF16 (wq_dequant.cuh) into wslots
  // ([wslot_count][3 * F * hidden]: gate, up, down) from the device table, on the calling
  // stream in kExpandChunks launches (in the order the GEMMs take them) while the side streams
  // run the GEMMs of the experts already expanded. With fewer slots than touched experts
  // (moe_wq_expand_slots) the chunks take turns in a ring of whole chunks: chunk c + R is
  // expanded into chunk c's slots once every side stream is past chunk c's GEMMs.
  DType wdtype = DType::BF16;
  const ExpertPtrs* experts_device = nullptr;
  void* wslots = nullptr;
  int64_t wslot_count = 0;
};

struct GroupedFfnArgs : FfnProblem {    // lists with the tile table
  const ExpertPtrs* experts = nullptr;  // device [E]; BF16 weights
  void* xa = nullptr;  // BF16: x gathered per sorted position [N, hidden] (W4A16 / FP8W /
                       // Streamed; not FP8W's decode variants, which read x's F32 rows), or x
                       // itself [T, hidden] (Grouped / Wide)
  void* h = nullptr;   // [N, F] BF16: silu(gate x) * up x
  float* y = nullptr;  // [N, hidden] F32: down h
  bool wq_issue_first = false;  // the wq launches set it per format (moe_wq.cu, issue_first_of)
  bool wq_skip_scales = false;  // DEEPSERVE_WQ_PROBE_SKIP_SCALES (CtaJob::skip_scales)
  int num_shared = 0;  // always-on experts: the last of num_experts, so of the tile table too
  // DEEPSERVE_MOE_ITEMS (moe_item_log): the one-launch FFN's item log (device_log.h), or null.
  unsigned long long* item_log = nullptr;
  int item_cap = 0;
  long long item_skip = 0;
};

// x to BF16 [T, hidden], then the gate/up and down tensor-core kernels over the tile table
// (lists.tile_rows: kTileM, kSmallTileM or kWideTileM); no host sync.
void launch_grouped_ffn(const GroupedFfnArgs& a, cudaStream_t stream);
// The same for W4A16 / FP8W experts (moe_wq.cu): weights dequantized in registers.
void launch_wq_ffn(const GroupedFfnArgs& a, DType dtype, cudaStream_t stream);
void prepare_grouped_kernels();

// act[p, :] = x[sorted_token[p], :] for p < *assigned (grid n rows; sorted_token null: row p of
// x; assigned null: all n rows), 16 bits an element as the kernels of format `as` stage them:
// BF16; W4A16's 8-column chunks in its order (wq_kernel.cuh, w4_stage_pos; hidden a multiple
// of 8); FP8W's FP16, saturated at its range.
void launch_gather_act(const float* x, int64_t x_stride, const int* sorted_token,
                       const int* assigned, int64_t n, int hidden, void* act, cudaStream_t stream,
                       WqFormat as = WqFormat::BF16);

// Gathers, runs the GEMMs of every touched expert and leaves y [N, hidden] F32 in a.gu.
// Synchronizes the stream once to read the per-expert counts.
void run_prefill_ffn(const PrefillFfnArgs& a, cudaStream_t stream);

}  // namespace moe
}  // namespace ds::cuda
