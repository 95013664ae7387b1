// Mixture-of-experts routing and expert FFN on the CPU: see moe.h.
#include "backend/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/thread_pool.h"

namespace ds::cpu {
namespace {

// Expert rows gathered per matmul: bounds the scratch (a few MiB per 512 rows) while each
// weight panel is still reused across many rows.
constexpr int64_t kChunkRows = 512;
// Below this many elements touched, a helper loop runs on the calling thread alone.
constexpr int64_t kMinParallel = 1 << 15;

// Calls fn(begin, end) over [0, n), split across the pool when `work` is large enough.
template <typename Fn>
void parallel_range(ThreadPool& pool, int64_t n, int64_t work, const Fn& fn) {
  if (pool.size() == 1 || work < kMinParallel || n < 2) {
    if (n > 0) fn(int64_t(0), n);
    return;
  }
  pool.run([&](int ith, int nth) {
    const auto [b, e] = ThreadPool::split(n, ith, nth);
    if (b < e) fn(b, e);
  });
}

// Per-thread working memory of moe_route.
struct RouteScratch {
  std::vector<double> ex;
  std::vector<float> scores, group_max;
  std::vector<char> taken, keep;
};

// Routes one token (see moe.h): ids/w receive top_k entries.
void route_row(const float* logits, int E, const MoeRouteParams& p, RouteScratch& s, int32_t* ids,
               float* w) {
  s.ex.resize(size_t(E));
  s.scores.resize(size_t(E));
  float mx = -INFINITY;
  for (int e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += s.ex[size_t(e)] = std::exp(double(logits[e]) - double(mx));
  for (int e = 0; e < E; ++e) s.scores[size_t(e)] = float(s.ex[size_t(e)] / sum);
  float* sc = s.scores.data();

  if (p.method == MoeTopk::GroupLimitedGreedy) {
    const int G = p.n_group, per = E / G;
    s.group_max.assign(size_t(G), 0.0f);
    s.keep.assign(size_t(G), 0);
    for (int g = 0; g < G; ++g)
      s.group_max[size_t(g)] = *std::max_element(sc + g * per, sc + (g + 1) * per);
    for (int k = 0; k < p.topk_group; ++k) {
      int best = -1;
      for (int g = 0; g < G; ++g)
        if (!s.keep[size_t(g)] && (best < 0 || s.group_max[size_t(g)] > s.group_max[size_t(best)]))
          best = g;
      s.keep[size_t(best)] = 1;
    }
    // As MoEGate: experts of dropped groups score 0 and still take part in the top_k.
    for (int e = 0; e < E; ++e)
      if (!s.keep[size_t(e / per)]) sc[e] = 0.0f;
  }

  s.taken.assign(size_t(E), 0);
  for (int k = 0; k < p.top_k; ++k) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (!s.taken[size_t(e)] && (best < 0 || sc[e] > sc[best])) best = e;
    s.taken[size_t(best)] = 1;
    ids[k] = best;
    w[k] = sc[best];
  }
  if (p.top_k > 1 && p.norm_topk_prob) {
    double total = 0;
    for (int k = 0; k < p.top_k; ++k) total += w[k];
    for (int k = 0; k < p.top_k; ++k) w[k] = float(double(w[k]) / (total + 1e-20));
  } else {
    for (int k = 0; k < p.top_k; ++k) w[k] *= p.routed_scaling_factor;
  }
}

float* frow(const TensorView& v, int64_t r) {
  return reinterpret_cast<float*>(v.row(r));
}

// out[M, N] = x[M, K] * w[N, K]^T with packed x and out.
void run_matmul(const MatmulContext& mm, const float* x, int64_t M, int64_t K, const TensorView& w,
                float* out) {
  MatmulArgs a;
  a.x = x;
  a.M = M;
  a.K = K;
  a.ldx = K;
  a.w = w.data;
  a.wtype = w.dtype;
  a.N = w.rows();
  a.w_row_bytes = size_t(w.row_stride());
  a.out = out;
  a.ldo = a.N;
  a.act = mm.act;
  matmul(a, *mm.pool, mm.isa);
}

void grow(std::vector<float>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
}

}  // namespace

void moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
               TensorView weights, ThreadPool& pool) {
  DS_CHECK(logits.dtype == DType::F32 && ids.dtype == DType::I32 && weights.dtype == DType::F32,
           "moe_route: logits F32, ids I32, weights F32");
  const int64_t T = logits.rows();
  const int E = int(logits.cols());
  DS_CHECK(p.top_k >= 1 && p.top_k <= E, "moe_route: top_k must be in [1, num_experts]");
  DS_CHECK(
      ids.rows() == T && ids.cols() == p.top_k && weights.rows() == T && weights.cols() == p.top_k,
      "moe_route shapes: logits " + logits.shape_str() + ", ids " + ids.shape_str() + ", weights " +
          weights.shape_str() + ", top_k " + std::to_string(p.top_k));
  if (p.method == MoeTopk::GroupLimitedGreedy)
    DS_CHECK(p.n_group >= 1 && E % p.n_group == 0 && p.topk_group >= 1 && p.topk_group <= p.n_group,
             "moe_route: n_group must divide the experts and topk_group lie in [1, n_group]");
  parallel_range(pool, T, T * E * 8, [&](int64_t b, int64_t e) {
    RouteScratch s;
    for (int64_t t = b; t < e; ++t)
      route_row(reinterpret_cast<const float*>(logits.row(t)), E, p, s,
                reinterpret_cast<int32_t*>(ids.row(t)), frow(weights, t));
  });
  if (p.expert_counts)
    for (int64_t t = 0; t < T; ++t) {
      const auto* id = reinterpret_cast<const int32_t*>(ids.row(t));
      for (int k = 0; k < p.top_k; ++k) ++p.expert_counts[id[k]];
    }
}

