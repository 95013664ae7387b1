// The CUDA backend's own ops (embed, rms_norm, rope, store_kv, silu_mul, add, copy, matmul,
// batched_matmul) against the CPU backend and float64 references with the same random inputs
// over awkward shapes and strided views, and its device memory pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/memory_pool.h"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/switches.h"
#include "gpu_test_util.h"

namespace ds {
namespace {

using test::BackendTensor;
using test::buffer_bounds;
using test::to_double;
using test::Twin;
using test::twin_floats;
using test::twin_ints;
using test::view_of;

std::string dt(DType t) {
  return std::string(dtype_name(t));
}

// Sentinel-filled initial contents, so writes outside a view show.
std::vector<float> sentinel(int64_t n) {
  return std::vector<float>(size_t(n), 7.25f);
}

// ---- the memory pool -----------------------------------------------------------------------

TEST(RangeAllocator, FirstFitAlignmentAndCoalescing) {
  cuda::RangeAllocator r(4096, 256);
  const auto a = r.allocate(1), b = r.allocate(300), c = r.allocate(256);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, 256u);  // a took one aligned unit
  EXPECT_EQ(*c, 768u);  // b took two
  EXPECT_EQ(r.used(), 1024u);
  r.release(*a);
  r.release(*c);
  r.release(*b);  // merges with both neighbours and the tail
  EXPECT_EQ(r.used(), 0u);
  EXPECT_EQ(r.largest_free(), 4096u);
  const auto d = r.allocate(4096);
  ASSERT_TRUE(d);
  EXPECT_EQ(*d, 0u);
  EXPECT_FALSE(r.allocate(1).has_value());
  EXPECT_THROW(r.release(256), Error);  // not the start of a range
}

TEST(RangeAllocator, RandomSequenceNeverOverlapsAndReturnsEverything) {
  constexpr size_t kCap = 1 << 20, kAlign = 256;
  cuda::RangeAllocator r(kCap, kAlign);
  std::vector<std::pair<size_t, size_t>> live;  // offset, requested bytes
  const std::vector<int32_t> ops = test::random_ints(4000, 11, 0, 2);
  const std::vector<int32_t> sizes = test::random_ints(4000, 12, 0, 40000);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i] > 0 || live.empty()) {
      const auto off = r.allocate(size_t(sizes[i]));
      if (!off) {
        EXPECT_LT(r.largest_free(), std::max<size_t>(size_t(sizes[i]), 1));
        continue;
      }
      EXPECT_EQ(*off % kAlign, 0u);
      EXPECT_LE(*off + size_t(sizes[i]), kCap);
      for (const auto& [o, s] : live)  // no overlap with any live range
        EXPECT_TRUE(*off + std::max<size_t>(size_t(sizes[i]), 1) <= o ||
                    o + std::max<size_t>(s, 1) <= *off);
      live.emplace_back(*off, size_t(sizes[i]));
    } else {
      const size_t k = size_t(sizes[i]) % live.size();
      r.release(live[k].first);
      live.erase(live.begin() + std::ptrdiff_t(k));
    }
  }
  for (const auto& [o, s] : live) r.release(o);
  EXPECT_EQ(r.used(), 0u);
  EXPECT_EQ(r.largest_free(), kCap);
}

TEST(CudaPool, InfoRefusesACpuBackend) {
  EXPECT_THROW(cuda_pool_info(test::cpu_backend()), Error);
}

TEST(CudaPool, RejectsBadUtilization) {
  DS_REQUIRE_GPU();
  for (double u : {0.0, -0.5, 1.5}) {
    BackendOptions o;
    o.gpu_memory_utilization = u;
    EXPECT_THROW(make_cuda_backend(o, 0), Error) << u;
  }
}

TEST(CudaPool, ExhaustionIsAClearError) {
  DS_REQUIRE_GPU();
  BackendOptions o;
  o.gpu_memory_utilization = 0.02;
  std::unique_ptr<Backend> b = make_cuda_backend(o, 0);
  const CudaPoolInfo info = cuda_pool_info(*b);
  ASSERT_GT(info.capacity_bytes, size_t(64) << 20);
  EXPECT_EQ(info.used_bytes + info.free_bytes, info.capacity_bytes);
  try {
    b->alloc(info.capacity_bytes + 1);
    ADD_FAILURE() << "an allocation larger than the pool succeeded";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("exhausted"), std::string::npos) << m;
    EXPECT_NE(m.find("--gpu-memory-utilization"), std::string::npos) << m;
    EXPECT_NE(m.find("--kv-cache-tokens"), std::string::npos) << m;
  }
  std::unique_ptr<Buffer> all = b->alloc(info.largest_free_bytes);
  EXPECT_THROW(b->alloc(1), Error);
  all.reset();
  EXPECT_NO_THROW(b->alloc(info.largest_free_bytes));
}

TEST(CudaPool, FreedRangesAreReusedAndMerged) {
  DS_REQUIRE_GPU();
  BackendOptions o;
  o.gpu_memory_utilization = 0.02;
  std::unique_ptr<Backend> be = make_cuda_backend(o, 0);
  const size_t mib = size_t(1) << 20, base_used = cuda_pool_info(*be).used_bytes;
  std::unique_ptr<Buffer> a = be->alloc(mib), b = be->alloc(mib), c = be->alloc(mib);
  auto* pa = static_cast<char*>(a->data());
  EXPECT_EQ(static_cast<char*>(b->data()), pa + mib);  // first fit from an untouched pool
  EXPECT_EQ(cuda_pool_info(*be).used_bytes, base_used + 3 * mib);
  a.reset();
  std::unique_ptr<Buffer> d = be->alloc(mib);
  EXPECT_EQ(d->data(), pa);
  d.reset();
  b.reset();  // [pa, pa + 2 MiB) is one free range now
  std::unique_ptr<Buffer> e = be->alloc(2 * mib);
  EXPECT_EQ(e->data(), pa);
  // The memory works: a round trip through a pool buffer.
  const std::vector<float> v = test::random_floats(1000, 5);
  BackendTensor t = test::upload_floats(*be, DType::F32, {1000}, v);
  EXPECT_TRUE(test::all_equal(test::download_floats(*be, t), v, "pool round trip"));
  e.reset();
  c.reset();
  t = {};
  EXPECT_EQ(cuda_pool_info(*be).used_bytes, base_used);
}

