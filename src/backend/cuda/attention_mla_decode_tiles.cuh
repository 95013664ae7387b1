// What the two MLA decode kernels share (attention_mla_decode.cu: the first kernel, also for FP8
// caches; attention_mla_decode_regq.cu: Q in registers, BF16 caches): the CTA shape, the staged
// rows' swizzle, the hi + lo split of F32 values, a split's key range and the row stores.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/attention_mla_decode.cuh"
#include "backend/cuda/device_log.cuh"
#include "backend/cuda/mma_ptx.cuh"

namespace ds::cuda::mla_decode {

using ptx::smem_u32;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;           // heads per CTA
constexpr int kKeys = 64;           // keys per tile
constexpr int kR = kMlaDecodeRank;  // value dims; kWarps x 64
constexpr int kMaxDim = kR + kMlaDecodeMaxRope;
constexpr int kRowBytes = kMaxDim * 2;  // staged row stride (BF16)
constexpr int kTileBytes = kKeys * kRowBytes;
constexpr int kPBytes = kRows * kKeys * 2;
constexpr int kSlotBytes = kKeys * 8;  // cache slot of each key of a tile (-1: none)
static_assert(kR == kWarps * 64, "each warp owns 64 value dims");

// DEEPSERVE_MLA_PHASES (attention_mla_decode.cuh): thread 0 of every CTA of the register-Q
// kernel stamps its SM's clock at the kernel's phases (kMlaPhases: entry, slots, tile 0 issued,
// after the dependent-launch wait, Q in registers, tile 0 visible, tile 0 done, loop done,
// end) and the global timer at entry and end, into one record of the log: where a CTA's time
// goes inside a replayed graph, which neither Nsight Compute (a kernel alone) nor the kernel
// trace (a kernel's span) shows. Record words: 0 seq | split << 24 | tiles << 40, 1 SM |
// head chunk << 16, 2 / 3 global timer at entry / end (ns), 4 + i clock at phase i.
constexpr int kMlaPhases = 9;
constexpr int kMlaPhaseWords = 16;
struct PhaseLog {
  unsigned long long* rec = nullptr;  // this CTA's record (thread 0 of a logged CTA), else null

  __device__ __forceinline__ void open(const kern::AttnParams& p) {
    if (p.phase_log == nullptr || threadIdx.x != 0) return;
    // (device_log::claim's steps, spelled out: through the call the kernel's registers were
    // allocated differently, and the kernel is the decode step's.)
    const unsigned long long n = atomicAdd(p.phase_log, 1ull);
    const unsigned long long skip = static_cast<unsigned long long>(p.phase_skip);
    if (n < skip || n - skip >= static_cast<unsigned long long>(p.phase_cap)) return;
    rec = p.phase_log + (n - skip + 1) * kMlaPhaseWords;
    rec[2] = device_log::globaltimer();
    rec[4] = clock64();
  }
  __device__ __forceinline__ void mark(int phase) {
    if (rec) rec[4 + phase] = clock64();
  }
  __device__ __forceinline__ void close(int seq, int split, int tiles) {
    if (!rec) return;
    rec[4 + kMlaPhases - 1] = clock64();
    rec[3] = device_log::globaltimer();
    const unsigned sm = device_log::smid();
    rec[0] = static_cast<unsigned long long>(seq) | static_cast<unsigned long long>(split) << 24 |
             static_cast<unsigned long long>(tiles) << 40;
    rec[1] = sm | static_cast<unsigned long long>(blockIdx.z) << 16;
  }
};

// Byte offset of 16-byte chunk c of a staged row r (rows of `row_bytes`): chunks swizzled
// within groups of 8 by the row, so ldmatrix's 8 rows of a phase hit 8 different bank groups.
__device__ __forceinline__ uint32_t swz(int r, int c, int row_bytes) {
  return uint32_t(r * row_bytes + (((c & ~7) | ((c ^ r) & 7)) << 4));
}

// BF16 hi + lo of v (v ~= hi + lo to about 16 significant bits).
__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  lo = __float2bfloat16_rn(v - __bfloat162float(hi));
}

