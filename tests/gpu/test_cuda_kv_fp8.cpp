// FP8 KV cache on CUDA (--kv-cache-dtype fp8): store_kv writes the CPU store's bits (codes and
// scales), and attention / MLA over an FP8 cache match float64 math over the dequantized cache
// and the CPU backend on the same cache, for every kernel path (F32 SIMT, tensor cores, the MLA
// decode kernel), contexts 1 / 7 / 97 / 1000, block sizes 1 and 16, decode, whole prompts and
// chunked prefill after a cached prefix.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attention_reference.h"
#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_mla_decode.cuh"
#include "backend/cuda/attention_setup.h"
#include "backend/kv_fp8.h"
#include "launch_context.h"

namespace ds {
namespace {

using cuda::AttentionPath;

// An FP8 paged cache on a backend (gpu_test_util's random_paged_kv: rows quantized on the host
// by kvfp8), with its dequantized contents for the references.
test::BackendKv make_fp8_kv(Backend& b, int num_blocks, int block_size, int kv_heads, int head_dim,
                            bool latent, int split, uint32_t seed) {
  test::KvSpec spec;
  spec.dtype = DType::F8_E4M3;
  spec.num_blocks = num_blocks;
  spec.block_size = block_size;
  spec.kv_heads = kv_heads;
  spec.head_dim = head_dim;
  spec.latent = latent;
  return test::random_paged_kv(b, spec, seed, split);
}

struct Case {
  std::vector<test::StepSeq> seqs;
  int heads = 8, kv_heads = 2, hd = 64;  // MLA: hd = R
  int rope = 0;                          // MLA rope dims P; 0 = GQA
  int block_size = 16;
  AttentionPath path = AttentionPath::Auto;
};

std::string describe(const Case& c) {
  std::string s = std::string(c.rope ? "mla" : "gqa") + " heads " + std::to_string(c.heads) + "/" +
                  std::to_string(c.kv_heads) + " hd " + std::to_string(c.hd) + " rope " +
                  std::to_string(c.rope) + " bs " + std::to_string(c.block_size) + " path " +
                  std::to_string(int(c.path)) + ",";
  for (const auto& q : c.seqs)
    s += " " + std::to_string(q.query_len) + "/" + std::to_string(q.context_len);
  return s;
}

// Runs one case on the GPU (pinned path) and on the CPU backend, over the same FP8 cache.
void check_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  Backend& gpu = test::cuda_backend();
  Backend& cpu = test::cpu_backend();
  const bool mla = c.rope > 0;
  int blocks = 5;
  for (const auto& q : c.seqs) blocks += (q.context_len + c.block_size - 1) / c.block_size;
  const test::HostStep h = test::make_step(c.seqs, c.block_size, blocks, seed);
  const int kvh = mla ? 1 : c.kv_heads, dim = c.hd + c.rope;
  const test::BackendKv g =
      make_fp8_kv(gpu, blocks, c.block_size, kvh, dim, mla, mla ? c.hd : 0, seed + 1);
  const test::BackendKv hc =
      make_fp8_kv(cpu, blocks, c.block_size, kvh, dim, mla, mla ? c.hd : 0, seed + 1);
  const int64_t T = h.num_tokens, H = c.heads;
  const float scale = 2.0f / std::sqrt(float(dim));
  const std::vector<float> q = test::random_floats(size_t(T * H * c.hd), seed + 2);
  const std::vector<float> qr = test::random_floats(size_t(T * H * c.rope), seed + 3);
  const std::vector<int64_t> shape = {T, H, c.hd};