TEST(CudaBackend, SupportsTheFormatsItHasKernelsFor) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    EXPECT_TRUE(g.supports(Op::MatMul, t)) << dt(t);
    EXPECT_TRUE(g.supports(Op::Embed, t)) << dt(t);
    EXPECT_TRUE(g.supports(Op::StoreKv, t)) << dt(t);
  }
  // GGUF blocks with CUDA kernels (gemm_gguf.cu), and deepserve's W4A16 / FP8W (gemm_wq.cu).
  for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K,
                  DType::Q5_K, DType::Q6_K, DType::W4A16, DType::FP8W})
    EXPECT_TRUE(g.supports(Op::MatMul, t)) << dt(t);
  // No CUDA kernels: the engine keeps these on the CPU (or refuses the model).
  for (DType t : {DType::Q2_K, DType::Q3_K, DType::Q8_1, DType::Q8_K})
    EXPECT_FALSE(g.supports(Op::MatMul, t)) << dt(t);
  EXPECT_TRUE(g.supports(Op::RmsNorm, DType::F32));
  EXPECT_FALSE(g.supports(Op::RmsNorm, DType::BF16));
  BackendTensor w = test::zeros(g, DType::I8, {4, 256});
  w.view.dtype = DType::Q2_K;  // 4 rows of one Q2_K block (84 bytes) fit in 1 KiB
  w.view.shape[1] = 256;
  w.view.stride[1] = 0;
  w.view.stride[0] = 84;
  BackendTensor x = test::zeros(g, DType::F32, {1, 256}), y = test::zeros(g, DType::F32, {1, 4});
  EXPECT_THROW(g.matmul(x.view, w.view, y.view), UnsupportedError);
}

// ---- embed -----------------------------------------------------------------------------------

TEST(CudaOps, EmbedMatchesCpu) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int vocab, dim, n;
  };
  const Case cases[] = {{97, 1, 1}, {97, 7, 7}, {1000, 576, 97}, {50, 1000, 1000}, {3, 13, 7}};
  uint32_t seed = 100;
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    for (const Case& k : cases) {
      SCOPED_TRACE(dt(t) + " vocab " + std::to_string(k.vocab) + " dim " + std::to_string(k.dim) +
                   " n " + std::to_string(k.n));
      const Twin table = twin_floats(t, {k.vocab, k.dim},
                                     test::random_floats(size_t(k.vocab * k.dim), ++seed, -3, 3));
      const Twin ids = twin_ints(test::random_ints(size_t(k.n), ++seed, 0, k.vocab - 1));
      const int64_t ld = k.dim + 3;  // padded output rows
      const Twin out = twin_floats(DType::F32, {k.n, ld}, sentinel(k.n * ld));
      c.embed(table.cpu.view, ids.cpu.ptr<int32_t>(), k.n, view_of(out.cpu, {k.n, k.dim}, {ld, 1}));
      g.embed(table.gpu.view, ids.gpu.ptr<int32_t>(), k.n, view_of(out.gpu, {k.n, k.dim}, {ld, 1}));
      // A copy or an exact widening: bit-identical, padding untouched.
      EXPECT_TRUE(test::all_equal(test::download_floats(g, out.gpu),
                                  test::download_floats(c, out.cpu), "embed", {k.n, ld}));
    }
  }
}

TEST(CudaOps, EmbedReportsABadTokenAtSynchronize) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const BackendTensor table =
      test::upload_floats(g, DType::BF16, {10, 8}, test::random_floats(80, 1));
  const std::vector<int32_t> bad = {3, 10};
  const BackendTensor ids = test::upload_ints(g, bad);
  BackendTensor out = test::zeros(g, DType::F32, {2, 8});
  g.embed(table.view, ids.ptr<int32_t>(), 2, out.view);
  try {
    g.synchronize();
    ADD_FAILURE() << "an out-of-vocabulary id went unreported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 10"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(g.synchronize());  // reported once, then cleared
}

// ---- rms_norm ------------------------------------------------------------------------------

// A [rows, n] output (row stride ld) on the GPU against the CPU's: F32 sum of squares (block
// tree) vs the CPU's double, ~1e-6 relative on the scale, then two F32 products.
void expect_norm_close(const BackendTensor& got, const BackendTensor& want_t, int rows, int n,
                       int64_t ld, const char* what) {
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  const std::vector<float> want = test::download_floats(c, want_t);
  const std::vector<size_t> idx =
      test::view_offsets(want_t.view.data, view_of(want_t, {rows, n}, {ld, 1}));
  std::vector<double> vb(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) vb[i] = 1e-6 + 1e-5 * std::abs(want[idx[i]]);
  EXPECT_TRUE(test::all_close_bounds(test::download_floats(g, got), to_double(want),
                                     buffer_bounds(want.size(), idx, vb), what, {rows, ld}));
}