// split_bf16 of a and b, packed as BF16x2 (a low): hi in one rounding of both (the same
// round-to-nearest per value), the remainders from hi's exact F32 values.
__device__ __forceinline__ void split_bf16x2(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  const float ra = a - __uint_as_float(hi << 16), rb = b - __uint_as_float(hi & 0xffff0000u);
  const __nv_bfloat162 l = __floats2bfloat162_rn(ra, rb);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// The keys of split `split` of sequence `seq`: whole 64-key tiles, as few splits as the context
// needs. Returns false (in every thread) for a split with no keys, after telling the merge to
// skip it (report_empty: through part_ml for the CTA's `rows` heads from h0; the in-cluster merge
// is told through shared memory).
struct SplitKeys {
  int token = 0, key_begin = 0, key_end = 0;
  bool partial = false;
};
__device__ __forceinline__ bool split_keys(const kern::AttnParams& p, int seq, int split, int h0,
                                           int tid, SplitKeys& k, bool report_empty = true,
                                           int rows = kRows) {
  k.token = p.query_start[seq];
  const int ctx = p.context_lens[seq];
  const int tiles_total = (ctx + kKeys - 1) / kKeys;
  const int used = min(p.splits, tiles_total);
  const int tiles_per = used > 0 ? (tiles_total + used - 1) / used : 0;
  k.key_begin = split * tiles_per * kKeys;
  k.key_end = min(ctx, k.key_begin + tiles_per * kKeys);
  k.partial = p.splits > 1;
  if (k.key_begin < k.key_end) return true;
  if (report_empty && k.partial && tid < rows && h0 + tid < p.heads) {
    float* ml = p.part_ml + ((int64_t(split) * p.num_tokens + k.token) * p.heads + h0 + tid) * 2;
    ml[0] = -INFINITY;
    ml[1] = 0.0f;
  }
  return false;
}

// Rows g and g + 8 of a warp's 64 value dims (heads h0 + g (+ 8)): the normalized output, or
// with splits the split's unnormalized partial and (max, sum) of each row (m, l: rows g, g + 8).
__device__ __forceinline__ void store_rows(const kern::AttnParams& p, const SplitKeys& sk,
                                           int split, int h0, int warp, int lane,
                                           const float (&o)[8][4], const float (&m)[2],
                                           const float (&l)[2]) {
  const int g = lane >> 2, c2 = 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = h0 + g + 8 * h;
    if (head >= p.heads) continue;
    const int64_t prow = (int64_t(split) * p.num_tokens + sk.token) * p.heads + head;
    const float inv = sk.partial ? 1.0f : 1.0f / l[h];
    float* dst = sk.partial
                     ? p.part_o + prow * p.dv
                     : reinterpret_cast<float*>(p.out + sk.token * p.out_ts + head * p.out_hs);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int d = warp * 64 + n * 8 + c2;
      dst[d] = o[n][2 * h] * inv;
      dst[d + 1] = o[n][2 * h + 1] * inv;
    }
    if (sk.partial && warp == 0 && (lane & 3) == 0) {
      p.part_ml[prow * 2] = m[h];
      p.part_ml[prow * 2 + 1] = l[h];
    }
  }
}

// The split merge inside the kernel (the register-Q kernel's kCl): the splits of a (sequence,
// head chunk) are one thread-block cluster, cluster rank = split. Each CTA leaves its rows'
// unnormalized outputs in `part` ([kRows][kR] F32, its own shared memory; stash_rows) and their
// max and sum in row_m / row_l (-inf and 0 for a split without keys); then CTA z merges its
// share of the chunk's rows x dims from every CTA's shared memory, as the merge kernel does (the
// same bits), into the output. Every CTA of the cluster calls it, with or without keys.
__device__ __forceinline__ void stash_rows(float* part, int warp, int lane,
                                           const float (&o)[8][4]) {
  const int g = lane >> 2, c2 = 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int n = 0; n < 8; ++n)
      *reinterpret_cast<float2*>(part + (g + 8 * h) * kR + warp * 64 + n * 8 + c2) =
          make_float2(o[n][2 * h], o[n][2 * h + 1]);
}