  std::vector<float> results[2];
  bool bf16_qp = false;  // the GPU's MLA decode rounds Q and P to BF16 once
  for (int on_gpu = 0; on_gpu < 2; ++on_gpu) {
    Backend& b = on_gpu ? gpu : cpu;
    const test::BackendKv& kv = on_gpu ? g : hc;
    const test::BackendStep step = test::upload_step(b, h);
    test::BackendTensor tq = test::upload_floats(b, DType::F32, shape, q);
    test::BackendTensor tr;
    if (mla) tr = test::upload_floats(b, DType::F32, {T, H, c.rope}, qr);
    test::BackendTensor out = test::zeros(b, DType::F32, shape);
    b.synchronize();
    if (mla) {
      MlaAttentionParams p;
      p.q_latent = tq.view;
      p.q_rope = tr.view;
      p.out = out.view;
      p.cache = kv.kv;
      p.kv_lora_rank = c.hd;
      p.scale = scale;
      if (on_gpu) {
        const cuda::kern::AttnParams a = cuda::mla_params(p, step.meta);
        bf16_qp = cuda::mla_decode_fits(a) &&
                  (c.path == AttentionPath::MlaDecodeBf16 ||
                   (c.path == AttentionPath::Auto && cuda::mla_decode_bf16_auto(a)));
        cuda::mla_attention_on(launch_context().get(), p, step.meta, c.path);
      } else {
        b.mla_attention(p, step.meta);
      }
    } else {
      AttentionParams p;
      p.q = tq.view;
      p.out = out.view;
      p.kv = kv.kv;
      p.scale = scale;
      if (on_gpu)
        cuda::paged_attention_on(launch_context().get(), p, step.meta, c.path);
      else
        b.attention(p, step.meta);
    }
    if (on_gpu) {
      cuda_ok(cudaGetLastError(), "launch");
      cuda_ok(cudaStreamSynchronize(launch_context().stream()), "attention kernels");
    }
    results[on_gpu] = test::download_floats(b, out);
  }
  const std::vector<double> want =
      mla ? test::reference_mla(h, q, qr, g.k_host, c.heads, c.hd, c.rope, c.block_size, scale,
                                true)
          : test::reference_attention(h, q, g.k_host, g.v_host, c.heads, c.kv_heads, c.hd,
                                      c.block_size, scale, true);
  const test::Tolerance tol = test::attention_tolerance();
  // Outputs scale with the value rows (magnitudes up to 6.25 here), and the scores with the
  // key rows, whose split-BF16 products in the mma path carry ~6x the rounding of unit rows
  // (seen on the H200: 1 element in 10^5 at 1.2x an 8x bound; a wrong scale or a misread code
  // is off by orders of magnitude more).
  const test::Tolerance wide{12 * tol.abs, 2 * tol.rel};
  if (bf16_qp) {
    // BF16 Q / P (Auto's choice for many heads, or asked for): against float64 on the same
    // BF16-rounded queries, what remains is P's rounding, at most 2^-9 of the largest |v| for
    // any weighted average of value rows (FP8: P is scaled by the key's latent scale before it
    // is rounded, V being the exact codes). The CPU backend keeps F32 queries, so it is held to
    // the float64 reference of those instead.
    std::vector<float> qb = q, qrb = qr;
    for (float& v : qb) v = bf16_to_f32(f32_to_bf16(v));
    for (float& v : qrb) v = bf16_to_f32(f32_to_bf16(v));
    const std::vector<double> want_b =
        test::reference_mla(h, qb, qrb, g.k_host, c.heads, c.hd, c.rope, c.block_size, scale, true);
    double vmax = 0;
    for (size_t i = 0; i < g.k_host.size(); ++i)
      if (int(i % size_t(dim)) < c.hd) vmax = std::max(vmax, std::fabs(double(g.k_host[i])));
    EXPECT_TRUE(test::all_close(results[1], want_b, {.abs = 1.5 * vmax / 512.0, .rel = 0.0},
                                "gpu (BF16 Q / P) vs float64 on BF16 queries", shape));
    EXPECT_TRUE(test::all_close(results[0], want, wide, "cpu vs float64 over the dequantized cache",
                                shape));
    return;
  }
  EXPECT_TRUE(
      test::all_close(results[1], want, wide, "gpu vs float64 over the dequantized cache", shape));
  EXPECT_TRUE(test::all_close(results[1], results[0], {2 * wide.abs, 2 * wide.rel},
                              "gpu vs cpu backend on the same FP8 cache", shape));
}

std::vector<test::StepSeq> awkward() {
  // Contexts 1, 7, 97, 1000: decodes, whole prompts and chunks after a cached prefix.
  return {{1, 1}, {7, 7}, {97, 97}, {1, 1000}, {7, 1000}, {97, 1000}, {30, 97}};
}

std::vector<test::StepSeq> decodes_only() {
  std::vector<test::StepSeq> s = {{1, 1}, {1, 7}, {1, 97}, {1, 1000}};
  for (int32_t len : test::random_ints(40, 77, 1, 3000)) s.push_back({1, len});
  return s;
}

TEST(CudaKvFp8, GqaMatchesReference) {
  DS_REQUIRE_GPU();
  struct Shape {
    int heads, kv_heads, hd, bs;
  };
  uint32_t seed = 5000;
  for (const Shape s :
       {Shape{6, 2, 64, 16}, Shape{3, 3, 80, 1}, Shape{8, 1, 128, 16}, Shape{9, 3, 128, 1}})
    for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore}) {
      Case c;
      c.seqs = awkward();
      c.heads = s.heads, c.kv_heads = s.kv_heads, c.hd = s.hd, c.block_size = s.bs;
      c.path = path;
      check_case(c, seed++);
    }
}