TEST(CudaOps, RmsNormMatchesCpu) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int rows, n;
    bool in_place;
  };
  const Case cases[] = {{1, 1, false},      {1, 576, false}, {7, 7, true},     {97, 64, false},
                        {1000, 576, false}, {7, 5120, true}, {3, 7168, false}, {1000, 13, true}};
  uint32_t seed = 200;
  for (const Case& k : cases) {
    SCOPED_TRACE("rows " + std::to_string(k.rows) + " n " + std::to_string(k.n) +
                 (k.in_place ? " in place" : ""));
    const int64_t ldx = k.n + 5, ldo = k.n + 2;
    const Twin x = twin_floats(DType::F32, {k.rows, ldx},
                               test::random_floats(size_t(k.rows * ldx), ++seed, -2, 2));
    const Twin w = twin_floats(DType::F32, {k.n}, test::random_floats(size_t(k.n), ++seed));
    const Twin out = twin_floats(DType::F32, {k.rows, ldo}, sentinel(k.rows * ldo));
    const BackendTensor& target_c = k.in_place ? x.cpu : out.cpu;
    const BackendTensor& target_g = k.in_place ? x.gpu : out.gpu;
    const int64_t ld = k.in_place ? ldx : ldo;
    c.rms_norm(view_of(x.cpu, {k.rows, k.n}, {ldx, 1}), w.cpu.view, 1e-6f,
               view_of(target_c, {k.rows, k.n}, {ld, 1}));
    g.rms_norm(view_of(x.gpu, {k.rows, k.n}, {ldx, 1}), w.gpu.view, 1e-6f,
               view_of(target_g, {k.rows, k.n}, {ld, 1}));
    expect_norm_close(target_g, target_c, k.rows, k.n, ld, "rms_norm");
  }
}

// add_rms_norm: the fused kernel against the CPU's add then rms_norm; x after the add is
// bit-exact (one F32 addition), the norm within the rms_norm tolerance; out aliasing y too.
TEST(CudaOps, AddRmsNormMatchesCpu) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int rows, n;
    bool out_is_y;
  };
  const Case cases[] = {{1, 1, false},   {1, 2048, true},    {7, 7, false},
                        {97, 576, true}, {300, 2048, false}, {3, 7168, true}};
  uint32_t seed = 250;
  for (const Case& k : cases) {
    SCOPED_TRACE("rows " + std::to_string(k.rows) + " n " + std::to_string(k.n) +
                 (k.out_is_y ? " out = y" : ""));
    const int64_t ldx = k.n + 3, ldy = k.n + 1, ldo = k.n + 2;
    const Twin x = twin_floats(DType::F32, {k.rows, ldx},
                               test::random_floats(size_t(k.rows * ldx), ++seed, -2, 2));
    const Twin y = twin_floats(DType::F32, {k.rows, ldy},
                               test::random_floats(size_t(k.rows * ldy), ++seed, -2, 2));
    const Twin w = twin_floats(DType::F32, {k.n}, test::random_floats(size_t(k.n), ++seed));
    const Twin out = twin_floats(DType::F32, {k.rows, ldo}, sentinel(k.rows * ldo));
    const BackendTensor& target_c = k.out_is_y ? y.cpu : out.cpu;
    const BackendTensor& target_g = k.out_is_y ? y.gpu : out.gpu;
    const int64_t ld = k.out_is_y ? ldy : ldo;
    c.add(view_of(x.cpu, {k.rows, k.n}, {ldx, 1}), view_of(y.cpu, {k.rows, k.n}, {ldy, 1}));
    c.rms_norm(view_of(x.cpu, {k.rows, k.n}, {ldx, 1}), w.cpu.view, 1e-6f,
               view_of(target_c, {k.rows, k.n}, {ld, 1}));
    g.add_rms_norm(view_of(x.gpu, {k.rows, k.n}, {ldx, 1}), view_of(y.gpu, {k.rows, k.n}, {ldy, 1}),
                   w.gpu.view, 1e-6f, view_of(target_g, {k.rows, k.n}, {ld, 1}));
    EXPECT_EQ(test::download_floats(g, x.gpu), test::download_floats(c, x.cpu)) << "x += y";
    expect_norm_close(target_g, target_c, k.rows, k.n, ld, "add_rms_norm");
  }
}

// DEEPSERVE_ROW_REGS=1 (each thread's elements of a row in registers, the weights read before
// the wait): rms_norm and add_rms_norm give the same bits as the loop kernel, in out and in x
// after the add, over rms_norm's thread counts (32 to 1,024), rows that leave threads idle,
// out aliasing y, many rows, and the widths past kRowRegs x 1,024 that keep the loop.
TEST(CudaOps, NormRegsChangeNothing) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  struct Case {
    int rows, n;
    bool add, out_is_y;
  };
  const Case cases[] = {{1, 1, false, false},     {1, 2048, true, true},   {8, 2048, true, false},
                        {3, 5120, true, false},   {1, 7168, false, false}, {97, 576, true, true},
                        {1000, 13, false, false}, {2, 8192, true, false},  {1, 8200, true, false},
                        {5, 1000, false, false}};
  uint32_t seed = 700;
  for (const Case& k : cases) {
    SCOPED_TRACE("rows " + std::to_string(k.rows) + " n " + std::to_string(k.n) +
                 (k.add ? " add" : "") + (k.out_is_y ? " out = y" : ""));
    const int64_t ldx = k.n + 3, ldy = k.n + 1, ldo = k.n + 2;
    const std::vector<float> xs = test::random_floats(size_t(k.rows * ldx), ++seed, -2, 2);
    const std::vector<float> ys = test::random_floats(size_t(k.rows * ldy), ++seed, -2, 2);
    const Twin w = twin_floats(DType::F32, {k.n}, test::random_floats(size_t(k.n), ++seed));
    std::vector<float> got[2][2];  // [regs][x after the add, out]
    int64_t launches[2] = {0, 0};
    for (int regs : {0, 1}) {
      cuda::g_row_regs.force(regs);
      const Twin x = twin_floats(DType::F32, {k.rows, ldx}, xs);
      const Twin y = twin_floats(DType::F32, {k.rows, ldy}, ys);
      const Twin out = twin_floats(DType::F32, {k.rows, ldo}, sentinel(k.rows * ldo));
      const BackendTensor& target = k.out_is_y ? y.gpu : out.gpu;
      const TensorView tv = view_of(target, {k.rows, k.n}, {k.out_is_y ? ldy : ldo, 1});
      const int64_t before = cuda::row_regs_launches();
      if (k.add)
        g.add_rms_norm(view_of(x.gpu, {k.rows, k.n}, {ldx, 1}),
                       view_of(y.gpu, {k.rows, k.n}, {ldy, 1}), w.gpu.view, 1e-6f, tv);
      else
        g.rms_norm(view_of(x.gpu, {k.rows, k.n}, {ldx, 1}), w.gpu.view, 1e-6f, tv);
      launches[regs] = cuda::row_regs_launches() - before;
      got[regs][0] = test::download_floats(g, x.gpu);
      got[regs][1] = test::download_floats(g, target);
    }
    cuda::g_row_regs.force(-1);
    EXPECT_EQ(launches[0], 0);
    EXPECT_EQ(launches[1], k.n <= cuda::kRowRegs * 1024 ? 1 : 0);
    EXPECT_TRUE(test::bits_equal(got[1][0], got[0][0])) << "x after the add";
    EXPECT_TRUE(test::bits_equal(got[1][1], got[0][1])) << "out";
  }
}