void moe_ffn(const MoeFfnParams& p, const MatmulContext& mm, MoeScratch& s) {
  const TensorView &x = p.x, &ids = p.ids, &wts = p.weights, &out = p.out;
  DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32 && ids.dtype == DType::I32 &&
               wts.dtype == DType::F32,
           "moe_ffn: x, out, weights F32; ids I32");
  const int64_t T = x.rows(), hidden = x.cols(), K = ids.cols();
  const int E = int(p.experts.size());
  const int S = p.num_shared;
  DS_CHECK(S >= 0 && S < E, "moe_ffn: num_shared out of range");
  const int64_t slots = K + S;  // per token: routed, then shared (weight 1)
  DS_CHECK(out.rows() == T && out.cols() == hidden && ids.rows() == T && wts.rows() == T &&
               wts.cols() == K,
           "moe_ffn shapes: x " + x.shape_str() + ", ids " + ids.shape_str() + ", weights " +
               wts.shape_str() + ", out " + out.shape_str());
  DS_CHECK(x.data != out.data, "moe_ffn: out must not alias x");
  if (T == 0) return;

  // Assignments grouped by expert (a counting sort: increasing token and slot within each).
  s.offsets.assign(size_t(E) + 1, 0);
  // Expert parallel: global id -> local slot; -1 for another rank's expert (skipped).
  auto local = [&](int32_t id) {
    const int32_t e = id - p.expert_base;
    if (e >= 0 && e < E - S) return e;
    DS_CHECK(p.skip_foreign, "moe_ffn: expert id " + std::to_string(id) + " out of range [" +
                                 std::to_string(p.expert_base) + ", " +
                                 std::to_string(p.expert_base + E - S) + ")");
    return -1;
  };
  for (int64_t t = 0; t < T; ++t) {
    const auto* id = reinterpret_cast<const int32_t*>(ids.row(t));
    for (int64_t k = 0; k < K; ++k)
      if (const int e = local(id[k]); e >= 0) ++s.offsets[size_t(e) + 1];
    for (int j = 0; j < S; ++j) ++s.offsets[size_t(E - S + j) + 1];
  }
  for (int e = 0; e < E; ++e) s.offsets[size_t(e) + 1] += s.offsets[size_t(e)];
  s.assign.resize(size_t(T * slots));
  std::vector<int32_t> cursor(s.offsets.begin(), s.offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    const auto* id = reinterpret_cast<const int32_t*>(ids.row(t));
    for (int64_t k = 0; k < slots; ++k) {
      const int e = k < K ? local(id[k]) : E - S + int(k - K);
      if (e < 0) continue;
      s.assign[size_t(cursor[size_t(e)]++)] = int32_t(t * slots + k);
    }
  }

  // Every used expert is checked before anything is written.
  for (int e = 0; e < E; ++e) {
    if (s.offsets[size_t(e) + 1] == s.offsets[size_t(e)]) continue;
    const ExpertWeights& w = p.experts[size_t(e)];
    const int64_t F = w.gate.rows();
    DS_CHECK(w.gate.cols() == hidden && w.up.rows() == F && w.up.cols() == hidden &&
                 w.down.rows() == hidden && w.down.cols() == F,
             "moe_ffn: expert " + std::to_string(e) + " has shapes gate " + w.gate.shape_str() +
                 ", up " + w.up.shape_str() + ", down " + w.down.shape_str());
    for (const TensorView* v : {&w.gate, &w.up, &w.down})
      if (!matmul_supports(v->dtype, mm.act))
        throw UnsupportedError("cpu moe_ffn does not support " + std::string(dtype_name(v->dtype)) +
                               " expert weights");
  }

  for (int64_t t = 0; t < T; ++t) std::fill_n(frow(out, t), hidden, 0.0f);
  ThreadPool& pool = *mm.pool;
  for (int e = 0; e < E; ++e) {
    const ExpertWeights& w = p.experts[size_t(e)];
    const int64_t F = w.gate.rows();
    for (int64_t r0 = s.offsets[size_t(e)]; r0 < s.offsets[size_t(e) + 1]; r0 += kChunkRows) {
      const int64_t n = std::min<int64_t>(kChunkRows, s.offsets[size_t(e) + 1] - r0);
      const int32_t* rows = s.assign.data() + r0;  // token * slots + slot
      grow(s.x, n * hidden);
      grow(s.gate, n * F);
      grow(s.up, n * F);
      grow(s.down, n * hidden);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(s.x.data() + r * hidden, frow(x, rows[r] / slots), size_t(hidden) * 4);
      run_matmul(mm, s.x.data(), n, hidden, w.gate, s.gate.data());  // [n, F]
      run_matmul(mm, s.x.data(), n, hidden, w.up, s.up.data());      // [n, F]
      float *g = s.gate.data(), *u = s.up.data();
      // silu(g) * u as the backend's silu_mul computes it.
      parallel_range(pool, n * F, n * F * 16, [&](int64_t b, int64_t end) {
        for (int64_t i = b; i < end; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      });
      run_matmul(mm, g, n, F, w.down, s.down.data());  // [n, hidden]
      // Rows in increasing order per column range: no two threads touch one element.
      const float* d = s.down.data();
      parallel_range(pool, hidden, n * hidden, [&](int64_t c0, int64_t c1) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t t = rows[r] / slots, k = rows[r] % slots;
          const float wk = k < K ? frow(wts, t)[k] : 1.0f;
          float* o = frow(out, t);
          const float* y = d + r * hidden;
          for (int64_t c = c0; c < c1; ++c) o[c] += wk * y[c];
        }
      });
    }
  }
}

}  // namespace ds::cpu
