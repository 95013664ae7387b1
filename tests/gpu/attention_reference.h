// Float64 references for paged attention and absorbed MLA, straight from the definitions in
// backend.h, over the host copies the test harness keeps of a step and a cache. Shared by the
// GPU tests and the host-simulation tests of the CUDA kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "gpu_test_util.h"

namespace ds::test {

// Softmax-weighted sum of value rows for one query row, given its scores.
inline void softmax_combine(const std::vector<double>& scores,
                            const std::vector<const float*>& values, int dv, double* out) {
  double mx = -INFINITY;
  for (double s : scores) mx = std::max(mx, s);
  double sum = 0.0;
  std::vector<double> w(scores.size());
  for (size_t j = 0; j < scores.size(); ++j) sum += w[j] = std::exp(scores[j] - mx);
  for (int d = 0; d < dv; ++d) out[d] = 0.0;
  for (size_t j = 0; j < scores.size(); ++j)
    for (int d = 0; d < dv; ++d) out[d] += w[j] / sum * double(values[j][d]);
}

// fn(s, i) for query i of every sequence s, spread over the host's cores.
template <typename Fn>
void for_each_query(const HostStep& h, Fn fn) {
  std::vector<std::pair<int, int>> items;
  for (int s = 0; s < h.num_seqs; ++s)
    for (int i = 0; i < h.query_start[size_t(s) + 1] - h.query_start[size_t(s)]; ++i)
      items.emplace_back(s, i);
  const size_t nth = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t w = 0; w < nth; ++w)
    pool.emplace_back([&, w] {
      for (size_t k = w; k < items.size(); k += nth) fn(items[k].first, items[k].second);
    });
  for (std::thread& t : pool) t.join();
}

// Number of cached positions token i (0-based within its sequence of n queries and ctx
// cached tokens) attends to.
inline int visible_keys(int ctx, int n, int i, bool causal) {
  return causal ? ctx - n + i + 1 : ctx;
}

// Backend::attention. q: [T, heads, hd]; k, v: flat [slots, kv_heads, hd] host copies.
// Returns [T, heads, hd].
inline std::vector<double> reference_attention(const HostStep& h, const std::vector<float>& q,
                                               const std::vector<float>& k,
                                               const std::vector<float>& v, int heads, int kv_heads,
                                               int hd, int block_size, float scale, bool causal) {
  std::vector<double> out(size_t(h.num_tokens) * size_t(heads) * size_t(hd));
  const int group = heads / kv_heads;
  for_each_query(h, [&](int s, int i) {
    const int q0 = h.query_start[size_t(s)], n = h.query_start[size_t(s) + 1] - q0;
    const int ctx = h.context_lens[size_t(s)];
    {
      const int t = q0 + i, nk = visible_keys(ctx, n, i, causal);
      for (int hh = 0; hh < heads; ++hh) {
        const int g = hh / group;
        const float* qr = &q[(size_t(t) * size_t(heads) + size_t(hh)) * size_t(hd)];
        std::vector<double> scores(static_cast<size_t>(nk));
        std::vector<const float*> vals(static_cast<size_t>(nk));
        for (int j = 0; j < nk; ++j) {
          const size_t row =
              (size_t(h.slot(s, j, block_size)) * size_t(kv_heads) + size_t(g)) * size_t(hd);
          double dot = 0.0;
          for (int d = 0; d < hd; ++d) dot += double(qr[d]) * double(k[row + size_t(d)]);
          scores[size_t(j)] = dot * double(scale);
          vals[size_t(j)] = &v[row];
        }
        softmax_combine(scores, vals, hd,
                        &out[(size_t(t) * size_t(heads) + size_t(hh)) * size_t(hd)]);
      }
    }
  });
  return out;
}

// Backend::mla_attention. q_latent: [T, heads, R]; q_rope: [T, heads, P]; cache: flat
// [slots, R + P]. Returns [T, heads, R].
inline std::vector<double> reference_mla(const HostStep& h, const std::vector<float>& q_latent,
                                         const std::vector<float>& q_rope,
                                         const std::vector<float>& cache, int heads, int R, int P,
                                         int block_size, float scale, bool causal) {
  std::vector<double> out(size_t(h.num_tokens) * size_t(heads) * size_t(R));
  for_each_query(h, [&](int s, int i) {
    const int q0 = h.query_start[size_t(s)], n = h.query_start[size_t(s) + 1] - q0;
    const int ctx = h.context_lens[size_t(s)];
    {
      const int t = q0 + i, nk = visible_keys(ctx, n, i, causal);
      for (int hh = 0; hh < heads; ++hh) {
        const size_t th = size_t(t) * size_t(heads) + size_t(hh);
        std::vector<double> scores(static_cast<size_t>(nk));
        std::vector<const float*> vals(static_cast<size_t>(nk));
        for (int j = 0; j < nk; ++j) {
          const float* c = &cache[size_t(h.slot(s, j, block_size)) * size_t(R + P)];
          double dot = 0.0;
          for (int d = 0; d < R; ++d) dot += double(q_latent[th * size_t(R) + size_t(d)]) * c[d];
          for (int d = 0; d < P; ++d) dot += double(q_rope[th * size_t(P) + size_t(d)]) * c[R + d];
          scores[size_t(j)] = dot * double(scale);
          vals[size_t(j)] = c;
        }
        softmax_combine(scores, vals, R, &out[th * size_t(R)]);
      }
    }
  });
  return out;
}

// Tolerance for attention outputs: F32 arithmetic (or split-BF16 tensor-core arithmetic, ~16
// mantissa bits per operand) against float64, on outputs of magnitude <= 1.
inline Tolerance attention_tolerance() {
  return Tolerance{.abs = 2e-5, .rel = 2e-4};
}

}  // namespace ds::test