// norm_matmul: the fused launch (the norm inside the skinny GEMM's CTAs) against the same call
// with DEEPSERVE_NORM_FUSE off (the norm kernel, then the GEMM), bit for bit in out, xn and
// x_out, with x and y left as they were; and against the CPU's add, rms_norm and matmul. The
// shapes cover rms_norm's thread counts (160, 256, 512, 1024 virtual threads), 1-8 rows, padded
// rows, every skinny weight dtype and the first layer's norm without a residual add.
TEST(CudaOps, NormMatmulFusedMatchesNormThenMatmul) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int rows, n, out_n;
    DType wt;
    bool add;
  };
  const Case cases[] = {{1, 2048, 3648, DType::BF16, true}, {1, 2048, 64, DType::F32, true},
                        {1, 2048, 100, DType::BF16, false}, {3, 576, 37, DType::F16, true},
                        {8, 2048, 64, DType::F32, true},    {2, 5120, 160, DType::BF16, true},
                        {5, 1000, 33, DType::F32, true},    {1, 7168, 24, DType::BF16, true}};
  struct Restore {
    ~Restore() {
      cuda::g_norm_fuse.force(-1);
      cuda::g_row_regs.force(-1);
    }
  } restore;
  uint32_t seed = 870;
  for (const Case& k : cases) {
    SCOPED_TRACE(std::to_string(k.rows) + " x " + std::to_string(k.n) + " -> " +
                 std::to_string(k.out_n) + " " + std::string(dtype_name(k.wt)) +
                 (k.add ? " +y" : ""));
    const int64_t ldx = k.n + 4, ldy = k.n + 8, ldn = k.n + 12, ldo = k.out_n + 3;
    const Twin x = twin_floats(DType::F32, {k.rows, ldx},
                               test::random_floats(size_t(k.rows * ldx), ++seed, -2, 2));
    const Twin y = twin_floats(DType::F32, {k.rows, ldy},
                               test::random_floats(size_t(k.rows * ldy), ++seed, -2, 2));
    const Twin nw =
        twin_floats(DType::F32, {k.n}, test::random_floats(size_t(k.n), ++seed, 0.9f, 1.1f));
    const float ws = 0.6f / std::sqrt(float(k.n));
    const Twin w = twin_floats(k.wt, {k.out_n, k.n},
                               test::random_floats(size_t(k.out_n * k.n), ++seed, -ws, ws));
    auto params = [&](const test::BackendTensor& xt, const test::BackendTensor& yt,
                      const test::BackendTensor& wt, const test::BackendTensor& nt,
                      const test::BackendTensor& xo, const test::BackendTensor& xn,
                      const test::BackendTensor& out) {
      NormMatmulParams p;
      p.x = view_of(xt, {k.rows, k.n}, {ldx, 1});
      if (k.add) {
        p.y = view_of(yt, {k.rows, k.n}, {ldy, 1});
        p.x_out = view_of(xo, {k.rows, k.n}, {ldn, 1});
      }
      p.norm = nt.view;
      p.eps = 1e-6f;
      p.xn = view_of(xn, {k.rows, k.n}, {ldn, 1});
      p.w = wt.view;
      p.out = view_of(out, {k.rows, k.out_n}, {ldo, 1});
      return p;
    };
    struct Outs {
      std::vector<float> out, xn, x_out, x, y;
    };
    auto run = [&](Backend& b, const Twin& xt, const Twin& yt, bool gpu, int fuse) {
      cuda::g_norm_fuse.force(fuse);
      const auto pick = [&](const Twin& t) -> const test::BackendTensor& {
        return gpu ? t.gpu : t.cpu;
      };
      const Twin xo = twin_floats(DType::F32, {k.rows, ldn}, sentinel(k.rows * ldn));
      const Twin xn = twin_floats(DType::F32, {k.rows, ldn}, sentinel(k.rows * ldn));
      const Twin out = twin_floats(DType::F32, {k.rows, ldo}, sentinel(k.rows * ldo));
      const NormMatmulParams p =
          params(pick(xt), pick(yt), pick(w), pick(nw), pick(xo), pick(xn), pick(out));
      if (gpu && fuse == 1) {
        // The case takes the fused launch (else this test would compare the fallback to itself).
        const cuda::SkinnyGemmArgs sk = cuda::skinny_matmul_args(p.x, p.w, p.out);
        EXPECT_TRUE(cuda::use_skinny_gemm(sk) && cuda::skinny_norm_fits(sk));
      }
      b.norm_matmul(p);
      b.synchronize();
      return Outs{test::download_floats(b, pick(out)), test::download_floats(b, pick(xn)),
                  test::download_floats(b, pick(xo)), test::download_floats(b, pick(xt)),
                  test::download_floats(b, pick(yt))};
    };
    const Outs fused = run(g, x, y, true, 1), plain = run(g, x, y, true, 0);
    const Outs cpu = run(c, x, y, false, -1);
    // DEEPSERVE_ROW_REGS=1 (rows in registers: norm_rows' loads at once, up to 4 elements a
    // virtual thread, and the norm kernel's): the same bits, fused and not.
    cuda::g_row_regs.force(1);
    const int64_t before = cuda::row_regs_launches();
    const Outs fused_regs = run(g, x, y, true, 1);
    EXPECT_EQ(cuda::row_regs_launches() > before, k.n <= 4 * cuda::rms_norm_threads(k.n));
    const Outs plain_regs = run(g, x, y, true, 0);
    cuda::g_row_regs.force(-1);
    for (const Outs* o : {&fused_regs, &plain_regs}) {
      EXPECT_TRUE(test::all_equal(o->out, plain.out, "out, regs", {k.rows, ldo}));
      EXPECT_TRUE(test::all_equal(o->xn, plain.xn, "xn, regs", {k.rows, ldn}));
      EXPECT_TRUE(test::all_equal(o->x_out, plain.x_out, "x_out, regs", {k.rows, ldn}));
    }
    EXPECT_TRUE(test::all_equal(fused.out, plain.out, "out", {k.rows, ldo}));
    EXPECT_TRUE(test::all_equal(fused.xn, plain.xn, "xn", {k.rows, ldn}));
    EXPECT_TRUE(test::all_equal(fused.x_out, plain.x_out, "x_out", {k.rows, ldn}));
    EXPECT_TRUE(test::all_equal(fused.x, cpu.x, "x untouched", {k.rows, ldx}));
    EXPECT_TRUE(test::all_equal(fused.y, cpu.y, "y untouched", {k.rows, ldy}));
    if (k.add) EXPECT_TRUE(test::all_equal(fused.x_out, cpu.x_out, "x + y", {k.rows, ldn}));
    EXPECT_TRUE(test::all_close(fused.xn, cpu.xn, {1e-5, 1e-5}, "xn vs cpu", {k.rows, ldn}));
    EXPECT_TRUE(test::all_close(fused.out, cpu.out, {2e-4, 2e-4}, "out vs cpu", {k.rows, ldo}));
  }
}

