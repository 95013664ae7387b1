// CUDA MoE routing and routed experts against the CPU backend on the same random inputs:
// routing exactly (ids as sets, weights ~1e-6, counts), the experts within F32 tolerance on
// the decode path and BF16 tolerance on the prefill path, batch invariance and determinism
// of the decode path, graph capture, and the expert-table cache. The benchmark is in
// bench_cuda_moe.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/switches.h"
#include "moe_test_util.h"

namespace ds {
namespace {

using moe_test::DirectCuda;
using moe_test::Experts;
using moe_test::FfnCase;
using moe_test::make_case;
using moe_test::make_experts;
using moe_test::Rng;
using test::BackendTensor;

// ---- routing ---------------------------------------------------------------------------------

struct RouteCase {
  const char* name;
  int E, k;
  MoeTopk method;
  int n_group, topk_group;
  bool norm;
  float scale;
};

// Random logits, with rows 0..4 built to tie: all equal; the k-th and (k+1)-th best equal;
// three experts sharing the maximum; the topk_group-th and next group maxima equal; huge
// logits whose small scores underflow to exactly 0.
std::vector<float> route_logits(const RouteCase& c, int T, uint64_t seed) {
  Rng rng{seed};
  const int E = c.E;
  std::vector<float> v(size_t(T) * size_t(E));
  for (float& x : v) x = rng.uniform(-4.0f, 4.0f);
  auto row = [&](int t) { return v.data() + size_t(t) * size_t(E); };
  auto order = [&](const float* r) {
    std::vector<int> o(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) o[size_t(e)] = e;
    std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return r[a] > r[b]; });
    return o;
  };
  if (T > 0) std::fill_n(row(0), E, 0.25f);
  if (T > 1 && c.k < E) {
    const auto o = order(row(1));
    row(1)[o[size_t(c.k)]] = row(1)[o[size_t(c.k - 1)]];
  }
  if (T > 2 && E >= 3) {
    float* r = row(2);
    const float top = *std::max_element(r, r + E) + 1.0f;
    r[E - 1] = r[E / 2] = r[1] = top;
  }
  if (T > 3 && c.method == MoeTopk::GroupLimitedGreedy && c.topk_group < c.n_group) {
    float* r = row(3);
    const int per = E / c.n_group;
    std::vector<std::pair<float, int>> gmax;  // (max logit, group)
    for (int g = 0; g < c.n_group; ++g)
      gmax.emplace_back(*std::max_element(r + g * per, r + (g + 1) * per), g);
    std::stable_sort(gmax.begin(), gmax.end(), [](auto& a, auto& b) { return a.first > b.first; });
    const int g_in = gmax[size_t(c.topk_group - 1)].second;
    const int g_out = gmax[size_t(c.topk_group)].second;
    float* out_max = std::max_element(r + g_out * per, r + (g_out + 1) * per);
    *out_max = *std::max_element(r + g_in * per, r + (g_in + 1) * per);
  }
  if (T > 4)
    for (int e = 0; e < E; ++e) row(4)[e] *= 20.0f;
  return v;
}

// (id, weight) of each token, sorted by id.
std::vector<std::vector<std::pair<int, float>>> by_token(const std::vector<float>& ids,
                                                         const std::vector<float>& w, int T,
                                                         int k) {
  std::vector<std::vector<std::pair<int, float>>> r(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j)
      r[size_t(t)].emplace_back(int(ids[size_t(t * k + j)]), w[size_t(t * k + j)]);
    std::sort(r[size_t(t)].begin(), r[size_t(t)].end());
  }
  return r;
}

const RouteCase kRouteCases[] = {
    {"v2-lite greedy", 64, 6, MoeTopk::Greedy, 1, 1, false, 1.0f},
    {"greedy norm", 64, 6, MoeTopk::Greedy, 1, 1, true, 1.0f},
    {"v2.5 group-limited", 160, 6, MoeTopk::GroupLimitedGreedy, 8, 3, false, 16.0f},
    {"256 experts group norm", 256, 8, MoeTopk::GroupLimitedGreedy, 8, 4, true, 2.5f},
    {"kept groups smaller than k", 64, 6, MoeTopk::GroupLimitedGreedy, 16, 1, false, 1.0f},
    {"top-1 ignores norm", 8, 1, MoeTopk::Greedy, 1, 1, true, 2.5f},
    {"40 experts", 40, 3, MoeTopk::Greedy, 1, 1, false, 0.5f},
    {"k equals E", 6, 6, MoeTopk::GroupLimitedGreedy, 3, 2, true, 1.0f},
    {"33 experts", 33, 4, MoeTopk::Greedy, 1, 1, true, 1.0f},
    {"96 experts, 32 groups", 96, 5, MoeTopk::GroupLimitedGreedy, 32, 7, false, 1.0f},
};

MoeRouteParams route_params(const RouteCase& rc) {
  MoeRouteParams p;
  p.top_k = rc.k;
  p.method = rc.method;
  p.n_group = rc.n_group;
  p.topk_group = rc.topk_group;
  p.norm_topk_prob = rc.norm;
  p.routed_scaling_factor = rc.scale;
  return p;
}

