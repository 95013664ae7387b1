// Backend::sample on CUDA against the CPU reference (cpu::sample_row): the same token on every
// row whose reference margins are clear of float rounding (and on >= 99% of all rows), draw
// frequencies that follow the renormalised kept distribution, graph capture and replay, edge
// cases (ties, -inf, NaN, degenerate filters), and a timing printout.
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/sample.h"
#include "gpu_test_util.h"

namespace ds {
namespace {

using test::BackendTensor;

constexpr double kMargin = 1e-5;  // reference margins below this may flip under float rounding

SampleRow make_row(float temperature, int top_k, float top_p, float min_p, uint64_t seed,
                   uint64_t counter) {
  return SampleRow{temperature, top_k, top_p, min_p, seed, counter};
}

// A spread of settings: greedy, plain temperature, each filter alone and combined.
SampleRow row_params(int64_t r) {
  static const SampleRow table[] = {
      make_row(0.0f, 0, 1.0f, 0.0f, 0, 0),      make_row(1.0f, 0, 1.0f, 0.0f, 0, 0),
      make_row(0.7f, 40, 0.95f, 0.05f, 0, 0),   make_row(1.0f, 0, 0.9f, 0.0f, 0, 0),
      make_row(0.6f, 0, 0.5f, 0.0f, 0, 0),      make_row(1.3f, 1000, 1.0f, 0.0f, 0, 0),
      make_row(0.8f, 20, 1.0f, 0.0f, 0, 0),     make_row(1.0f, 0, 1.0f, 0.1f, 0, 0),
      make_row(2.0f, 0, 0.99f, 0.0f, 0, 0),     make_row(0.2f, 5, 0.8f, 0.0f, 0, 0),
      make_row(1.0f, 50000, 0.97f, 0.0f, 0, 0), make_row(0.9f, 0, 0.7f, 0.02f, 0, 0),
      make_row(1.0f, 1, 1.0f, 0.0f, 0, 0),
  };
  SampleRow p = table[size_t(r) % std::size(table)];
  p.seed = uint64_t(r) * 7919 + 1;
  p.counter = uint64_t(r) * 3;
  return p;
}

// One row of LLM-like logits; `style` varies the shape: spread with planted peaks, one
// dominant token (the rest far below), flat, bf16-rounded (many exact ties), masked (-inf).
void fill_row(float* x, int64_t V, int style, uint32_t seed) {
  std::mt19937 rng(seed);
  const float sd[] = {2.0f, 1.0f, 0.3f, 3.0f, 2.0f};
  std::normal_distribution<float> d(0.0f, sd[style % 5]);
  for (int64_t i = 0; i < V; ++i) x[i] = d(rng);
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  switch (style % 5) {
    case 0:
      for (int j = 0; j < 20; ++j) x[pick(rng)] += 4.0f + 0.3f * float(j);
      break;
    case 1:
      x[pick(rng)] = 40.0f;
      break;
    case 3:
      for (int64_t i = 0; i < V; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i] + 8.0f));
      break;
    case 4:
      for (int64_t i = 0; i < V; ++i)
        if (pick(rng) % 10 == 0) x[i] = -INFINITY;
      break;
    default:
      break;
  }
}

std::vector<float> make_logits(int64_t R, int64_t V, int64_t ld, uint32_t seed) {
  std::vector<float> x(size_t(R * ld), 0.0f);
  for (int64_t r = 0; r < R; ++r) fill_row(x.data() + r * ld, V, int(r), seed + uint32_t(r));
  return x;
}

BackendTensor upload_params(Backend& b, const std::vector<SampleRow>& rows) {
  const size_t bytes = rows.size() * sizeof(SampleRow);
  return test::upload_bytes(b, DType::U8, {int64_t(bytes)}, rows.data(), bytes);
}