// p.merge_gather (DEEPSERVE_MLA_MERGE_GATHER): the weights first, then every split's values at
// once. Each (split, row)'s max and sum come over in one round of remote reads (a thread each)
// into `scratch` (this CTA's own shared memory, 3 kRows x kMaxClusterSize + kRows floats, apart
// from part, row_m and row_l, which the other CTAs read); one thread per row then forms the
// merge kernel's scale (merge_scale: the largest max, the sum over splits ascending, skipping
// empty ones) and each split's factor 2^(m_s - mx); a thread's item then loads its 4 dims from
// every split with keys before it sums them, ascending, as merge_dims does: the same bits in three
// rounds of remote reads, where the shared merge takes about eight (max, then max and sum, then
// max and values, in chunks of 8 splits, each load waiting on the one before).
// Called by merge_in_cluster (sm_90+) with its cluster, after the barrier that makes every CTA's
// part, row_m and row_l visible.
template <typename Cluster>
__device__ __forceinline__ void merge_gathered(const Cluster& cluster, const kern::AttnParams& p,
                                               int token, int h0, const float* part,
                                               const float* row_m, const float* row_l,
                                               float* scratch) {
  const int S = int(cluster.num_blocks()), z = int(cluster.block_rank());
  const int tid = int(threadIdx.x);
  float* sm_m = scratch;                         // [split][row]
  float* sm_l = sm_m + kMaxClusterSize * kRows;  // [split][row]
  float* fac = sm_l + kMaxClusterSize * kRows;   // [split][row]: 2^(m - mx), or -inf: empty
  float* inv = fac + kMaxClusterSize * kRows;    // [row]
  static_assert(kMaxClusterSize * kRows <= kThreads, "one thread per (split, row)");
  if (tid < S * kRows) {
    const int s = tid / kRows, row = tid % kRows;
    sm_m[tid] = *cluster.map_shared_rank(row_m + row, s);
    sm_l[tid] = *cluster.map_shared_rank(row_l + row, s);
  }
  __syncthreads();
  if (tid < kRows && h0 + tid < p.heads) {
    const int row = tid;
    inv[row] = kern::merge_row_factors(
        S, [&](int s) { return sm_m[s * kRows + row]; },
        [&](int s) { return sm_l[s * kRows + row]; },
        [&](int s, float f) { fac[s * kRows + row] = f; });
  }
  __syncthreads();
  constexpr int kPerRow = kR / 4, kItems = kRows * kPerRow;
  const int per = (kItems + S - 1) / S, end = min((z + 1) * per, kItems);
  for (int i = z * per + tid; i < end; i += kThreads) {
    const int row = i / kPerRow, d = (i - row * kPerRow) * 4;
    if (h0 + row >= p.heads) continue;
    auto fac_of = [&](int s) { return fac[s * kRows + row]; };
    float o[kMaxClusterSize][4];
#pragma unroll
    for (int s = 0; s < kMaxClusterSize; ++s)
      if (s < S && fac_of(s) != -INFINITY) {
        const float4 q =
            *reinterpret_cast<const float4*>(cluster.map_shared_rank(part + row * kR + d, s));
        o[s][0] = q.x, o[s][1] = q.y, o[s][2] = q.z, o[s][3] = q.w;
      }
    float acc[4];
    kern::merge_sum_factors<4, kMaxClusterSize>(S, fac_of, o, inv[row], acc);
    kern::store_f4(reinterpret_cast<float*>(p.out + token * p.out_ts + (h0 + row) * p.out_hs) + d,
                   acc);
  }
}

// scratch: merge_gathered's (with p.merge_gather).
__device__ __forceinline__ void merge_in_cluster(const kern::AttnParams& p, int token, int h0,
                                                 const float* part, const float* row_m,
                                                 const float* row_l, float* scratch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's part, row_m and row_l visible to the cluster
  if (p.merge_gather) {
    merge_gathered(cluster, p, token, h0, part, row_m, row_l, scratch);
  } else {
    kern::merge_cluster_items(
        int(cluster.num_blocks()), int(cluster.block_rank()), int(threadIdx.x), kThreads, kRows, kR,
        [&](int row) { return h0 + row < p.heads; },
        [&](int s, int row) { return *cluster.map_shared_rank(row_m + row, s); },
        [&](int s, int row) { return *cluster.map_shared_rank(row_l + row, s); },
        [&](int s, int row, int d, float(&o)[4]) {
          const float4 q =
              *reinterpret_cast<const float4*>(cluster.map_shared_rank(part + row * kR + d, s));
          o[0] = q.x, o[1] = q.y, o[2] = q.z, o[3] = q.w;
        },
        [&](int row, int d, const float(&acc)[4]) {
          kern::store_f4(
              reinterpret_cast<float*>(p.out + token * p.out_ts + (h0 + row) * p.out_hs) + d, acc);
        });
  }
  cluster.sync();  // the other CTAs are done reading this one's shared memory
#else
  (void)p, (void)token, (void)h0, (void)part, (void)row_m, (void)row_l, (void)scratch;
  __trap();  // launched on sm_90+ only (launch_regq)
#endif
}

// The register-Q kernel (attention_mla_decode_regq.cu) for `a` if it takes it (BF16 cache, 64
// rope dims, the latent from q, not switched off); false leaves `a` to the first kernel.
// Returns whether the kernel took it; `merged`: whether it also merged the splits in clusters
// (DEEPSERVE_MLA_CLUSTER=1, where every cluster fits at once), so no merge kernel follows.
bool launch_regq(const kern::AttnParams& a, cudaStream_t stream, bool bf16_qp, bool& merged);

}  // namespace ds::cuda::mla_decode