TEST(CudaMoeRoute, MatchesCpuIncludingTiesAndCounts) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  uint64_t seed = 1000;
  for (const RouteCase& rc : kRouteCases) {
    for (int T : {1, 5, 37, 300}) {
      SCOPED_TRACE(std::string(rc.name) + " T " + std::to_string(T));
      const std::vector<float> logits = route_logits(rc, T, ++seed);
      MoeRouteParams p = route_params(rc);
      const test::Twin l = test::twin_floats(DType::F32, {T, rc.E}, logits);
      const test::Twin ids = test::twin_ints(std::vector<int32_t>(size_t(T * rc.k), 0));
      const test::Twin w =
          test::twin_floats(DType::F32, {T, rc.k}, std::vector<float>(size_t(T * rc.k), 0.0f));
      std::vector<int64_t> cpu_counts(size_t(rc.E), 0);
      p.expert_counts = cpu_counts.data();
      c.moe_route(l.cpu.view, p, test::view_of(ids.cpu, {T, rc.k}, {rc.k, 1}), w.cpu.view);
      BackendTensor counts = test::zeros(g, DType::I64, {rc.E});
      p.expert_counts = counts.ptr<int64_t>();
      const TensorView ids_gpu = test::view_of(ids.gpu, {T, rc.k}, {rc.k, 1});
      g.moe_route(l.gpu.view, p, ids_gpu, w.gpu.view);
      g.moe_route(l.gpu.view, p, ids_gpu, w.gpu.view);  // counts accumulate

      const auto want =
          by_token(test::download_floats(c, ids.cpu), test::download_floats(c, w.cpu), T, rc.k);
      const auto got =
          by_token(test::download_floats(g, ids.gpu), test::download_floats(g, w.gpu), T, rc.k);
      const double tol = 1e-6 * std::max(1.0f, rc.scale);
      int bad = 0;
      for (int t = 0; t < T && bad < 5; ++t) {
        bool ok = true;
        for (int j = 0; j < rc.k; ++j) {
          const auto& a = got[size_t(t)][size_t(j)];
          const auto& b = want[size_t(t)][size_t(j)];
          ok = ok && a.first == b.first && std::abs(double(a.second) - b.second) <= tol;
        }
        if (!ok) {
          ++bad;
          std::string s = "token " + std::to_string(t) + ": got";
          for (const auto& [id, wt] : got[size_t(t)])
            s += " " + std::to_string(id) + ":" + std::to_string(wt);
          s += "; want";
          for (const auto& [id, wt] : want[size_t(t)])
            s += " " + std::to_string(id) + ":" + std::to_string(wt);
          ADD_FAILURE() << s;
        }
      }
      const std::vector<uint8_t> cb = test::download_bytes(g, counts);
      std::vector<int64_t> got_counts(size_t(rc.E));
      std::memcpy(got_counts.data(), cb.data(), cb.size());
      for (int e = 0; e < rc.E; ++e)
        EXPECT_EQ(got_counts[size_t(e)], 2 * cpu_counts[size_t(e)]) << "expert " << e;
    }
  }
}

TEST(CudaMoeRoute, AllEqualLogitsPickTheLowestExperts) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  // Independent of the CPU: equal scores go to the lower index, groups likewise.
  const int E = 64, k = 6, T = 3;
  BackendTensor l = test::upload_floats(g, DType::F32, {T, E}, std::vector<float>(T * E, 1.5f));
  BackendTensor ids = test::zeros(g, DType::I32, {T, k});
  BackendTensor w = test::zeros(g, DType::F32, {T, k});
  MoeRouteParams p;
  p.top_k = k;
  p.method = MoeTopk::GroupLimitedGreedy;
  p.n_group = 8;
  p.topk_group = 1;  // one group of 8: experts 0..5
  p.routed_scaling_factor = 3.0f;
  g.moe_route(l.view, p, ids.view, w.view);
  const std::vector<float> got_ids = test::download_floats(g, ids);
  const std::vector<float> got_w = test::download_floats(g, w);
  for (int t = 0; t < T; ++t) {
    std::set<int> s;
    for (int j = 0; j < k; ++j) {
      s.insert(int(got_ids[size_t(t * k + j)]));
      EXPECT_NEAR(got_w[size_t(t * k + j)], 3.0 / E, 1e-7);
    }
    EXPECT_EQ(s, (std::set<int>{0, 1, 2, 3, 4, 5}));
  }
}

// [T, H] rows of a [T, ld] buffer.
std::vector<float> rows_of(const std::vector<float>& buf, int T, int H, int64_t ld) {
  std::vector<float> r(size_t(T) * size_t(H));
  for (int t = 0; t < T; ++t) std::copy_n(buf.begin() + t * ld, H, r.begin() + int64_t(t) * H);
  return r;
}