std::vector<int32_t> download_ids(Backend& b, const BackendTensor& ids) {
  const std::vector<uint8_t> bytes = test::download_bytes(b, ids);
  std::vector<int32_t> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// The op on the GPU over rows ld floats apart.
std::vector<int32_t> gpu_sample(const std::vector<float>& logits, int64_t R, int64_t V, int64_t ld,
                                const std::vector<SampleRow>& rows) {
  Backend& g = test::cuda_backend();
  BackendTensor lt = test::upload_floats(g, DType::F32, {R, ld}, logits);
  const TensorView view = test::strided_view(lt.view, {R, V}, {ld * 4, 4});
  BackendTensor pt = upload_params(g, rows);
  BackendTensor ids = test::upload_ints(g, std::vector<int32_t>(size_t(R), -1));
  g.sample(view, pt.ptr<SampleRow>(), ids.view);
  return download_ids(g, ids);
}

// Every row with clear margins equal, and >= 99% of all rows.
void expect_matches_cpu(const std::vector<float>& logits, int64_t R, int64_t V, int64_t ld,
                        const std::vector<SampleRow>& rows, const std::vector<int32_t>& got,
                        const std::string& what) {
  int64_t equal = 0, unclear = 0, reported = 0;
  for (int64_t r = 0; r < R; ++r) {
    cpu::SampleTrace tr;
    const int32_t want =
        cpu::sample_row(std::span(logits.data() + r * ld, size_t(V)), rows[size_t(r)], &tr);
    const bool clear = tr.filter_margin > kMargin && tr.draw_margin > kMargin;
    unclear += !clear;
    if (got[size_t(r)] == want) {
      ++equal;
    } else if (clear && reported++ < 10) {
      const SampleRow& p = rows[size_t(r)];
      ADD_FAILURE() << what << " row " << r << ": gpu " << got[size_t(r)] << ", cpu " << want
                    << " (T " << p.temperature << ", k " << p.top_k << ", p " << p.top_p
                    << ", min_p " << p.min_p << "; kept " << tr.kept.size() << ", margins "
                    << tr.filter_margin << " / " << tr.draw_margin << ")";
    }
  }
  EXPECT_GE(equal, int64_t(std::floor(0.99 * double(R))))
      << what << ": " << equal << " of " << R << " rows equal";
  std::printf("  %s: %lld of %lld rows equal (%lld within %.0e of a boundary)\n", what.c_str(),
              (long long)equal, (long long)R, (long long)unclear, kMargin);
}

TEST(CudaSample, MatchesCpuReference) {
  DS_REQUIRE_GPU();
  for (int64_t V : {102400, 151936}) {
    for (int64_t R : {1, 3, 256}) {
      const int64_t ld = V + 32;  // strided rows
      const std::vector<float> logits = make_logits(R, V, ld, uint32_t(V + R));
      std::vector<SampleRow> rows;
      for (int64_t r = 0; r < R; ++r) rows.push_back(row_params(r + R));
      const std::vector<int32_t> got = gpu_sample(logits, R, V, ld, rows);
      expect_matches_cpu(logits, R, V, ld, rows, got,
                         "V " + std::to_string(V) + " B " + std::to_string(R));
    }
  }
}

TEST(CudaSample, LargestVocabularyAndContiguousRows) {
  DS_REQUIRE_GPU();
  const int64_t V = 262144, R = 26;
  const std::vector<float> logits = make_logits(R, V, V, 99);
  std::vector<SampleRow> rows;
  for (int64_t r = 0; r < R; ++r) rows.push_back(row_params(r));
  expect_matches_cpu(logits, R, V, V, rows, gpu_sample(logits, R, V, V, rows), "V 262144");
}

TEST(CudaSample, EdgeCasesMatchCpu) {
  DS_REQUIRE_GPU();
  const float inf = INFINITY;
  for (int64_t V : {7, 1000, 151936}) {
    std::vector<std::vector<float>> xs;
    std::vector<SampleRow> rows;
    auto add = [&](std::vector<float> x, SampleRow p) {
      xs.push_back(std::move(x));
      rows.push_back(p);
    };
    std::vector<float> ties(size_t(V), 0.0f);
    for (int64_t i = 0; i < V; i += 3) ties[size_t(i)] = 5.0f;  // many equal maxima
    for (int k : {1, 2, 3, 5}) add(ties, make_row(1.0f, k, 1.0f, 0.0f, 1, uint64_t(k)));
    for (float p : {0.3f, 0.6f, 0.95f}) add(ties, make_row(1.0f, 0, p, 0.0f, 2, 9));
    add(ties, make_row(0.0f, 0, 1.0f, 0.0f, 3, 0));  // greedy: the first maximum
    std::vector<float> mask(size_t(V), -inf);
    mask[size_t(V / 2)] = 1.0f;
    mask[size_t(V - 1)] = 1.5f;
    add(mask, make_row(1.0f, 0, 1.0f, 0.0f, 4, 1));
    add(mask, make_row(3.0f, std::min<int>(int(V), 10), 1.0f, 0.0f, 4, 2));  // k reaches -inf
    add(std::vector<float>(size_t(V), -inf), make_row(1.0f, 0, 0.9f, 0.0f, 5, 0));
    std::vector<float> nan0 = ties;
    nan0[0] = NAN;
    add(nan0, make_row(1.0f, 0, 1.0f, 0.0f, 6, 0));
    std::vector<float> nan_mid = ties;
    nan_mid[size_t(V - 1)] = NAN;
    add(nan_mid, make_row(1.0f, 0, 1.0f, 0.0f, 6, 0));
    std::vector<float> signed_zero(size_t(V), -1.0f);
    signed_zero[0] = -0.0f;
    signed_zero[size_t(V - 1)] = 0.0f;
    add(signed_zero, make_row(1.0f, 1 + int(V > 1), 1.0f, 0.0f, 7, 3));
    std::vector<float> spread(static_cast<size_t>(V));
    fill_row(spread.data(), V, 0, 8);
    add(spread, make_row(1.0f, 0, 1e-6f, 0.0f, 8, 0));          // tiny top_p: argmax
    add(spread, make_row(1.0f, 0, 1.0f, 1.0f, 8, 0));           // min_p 1: argmax
    add(spread, make_row(-2.0f, 40, 0.9f, 0.1f, 8, 0));         // negative temperature: greedy
    add(spread, make_row(1e-4f, 0, 1.0f, 0.0f, 8, 0));          // tiny temperature
    add(spread, make_row(1e4f, 0, 1.0f, 0.0f, 8, 0));           // huge temperature
    add(spread, make_row(1.0f, int(V) + 5, 1.0f, 0.0f, 8, 4));  // k >= V: off
    std::vector<float> bf16(static_cast<size_t>(V));
    fill_row(bf16.data(), V, 3, 9);
    for (float p : {0.5f, 0.9f}) add(bf16, make_row(1.0f, 0, p, 0.0f, 9, 1));
    add(bf16, make_row(0.8f, 64, 0.9f, 0.05f, 9, 2));

    const int64_t R = int64_t(xs.size());
    std::vector<float> logits;
    for (const auto& x : xs) logits.insert(logits.end(), x.begin(), x.end());
    expect_matches_cpu(logits, R, V, V, rows, gpu_sample(logits, R, V, V, rows),
                       "edge cases V " + std::to_string(V));
  }
}

// The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty).
double chi2_critical(double df) {
  const double z = 3.0902, a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

// The kept set's probabilities at the temperature, computed here in long double by sorting.
std::map<int32_t, double> kept_distribution(const std::vector<float>& x, const SampleRow& p) {
  std::vector<int32_t> order(x.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int32_t(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return x[size_t(a)] > x[size_t(b)]; });
  const long double m = x[size_t(order[0])];
  size_t n = p.top_k > 0 ? std::min(order.size(), size_t(p.top_k)) : order.size();
  long double z = 0, cum = 0;
  for (size_t i = 0; i < n; ++i) z += std::exp((long double)x[size_t(order[i])] - m);
  if (p.top_p < 1.0f)
    for (size_t i = 0; i < n; ++i) {
      cum += std::exp((long double)x[size_t(order[i])] - m) / z;
      if (cum >= p.top_p) {
        n = i + 1;
        break;
      }
    }
  size_t keep = 1;
  while (keep < n && std::exp((long double)x[size_t(order[keep])] - m) >= p.min_p) ++keep;
  n = keep;
  std::map<int32_t, double> prob;
  long double total = 0;
  for (size_t i = 0; i < n; ++i)
    total += std::exp(((long double)x[size_t(order[i])] - m) / p.temperature);
  for (size_t i = 0; i < n; ++i)
    prob[order[i]] =
        double(std::exp(((long double)x[size_t(order[i])] - m) / p.temperature) / total);
  return prob;
}

// 20480 draws (40 launches of 512 rows reading one logits row through a zero row stride,
// counters 0..20479) against the kept distribution: chi-square at p = 0.001.
TEST(CudaSample, FrequenciesFollowTheKeptDistribution) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  struct Case {
    int64_t V;
    SampleRow p;
  };
  const Case cases[] = {{64, make_row(0.9f, 20, 0.9f, 0.01f, 11, 0)},
                        {64, make_row(1.5f, 0, 1.0f, 0.0f, 12, 0)},
                        {151936, make_row(1.0f, 0, 0.95f, 0.0f, 13, 0)},
                        {151936, make_row(0.7f, 12, 1.0f, 0.0f, 14, 0)}};
  const int64_t R = 512, launches = 40;
  for (const Case& c : cases) {
    std::vector<float> x(static_cast<size_t>(c.V));
    std::mt19937 rng(uint32_t(c.V));
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (float& v : x) v = c.V > 1000 ? d(rng) - 40.0f : d(rng);
    for (int j = 0; j < 16 && c.V > 1000; ++j) x[size_t(j * 9001 + 5)] = 0.25f * float(j);
    const std::map<int32_t, double> want = kept_distribution(x, c.p);
    BackendTensor lt = test::upload_floats(g, DType::F32, {1, c.V}, x);
    const TensorView view = test::strided_view(lt.view, {R, c.V}, {0, 4});  // one row, R times
    BackendTensor ids = test::upload_ints(g, std::vector<int32_t>(size_t(R), -1));
    std::map<int32_t, int64_t> counts;
    for (int64_t l = 0; l < launches; ++l) {
      std::vector<SampleRow> rows(size_t(R), c.p);
      for (int64_t r = 0; r < R; ++r) rows[size_t(r)].counter = uint64_t(l * R + r);
      BackendTensor pt = upload_params(g, rows);
      g.sample(view, pt.ptr<SampleRow>(), ids.view);
      for (int32_t id : download_ids(g, ids)) ++counts[id];
    }
    const double n = double(R * launches);
    double chi2 = 0;
    for (const auto& [id, c_] : counts) EXPECT_TRUE(want.count(id)) << "drew " << id;
    for (const auto& [id, p] : want) {
      const double got = counts.count(id) ? double(counts[id]) : 0.0;
      chi2 += (got - p * n) * (got - p * n) / (p * n);
    }
    const double df = double(want.size() - 1);
    EXPECT_LT(chi2, chi2_critical(df)) << "V " << c.V << " kept " << want.size();
    std::printf("  V %lld, kept %zu: chi2 %.1f (df %.0f, critical %.1f)\n", (long long)c.V,
                want.size(), chi2, df, chi2_critical(df));
  }
}

// Captured once; replays with new logits and new counters written into the same buffers equal
// an eager run bit for bit and match the CPU reference.
TEST(CudaSample, GraphReplaySamplesNewInputs) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  ASSERT_TRUE(g.supports_graphs());
  const int64_t R = 64, V = 151936;
  BackendTensor lt = test::zeros(g, DType::F32, {R, V});
  std::vector<SampleRow> rows(static_cast<size_t>(R));
  BackendTensor pt = upload_params(g, rows);
  BackendTensor ids = test::upload_ints(g, std::vector<int32_t>(size_t(R), -1));
  BackendTensor eager_ids = test::upload_ints(g, std::vector<int32_t>(size_t(R), -1));
  g.synchronize();
  g.begin_capture();
  g.sample(lt.view, pt.ptr<SampleRow>(), ids.view);
  const int graph = g.end_capture();
  for (uint32_t it = 0; it < 3; ++it) {
    const std::vector<float> logits = make_logits(R, V, V, 500 + it);
    for (int64_t r = 0; r < R; ++r) {
      rows[size_t(r)] = row_params(r + it);
      rows[size_t(r)].counter += 1000 * it;
    }
    g.upload(lt.view, logits.data(), logits.size() * 4);
    g.upload(pt.view, rows.data(), rows.size() * sizeof(SampleRow));
    g.replay(graph);
    const std::vector<int32_t> got = download_ids(g, ids);
    g.sample(lt.view, pt.ptr<SampleRow>(), eager_ids.view);
    EXPECT_EQ(got, download_ids(g, eager_ids)) << "replay " << it << " differs from eager";
    expect_matches_cpu(logits, R, V, V, rows, got, "replay " + std::to_string(it));
  }
}