// matmul_add_norm: the add and norm in the skinny GEMM's last CTA (DEEPSERVE_ADD_NORM_LAST=1)
// against the GEMM, then the norm kernel (off), bit for bit in out, r_out and rn, with x and r
// left as they were; and against the CPU. Each fused call runs twice: the second finds the
// arrival counter put back (else its rows are never normalized). The shapes cover rms_norm's
// thread counts for a row of n (32 to 1,024), 1-8 rows, padded rows, every skinny weight
// dtype, 8 rows of 3,000 and a one-CTA grid.
TEST(CudaOps, MatmulAddNormLastCtaMatchesMatmulThenNorm) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int rows, k, n;
    DType wt;
  };
  const Case cases[] = {{1, 2048, 2048, DType::BF16}, {8, 2048, 1024, DType::BF16},
                        {3, 576, 1000, DType::F16},   {2, 1536, 5120, DType::BF16},
                        {5, 512, 64, DType::F32},     {1, 128, 7168, DType::BF16},
                        {8, 256, 3000, DType::F32},   {1, 64, 8, DType::F32}};
  struct Restore {
    ~Restore() { cuda::g_add_norm_last.force(-1); }
  } restore;
  uint32_t seed = 930;
  for (const Case& k : cases) {
    SCOPED_TRACE(std::to_string(k.rows) + " x " + std::to_string(k.k) + " -> " +
                 std::to_string(k.n) + " " + std::string(dtype_name(k.wt)));
    const int64_t ldx = k.k + 4, ldr = k.n + 8, ldn = k.n + 12, ldo = k.n + 3;
    const Twin x = twin_floats(DType::F32, {k.rows, ldx},
                               test::random_floats(size_t(k.rows * ldx), ++seed, -2, 2));
    const Twin r = twin_floats(DType::F32, {k.rows, ldr},
                               test::random_floats(size_t(k.rows * ldr), ++seed, -2, 2));
    const Twin nw =
        twin_floats(DType::F32, {k.n}, test::random_floats(size_t(k.n), ++seed, 0.9f, 1.1f));
    const float ws = 0.6f / std::sqrt(float(k.k));
    const Twin w =
        twin_floats(k.wt, {k.n, k.k}, test::random_floats(size_t(k.n * k.k), ++seed, -ws, ws));
    struct Outs {
      std::vector<float> out, r_out, rn, x, r;
    };
    auto run = [&](Backend& b, bool gpu, int last) {
      cuda::g_add_norm_last.force(last);
      const auto pick = [&](const Twin& t) -> const test::BackendTensor& {
        return gpu ? t.gpu : t.cpu;
      };
      const Twin ro = twin_floats(DType::F32, {k.rows, ldn}, sentinel(k.rows * ldn));
      const Twin rn = twin_floats(DType::F32, {k.rows, ldn}, sentinel(k.rows * ldn));
      const Twin out = twin_floats(DType::F32, {k.rows, ldo}, sentinel(k.rows * ldo));
      MatmulNormParams p;
      p.x = view_of(pick(x), {k.rows, k.k}, {ldx, 1});
      p.w = pick(w).view;
      p.out = view_of(pick(out), {k.rows, k.n}, {ldo, 1});
      p.add_norm.r = view_of(pick(r), {k.rows, k.n}, {ldr, 1});
      p.add_norm.norm = pick(nw).view;
      p.add_norm.eps = 1e-6f;
      p.add_norm.r_out = view_of(pick(ro), {k.rows, k.n}, {ldn, 1});
      p.add_norm.rn = view_of(pick(rn), {k.rows, k.n}, {ldn, 1});
      if (gpu && last == 1) {
        // The case takes the fused launch (else this test would compare the fallback to itself).
        const cuda::SkinnyGemmArgs sk = cuda::skinny_matmul_args(p.x, p.w, p.out);
        EXPECT_TRUE(cuda::use_skinny_gemm(sk) && cuda::skinny_add_norm_fits(sk));
      }
      b.matmul_add_norm(p);
      b.synchronize();
      return Outs{test::download_floats(b, pick(out)), test::download_floats(b, pick(ro)),
                  test::download_floats(b, pick(rn)), test::download_floats(b, pick(x)),
                  test::download_floats(b, pick(r))};
    };
    const Outs fused = run(g, true, 1), again = run(g, true, 1), plain = run(g, true, 0);
    const Outs cpu = run(c, false, -1);
    for (const Outs* o : {&fused, &again}) {
      EXPECT_TRUE(test::all_equal(o->out, plain.out, "out", {k.rows, ldo}));
      EXPECT_TRUE(test::all_equal(o->r_out, plain.r_out, "r_out", {k.rows, ldn}));
      EXPECT_TRUE(test::all_equal(o->rn, plain.rn, "rn", {k.rows, ldn}));
      EXPECT_TRUE(test::all_equal(o->x, cpu.x, "x untouched", {k.rows, ldx}));
      EXPECT_TRUE(test::all_equal(o->r, cpu.r, "r untouched", {k.rows, ldr}));
    }
    EXPECT_TRUE(test::all_close(fused.out, cpu.out, {2e-4, 2e-4}, "out vs cpu", {k.rows, ldo}));
    EXPECT_TRUE(
        test::all_close(fused.r_out, cpu.r_out, {2e-4, 2e-4}, "r + out vs cpu", {k.rows, ldn}));
    EXPECT_TRUE(test::all_close(fused.rn, cpu.rn, {1e-3, 1e-3}, "rn vs cpu", {k.rows, ldn}));
  }
}