// Per token: ||got - want|| <= row_tol * ||want|| and every |got - want| <= elem_tol * the
// row's RMS. Reports the worst token.
::testing::AssertionResult rows_close(const std::vector<float>& got, const std::vector<float>& want,
                                      int T, int H, double row_tol, double elem_tol) {
  int bad = 0, worst = -1;
  double worst_ratio = 0, worst_rel = 0, worst_el = 0;
  for (int t = 0; t < T; ++t) {
    double nw = 0, ne = 0, me = 0;
    for (int i = 0; i < H; ++i) {
      const double a = got[size_t(t) * H + i], b = want[size_t(t) * H + i];
      nw += b * b;
      ne += (a - b) * (a - b);
      me = std::max(me, std::isfinite(a) ? std::abs(a - b) : INFINITY);
    }
    const double rms = std::sqrt(nw / H) + 1e-30;
    const double rel = std::sqrt(ne / (nw + 1e-60)), el = me / rms;
    const double ratio = std::max(rel / row_tol, el / elem_tol);
    if (ratio > 1) ++bad;
    if (ratio > worst_ratio || !std::isfinite(ratio)) {
      worst_ratio = ratio;
      worst = t;
      worst_rel = rel;
      worst_el = el;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << T << " tokens out of tolerance; worst token " << worst
         << ": relative L2 error " << worst_rel << " (tol " << row_tol << "), max |err| / RMS "
         << worst_el << " (tol " << elem_tol << ")";
}

// F32 activations (decode path): only summation order differs from the CPU.
constexpr double kDecodeRowTol = 1e-4, kDecodeElemTol = 1e-3;
// BF16-rounded activations (prefill path): ~0.3% expected.
constexpr double kPrefillRowTol = 1.5e-2, kPrefillElemTol = 6e-2;

const char* path_name(cuda::MoeFfnPath p) {
  return p == cuda::MoeFfnPath::Auto       ? "auto"
         : p == cuda::MoeFfnPath::Decode   ? "decode"
         : p == cuda::MoeFfnPath::Grouped  ? "grouped"
         : p == cuda::MoeFfnPath::Streamed ? "streamed"
         : p == cuda::MoeFfnPath::Wide     ? "wide"
         : p == cuda::MoeFfnPath::Split    ? "split"
                                           : "prefill";
}

// Whether Auto takes a path that rounds activations to BF16 (grouped or prefill).
bool auto_rounds_to_bf16(const FfnCase& c, DType t) {
  const cuda::MoeFfnPath p = cuda::moe_auto_path(t == DType::BF16, c.T, c.k, c.shared, false, false,
                                                 cuda::g_moe_split.on());
  return p != cuda::MoeFfnPath::Decode && p != cuda::MoeFfnPath::Split;
}

// The CPU result, then each path on the GPU against it; the sentinel padding of out must
// survive. The grouped kernels with 128-row tiles (Wide) and with 32-row tiles (the default
// up to 256 tokens) give every row the same k order as the 64-row ones: bit for bit.
void check_all_paths(const Experts& ex, FfnCase& c, bool with_bf16_paths) {
  Backend &g = test::cuda_backend(), &cpu = test::cpu_backend();
  cpu.moe_ffn(c.cpu);
  const std::vector<float> want_buf = test::download_floats(cpu, c.out.cpu);
  const std::vector<float> want = rows_of(want_buf, c.T, c.H, c.out_ld);
  DirectCuda d;
  std::vector<cuda::MoeFfnPath> paths = {cuda::MoeFfnPath::Auto, cuda::MoeFfnPath::Decode};
  // Split (BF16 and F16 experts) up to 64 tokens: its partial sums grow with the tokens.
  if ((with_bf16_paths || ex.dtype == DType::F16) && c.T <= 64)
    paths.push_back(cuda::MoeFfnPath::Split);
  if (with_bf16_paths) {
    paths.push_back(cuda::MoeFfnPath::Prefill);
    paths.push_back(cuda::MoeFfnPath::Grouped);
    paths.push_back(cuda::MoeFfnPath::Streamed);
    paths.push_back(cuda::MoeFfnPath::Wide);
  }
  std::vector<float> grouped;
  auto run = [&](cuda::MoeFfnPath path) {
    const std::vector<float> sentinel(c.out.gpu.numel(), 7.25f);
    g.upload(c.out.gpu.view, sentinel.data(), c.out.gpu.view.nbytes());
    g.synchronize();
    if (path == cuda::MoeFfnPath::Auto) {
      g.moe_ffn(c.gpu);  // through the backend
    } else {
      d.ffn(c.gpu, path);
    }
    return test::download_floats(g, c.out.gpu);
  };
  for (cuda::MoeFfnPath path : paths) {
    SCOPED_TRACE(path_name(path));
    const std::vector<float> got_buf = run(path);
    if (path == cuda::MoeFfnPath::Grouped) grouped = got_buf;
    if (path == cuda::MoeFfnPath::Wide) EXPECT_EQ(got_buf, grouped) << "wide differs from grouped";
    const bool prefill = path == cuda::MoeFfnPath::Prefill || path == cuda::MoeFfnPath::Grouped ||
                         path == cuda::MoeFfnPath::Streamed || path == cuda::MoeFfnPath::Wide ||
                         (path == cuda::MoeFfnPath::Auto && auto_rounds_to_bf16(c, ex.dtype));
    EXPECT_TRUE(rows_close(rows_of(got_buf, c.T, c.H, c.out_ld), want, c.T, c.H,
                           prefill ? kPrefillRowTol : kDecodeRowTol,
                           prefill ? kPrefillElemTol : kDecodeElemTol));
    for (int t = 0; t < c.T; ++t)
      for (int64_t i = c.H; i < c.out_ld; ++i)
        ASSERT_EQ(got_buf[size_t(t * c.out_ld + i)], 7.25f) << "padding written, token " << t;
  }
  if (with_bf16_paths && c.T <= 16) {  // Streamed's gate/up and down in one launch: same bits
    const std::vector<float> two = run(cuda::MoeFfnPath::Streamed);
    cuda::g_moe_bf16_fused.force(1);
    const int64_t before = cuda::moe_wq_fused_launches();
    EXPECT_EQ(run(cuda::MoeFfnPath::Streamed), two) << "one launch differs from two, T " << c.T;
    EXPECT_GT(cuda::moe_wq_fused_launches(), before);
    cuda::g_moe_bf16_fused.force(-1);
  }
  if (with_bf16_paths) {  // 32-row tiles (the default up to 256 tokens) against 64-row ones
    cuda::g_moe_tile32.force(0);
    const std::vector<float> g64 = run(cuda::MoeFfnPath::Grouped);
    cuda::g_moe_tile32.force(1);
    EXPECT_EQ(run(cuda::MoeFfnPath::Grouped), g64) << "32-row tiles differ from 64-row ones";
    cuda::g_moe_tile32.force(-1);
  }
}

TEST(CudaMoeFfn, EightExpertsSmallShapesAllPaths) {
  DS_REQUIRE_GPU();
  const auto ex = make_experts(8, 64, 48, DType::BF16, 11);
  uint64_t seed = 20;
  for (int T : {1, 3, 8, 64, 300, 2000}) {
    for (bool skewed : {false, true}) {
      SCOPED_TRACE("T " + std::to_string(T) + (skewed ? " skewed" : " uniform"));
      auto c = make_case(*ex, T, 2, skewed, ++seed, T == 64 ? 8 : 0);
      check_all_paths(*ex, *c, true);
    }
  }
}

TEST(CudaMoeFfn, SixtyFourExpertsSmallShapesAllPaths) {
  DS_REQUIRE_GPU();
  const auto ex = make_experts(64, 64, 48, DType::BF16, 12);
  uint64_t seed = 40;
  for (int T : {1, 3, 8, 64, 300, 2000}) {
    for (bool skewed : {false, true}) {
      SCOPED_TRACE("T " + std::to_string(T) + (skewed ? " skewed" : " uniform"));
      auto c = make_case(*ex, T, 6, skewed, ++seed, T == 8 ? 4 : 0);
      check_all_paths(*ex, *c, true);
    }
  }
}

// Gate and up rows back to back (a fused gate_up checkpoint): the prefill path runs one GEMM
// of 2F rows per expert; skewed routing leaves a few experts most tokens, so the side streams
// carry uneven work, and padded output rows must survive every path.
TEST(CudaMoeFfn, StackedGateUpAllPaths) {
  DS_REQUIRE_GPU();
  const auto ex = make_experts(24, 128, 80, DType::BF16, 14, true);
  uint64_t seed = 50;
  for (int T : {1, 7, 300, 2000}) {
    for (bool skewed : {false, true}) {
      SCOPED_TRACE("T " + std::to_string(T) + (skewed ? " skewed" : " uniform"));
      auto c = make_case(*ex, T, 6, skewed, ++seed, T == 300 ? 4 : 0);
      check_all_paths(*ex, *c, true);
    }
  }
}

TEST(CudaMoeFfn, DeepSeekV2LiteShapesAllPaths) {
  DS_REQUIRE_GPU();
  const auto ex = make_experts(64, 2048, 1408, DType::BF16, 13);
  uint64_t seed = 60;
  for (int T : {1, 3, 8, 64, 300}) {
    SCOPED_TRACE("T " + std::to_string(T));
    auto c = make_case(*ex, T, 6, false, ++seed);
    check_all_paths(*ex, *c, true);
  }
  SCOPED_TRACE("T 64 skewed");
  auto c = make_case(*ex, 64, 6, true, ++seed);
  check_all_paths(*ex, *c, true);
}

// Shared experts ride along as always-on slots (weight 1) on every path, and stay batch
// invariant: 64 routed + 2 shared as DeepSeek-V2-Lite folds them, and a small odd case.
TEST(CudaMoeFfn, SharedExpertsAllPaths) {
  DS_REQUIRE_GPU();
  uint64_t seed = 500;
  // The last case has 17 routed + 2 shared slots per token: more than the combine kernel loads
  // at once (16), so its second chunk of slots runs.
  for (auto [E, H, F, k, S] : {std::tuple{66, 2048, 1408, 6, 2}, std::tuple{9, 64, 48, 3, 1},
                               std::tuple{42, 64, 48, 17, 2}}) {
    const auto ex = make_experts(E, H, F, DType::BF16, ++seed);
    for (int T : {1, 8, 12, 64, 300}) {  // 12: the 16-token variants
      SCOPED_TRACE("E " + std::to_string(E) + " T " + std::to_string(T));
      auto c = make_case(*ex, T, k, T == 64, ++seed, T == 8 ? 4 : 0, S);
      check_all_paths(*ex, *c, true);
    }
  }
}

TEST(CudaMoeFfn, HalfAndFloatWeightsUseTheDecodeKernels) {
  DS_REQUIRE_GPU();
  uint64_t seed = 80;
  for (DType t : {DType::F16, DType::F32}) {
    const auto ex = make_experts(8, 64, 48, t, ++seed);
    for (int T : {1, 64, 600}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " T " + std::to_string(T));
      auto c = make_case(*ex, T, 2, T == 64, ++seed);
      check_all_paths(*ex, *c, false);
      DirectCuda d;
      EXPECT_THROW(cuda::moe_ffn(d.ctx(), c->gpu, cuda::MoeFfnPath::Prefill), UnsupportedError);
      EXPECT_THROW(cuda::moe_ffn(d.ctx(), c->gpu, cuda::MoeFfnPath::Grouped), UnsupportedError);
      EXPECT_THROW(cuda::moe_ffn(d.ctx(), c->gpu, cuda::MoeFfnPath::Streamed), UnsupportedError);
      EXPECT_THROW(cuda::moe_ffn(d.ctx(), c->gpu, cuda::MoeFfnPath::Wide), UnsupportedError);
      if (t == DType::F32) {
        EXPECT_THROW(cuda::moe_ffn(d.ctx(), c->gpu, cuda::MoeFfnPath::Split), UnsupportedError);
      }
    }
  }
}

// Decode, grouped and streamed paths: a token's output alone equals its output inside a batch bit
// for bit (also with the batch reversed and with a few experts taking most tokens), and reruns are
// identical.
TEST(CudaMoeFfn, DecodeAndGroupedPathsAreBatchInvariantAndDeterministic) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const auto ex = make_experts(16, 2048, 1408, DType::BF16, 14);
  const int k = 4, H = ex->H;
  for (auto [path, skewed] :
       {std::pair{cuda::MoeFfnPath::Decode, false}, std::pair{cuda::MoeFfnPath::Decode, true},
        std::pair{cuda::MoeFfnPath::Grouped, false}, std::pair{cuda::MoeFfnPath::Grouped, true},
        std::pair{cuda::MoeFfnPath::Streamed, false}, std::pair{cuda::MoeFfnPath::Streamed, true},
        std::pair{cuda::MoeFfnPath::Wide, false}, std::pair{cuda::MoeFfnPath::Wide, true},
        std::pair{cuda::MoeFfnPath::Split, false}, std::pair{cuda::MoeFfnPath::Split, true}}) {
    const int T = 64;
    SCOPED_TRACE(std::string(path_name(path)) + (skewed ? " skewed" : " uniform"));
    auto c = make_case(*ex, T, k, skewed, skewed ? 91 : 90);
    DirectCuda d;
    g.synchronize();
    d.ffn(c->gpu, path);
    const std::vector<float> batch = test::download_floats(g, c->out.gpu);
    d.ffn(c->gpu, path);
    EXPECT_EQ(test::download_floats(g, c->out.gpu), batch) << "rerun differs";

    // Reversed batch: token t sits at T - 1 - t.
    std::vector<float> xs = test::download_floats(g, c->x.gpu),
                       ws = test::download_floats(g, c->w.gpu);
    std::vector<float> ids_f = test::download_floats(g, c->ids.gpu);
    std::vector<float> rx(xs.size()), rw(ws.size());
    std::vector<int32_t> rids(ids_f.size());
    for (int t = 0; t < T; ++t) {
      std::copy_n(xs.begin() + t * H, H, rx.begin() + (T - 1 - t) * H);
      for (int j = 0; j < k; ++j) {
        rw[size_t((T - 1 - t) * k + j)] = ws[size_t(t * k + j)];
        rids[size_t((T - 1 - t) * k + j)] = int32_t(ids_f[size_t(t * k + j)]);
      }
    }
    BackendTensor rx_d = test::upload_floats(g, DType::F32, {T, H}, rx);
    BackendTensor rw_d = test::upload_floats(g, DType::F32, {T, k}, rw);
    BackendTensor rid_d = test::upload_bytes(g, DType::I32, {T, k}, rids.data(), rids.size() * 4);
    BackendTensor rout = test::zeros(g, DType::F32, {T, H});
    MoeFfnParams rp = c->gpu;
    rp.x = rx_d.view;
    rp.weights = rw_d.view;
    rp.ids = rid_d.view;
    rp.out = rout.view;
    g.synchronize();
    d.ffn(rp, path);
    const std::vector<float> rev = test::download_floats(g, rout);

    BackendTensor one = test::zeros(g, DType::F32, {1, H});
    int mismatched = 0;
    for (int t = 0; t < T; ++t) {
      MoeFfnParams p = c->gpu;
      p.x = c->gpu.x.slice_rows(t, t + 1);
      p.ids = c->gpu.ids.slice_rows(t, t + 1);
      p.weights = c->gpu.weights.slice_rows(t, t + 1);
      p.out = one.view;
      g.synchronize();
      d.ffn(p, path);
      const std::vector<float> alone = test::download_floats(g, one);
      const bool same_alone =
          std::memcmp(alone.data(), batch.data() + size_t(t) * H, size_t(H) * 4) == 0;
      const bool same_rev = std::memcmp(rev.data() + size_t(T - 1 - t) * H,
                                        batch.data() + size_t(t) * H, size_t(H) * 4) == 0;
      if (!same_alone || !same_rev) ++mismatched;
      EXPECT_TRUE(same_alone) << "token " << t << " alone differs from the batch";
      EXPECT_TRUE(same_rev) << "token " << t << " differs in the reversed batch";
      if (mismatched > 3) break;
    }
  }
}