TEST(CudaKvFp8, MlaMatchesReference) {
  DS_REQUIRE_GPU();
  struct Shape {
    int heads, R, P, bs;
  };
  uint32_t seed = 6000;
  for (const Shape s : {Shape{16, 512, 64, 16}, Shape{20, 512, 64, 1}, Shape{5, 64, 8, 16}})
    for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore}) {
      Case c;
      c.seqs = awkward();
      c.heads = s.heads, c.hd = s.R, c.rope = s.P, c.block_size = s.bs;
      c.path = path;
      check_case(c, seed++);
    }
}

TEST(CudaKvFp8, MlaDecodeKernelMatchesReference) {
  DS_REQUIRE_GPU();
  uint32_t seed = 7000;
  for (int heads : {16, 20, 128})
    for (int bs : {1, 16})
      for (AttentionPath path :
           {AttentionPath::MlaDecode, AttentionPath::MlaDecodeBf16, AttentionPath::Auto}) {
        Case c;
        c.seqs = decodes_only();
        c.heads = heads, c.hd = 512, c.rope = 64, c.block_size = bs;
        c.path = path;
        check_case(c, seed++);
      }
}

// store_kv on CUDA writes exactly the CPU store's codes and scales (GQA K/V, MLA latent with
// split scales), skipping padding tokens.
TEST(CudaKvFp8, StoreMatchesCpuBits) {
  DS_REQUIRE_GPU();
  struct Shape {
    int kv_heads, hd, split;
  };
  uint32_t seed = 8000;
  for (const Shape s : {Shape{3, 80, 0}, Shape{8, 128, 0}, Shape{1, 576, 512}, Shape{1, 72, 64}}) {
    SCOPED_TRACE("kv heads " + std::to_string(s.kv_heads) + " hd " + std::to_string(s.hd));
    const bool latent = s.split > 0;
    const int blocks = 9, bs = 16, T = 100;
    std::vector<int32_t> slots(T);
    for (int t = 0; t < T; ++t) slots[size_t(t)] = t % 11 == 3 ? -1 : (t * 37) % (blocks * bs);
    const std::vector<int64_t> dims = {T, s.kv_heads, s.hd};
    std::vector<float> k = test::random_floats(size_t(T * s.kv_heads * s.hd), seed++, -3, 3);
    std::vector<float> v = test::random_floats(k.size(), seed++, -0.01f, 0.01f);
    k[5] = 0.0f;  // an exact zero, and an all-zero row (scale 1)
    std::fill_n(k.begin() + s.hd * s.kv_heads * 2, s.hd, 0.0f);
    std::vector<uint8_t> codes[2], vcodes[2];
    std::vector<float> scales[2], vscales[2];
    for (int on_gpu = 0; on_gpu < 2; ++on_gpu) {
      Backend& b = on_gpu ? test::cuda_backend() : test::cpu_backend();
      test::BackendKv kv = make_fp8_kv(b, blocks, bs, s.kv_heads, s.hd, latent, s.split, 1);
      test::BackendTensor tk = test::upload_floats(b, DType::F32, dims, k);
      test::BackendTensor tv = test::upload_floats(b, DType::F32, dims, v);
      test::BackendTensor ts = test::upload_ints(b, slots);
      AttentionMeta m;
      m.num_tokens = T;
      m.slot_mapping = ts.ptr<int32_t>();
      b.store_kv(tk.view, tv.view, kv.kv, m);
      codes[on_gpu] = test::download_bytes(b, kv.k);
      const std::vector<uint8_t> sb = test::download_bytes(b, kv.ks);
      scales[on_gpu].resize(sb.size() / 4);
      std::memcpy(scales[on_gpu].data(), sb.data(), sb.size());
      if (!latent) {
        vcodes[on_gpu] = test::download_bytes(b, kv.v);
        const std::vector<uint8_t> vb = test::download_bytes(b, kv.vs);
        vscales[on_gpu].resize(vb.size() / 4);
        std::memcpy(vscales[on_gpu].data(), vb.data(), vb.size());
      }
    }
    EXPECT_TRUE(codes[0] == codes[1]) << "key codes differ";
    EXPECT_TRUE(scales[0] == scales[1]) << "key scales differ";
    EXPECT_TRUE(vcodes[0] == vcodes[1]) << "value codes differ";
    EXPECT_TRUE(vscales[0] == vscales[1]) << "value scales differ";
  }
}

}  // namespace
}  // namespace ds