// ---- rope --------------------------------------------------------------------------------

TEST(CudaOps, RopeMatchesCpu) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int tokens, heads, head_dim;  // the view's [T, H, head_dim]
    int row_dim, offset;          // each head's row in the buffer; the view starts offset in
    RopeParams p;
    int max_position;
  };
  RopeParams plain;
  plain.rotary_dim = 64;
  RopeParams llama_gguf = plain;
  llama_gguf.style = RopeStyle::Adjacent;
  llama_gguf.theta = 100000.0f;
  RopeParams yarn;  // DeepSeek-V2-Lite's, with an mscale that makes attn_factor != 1
  yarn.rotary_dim = 64;
  yarn.yarn_factor = 40.0f;
  yarn.yarn_original_max_position = 4096;
  yarn.attn_factor = yarn_mscale(40.0f, 1.0f) / yarn_mscale(40.0f, 0.707f);
  RopeParams partial;  // only the leading 10 of 14 dims rotate
  partial.style = RopeStyle::Adjacent;
  partial.rotary_dim = 10;
  RopeParams scaled;
  scaled.rotary_dim = 128;
  scaled.freq_scale = 0.25f;
  scaled.attn_factor = 1.3f;
  const Case cases[] = {
      {1, 1, 64, 64, 0, plain, 100},       {7, 9, 64, 64, 0, llama_gguf, 4096},
      {97, 3, 64, 192, 128, yarn, 163840}, {1000, 2, 14, 14, 0, partial, 1000},
      {7, 16, 128, 130, 2, scaled, 32768}, {1, 16, 64, 192, 128, yarn, 5},
  };
  uint32_t seed = 300;
  for (int round = 0; round < 2; ++round) {  // round 2 reuses the cached frequency tables
    for (const Case& k : cases) {
      SCOPED_TRACE("T " + std::to_string(k.tokens) + " H " + std::to_string(k.heads) + " d " +
                   std::to_string(k.head_dim) + " rotary " + std::to_string(k.p.rotary_dim) +
                   (k.p.yarn_factor > 0 ? " yarn" : ""));
      const int64_t total = int64_t(k.tokens) * k.heads * k.row_dim;
      const Twin x = twin_floats(DType::F32, {k.tokens, k.heads, k.row_dim},
                                 test::random_floats(size_t(total), ++seed, -2, 2));
      const Twin pos =
          twin_ints(test::random_ints(size_t(k.tokens), ++seed, 0, k.max_position - 1));
      const std::vector<int64_t> dims = {k.tokens, k.heads, k.head_dim},
                                 strides = {int64_t(k.heads) * k.row_dim, k.row_dim, 1};
      c.rope(view_of(x.cpu, dims, strides, k.offset), pos.cpu.ptr<int32_t>(), k.p);
      g.rope(view_of(x.gpu, dims, strides, k.offset), pos.gpu.ptr<int32_t>(), k.p);
      // Identical F32 angles; sincosf vs libm differ by ~2 ulp, so each output is off by about
      // (|x0| + |x1|) * 2^-22 * attn_factor: 4e-6 absolute covers |x| <= 2 with margin.
      const std::vector<float> want = test::download_floats(c, x.cpu);
      const std::vector<size_t> idx =
          test::view_offsets(x.cpu.view.data, view_of(x.cpu, dims, strides, k.offset));
      std::vector<double> vb(idx.size());
      for (size_t i = 0; i < idx.size(); ++i)
        vb[i] = 4e-6 * std::max(1.0f, k.p.attn_factor) + 1e-5 * std::abs(want[idx[i]]);
      EXPECT_TRUE(test::all_close_bounds(test::download_floats(g, x.gpu), to_double(want),
                                         buffer_bounds(want.size(), idx, vb), "rope",
                                         {k.tokens, k.heads, k.row_dim}));
    }
  }
}