// Captured once, replayed with new routing and activations in the same buffers: the replay
// equals an eager run of the path Auto takes bit for bit. T * k = 1200 is where Auto would
// take the (host-syncing) prefill path outside capture, if its threshold were that low.
TEST(CudaMoeFfn, GraphReplayFollowsNewRouting) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const auto ex = make_experts(64, 256, 128, DType::BF16, 15);
  for (int T : {1, 8, 200}) {
    SCOPED_TRACE("T " + std::to_string(T));
    auto c = make_case(*ex, T, 6, false, 100 + uint64_t(T));
    auto c2 = make_case(*ex, T, 6, false, 200 + uint64_t(T));
    // The path Auto takes under capture; its eager run sizes the scratch first.
    const cuda::MoeFfnPath ref = cuda::moe_auto_path(true, T, 6, 0, true);
    DirectCuda d;
    g.synchronize();
    d.ffn(c->gpu, ref);  // warms scratch and the expert table
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    MOE_CUDA_OK(cudaStreamBeginCapture(d.stream(), cudaStreamCaptureModeGlobal));
    cuda::moe_ffn(d.ctx(), c->gpu);  // Auto
    MOE_CUDA_OK(cudaStreamEndCapture(d.stream(), &graph));
    MOE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    // Eager reference for the second problem, computed in c2's own buffers.
    g.synchronize();
    d.ffn(c2->gpu, ref);
    const std::vector<float> want = test::download_floats(g, c2->out.gpu);

    // Copy c2's inputs into c's buffers and replay.
    for (auto [dst, src] : {std::pair{&c->x.gpu, &c2->x.gpu}, std::pair{&c->ids.gpu, &c2->ids.gpu},
                            std::pair{&c->w.gpu, &c2->w.gpu}})
      MOE_CUDA_OK(cudaMemcpyAsync(dst->view.data, src->view.data, src->view.nbytes(),
                                  cudaMemcpyDeviceToDevice, d.stream()));
    MOE_CUDA_OK(cudaGraphLaunch(exec, d.stream()));
    d.sync();
    EXPECT_EQ(test::download_floats(g, c->out.gpu), want);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// The cached device table follows the span: pointing the experts at other weights (same span
// address) changes the result, exactly as the CPU sees it.
TEST(CudaMoeFfn, ExpertTableFollowsChangedPointers) {
  DS_REQUIRE_GPU();
  const auto ex = make_experts(8, 64, 48, DType::BF16, 16);
  auto c = make_case(*ex, 8, 2, false, 300);
  check_all_paths(*ex, *c, false);
  for (int e = 0; e < 8; e += 2) {  // every expert changes, so every token sees it
    std::swap(ex->gpu[size_t(e)], ex->gpu[size_t(e + 1)]);
    std::swap(ex->cpu[size_t(e)], ex->cpu[size_t(e + 1)]);
  }
  check_all_paths(*ex, *c, false);
}

// Weight prefetch (pdl.cuh) asks L2 for the experts early, and the down kernels read the token
// lists before their wait: every path must give the same bits with it off and on. Two calls run
// back to back without a sync, with different routing, so a down kernel that read the lists of
// the call before (not this call's) would show.
TEST(CudaMoeFfn, WeightPrefetchChangesNothing) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const auto ex = make_experts(16, 2048, 1408, DType::BF16, 17);
  DirectCuda d;
  for (cuda::MoeFfnPath path : {cuda::MoeFfnPath::Decode, cuda::MoeFfnPath::Grouped,
                                cuda::MoeFfnPath::Streamed, cuda::MoeFfnPath::Wide}) {
    for (int T : {1, 5, 40}) {
      SCOPED_TRACE(std::string(path_name(path)) + " T " + std::to_string(T));
      auto a = make_case(*ex, T, 4, false, uint64_t(400 + T), 0, 2);
      auto b = make_case(*ex, T, 4, true, uint64_t(500 + T), 0, 2);
      std::vector<float> out[3][2];
      for (int mode = 0; mode < 3; ++mode) {  // off, on, on with 4 KB per CTA
        const test::Forced on(cuda::g_prefetch, mode > 0 ? 1 : 0);
        const test::Forced cap(cuda::g_prefetch_cap, mode == 2 ? 4096 : 0);
        g.synchronize();
        d.ffn(a->gpu, path);
        d.ffn(b->gpu, path);
        out[mode][0] = test::download_floats(g, a->out.gpu);
        out[mode][1] = test::download_floats(g, b->out.gpu);
      }
      for (int mode = 1; mode < 3; ++mode) {
        EXPECT_EQ(out[mode][0], out[0][0]) << "first call, mode " << mode;
        EXPECT_EQ(out[mode][1], out[0][1]) << "second call, mode " << mode;
      }
      EXPECT_NE(out[0][0], out[0][1]) << "the two routings should differ";
    }
  }
}