// Not a check: microseconds per launch, for the record.
TEST(CudaSample, Timing) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const int64_t V = 151936;
  const SampleRow settings[] = {make_row(0.8f, 40, 0.95f, 0.05f, 1, 0),
                                make_row(1.0f, 0, 0.9f, 0.0f, 1, 0),
                                make_row(1.0f, 0, 1.0f, 0.0f, 1, 0)};
  const char* names[] = {"k40 p0.95 min_p0.05", "p0.9", "temperature only"};
  for (int64_t R : {1, 64, 512}) {
    BackendTensor lt = test::upload_floats(g, DType::F32, {R, V}, make_logits(R, V, V, 7));
    BackendTensor ids = test::zeros(g, DType::I32, {R});
    for (size_t s = 0; s < std::size(settings); ++s) {
      BackendTensor pt = upload_params(g, std::vector<SampleRow>(size_t(R), settings[s]));
      g.sample(lt.view, pt.ptr<SampleRow>(), ids.view);
      g.synchronize();
      const int reps = 20;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) g.sample(lt.view, pt.ptr<SampleRow>(), ids.view);
      g.synchronize();
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
          reps;
      std::printf("  sample V %lld B %lld %-22s %8.1f us\n", (long long)V, (long long)R, names[s],
                  us);
    }
  }
}

}  // namespace
}  // namespace ds