// ---- store_kv -------------------------------------------------------------------------------

TEST(CudaOps, StoreKvWritesTheMappedSlots) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    DType dtype;
    int block_size, kv_heads, head_dim;
    bool latent;
    std::vector<test::StepSeq> seqs;
  };
  const Case cases[] = {
      {DType::F32, 16, 3, 64, false, {{7, 7}}},
      {DType::F16, 1, 1, 7, false, {{1, 5}, {3, 3}, {1, 1}}},
      {DType::BF16, 16, 2, 128, false, {{97, 100}, {1, 40}}},
      {DType::BF16, 16, 1, 576, true, {{7, 30}, {1, 17}}},
      {DType::F32, 1, 1, 576, true, {{97, 97}}},
      {DType::F16, 16, 8, 96, false, {{1000, 1000}}},
  };
  uint32_t seed = 400;
  for (const Case& k : cases) {
    SCOPED_TRACE(dt(k.dtype) + " block " + std::to_string(k.block_size) + " heads " +
                 std::to_string(k.kv_heads) + " dim " + std::to_string(k.head_dim) +
                 (k.latent ? " latent" : ""));
    int num_blocks = 5;
    for (const test::StepSeq& s : k.seqs)
      num_blocks += (s.context_len + k.block_size - 1) / k.block_size;
    const test::HostStep step = test::make_step(k.seqs, k.block_size, num_blocks, ++seed);
    const test::KvSpec spec{k.dtype, num_blocks, k.block_size, k.kv_heads, k.head_dim, k.latent};
    const uint32_t cache_seed = ++seed;
    test::BackendKv cache_g = test::random_paged_kv(g, spec, cache_seed);
    test::BackendKv cache_c = test::random_paged_kv(c, spec, cache_seed);
    const int64_t T = step.num_tokens, H = k.kv_heads, D = k.head_dim;
    // k rows padded by 3 floats; v with one spare head between tokens.
    const std::vector<float> kv_src = test::random_floats(size_t(T * H * (D + 3)), ++seed, -4, 4);
    const std::vector<float> v_src = test::random_floats(size_t(T * (H + 1) * D), ++seed, -4, 4);
    const Twin kt = twin_floats(DType::F32, {T, H, D + 3}, kv_src);
    const Twin vt = twin_floats(DType::F32, {T, H + 1, D}, v_src);
    const std::vector<int64_t> dims = {T, H, D}, k_strides = {H * (D + 3), D + 3, 1},
                               v_strides = {(H + 1) * D, D, 1};
    const test::BackendStep meta_g = test::upload_step(g, step);
    const test::BackendStep meta_c = test::upload_step(c, step);
    g.store_kv(view_of(kt.gpu, dims, k_strides),
               k.latent ? TensorView{} : view_of(vt.gpu, dims, v_strides), cache_g.kv, meta_g.meta);
    // Independent reference: the initial cache with each token's rows overwritten, rounded.
    std::vector<float> want_k = cache_g.k_host, want_v = cache_g.v_host;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) {
          const size_t dst = size_t((step.slot_mapping[size_t(t)] * H + h) * D + i);
          want_k[dst] = test::round_to(k.dtype, kv_src[size_t((t * H + h) * (D + 3) + i)]);
          if (!k.latent)
            want_v[dst] = test::round_to(k.dtype, v_src[size_t((t * (H + 1) + h) * D + i)]);
        }
    const std::vector<float> got_k = test::download_floats(g, cache_g.k);
    EXPECT_TRUE(test::all_equal(got_k, want_k, "store_kv k"));
    if (!k.latent) {
      EXPECT_TRUE(test::all_equal(test::download_floats(g, cache_g.v), want_v, "store_kv v"));
      // And the CPU backend writes the same bits (its store_kv has no latent mode to compare).
      c.store_kv(view_of(kt.cpu, dims, k_strides), view_of(vt.cpu, dims, v_strides), cache_c.kv,
                 meta_c.meta);
      EXPECT_TRUE(test::all_equal(got_k, test::download_floats(c, cache_c.k), "store_kv k vs cpu"));
      EXPECT_TRUE(test::all_equal(test::download_floats(g, cache_g.v),
                                  test::download_floats(c, cache_c.v), "store_kv v vs cpu"));
    }
  }
}

TEST(CudaOps, StoreKvReportsABadSlotAtSynchronize) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  test::BackendKv cache = test::random_paged_kv(g, {DType::BF16, 2, 16, 1, 8, false}, 1);
  const std::vector<float> before = test::download_floats(g, cache.k);
  const BackendTensor k = test::upload_floats(g, DType::F32, {1, 1, 8}, test::random_floats(8, 2));
  const std::vector<int32_t> slots = {32};  // capacity is 2 * 16
  const BackendTensor slot = test::upload_ints(g, slots);
  AttentionMeta meta;
  meta.num_tokens = 1;
  meta.slot_mapping = slot.ptr<int32_t>();
  g.store_kv(k.view, k.view, cache.kv, meta);
  try {
    g.synchronize();
    ADD_FAILURE() << "an out-of-range slot went unreported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KV slot 32"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::all_equal(test::download_floats(g, cache.k), before, "cache untouched"));
}

// ---- silu_mul, add, copy -------------------------------------------------------------------