using test::bits_equal;

// Fills c's output with NaN (0xff bytes) on d's stream, so an output a kernel skips shows.
void poison_out(DirectCuda& d, FfnCase& c) {
  MOE_CUDA_OK(cudaMemsetAsync(c.out.gpu.view.data, 0xff, c.out.gpu.view.nbytes(), d.stream()));
}

// The two problems of the decode-path mode tests over top-4 of ex: a with padded rows (without
// shared experts also an expert base of 3, ids outside the local range skipped), b with
// skewed routing.
std::pair<std::unique_ptr<FfnCase>, std::unique_ptr<FfnCase>> decode_pair(const Experts& ex, int T,
                                                                          int S, uint64_t seed_a,
                                                                          uint64_t seed_b) {
  auto a = make_case(ex, T, 4, false, seed_a + uint64_t(T + 50 * S), 3, S);
  auto b = make_case(ex, T, 4, true, seed_b + uint64_t(T + 50 * S), 0, S);
  if (S == 0) {
    a->gpu.expert_base = a->cpu.expert_base = 3;
    a->gpu.skip_foreign = a->cpu.skip_foreign = true;
  }
  return {std::move(a), std::move(b)};
}

// path on a, then on b, back to back without a sync, into poisoned outputs; returns both.
std::array<std::vector<float>, 2> run_pair(DirectCuda& d, FfnCase& a, FfnCase& b,
                                           cuda::MoeFfnPath path) {
  Backend& g = test::cuda_backend();
  poison_out(d, a);
  poison_out(d, b);
  cuda::moe_ffn(d.ctx(), a.gpu, path);
  cuda::moe_ffn(d.ctx(), b.gpu, path);
  d.sync();
  return {test::download_floats(g, a.out.gpu), test::download_floats(g, b.out.gpu)};
}

