// GGUF block-quantized weights on CUDA (the blocks as in the file, dequantized in registers)
// against the CPU dequantizer (quants.cpp) then an F64 reference: matmul over awkward shapes
// (M = 1..200, K = 256..2048 and 32-multiples like 1408, N not a tile multiple, strided
// activations, rows only 2-byte aligned), the embedding of a quantized table, and MoE experts
// sliced out of stacked [E, F, H] tensors as a GGUF file stores them, with an expert that gets
// no tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cuda/gguf_blocks.cuh"
#include "gguf_test_util.h"
#include "gpu_test_util.h"
#include "moe_test_util.h"

namespace ds {
namespace {

using test::cuda_backend;

// Rows of type t on the device, `skew` bytes past a fresh allocation (2 makes rows 2-byte
// aligned only), plus their CPU dequantization.
struct GgufWeight {
  std::unique_ptr<Buffer> buf;
  TensorView dev;
  std::vector<float> deq;  // [rows, k]
};

GgufWeight gguf_weight(DType t, int64_t rows, int64_t k, uint32_t seed, int skew = 0) {
  Backend& be = cuda_backend();
  GgufWeight w;
  const auto bytes = test::random_gguf_rows(t, rows, k, seed);
  w.deq = test::dequantize_rows(t, bytes, rows, k);
  w.buf = be.alloc(bytes.size() + 16);
  void* at = static_cast<uint8_t*>(w.buf->data()) + skew;
  be.upload(TensorView::contiguous(at, DType::U8, {int64_t(bytes.size())}, be.device()),
            bytes.data(), bytes.size());
  w.dev = TensorView::contiguous(at, t, {rows, k}, be.device());
  return w;
}

TEST(CudaGguf, MatmulMatchesTheDequantizedProduct) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  for (DType t : test::kGgufTypes) {
    const int bs = dtype_info(t).block_size;
    for (int64_t K : {256, 768, 1408, 2048}) {
      if (K % bs) continue;
      for (int64_t N : {1, 7, 33, 257}) {
        const GgufWeight w = gguf_weight(t, N, K, uint32_t(K * 7 + N), t == DType::Q8_0 ? 2 : 0);
        for (int64_t M : {1, 3, 8, 17, 200}) {
          if (M == 200 && N > 33) continue;        // keep the host reference quick
          const int64_t ldx = K + 4, ldo = N + 3;  // strided rows
          const auto x = test::random_floats(size_t(M * ldx), uint32_t(M + K + N));
          auto xd = be.alloc(x.size() * 4), od = be.alloc(size_t(M * ldo) * 4);
          be.upload(test::make_view(xd->data(), DType::F32, {M * ldx}, be.device()), x.data(),
                    x.size() * 4);
          TensorView xv = test::make_view(xd->data(), DType::F32, {M, K}, be.device());
          xv.stride[0] = ldx * 4;
          TensorView ov = test::make_view(od->data(), DType::F32, {M, N}, be.device());
          ov.stride[0] = ldo * 4;
          be.matmul(xv, w.dev, ov);
          std::vector<float> out(size_t(M * ldo));
          be.synchronize();
          be.download(out.data(), test::make_view(od->data(), DType::F32, {M * ldo}, be.device()),
                      out.size() * 4);
          int bad = 0;
          for (int64_t m = 0; m < M && bad < 5; ++m)
            for (int64_t n = 0; n < N && bad < 5; ++n) {
              double s = 0, mag = 0;
              for (int64_t k = 0; k < K; ++k) {
                const double p = double(w.deq[size_t(n * K + k)]) * x[size_t(m * ldx + k)];
                s += p;
                mag += std::fabs(p);
              }
              const double got = out[size_t(m * ldo + n)];
              if (!(std::fabs(got - s) <= 2e-5 * mag + 1e-6)) {
                ADD_FAILURE() << dtype_name(t) << " M " << M << " N " << N << " K " << K << " at ("
                              << m << ", " << n << "): " << got << " vs " << s;
                ++bad;
              }
            }
        }
      }
    }
  }
}

TEST(CudaGguf, EmbeddingDequantizesTheRows) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  for (DType t : test::kGgufTypes) {
    const int64_t V = 37, D = 768;
    const GgufWeight w = gguf_weight(t, V, D, 11, 2);
    const std::vector<int32_t> ids = {0, 36, 5, 5, 17};
    auto idb = test::upload_ints(be, ids);
    auto ob = test::zeros(be, DType::F32, {int64_t(ids.size()), D});
    be.embed(w.dev, idb.view.ptr<int32_t>(), int(ids.size()), ob.view);
    const auto got = test::download_floats(be, ob);
    std::vector<float> want;
    for (int32_t id : ids)
      want.insert(want.end(), w.deq.begin() + id * D, w.deq.begin() + (id + 1) * D);
    EXPECT_TRUE(test::all_close(got, want, {.abs = 1e-7, .rel = 1e-6},
                                "embed " + std::string(dtype_name(t)), {int64_t(ids.size()), D}));
  }
  // An id outside the table is reported at the next synchronize.
  const GgufWeight w = gguf_weight(DType::Q4_K, 4, 256, 3);
  const std::vector<int32_t> bad = {1, 4};
  auto idb = test::upload_ints(be, bad);
  auto ob = test::zeros(be, DType::F32, {2, 256});
  be.embed(w.dev, idb.view.ptr<int32_t>(), 2, ob.view);
  EXPECT_THROW(be.synchronize(), Error);
}

