#include "backend/cpu/sample.h"

#include <algorithm>
#include <numeric>

#include "core/argmax.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace ds::cpu {

int32_t sample_row(std::span<const float> row, const SampleRow& p, SampleTrace* trace) {
  DS_CHECK(!row.empty(), "sample: empty logits row");
  const size_t V = row.size();
  const int32_t best = int32_t(argmax_first(row.data(), V));  // as Backend::argmax
  const double m = row[size_t(best)];
  SampleTrace local;
  SampleTrace& tr = trace ? *trace : local;
  tr = SampleTrace{};
  tr.u = sample_uniform(p.seed, p.counter);
  if (!(p.temperature > 0.0f) || p.top_k == 1 || !std::isfinite(m)) {
    tr.kept = {best};
    return best;
  }
  // NaN logits count as -inf (never drawn), which also keeps the sort's order strict.
  std::vector<float> clean;
  std::span<const float> x = row;
  if (std::any_of(row.begin(), row.end(), [](float v) { return std::isnan(v); })) {
    clean.assign(row.begin(), row.end());
    for (float& v : clean)
      if (std::isnan(v)) v = -INFINITY;
    x = clean;
  }
  const double min_p = std::min(double(p.min_p), 1.0);

  // Candidates in (logit descending, index ascending) order, as far as the filters need it.
  const size_t n_k = p.top_k > 0 && size_t(p.top_k) < V ? size_t(p.top_k) : V;
  const bool top_p = p.top_p < 1.0f;
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](int32_t a, int32_t b) {
    return x[size_t(a)] > x[size_t(b)] || (x[size_t(a)] == x[size_t(b)] && a < b);
  };
  auto weight = [&](int32_t i) { return std::exp(double(x[size_t(i)]) - m); };
  size_t n = V;
  if (n_k < V || top_p) {
    if (n_k < V)
      std::partial_sort(order.begin(), order.begin() + std::ptrdiff_t(n_k), order.end(), before);
    else
      std::sort(order.begin(), order.end(), before);
    n = n_k;
    std::vector<double> w(n);
    double z = 0;
    for (size_t i = 0; i < n; ++i) z += w[i] = weight(order[i]);
    if (top_p) {
      double cum = 0;
      for (size_t i = 0; i < n; ++i) {
        const double prev = cum;
        cum += w[i] / z;
        if (cum >= double(p.top_p)) {
          tr.filter_margin = std::min(cum - double(p.top_p), double(p.top_p) - prev);
          n = i + 1;
          break;
        }
      }
    }
    if (min_p > 0) {
      size_t keep = 1;  // the maximum always passes (p_max >= min_p * p_max)
      while (keep < n && w[keep] >= min_p) ++keep;
      if (keep > 1) tr.filter_margin = std::min(tr.filter_margin, w[keep - 1] - min_p);
      if (keep < n) tr.filter_margin = std::min(tr.filter_margin, min_p - w[keep]);
      n = keep;
    }
    order.resize(n);
    std::sort(order.begin(), order.end());
  } else if (min_p > 0) {
    // Neither top-k nor top-p: min-p is a threshold on the value, no order needed.
    order.clear();
    for (size_t i = 0; i < V; ++i) {
      const double w = weight(int32_t(i));
      if (w >= min_p) order.push_back(int32_t(i));
      if (int32_t(i) != best) tr.filter_margin = std::min(tr.filter_margin, std::abs(w - min_p));
    }
  }
  tr.kept = order;

  // Inverse CDF over the kept tokens in index order, at the temperature.
  const double inv_t = 1.0 / double(p.temperature);
  auto tweight = [&](int32_t i) {
    const double t = std::exp((double(x[size_t(i)]) - m) * inv_t);
    return t > 0 ? t : 0.0;  // also -inf at an infinite temperature (NaN)
  };
  double total = 0;
  for (int32_t i : order) total += tweight(i);
  const double r = tr.u * total;
  double cum = 0;
  int32_t last = best;
  for (int32_t i : order) {
    const double t = tweight(i);
    if (t <= 0) continue;
    const double prev = cum;
    cum += t;
    last = i;
    if (cum > r) {
      tr.draw_margin = std::min(r - prev, cum - r) / total;
      return i;
    }
  }
  tr.draw_margin = 0;  // u * total rounded onto the end: the last token with weight
  return last;
}

void sample_rows(const float* logits, int64_t num_rows, int64_t vocab, int64_t ld,
                 const SampleRow* rows, int32_t* ids, ThreadPool* pool) {
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      ids[r] = sample_row(std::span<const float>(logits + r * ld, size_t(vocab)), rows[r]);
  };
  if (!pool || num_rows <= 1) {
    run(0, num_rows);
    return;
  }
  pool->run([&](int ith, int nth) {
    auto [b, e] = ThreadPool::split(num_rows, ith, nth);
    run(b, e);
  });
}

}  // namespace ds::cpu