// path on c captured once and replayed twice into a poisoned output: each replay gives want.
void expect_replays(DirectCuda& d, FfnCase& c, cuda::MoeFfnPath path,
                    const std::vector<float>& want) {
  Backend& g = test::cuda_backend();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_OK(cudaStreamBeginCapture(d.stream(), cudaStreamCaptureModeGlobal));
  cuda::moe_ffn(d.ctx(), c.gpu, path);
  MOE_CUDA_OK(cudaStreamEndCapture(d.stream(), &graph));
  MOE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 2; ++r) {
    poison_out(d, c);
    MOE_CUDA_OK(cudaGraphLaunch(exec, d.stream()));
    d.sync();
    EXPECT_TRUE(bits_equal(test::download_floats(g, c.out.gpu), want)) << "replay " << r;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// The decode path's fused combine (the down kernel's last CTA per row tile sums the slots), its
// one-wave grid sizing, the token lists built in the gate/up kernel (steps of at most 32
// assignments) and 4 chunks per row in flight (passes of up to 2 tokens;
// DEEPSERVE_MOE_DECODE_UNROLL), the down kernel's early start (its expert and first weights
// before the wait, DEEPSERVE_MOE_DOWN_EARLY) and shared experts' gate/up before the wait (one
// token, DEEPSERVE_MOE_SHARED_EARLY) and x and h staged a batch of loads at a time
// (DEEPSERVE_ROW_REGS) give the bits of the token-list kernel, the base grid, the separate
// combine, 2 chunks in flight, everything after the wait and the staging loop:
// every mode on the same problems, back to back without a sync (the arrival counters must be
// left zero), into outputs poisoned with NaN first (a row tile left uncombined would show), then
// replayed from a graph twice. Without shared experts the first problem also has an expert base
// (expert parallelism: ids outside the local range are skipped).
TEST(CudaMoeFfn, FusedCombineAndWaveSizingChangeNothing) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const auto ex = make_experts(18, 2048, 1408, DType::BF16, 23);
  DirectCuda d;
  for (int S : {0, 2}) {
    for (int T : {1, 2, 3, 5, 8, 21}) {
      SCOPED_TRACE("shared " + std::to_string(S) + " T " + std::to_string(T));
      auto [a, b] = decode_pair(*ex, T, S, 600, 700);
      // (fused combine, units-per-warp multiple, warp lists, unroll, down's early start, shared
      // experts first, rows staged a batch of loads at a time): the reference first.
      const std::tuple<int, long long, int, long long, int, int, int> modes[] = {
          {0, 1, 0, 2, 0, 0, 0}, {1, 0, 1, 2, 0, 0, 0}, {1, 1, 1, 2, 0, 0, 0},
          {1, 2, 0, 2, 0, 0, 0}, {1, 3, 1, 2, 0, 0, 0}, {0, 0, 1, 2, 0, 0, 0},
          {1, 0, 0, 2, 0, 0, 0}, {1, 0, 1, 4, 0, 0, 0}, {0, 1, 0, 4, 0, 0, 0},
          {1, 2, 1, 4, 0, 0, 0}, {1, 0, 1, 4, 1, 0, 0}, {1, 0, 0, 4, 1, 0, 0},
          {0, 1, 1, 2, 1, 0, 0}, {1, 2, 0, 2, 1, 0, 0}, {1, 0, 1, 4, 0, 1, 0},
          {1, 0, 1, 4, 1, 1, 0}, {0, 1, 1, 2, 1, 1, 0}, {1, 3, 1, 4, 0, 1, 0},
          {1, 0, 1, 4, 0, 0, 1}, {0, 1, 0, 2, 0, 0, 1}, {1, 0, 1, 4, 1, 1, 1},
          {1, 2, 0, 2, 1, 0, 1}};
      constexpr int kModes = int(std::size(modes));
      std::array<std::vector<float>, 2> out[kModes];
      g.synchronize();
      auto& counts = cuda::moe::early_launch_counts();
      for (int m = 0; m < kModes; ++m) {
        const test::Forced fused(cuda::g_moe_fused_combine, std::get<0>(modes[m]));
        const test::Forced upw(cuda::g_moe_decode_upw, std::get<1>(modes[m]));
        const test::Forced lists(cuda::g_moe_warp_lists, std::get<2>(modes[m]));
        const test::Forced unroll(cuda::g_moe_decode_unroll, std::get<3>(modes[m]));
        const test::Forced early(cuda::g_moe_down_early, std::get<4>(modes[m]));
        const test::Forced shared_first(cuda::g_moe_shared_early, std::get<5>(modes[m]));
        const test::Forced row_regs(cuda::g_row_regs, std::get<6>(modes[m]));
        const int64_t sf = counts.shared_first, de = counts.down_early;
        const int64_t rr = cuda::row_regs_launches();
        out[m] = run_pair(d, *a, *b, cuda::MoeFfnPath::Decode);
        // Each switch is taken where it applies: the early down on every launch, shared experts
        // first on one-token steps with shared experts whose lists the gate/up kernel builds.
        EXPECT_EQ(counts.down_early - de, std::get<4>(modes[m]) ? 2 : 0) << "mode " << m;
        const bool sf_applies = std::get<5>(modes[m]) && std::get<2>(modes[m]) && T == 1 && S > 0;
        EXPECT_EQ(counts.shared_first - sf, sf_applies ? 2 : 0) << "mode " << m;
        EXPECT_EQ(cuda::row_regs_launches() - rr, std::get<6>(modes[m]) ? 2 : 0) << "mode " << m;
      }
      for (int m = 1; m < kModes; ++m) {
        EXPECT_TRUE(bits_equal(out[m][0], out[0][0])) << "first problem, mode " << m;
        EXPECT_TRUE(bits_equal(out[m][1], out[0][1])) << "second problem, mode " << m;
      }
      // The reference itself is the CPU's result (and wrote every row: no NaN left).
      Backend& cpu = test::cpu_backend();
      cpu.moe_ffn(a->cpu);
      EXPECT_TRUE(rows_close(rows_of(out[0][0], T, a->H, a->out_ld),
                             rows_of(test::download_floats(cpu, a->out.cpu), T, a->H, a->out_ld), T,
                             a->H, kDecodeRowTol, kDecodeElemTol));

      // Graph replays: the fused path twice from one capture (Auto's sizing, fused on), with the
      // down kernel's lookup after its wait and before it.
      expect_replays(d, *b, cuda::MoeFfnPath::Decode, out[0][1]);
      const test::Forced early(cuda::g_moe_down_early, 1);
      const test::Forced shared_first(cuda::g_moe_shared_early, 1);
      expect_replays(d, *b, cuda::MoeFfnPath::Decode, out[0][1]);
    }
  }
}