// Experts sliced from stacked tensors: gate and up [E, F, H], down [E, H, F].
struct GgufExperts {
  GgufWeight gate, up, down;
  std::vector<ExpertWeights> views;
};

GgufExperts gguf_experts(DType t, int E, int64_t H, int64_t F) {
  GgufExperts x{
      gguf_weight(t, E * F, H, 21), gguf_weight(t, E * F, H, 22), gguf_weight(t, E * H, F, 23), {}};
  for (int e = 0; e < E; ++e)
    x.views.push_back({x.gate.dev.slice_rows(e * F, (e + 1) * F),
                       x.up.dev.slice_rows(e * F, (e + 1) * F),
                       x.down.dev.slice_rows(e * H, (e + 1) * H)});
  return x;
}

// out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) + shared experts, in F64.
std::vector<float> moe_reference(const GgufExperts& ex, int64_t H, int64_t F, int shared, int E,
                                 const std::vector<float>& x, const std::vector<int32_t>& ids,
                                 const std::vector<float>& wts, int64_t T, int k) {
  std::vector<float> out(size_t(T * H), 0.0f);
  std::vector<double> h(static_cast<size_t>(F));
  auto apply = [&](int e, int64_t t, double weight) {
    for (int64_t f = 0; f < F; ++f) {
      double g = 0, u = 0;
      for (int64_t c = 0; c < H; ++c) {
        g += double(ex.gate.deq[size_t((e * F + f) * H + c)]) * x[size_t(t * H + c)];
        u += double(ex.up.deq[size_t((e * F + f) * H + c)]) * x[size_t(t * H + c)];
      }
      h[size_t(f)] = g / (1 + std::exp(-g)) * u;
    }
    for (int64_t n = 0; n < H; ++n) {
      double y = 0;
      for (int64_t f = 0; f < F; ++f)
        y += double(ex.down.deq[size_t((e * H + n) * F + f)]) * h[size_t(f)];
      out[size_t(t * H + n)] += float(weight * y);
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) apply(ids[size_t(t * k + j)], t, wts[size_t(t * k + j)]);
    for (int s = 0; s < shared; ++s) apply(E - shared + s, t, 1.0);
  }
  return out;
}

TEST(CudaGguf, MoeFfnMatchesTheDequantizedExperts) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const int E = 8, k = 2;
  struct Shape {
    DType t;
    int64_t H, F;
  };
  const std::vector<Shape> shapes = {{DType::Q8_0, 288, 160}, {DType::Q4_0, 256, 352},
                                     {DType::Q4_1, 256, 96},  {DType::Q5_0, 160, 224},
                                     {DType::Q4_K, 256, 512}, {DType::Q5_K, 512, 256},
                                     {DType::Q6_K, 256, 256}};
  for (const Shape& sh : shapes) {
    const GgufExperts ex = gguf_experts(sh.t, E, sh.H, sh.F);
    for (int shared : {0, 1}) {
      for (int64_t T : {1, 3, 8, 37}) {
        const moe_test::Routing r = moe_test::routing_without_expert5(T, E - shared);
        const std::vector<int32_t>& ids = r.ids;
        const std::vector<float>& wts = r.w;
        const auto x = test::random_floats(size_t(T * sh.H), uint32_t(T));
        const auto got = moe_test::run_moe_ffn(be, x, ids, wts, ex.views, shared, T, sh.H, k);
        const auto want = moe_reference(ex, sh.H, sh.F, shared, E, x, ids, wts, T, k);
        double mx = 0;
        for (float v : want) mx = std::max(mx, double(std::fabs(v)));
        test::Tolerance tol;
        tol.abs = 1e-4 * std::max(1e-3, mx);
        tol.rel = 0;
        EXPECT_TRUE(test::all_close(got, want, tol,
                                    std::string(dtype_name(sh.t)) + " moe T " + std::to_string(T) +
                                        " shared " + std::to_string(shared),
                                    {T, sh.H}));
      }
    }
  }
}

}  // namespace
}  // namespace ds
