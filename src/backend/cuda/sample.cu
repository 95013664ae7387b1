// Backend::sample on the device: one CTA per row, no sort of the vocabulary.
//
// The kept set is a prefix of the order (logit descending, index ascending), described by a
// Cut: every token whose key is above cut.key plus the first cut.ties (in index order) of
// those equal to it. Top-k and top-p each find their cut by selection: a histogram pass over
// buckets linear in (max - logit), which spreads the shared-memory atomics, then radix passes
// over the chosen bucket's key range down to a single key. Probability mass is summed as
// integers in units of 2^-43, so every sum is exact and independent of order (the op is
// deterministic). The draw is the inverse CDF in index order: per-warp sums of contiguous
// parts find the part, per-thread sums within it find the thread, which walks its tokens.
#include <climits>
#include <cstdint>

#include "backend/cuda/pdl.cuh"
#include "backend/cuda/sample.cuh"

namespace ds::cuda {
namespace {

using u64 = unsigned long long;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kBins = 2048;
constexpr int kNearBins = 1792;  // buckets 1/64 logit wide, down to 28 below the maximum
constexpr float kNearScale = 64.0f;
constexpr float kNearSpan = 28.0f;
constexpr float kFixedOne = 8796093022208.0f;  // 2^43; V * 2^43 < 2^64 for V < 2^21
static_assert(kWarps == 32, "the block scans assume 32 warps");
static_assert(kBins == 2 * kThreads, "find_bin gives each thread two bins");

// Keeps every token with a key above `key` and the first `ties` (index order) equal to it.
struct Cut {
  uint32_t key;
  long long ties;
};

struct Shared {
  u64 hist[kBins];
  u64 scan[kWarps];
  u64 part_sum[kWarps], part_ties[kWarps];
  int bin;  // find_bin's answer
  u64 above, binw;
  int part;  // the draw's part, the offset of u * total in it, its first tie rank
  u64 r;
  long long tie_start;
  float best_v[kWarps];
  int best_i[kWarps];
};

// The row's constants every weight needs.
struct RowConst {
  float m;      // the maximum logit
  float inv_t;  // 1 / temperature
  float min_p;  // <= 0: off
};

__device__ __forceinline__ float load(const float* x, int64_t i) {
  const float v = x[i];
  return v != v ? -INFINITY : v;  // NaN counts as -inf
}

// An unsigned key in float order (-0 and +0 share one).
__device__ __forceinline__ uint32_t key_of(float v) {
  uint32_t b = __float_as_uint(v);
  if (b == 0x80000000u) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float value_of(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ u64 fixed(float w) {
  return w > 0.0f ? __float2ull_rz(w * kFixedOne) : 0ull;
}

// Softmax weight at temperature 1 (top-p mass), and at the row's temperature (the draw).
__device__ __forceinline__ u64 mass1(float v, const RowConst& c) {
  return fixed(expf(v - c.m));
}
__device__ __forceinline__ u64 mass_t(float v, const RowConst& c) {
  return fixed(expf((v - c.m) * c.inv_t));
}
__device__ __forceinline__ bool passes_min_p(float v, const RowConst& c) {
  return !(c.min_p > 0.0f) || expf(v - c.m) >= c.min_p;
}

// Monotone in v (a higher logit never lands in a later bucket): linear in m - v near the
// maximum, then by the key's top byte.
__device__ __forceinline__ int bucket_of(float v, uint32_t key, float m) {
  const float d = m - v;
  if (d < kNearSpan) return int(d * kNearScale);
  return kNearBins + int(255u - (key >> 24));
}

__device__ __forceinline__ u64 warp_inclusive_scan(u64 v) {
  const int lane = int(threadIdx.x) & 31;
  for (int d = 1; d < 32; d <<= 1) {
    const u64 n = __shfl_up_sync(kFull, v, d);
    if (lane >= d) v += n;
  }
  return v;
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Inclusive prefix sum over the block in thread order; *total (if given) gets the sum.
__device__ u64 block_inclusive_scan(u64 v, Shared& sh, u64* total) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  v = warp_inclusive_scan(v);
  __syncthreads();  // sh.scan may still be read by a previous call
  if (lane == 31) sh.scan[warp] = v;
  __syncthreads();
  if (warp == 0) sh.scan[lane] = warp_inclusive_scan(sh.scan[lane]);
  __syncthreads();
  if (total) *total = sh.scan[kWarps - 1];
  return v + (warp > 0 ? sh.scan[warp - 1] : 0);
}

// Adds one per lane with bin >= 0; lanes of a warp that share a bin add once, together.
__device__ __forceinline__ void add_counts(u64* hist, int bin) {
  const unsigned group = __match_any_sync(kFull, bin);
  if (bin >= 0 && int(threadIdx.x & 31) == __ffs(group) - 1)
    atomicAdd(&hist[bin], u64(__popc(group)));
}

// Walks hist[0, nb) from the highest keys down (bin 0 first, or bin nb-1 first when
// `descending`) and finds the bin where above + the running weight first reaches target.
// Sets sh.bin, sh.above (the weight before that bin) and sh.binw (its weight).
__device__ void find_bin(Shared& sh, int nb, bool descending, u64 above, u64 target) {
  const int j0 = 2 * int(threadIdx.x), j1 = j0 + 1;
  const int b0 = descending ? nb - 1 - j0 : j0, b1 = descending ? nb - 1 - j1 : j1;
  const u64 h0 = j0 < nb ? sh.hist[b0] : 0, h1 = j1 < nb ? sh.hist[b1] : 0;
  if (threadIdx.x == 0) {  // unreachable when target <= above + the total, as callers ensure
    sh.bin = descending ? 0 : nb - 1;
    sh.above = above;
    sh.binw = 0;
  }
  const u64 incl = block_inclusive_scan(h0 + h1, sh, nullptr);
  const u64 acc = above + (incl - h0 - h1);
  if (acc < target && target <= above + incl) {
    const bool first = acc + h0 >= target;
    sh.bin = first ? b0 : b1;
    sh.above = first ? acc : acc + h0;
    sh.binw = first ? h0 : h1;
  }
  __syncthreads();
}

// The cut where the weight of the admitted tokens, from the highest key down, first reaches
// the target. kMass: weight = softmax mass at temperature 1 and target = ceil(top_p * total);
// otherwise weight = 1 and target = k. Admitted: every token, or with a floor only those the
// floor keeps (the top-k survivors, for top-p).
template <bool kMass>
__device__ Cut select_cut(const float* x, int64_t V, const RowConst& c, bool has_floor, Cut floor,
                          u64 k, float top_p, Shared& sh) {
  const int tid = int(threadIdx.x);
  auto weight = [&](float v) -> u64 { return kMass ? mass1(v, c) : 1ull; };
  auto admitted = [&](uint32_t key) { return !has_floor || key > floor.key; };
  const float floor_v = value_of(floor.key);
  const u64 floor_w = has_floor ? weight(floor_v) * u64(floor.ties) : 0;

  // Pass 0: buckets of m - v.
  for (int j = tid; j < kBins; j += kThreads) sh.hist[j] = 0;
  __syncthreads();
  for (int64_t base = 0; base < V; base += kThreads) {
    const int64_t i = base + tid;
    int bin = -1;
    u64 w = 0;
    if (i < V) {
      const float v = load(x, i);
      const uint32_t key = key_of(v);
      if (admitted(key)) {
        w = weight(v);
        if (w) bin = bucket_of(v, key, c.m);
      }
    }
    if (kMass) {
      if (bin >= 0) atomicAdd(&sh.hist[bin], w);
    } else {
      // Far tokens are many and share few bins: their lanes add together (all lanes call).
      const bool near = bin >= 0 && bin < kNearBins;
      if (near) atomicAdd(&sh.hist[bin], w);
      add_counts(sh.hist, near ? -1 : bin);
    }
  }
  if (tid == 0 && floor_w) atomicAdd(&sh.hist[bucket_of(floor_v, floor.key, c.m)], floor_w);
  __syncthreads();
  u64 target = k;
  if (kMass) {
    u64 total = 0;
    block_inclusive_scan(sh.hist[2 * tid] + sh.hist[2 * tid + 1], sh, &total);
    target = max(1ull, u64(ceil(double(top_p) * double(total))));
  }
  find_bin(sh, kBins, false, 0, target);
  const int bucket = sh.bin;
  u64 above = sh.above, binw = sh.binw;
  uint32_t lo, hi;
  if (bucket < kNearBins) {
    // A superset of the bucket's keys (the passes below re-test the bucket): m - v is exact
    // to a few ulps, far inside the slack.
    const float slack = 1e-3f + fabsf(c.m) * 1e-5f;
    lo = key_of(c.m - float(bucket + 1) / kNearScale - slack);
    hi = key_of(c.m - float(bucket) / kNearScale + slack);
  } else {
    lo = uint32_t(255 - (bucket - kNearBins)) << 24;
    hi = lo | 0xffffffu;
  }
  __syncthreads();  // everyone has read the answer before the next pass reuses sh

  // Radix passes over the bucket's keys [lo, hi] until one key is left.
  while (lo < hi) {
    const u64 span = u64(hi) - lo + 1;
    int s = 0;
    while (((span - 1) >> s) >= u64(kBins)) ++s;
    const int nb = int(((span - 1) >> s) + 1);
    for (int j = tid; j < nb; j += kThreads) sh.hist[j] = 0;
    __syncthreads();
    auto inside = [&](float v, uint32_t key) {
      return key >= lo && key <= hi && bucket_of(v, key, c.m) == bucket;
    };
    for (int64_t base = 0; base < V; base += kThreads) {
      const int64_t i = base + tid;
      int bin = -1;
      u64 w = 0;
      if (i < V) {
        const float v = load(x, i);
        const uint32_t key = key_of(v);
        if (admitted(key) && inside(v, key)) {
          w = weight(v);
          if (w) bin = int((key - lo) >> s);
        }
      }
      if (kMass) {
        if (bin >= 0) atomicAdd(&sh.hist[bin], w);
      } else {
        add_counts(sh.hist, bin);
      }
    }
    if (tid == 0 && floor_w && inside(floor_v, floor.key))
      atomicAdd(&sh.hist[(floor.key - lo) >> s], floor_w);
    __syncthreads();
    find_bin(sh, nb, true, above, target);
    const uint32_t j = uint32_t(sh.bin);
    above = sh.above;
    binw = sh.binw;
    __syncthreads();
    lo += j << s;
    hi = uint32_t(min(u64(hi), u64(lo) + (1ull << s) - 1));
  }

  Cut cut{lo, 0};
  if (!kMass) {
    cut.ties = (long long)(target - above);
  } else {
    // Every token at the cut key has the same mass: take as many as reach the target.
    const u64 wt = weight(value_of(lo));
    const u64 ntie = wt ? binw / wt : 1;
    const u64 need = wt ? (target - above + wt - 1) / wt : 1;
    cut.ties = (long long)max(1ull, min(need, ntie));
  }
  return cut;
}

// Of n tokens at the cut key whose first has tie rank `start`, how many the cut keeps.
__device__ __forceinline__ u64 kept_ties(long long cut_ties, long long start, u64 n) {
  const long long k = cut_ties - start;
  return k <= 0 ? 0 : min(u64(k), n);
}

// The lowest index of the maximum; NaN never wins except at index 0 (the host's rule).
__device__ int block_argmax(const float* x, int64_t V, Shared& sh) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const float v = x[i];
    if (v > bv) {
      bv = v;
      bi = int(i);
    }
  }
  warp_argmax(bv, bi);
  if (lane == 0) {
    sh.best_v[warp] = bv;
    sh.best_i[warp] = bi;
  }
  __syncthreads();
  bv = sh.best_v[lane];
  bi = sh.best_i[lane];
  warp_argmax(bv, bi);
  __syncthreads();  // best_v / best_i are free again
  const float x0 = x[0];
  return x0 != x0 || bi == INT_MAX ? 0 : bi;
}

__global__ void __launch_bounds__(kThreads, 1) sample_kernel(SampleArgs a) {
  pdl::enter();
  __shared__ Shared sh;
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const float* x = a.logits + int64_t(blockIdx.x) * a.ld;
  const SampleRow p = a.params[blockIdx.x];
  const int64_t V = a.vocab;

  const int best = block_argmax(x, V, sh);
  const float m = x[best];
  if (!(p.temperature > 0.0f) || p.top_k == 1 || !isfinite(m)) {
    if (tid == 0) a.ids[blockIdx.x] = best;
    return;
  }
  const RowConst c{m, 1.0f / p.temperature, fminf(p.min_p, 1.0f)};

  // The kept prefix: top-k, then top-p over the top-k survivors; min-p filters below.
  Cut cut{0u, LLONG_MAX};  // no token has key 0 (NaNs are gone): keeps everything
  const bool top_k = p.top_k > 0 && p.top_k < V;
  const bool top_p = p.top_p < 1.0f;
  if (top_k) cut = select_cut<false>(x, V, c, false, cut, u64(p.top_k), 0.0f, sh);
  if (top_p) cut = select_cut<true>(x, V, c, top_k, cut, 0, p.top_p, sh);
  const float cut_v = value_of(cut.key);
  const u64 tie_w = (top_k || top_p) && passes_min_p(cut_v, c) ? mass_t(cut_v, c) : 0;

  // The kept weight of token i, given its tie rank when it sits at the cut key.
  auto kept_weight = [&](float v, uint32_t key, long long& rank) -> u64 {
    if (key > cut.key) return passes_min_p(v, c) ? mass_t(v, c) : 0;
    if (key == cut.key) return rank++ < cut.ties ? tie_w : 0;
    return 0;
  };

  // Level 0: each warp sums a contiguous part of the row; warp 0 picks the part.
  const int64_t part_len = (V + kWarps - 1) / kWarps;
  {
    const int64_t b = min(V, warp * part_len), e = min(V, b + part_len);
    u64 sum = 0, ties = 0;
    for (int64_t i = b + lane; i < e; i += 32) {
      const float v = load(x, i);
      const uint32_t key = key_of(v);
      if (key > cut.key) {
        if (passes_min_p(v, c)) sum += mass_t(v, c);
      } else if (key == cut.key) {
        ++ties;
      }
    }
    sum = warp_sum(sum);
    ties = warp_sum(ties);
    if (lane == 0) {
      sh.part_sum[warp] = sum;
      sh.part_ties[warp] = ties;
    }
  }
  __syncthreads();
  if (warp == 0) {
    const u64 sum = sh.part_sum[lane], ties = sh.part_ties[lane];
    const long long tie_start = (long long)(warp_inclusive_scan(ties) - ties);
    const u64 kept = sum + tie_w * kept_ties(cut.ties, tie_start, ties);
    const u64 incl = warp_inclusive_scan(kept);
    const u64 total = __shfl_sync(kFull, incl, 31);  // >= 2^43: the maximum is always kept
    u64 r = u64(sample_uniform(p.seed, p.counter) * double(total));
    if (r >= total) r = total - 1;
    const unsigned hit = __ballot_sync(kFull, incl > r);
    if (lane == __ffs(hit) - 1) {
      sh.part = lane;
      sh.r = r - (incl - kept);
      sh.tie_start = tie_start;
    }
  }
  __syncthreads();

  // Level 1: each thread sums a few consecutive tokens of that part; the one holding r walks
  // them (level 2). Integer sums make the levels agree exactly.
  const int64_t pb = min(V, sh.part * part_len), pe = min(V, pb + part_len);
  const int64_t per = (pe - pb + kThreads - 1) / kThreads;
  const int64_t tb = min(pe, pb + tid * per), te = min(pe, tb + per);
  u64 sum = 0, ties = 0;
  for (int64_t i = tb; i < te; ++i) {
    const float v = load(x, i);
    const uint32_t key = key_of(v);
    if (key > cut.key) {
      if (passes_min_p(v, c)) sum += mass_t(v, c);
    } else if (key == cut.key) {
      ++ties;
    }
  }
  const u64 r = sh.r;
  const long long part_tie_start = sh.tie_start;
  const long long tie_start =
      part_tie_start + (long long)(block_inclusive_scan(ties, sh, nullptr) - ties);
  const u64 kept = sum + tie_w * kept_ties(cut.ties, tie_start, ties);
  const u64 incl = block_inclusive_scan(kept, sh, nullptr);
  if (incl - kept <= r && r < incl) {
    u64 left = r - (incl - kept);
    long long rank = tie_start;
    for (int64_t i = tb; i < te; ++i) {
      const float v = load(x, i);
      const u64 w = kept_weight(v, key_of(v), rank);
      if (w > left) {
        a.ids[blockIdx.x] = int32_t(i);
        break;
      }
      left -= w;
    }
  }
}

}  // namespace

void launch_sample(const SampleArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return;
  pdl::launch(sample_kernel, unsigned(a.rows), kThreads, 0, stream, a);
}

}  // namespace ds::cuda