// moe_ffn with an add and norm after it (post: the Decode path's down kernel adds out into the
// residual and normalizes where it does the combine, DEEPSERVE_ADD_NORM_LAST) against moe_ffn,
// then the norm kernel: the same bits in out, r_out and rn, with the down kernel's early start
// and without, 1-8 tokens, shared experts or none, padded rows, two calls in a row (the second
// finds the counters put back) and graph replays.
TEST(CudaMoeFfn, AddNormAfterTheCombineMatchesTheNormKernel) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const auto ex = make_experts(18, 2048, 1408, DType::BF16, 29);
  DirectCuda d;
  int* counter = nullptr;
  MOE_CUDA_OK(cudaMalloc(&counter, sizeof(int)));
  MOE_CUDA_OK(cudaMemset(counter, 0, sizeof(int)));
  const test::Forced fused(cuda::g_moe_fused_combine, 1);
  for (int S : {0, 2}) {
    for (int T : {1, 3, 8}) {
      SCOPED_TRACE("shared " + std::to_string(S) + " T " + std::to_string(T));
      auto pair = decode_pair(*ex, T, S, 800, 900);
      auto& a = pair.first;
      const int H = a->H;
      const int64_t ld = H + 5;
      const test::Twin r =
          test::twin_floats(DType::F32, {T, ld},
                            test::random_floats(size_t(T * ld), uint32_t(40 + T + 9 * S), -2, 2));
      const test::Twin nw = test::twin_floats(
          DType::F32, {H}, test::random_floats(size_t(H), uint32_t(60 + T), 0.9f, 1.1f));
      const test::Twin r_out = test::twin_floats(DType::F32, {T, ld}, std::vector<float>(T * ld));
      const test::Twin rn = test::twin_floats(DType::F32, {T, ld}, std::vector<float>(T * ld));
      const auto rows = [&](const test::Twin& t) { return view_of(t.gpu, {T, H}, {ld, 1}); };
      cuda::AddNormArgs post;
      post.r = r.gpu.view.ptr<float>();
      post.r_row = ld * 4;
      post.g = nw.gpu.view.ptr<float>();
      post.eps = 1e-6f;
      post.r_out = r_out.gpu.view.ptr<float>();
      post.r_out_row = ld * 4;
      post.rn = rn.gpu.view.ptr<float>();
      post.rn_row = ld * 4;
      post.threads = cuda::rms_norm_threads(H);
      post.counter = counter;
      auto poison = [&] {
        poison_out(d, *a);
        for (const test::Twin* t : {&r_out, &rn})
          MOE_CUDA_OK(cudaMemsetAsync(t->gpu.view.data, 0xff, t->gpu.view.nbytes(), d.stream()));
      };
      auto result = [&] {
        d.sync();
        return std::array<std::vector<float>, 3>{test::download_floats(g, a->out.gpu),
                                                 test::download_floats(g, r_out.gpu),
                                                 test::download_floats(g, rn.gpu)};
      };
      for (int early : {0, 1}) {
        SCOPED_TRACE("early down " + std::to_string(early));
        const test::Forced down_early(cuda::g_moe_down_early, early);
        g.synchronize();
        poison();
        EXPECT_FALSE(cuda::moe_ffn(d.ctx(), a->gpu, cuda::MoeFfnPath::Decode));
        cuda::RmsNormArgs na{rows(r), nw.gpu.view, 1e-6f, rows(rn)};
        na.residual = a->gpu.out;
        na.x_out = rows(r_out);
        cuda::launch_rms_norm(na, d.stream());
        const auto want = result();
        for (int rep = 0; rep < 2; ++rep) {
          poison();
          EXPECT_TRUE(
              cuda::moe_ffn(d.ctx(), a->gpu, cuda::MoeFfnPath::Decode, cuda::kMoeAllStages, &post));
          const auto got = result();
          EXPECT_TRUE(bits_equal(got[0], want[0])) << "out, call " << rep;
          EXPECT_TRUE(bits_equal(got[1], want[1])) << "r_out, call " << rep;
          EXPECT_TRUE(bits_equal(got[2], want[2])) << "rn, call " << rep;
        }
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        MOE_CUDA_OK(cudaStreamBeginCapture(d.stream(), cudaStreamCaptureModeGlobal));
        cuda::moe_ffn(d.ctx(), a->gpu, cuda::MoeFfnPath::Decode, cuda::kMoeAllStages, &post);
        MOE_CUDA_OK(cudaStreamEndCapture(d.stream(), &graph));
        MOE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        for (int rep = 0; rep < 2; ++rep) {
          poison();
          MOE_CUDA_OK(cudaGraphLaunch(exec, d.stream()));
          const auto got = result();
          EXPECT_TRUE(bits_equal(got[2], want[2])) << "rn, replay " << rep;
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
    }
  }
  cudaFree(counter);
}

// The split path (gate, up and a strip of down per CTA, then the strip reduce and combine):
// against the CPU, the same bits with the token lists built in the kernel or by the token-list
// kernel and with the strip of down prefetched or not, every output written (poisoned with
// NaN first), two problems back to back without a sync, and graph replays. Without shared
// experts the first problem has an expert base (ids outside the local range are skipped).
TEST(CudaMoeFfn, SplitPathMatchesCpuInEveryMode) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &cpu = test::cpu_backend();
  const auto ex = make_experts(18, 2048, 1408, DType::BF16, 29);
  DirectCuda d;
  for (int S : {0, 2}) {
    for (int T : {1, 2, 3, 5, 8, 21}) {
      SCOPED_TRACE("shared " + std::to_string(S) + " T " + std::to_string(T));
      auto [a, b] = decode_pair(*ex, T, S, 800, 900);
      const std::pair<int, int> modes[] = {{1, 0}, {0, 0}, {1, 1}, {0, 1}};  // (lists, prefetch)
      std::array<std::vector<float>, 2> out[4];
      g.synchronize();
      for (int m = 0; m < 4; ++m) {
        const test::Forced lists(cuda::g_moe_warp_lists, modes[m].first);
        const test::Forced pf(cuda::g_moe_split_prefetch, modes[m].second);
        out[m] = run_pair(d, *a, *b, cuda::MoeFfnPath::Split);
      }
      for (int m = 1; m < 4; ++m) {
        EXPECT_TRUE(bits_equal(out[m][0], out[0][0])) << "first problem, mode " << m;
        EXPECT_TRUE(bits_equal(out[m][1], out[0][1])) << "second problem, mode " << m;
      }
      cpu.moe_ffn(a->cpu);
      cpu.moe_ffn(b->cpu);
      for (int i = 0; i < 2; ++i) {
        FfnCase& c = i == 0 ? *a : *b;
        EXPECT_TRUE(rows_close(rows_of(out[0][i], T, c.H, c.out_ld),
                               rows_of(test::download_floats(cpu, c.out.cpu), T, c.H, c.out_ld), T,
                               c.H, kDecodeRowTol, kDecodeElemTol))
            << "problem " << i;
      }
      // DEEPSERVE_MOE_SPLIT=1: Auto takes it for decode-sized BF16 steps.
      if (cuda::moe_auto_path(true, T, 4, S, false, false, true) == cuda::MoeFfnPath::Split) {
        const test::Forced on(cuda::g_moe_split, 1);
        poison_out(d, *b);
        cuda::moe_ffn(d.ctx(), b->gpu, cuda::MoeFfnPath::Auto);
        d.sync();
        EXPECT_TRUE(bits_equal(test::download_floats(g, b->out.gpu), out[0][1])) << "auto";
      }
      expect_replays(d, *b, cuda::MoeFfnPath::Split, out[0][1]);
    }
  }
}

}  // namespace
}  // namespace ds