TEST(CudaOps, SiluMulMatchesCpu) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  const std::pair<int, int> cases[] = {{1, 1}, {7, 7}, {97, 1408}, {1000, 96}, {1, 18944}};
  uint32_t seed = 500;
  for (const auto& [rows, n] : cases) {
    SCOPED_TRACE("rows " + std::to_string(rows) + " n " + std::to_string(n));
    const int64_t ldg = 2 * n + 4, ldo = n + 1;
    const Twin gu = twin_floats(DType::F32, {rows, ldg},
                                test::random_floats(size_t(rows * ldg), ++seed, -8, 8));
    const Twin out = twin_floats(DType::F32, {rows, ldo}, sentinel(rows * ldo));
    c.silu_mul(view_of(gu.cpu, {rows, 2 * n}, {ldg, 1}), view_of(out.cpu, {rows, n}, {ldo, 1}));
    g.silu_mul(view_of(gu.gpu, {rows, 2 * n}, {ldg, 1}), view_of(out.gpu, {rows, n}, {ldo, 1}));
    // expf (2 ulp) vs libm, a division and a product: a few F32 ulps.
    const std::vector<float> want = test::download_floats(c, out.cpu);
    const std::vector<size_t> idx =
        test::view_offsets(out.cpu.view.data, view_of(out.cpu, {rows, n}, {ldo, 1}));
    std::vector<double> vb(idx.size());
    for (size_t i = 0; i < idx.size(); ++i) vb[i] = 1e-7 + 2e-6 * std::abs(want[idx[i]]);
    EXPECT_TRUE(test::all_close_bounds(test::download_floats(g, out.gpu), to_double(want),
                                       buffer_bounds(want.size(), idx, vb), "silu_mul",
                                       {rows, ldo}));
  }
}

TEST(CudaOps, AddMatchesCpuExactly) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  const std::pair<int, int> cases[] = {{1, 1}, {7, 7}, {97, 576}, {1000, 1000}, {3, 2049}};
  uint32_t seed = 600;
  for (const auto& [rows, n] : cases) {
    SCOPED_TRACE("rows " + std::to_string(rows) + " n " + std::to_string(n));
    const int64_t ldx = n + 2, ldy = n + 5;
    const Twin x = twin_floats(DType::F32, {rows, ldx},
                               test::random_floats(size_t(rows * ldx), ++seed, -100, 100));
    const Twin y =
        twin_floats(DType::F32, {rows, ldy}, test::random_floats(size_t(rows * ldy), ++seed));
    c.add(view_of(x.cpu, {rows, n}, {ldx, 1}), view_of(y.cpu, {rows, n}, {ldy, 1}));
    g.add(view_of(x.gpu, {rows, n}, {ldx, 1}), view_of(y.gpu, {rows, n}, {ldy, 1}));
    // One correctly rounded F32 addition per element on both: bit-identical.
    EXPECT_TRUE(test::all_equal(test::download_floats(g, x.gpu), test::download_floats(c, x.cpu),
                                "add", {rows, ldx}));
  }
}

TEST(CudaOps, CopyHandlesStridedAndPermutedViews) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  struct Case {
    DType dtype;
    std::vector<int64_t> src_dims;      // the source buffer, contiguous
    std::vector<int64_t> view_dims;     // the copied view over it
    std::vector<int64_t> view_strides;  // elements
    int64_t offset;
  };
  const Case cases[] = {
      {DType::F32, {97, 9}, {97, 7}, {9, 1}, 1},                    // padded rows: 2-D copy
      {DType::BF16, {7, 3, 5}, {3, 7, 5}, {5, 15, 1}, 0},           // [T,H,d] -> [H,T,d], 10 B rows
      {DType::F32, {97, 4, 8}, {4, 97, 8}, {8, 32, 1}, 0},          // 32 B rows: 16 B units
      {DType::I32, {5, 6, 3}, {6, 5, 3}, {3, 18, 1}, 0},            // 4 B units
      {DType::F16, {2, 3, 4, 6}, {3, 2, 4, 5}, {24, 72, 6, 1}, 1},  // 4-D, sliced rows
      {DType::F32, {1000, 3, 13}, {1000, 2, 13}, {39, 13, 1}, 13},  // heads 1..2 of 3
  };
  uint32_t seed = 700;
  for (const Case& k : cases) {
    SCOPED_TRACE(dt(k.dtype) + " view " + std::to_string(k.view_dims.size()) + "-D");
    const int64_t n = test::product(k.src_dims);
    std::vector<float> vals = test::random_floats(size_t(n), ++seed, -1000, 1000);
    if (k.dtype == DType::I32)
      for (float& v : vals) v = std::round(v);
    std::vector<uint8_t> bytes;
    if (k.dtype == DType::I32) {
      for (float v : vals) {
        const int32_t x = int32_t(v);
        const auto* p = reinterpret_cast<const uint8_t*>(&x);
        bytes.insert(bytes.end(), p, p + 4);
      }
    } else {
      bytes = test::encode(k.dtype, vals);
    }
    const BackendTensor src =
        test::upload_bytes(g, k.dtype, k.src_dims, bytes.data(), bytes.size());
    const TensorView sv = view_of(src, k.view_dims, k.view_strides, k.offset);
    BackendTensor dst = test::zeros(g, k.dtype, k.view_dims);
    g.copy(sv, dst.view);
    const std::vector<float> want = test::gather_view(bytes, src.view.data, sv);
    EXPECT_TRUE(test::all_equal(test::download_floats(g, dst), want, "copy", k.view_dims));
    // And back into a strided destination: the round trip restores the source.
    BackendTensor back = test::zeros(g, k.dtype, k.src_dims);
    g.copy(dst.view, view_of(back, k.view_dims, k.view_strides, k.offset));
    const std::vector<float> got_back = test::download_floats(g, back);
    const std::vector<size_t> idx =
        test::view_offsets(back.view.data, view_of(back, k.view_dims, k.view_strides, k.offset));
    std::vector<float> want_back(size_t(n), 0.0f);
    const std::vector<float> src_vals = test::decode(k.dtype, bytes.data(), size_t(n));
    for (size_t i : idx) want_back[i] = src_vals[i];
    EXPECT_TRUE(test::all_equal(got_back, want_back, "copy back", k.src_dims));
  }
}

}  // namespace
}  // namespace ds
