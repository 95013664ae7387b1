// CUDA paged attention and MLA against float64 references (and the CPU backend where it has
// the op), over awkward shapes: query lengths 1 / 7 / 97 after cached prefixes, contexts up to
// 5000 (split-K), heads not a power of two, GQA groups of 1, 3 and 4, head_dim 64 / 80 / 128 /
// 256, block sizes 1 and 16 with shuffled block tables, F32 / F16 / BF16 caches, 64 and 256
// decodes in one launch, strided views, and a CUDA graph replayed with new metadata. Both
// kernel families (F32 SIMT and tensor cores) are pinned in turn. The launchers are called
// directly with a Context of the test's own, so these tests do not depend on the backend's
// wiring; one test per op also goes through the Backend when it supports the op.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "attention_reference.h"
#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_mla_decode.cuh"
#include "backend/cuda/attention_setup.h"
#include "backend/cuda/context.cuh"
#include "backend/cuda/switches.h"
#include "launch_context.h"

namespace ds {
namespace {

using cuda::AttentionPath;

const char* path_name(AttentionPath p) {
  return p == AttentionPath::Simt            ? "simt"
         : p == AttentionPath::TensorCore    ? "mma"
         : p == AttentionPath::MlaDecode     ? "mla-decode"
         : p == AttentionPath::MlaDecodeBf16 ? "mla-decode-bf16"
                                             : "auto";
}

struct Case {
  std::vector<test::StepSeq> seqs;
  int heads = 16, kv_heads = 16, hd = 128;  // MLA: hd = R, kv_heads unused
  int rope = 0;                             // MLA rope dims P; 0 = GQA
  int block_size = 16;
  DType dtype = DType::BF16;
  bool causal = true;
  bool strided = false;  // q inside a wider qkv buffer, out rows padded
  bool settled = false;  // MLA: MlaAttentionParams::cache_settled (early cache reads)
  AttentionPath path = AttentionPath::Auto;
};

std::string describe(const Case& c) {
  std::string s = std::string(c.rope ? "mla" : "gqa") + " heads " + std::to_string(c.heads) +
                  (c.rope ? " R " + std::to_string(c.hd) + " P " + std::to_string(c.rope)
                          : "/" + std::to_string(c.kv_heads) + " hd " + std::to_string(c.hd)) +
                  " bs " + std::to_string(c.block_size) + " " + std::string(dtype_name(c.dtype)) +
                  " " + path_name(c.path) + (c.causal ? "" : " non-causal") +
                  (c.strided ? " strided" : "") + ", " + std::to_string(c.seqs.size()) + " seqs";
  if (c.seqs.size() <= 8)
    for (const auto& q : c.seqs)
      s += " " + std::to_string(q.query_len) + "/" + std::to_string(q.context_len);
  return s;
}

int blocks_needed(const Case& c) {
  int blocks = 0;
  for (const auto& q : c.seqs) blocks += (q.context_len + c.block_size - 1) / c.block_size;
  return blocks + 5;  // a few never referenced
}

// Everything one case needs on the GPU (and the host copies for the references).
struct Inputs {
  test::HostStep h;
  test::BackendStep step;
  test::BackendKv kv;
  std::vector<float> q, q_rope;
  test::BackendTensor q_buf, q_rope_buf, out_buf;
  TensorView q_view, q_rope_view, out_view;
  float scale = 1.0f;
};

Inputs make_inputs(const Case& c, uint32_t seed) {
  Backend& gpu = test::cuda_backend();
  Inputs in;
  in.h = test::make_step(c.seqs, c.block_size, blocks_needed(c), seed);
  in.step = test::upload_step(gpu, in.h);
  const bool mla = c.rope > 0;
  test::KvSpec spec;
  spec.dtype = c.dtype;
  spec.num_blocks = blocks_needed(c);
  spec.block_size = c.block_size;
  spec.kv_heads = mla ? 1 : c.kv_heads;
  spec.head_dim = c.hd + c.rope;
  spec.latent = mla;
  in.kv = test::random_paged_kv(gpu, spec, seed + 1);
  const int64_t T = in.h.num_tokens, H = c.heads;
  // Peaked enough that masking or dropping one key shows, flat enough that many keys count.
  in.scale = 2.0f / std::sqrt(float(c.hd + c.rope));
  in.q = test::random_floats(size_t(T * H * c.hd), seed + 2);
  in.q_rope = test::random_floats(size_t(T * H * c.rope), seed + 3);
  const std::vector<float> nan_out(size_t(T * H * (c.hd + 16)),
                                   std::numeric_limits<float>::quiet_NaN());
  if (c.strided) {
    // q = heads [kv, kv + H) of a [T, H + 2 kv, hd] buffer; out rows padded by 16 floats.
    const int64_t wide = H + 2 * c.kv_heads;
    std::vector<float> qkv(size_t(T * wide * c.hd), 7.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int d = 0; d < c.hd; ++d)
          qkv[size_t((t * wide + c.kv_heads + h) * c.hd + d)] =
              in.q[size_t((t * H + h) * c.hd + d)];
    in.q_buf = test::upload_floats(gpu, DType::F32, {T, wide, c.hd}, qkv);
    in.q_view = test::strided_view(in.q_buf.view, {T, H, c.hd}, {wide * c.hd * 4, c.hd * 4, 4},
                                   c.kv_heads * c.hd * 4);
    in.out_buf = test::upload_floats(gpu, DType::F32, {T, H, c.hd + 16}, nan_out);
    in.out_view = test::strided_view(in.out_buf.view, {T, H, c.hd},
                                     {H * (c.hd + 16) * 4, (c.hd + 16) * 4, 4});
  } else {
    in.q_buf = test::upload_floats(gpu, DType::F32, {T, H, c.hd}, in.q);
    in.q_view = in.q_buf.view;
    in.out_buf = test::upload_floats(gpu, DType::F32, {T, H, c.hd},
                                     std::span<const float>(nan_out.data(), size_t(T * H * c.hd)));
    in.out_view = in.out_buf.view;
  }
  if (mla && c.strided) {
    // q_rope = dims [16, 16 + P) of each head of a [T, H, 16 + P] buffer (the model's q_pe).
    const int64_t qk = 16 + c.rope;
    std::vector<float> q(size_t(T * H * qk), 7.0f);
    for (int64_t r = 0; r < T * H; ++r)
      for (int d = 0; d < c.rope; ++d)
        q[size_t(r * qk + 16 + d)] = in.q_rope[size_t(r * c.rope + d)];
    in.q_rope_buf = test::upload_floats(gpu, DType::F32, {T, H, qk}, q);
    in.q_rope_view =
        test::strided_view(in.q_rope_buf.view, {T, H, c.rope}, {H * qk * 4, qk * 4, 4}, 16 * 4);
  } else if (mla) {
    in.q_rope_buf = test::upload_floats(gpu, DType::F32, {T, H, c.rope}, in.q_rope);
    in.q_rope_view = in.q_rope_buf.view;
  }
  gpu.synchronize();  // uploads ran on the backend's stream; the kernels run on ours
  return in;
}

AttentionParams gqa_params(const Case& c, const Inputs& in) {
  AttentionParams p;
  p.q = in.q_view;
  p.out = in.out_view;
  p.kv = in.kv.kv;
  p.scale = in.scale;
  p.causal = c.causal;
  return p;
}

MlaAttentionParams mla_params(const Case& c, const Inputs& in) {
  MlaAttentionParams p;
  p.q_latent = in.q_view;
  p.q_rope = in.q_rope_view;
  p.out = in.out_view;
  p.cache = in.kv.kv;
  p.kv_lora_rank = c.hd;
  p.scale = in.scale;
  p.causal = c.causal;
  p.cache_settled = c.settled;
  return p;
}

void launch(const Case& c, const Inputs& in) {
  const cuda::Context& ctx = launch_context().get();
  if (c.rope > 0)
    cuda::mla_attention_on(ctx, mla_params(c, in), in.step.meta, c.path);
  else
    cuda::paged_attention_on(ctx, gqa_params(c, in), in.step.meta, c.path);
  cuda_ok(cudaGetLastError(), "launch");
  cuda_ok(cudaStreamSynchronize(launch_context().stream()), "attention kernels");
}

std::vector<double> reference(const Case& c, const Inputs& in) {
  if (c.rope > 0)
    return test::reference_mla(in.h, in.q, in.q_rope, in.kv.k_host, c.heads, c.hd, c.rope,
                               c.block_size, in.scale, c.causal);
  return test::reference_attention(in.h, in.q, in.kv.k_host, in.kv.v_host, c.heads, c.kv_heads,
                                   c.hd, c.block_size, in.scale, c.causal);
}

// The output rows the view addresses (and, for padded rows, that the padding kept its NaNs).
std::vector<float> read_out(const Case& c, const Inputs& in) {
  Backend& gpu = test::cuda_backend();
  const std::vector<uint8_t> bytes = test::download_bytes(gpu, in.out_buf);
  if (c.strided) {
    const std::vector<float> all = test::decode(DType::F32, bytes.data(), in.out_buf.numel());
    const int row = c.hd + 16;
    for (size_t r = 0; r < all.size() / size_t(row); ++r)
      for (int d = c.hd; d < row; ++d)
        EXPECT_TRUE(std::isnan(all[r * size_t(row) + size_t(d)])) << "padding written, row " << r;
  }
  return test::gather_view(bytes, in.out_buf.view.data, in.out_view);
}

// Runs the case on the GPU and checks it against float64 (and the CPU backend for GQA).
void check_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  const Inputs in = make_inputs(c, seed);
  launch(c, in);
  const std::vector<float> got = read_out(c, in);
  const std::vector<int64_t> shape = {in.h.num_tokens, c.heads, c.hd};
  EXPECT_TRUE(
      test::all_close(got, reference(c, in), test::attention_tolerance(), "vs float64", shape));
  if (c.rope == 0 && !c.strided) {
    // The CPU backend on the same cache contents (same seed) and the same queries.
    Backend& cpu = test::cpu_backend();
    const test::BackendStep cstep = test::upload_step(cpu, in.h);
    test::KvSpec spec;
    spec.dtype = c.dtype;
    spec.num_blocks = blocks_needed(c);
    spec.block_size = c.block_size;
    spec.kv_heads = c.kv_heads;
    spec.head_dim = c.hd;
    const test::BackendKv ckv = test::random_paged_kv(cpu, spec, seed + 1);
    test::BackendTensor cq = test::upload_floats(cpu, DType::F32, shape, in.q);
    test::BackendTensor cout = test::zeros(cpu, DType::F32, shape);
    AttentionParams p;
    p.q = cq.view;
    p.out = cout.view;
    p.kv = ckv.kv;
    p.scale = in.scale;
    p.causal = c.causal;
    cpu.attention(p, cstep.meta);
    const std::vector<float> want = test::download_floats(cpu, cout);
    const test::Tolerance tol = test::attention_tolerance();
    EXPECT_TRUE(test::all_close(got, want, {2 * tol.abs, 2 * tol.rel}, "vs cpu backend", shape));
  }
}

// Query lengths 1, 7 and 97, each as a whole prompt and after a cached prefix; contexts to 3000.
std::vector<test::StepSeq> mixed_gqa() {
  return {{1, 1}, {1, 2999}, {7, 7}, {7, 1500}, {97, 97}, {97, 2100}, {33, 520}};
}

std::vector<test::StepSeq> mixed_mla() {
  return {{1, 1}, {1, 1200}, {7, 700}, {97, 97}, {20, 1000}};
}

std::vector<test::StepSeq> decodes(int n, int max_context, uint32_t seed) {
  std::vector<test::StepSeq> seqs;
  for (int32_t len : test::random_ints(size_t(n), seed, 1, max_context)) seqs.push_back({1, len});
  return seqs;
}

TEST(CudaAttention, GqaMixedShapes) {
  DS_REQUIRE_GPU();
  struct Shape {
    int heads, kv_heads, hd, block_size;
    DType dtype;
  };
  const Shape shapes[] = {
      {3, 1, 64, 16, DType::BF16},   {16, 16, 128, 1, DType::F32}, {12, 4, 80, 16, DType::F16},
      {12, 4, 128, 16, DType::BF16}, {9, 3, 64, 16, DType::BF16},  {8, 2, 256, 16, DType::BF16},
      {4, 4, 64, 1, DType::F32},
  };
  uint32_t seed = 1000;
  for (const Shape& s : shapes)
    for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore}) {
      Case c;
      c.seqs = mixed_gqa();
      c.heads = s.heads, c.kv_heads = s.kv_heads, c.hd = s.hd, c.block_size = s.block_size;
      c.dtype = s.dtype;
      c.path = path;
      check_case(c, seed++);
    }
}

TEST(CudaAttention, GqaManyDecodes) {
  DS_REQUIRE_GPU();
  for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore, AttentionPath::Auto}) {
    Case c;
    c.seqs = decodes(64, 2000, 7);
    c.heads = 12, c.kv_heads = 4, c.hd = 128;
    c.path = path;
    check_case(c, 1100);
  }
}

TEST(CudaAttention, GqaLongContextSplitK) {
  DS_REQUIRE_GPU();
  for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore}) {
    Case c;
    c.seqs = {{1, 5000}, {16, 5000}, {1, 4097}};
    c.heads = 8, c.kv_heads = 1, c.hd = 128;
    c.path = path;
    check_case(c, 1200);
  }
}

TEST(CudaAttention, GqaNonCausalAndStrided) {
  DS_REQUIRE_GPU();
  for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore}) {
    Case c;
    c.seqs = {{1, 300}, {7, 40}, {12, 12}};
    c.heads = 6, c.kv_heads = 2, c.hd = 64;
    c.path = path;
    c.causal = false;
    check_case(c, 1300);
    c.causal = true;
    c.strided = true;
    check_case(c, 1301);
  }
}

TEST(CudaAttention, MlaMixedShapes) {
  DS_REQUIRE_GPU();
  struct Shape {
    int heads, R, P, block_size;
    DType dtype;
  };
  const Shape shapes[] = {
      {16, 512, 64, 16, DType::BF16},  {1, 32, 8, 1, DType::F32},  {16, 32, 8, 16, DType::F32},
      {128, 512, 64, 16, DType::BF16}, {3, 64, 8, 16, DType::F16}, {16, 1024, 64, 16, DType::BF16},
  };
  uint32_t seed = 2000;
  for (const Shape& s : shapes)
    for (AttentionPath path : {AttentionPath::Simt, AttentionPath::Auto}) {
      Case c;
      c.seqs = s.heads == 128 ? std::vector<test::StepSeq>{{1, 1}, {1, 900}, {7, 300}, {20, 20}}
                              : mixed_mla();
      c.heads = s.heads, c.hd = s.R, c.rope = s.P, c.block_size = s.block_size;
      c.dtype = s.dtype;
      c.path = path;
      check_case(c, seed++);
    }
}

// One whole prompt of 1..64 tokens, as the tiny DeepSeek-V2 fixture's prefill runs it: 3 heads
// (5 tokens per 16-row tile, so tiles start mid-block), R 32, P 8, q_rope a strided view; and
// GQA prompts with 3 / 1 and 6 / 2 heads.
TEST(CudaAttention, WholePromptSweep) {
  DS_REQUIRE_GPU();
  for (AttentionPath path : {AttentionPath::Simt, AttentionPath::Auto})
    for (DType dt : {DType::BF16, DType::F32})
      for (int T = 1; T <= 64; ++T) {
        Case c;
        c.seqs = {{T, T}};
        c.heads = 3, c.kv_heads = 3, c.hd = 32, c.rope = 8, c.strided = true;
        c.dtype = dt, c.path = path;
        check_case(c, 2500 + uint32_t(T));
      }
  for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore})
    for (int hd : {16, 24})
      for (auto [heads, kv] : {std::pair{3, 1}, std::pair{6, 2}})
        for (int T = 1; T <= 64; ++T) {
          Case c;
          c.seqs = {{T, T}};
          c.heads = heads, c.kv_heads = kv, c.hd = hd, c.path = path;
          check_case(c, 2600 + uint32_t(T));
        }
}

// The MLA decode kernels: the register-Q kernel (the default for a BF16 cache with 64 rope
// dims) and the first one (DEEPSERVE_MLA_DECODE_REGQ=0; FP8 caches and other rope sizes).
constexpr int kMlaDecodeKernels[] = {1, 0};

TEST(CudaAttention, MlaDecodeBatches) {
  DS_REQUIRE_GPU();
  // W1's shape (8 sequences, contexts ~1280) and W2's (256 sequences).
  for (int n : {8, 256})
    for (AttentionPath path :
         {AttentionPath::Simt, AttentionPath::TensorCore, AttentionPath::MlaDecode}) {
      Case c;
      c.seqs = decodes(n, 1400, uint32_t(n));
      c.heads = 16, c.hd = 512, c.rope = 64;
      c.path = path;
      for (int regq : kMlaDecodeKernels) {
        if (path != AttentionPath::MlaDecode && regq == 0) continue;
        const test::Forced kernel(cuda::g_mla_decode_regq, regq);
        SCOPED_TRACE(regq ? "register-Q kernel" : "first kernel");
        check_case(c, 2100 + uint32_t(n));
      }
    }
}

// The MLA decode kernel on its edges: contexts around its 64-key tiles, 1 to 20,000 keys (one
// sequence: split-K over 16 splits, and 78 for the longest), head counts that fill 16-row chunks
// partly (8), exactly (16) or several (32, 128), 32 rope dims, block size 1, strided q / q_rope /
// out, and the F32-cache fallback.
TEST(CudaAttention, MlaDecodeKernelEdges) {
  DS_REQUIRE_GPU();
  struct Shape {
    int heads, P, block_size;
    std::vector<test::StepSeq> seqs;
    bool strided = false;
  };
  const std::vector<test::StepSeq> edges = {{1, 1},   {1, 63},  {1, 64},  {1, 65},
                                            {1, 128}, {1, 129}, {1, 777}, {1, 2049}};
  const Shape shapes[] = {{16, 64, 16, edges},       {8, 64, 16, edges},
                          {32, 64, 16, edges},       {128, 64, 16, {{1, 300}, {1, 1}}},
                          {16, 64, 16, edges, true}, {16, 32, 1, {{1, 100}, {1, 17}}},
                          {16, 64, 16, {{1, 5000}}}, {16, 64, 16, {{1, 20000}}},
                          {16, 64, 16, {{1, 1}}}};
  uint32_t seed = 2300;
  for (int regq : kMlaDecodeKernels) {
    const test::Forced kernel(cuda::g_mla_decode_regq, regq);
    SCOPED_TRACE(regq ? "register-Q kernel" : "first kernel");
    for (const Shape& sh : shapes) {
      Case c;
      c.seqs = sh.seqs;
      c.heads = sh.heads, c.hd = 512, c.rope = sh.P, c.block_size = sh.block_size;
      c.strided = sh.strided;
      c.path = AttentionPath::MlaDecode;
      check_case(c, seed++);
    }
  }
  Case f;  // F32 cache: Auto falls back to the other kernels, a forced MlaDecode refuses
  f.seqs = {{1, 100}};
  f.heads = 16, f.hd = 512, f.rope = 64, f.dtype = DType::F32;
  check_case(f, seed++);
  f.path = AttentionPath::MlaDecode;
  const Inputs in = make_inputs(f, seed);
  EXPECT_THROW(launch(f, in), Error);
}

// The register-Q kernel's splits merged inside thread-block clusters (DEEPSERVE_MLA_CLUSTER=1;
// one cluster of splits per sequence and head chunk, no merge launch) give the merge kernel's
// bits: W3's, W1's and W5's shapes, contexts around the tiles (splits without keys), partial and
// several head chunks, padded output rows, Q and P split hi + lo or rounded once, and outputs
// poisoned with NaN before each launch. W3's shape (one cluster of 16), 5-split clusters over a
// partial head chunk and a padded 13-split one must take the cluster path; one split or more
// than 16 must not (the switch then changes nothing); whether all of W1's 8 clusters of 16 fit at
// once depends on the device's GPCs.
TEST(CudaAttention, MlaDecodeClusterMergeChangesNothing) {
  DS_REQUIRE_GPU();
  const std::vector<test::StepSeq> edges = {{1, 1},   {1, 63},  {1, 64},  {1, 65},
                                            {1, 128}, {1, 129}, {1, 777}, {1, 2049}};
  enum Taken { kMust, kMustNot, kAny };
  struct Shape {
    int heads;
    std::vector<test::StepSeq> seqs;
    Taken cluster;
    bool strided = false;
  };
  const Shape shapes[] = {{16, {{1, 1088}}, kMust},
                          {16, decodes(8, 1400, 8), kAny},
                          {128, decodes(8, 1300, 5), kAny},
                          {16, edges, kAny},
                          {8, edges, kAny},
                          {20, {{1, 300}, {1, 77}}, kMust},
                          {16, {{1, 777}}, kMust, true},
                          {16, {{1, 1}}, kMustNot},
                          {16, {{1, 20000}}, kMustNot}};
  const int sms = launch_context().get().sm_count;
  uint32_t seed = 2900;
  for (AttentionPath path : {AttentionPath::MlaDecode, AttentionPath::MlaDecodeBf16})
    for (const Shape& sh : shapes) {
      Case c;
      c.seqs = sh.seqs;
      c.heads = sh.heads, c.hd = 512, c.rope = 64, c.path = path, c.strided = sh.strided;
      SCOPED_TRACE(describe(c));
      std::vector<float> out[2];
      for (int on : {0, 1}) {
        const test::Forced cluster(cuda::g_mla_cluster, on);
        const Inputs in = make_inputs(c, seed);  // the same inputs, outputs NaN again
        if (on) {
          cuda::kern::AttnParams a = cuda::mla_params(mla_params(c, in), in.step.meta);
          a.splits = cuda::mla_decode_splits(a, sms);
          const bool taken = cuda::mla_decode_merges_in_cluster(a);
          if (sh.cluster != kAny) EXPECT_EQ(taken, sh.cluster == kMust) << a.splits << " splits";
          std::printf("[ cluster  ] %s: %d splits, %s\n", describe(c).c_str(), a.splits,
                      taken ? "merged in clusters" : "merge kernel");
        }
        launch(c, in);
        out[on] = read_out(c, in);
      }
      EXPECT_TRUE(test::bits_equal(out[1], out[0]));
      if (path == AttentionPath::MlaDecode) {
        const Inputs in = make_inputs(c, seed);
        EXPECT_TRUE(test::all_close(out[1], reference(c, in), test::attention_tolerance(),
                                    "vs float64", {in.h.num_tokens, c.heads, c.hd}));
      }
      ++seed;
    }
}

// The register-Q kernel's optional forms give the bits of its plainest one (every read after the
// dependent-launch wait, one Q element a load, the shared merge): reads before the wait
// (cache_settled: the slots and tile 0's copies), Q element pairs in one load
// (DEEPSERVE_MLA_Q_PAIRS), unconditional Q loads split a pair at a time (DEEPSERVE_MLA_Q_SPLIT2)
// and the in-cluster merge that gathers the weights first (DEEPSERVE_MLA_MERGE_GATHER). W3's
// shape (splits of two tiles past 1,024 keys), W1's and W5's batches, contexts around the tiles
// (splits of one tile, none, many) and a long one, with Q and P split hi + lo or rounded once,
// the splits merged in clusters or by the merge kernel; float64 checks the plainest. Outputs are
// poisoned with NaN before each launch.
TEST(CudaAttention, MlaDecodeFormsChangeNothing) {
  DS_REQUIRE_GPU();
  const std::vector<test::StepSeq> edges = {{1, 1},   {1, 63},  {1, 64},  {1, 65},
                                            {1, 128}, {1, 129}, {1, 777}, {1, 2049}};
  struct Shape {
    int heads;
    std::vector<test::StepSeq> seqs;
  };
  const Shape shapes[] = {{16, {{1, 1088}}},          {16, {{1, 1025}}}, {16, decodes(8, 1400, 8)},
                          {128, decodes(8, 1300, 5)}, {16, edges},       {16, {{1, 20000}}}};
  // (settled, Q pairs, merge gather, Q split2); the first is the reference.
  const int modes[][4] = {{0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0},
                          {0, 0, 0, 1}, {0, 1, 0, 1}, {1, 1, 1, 1}};
  uint32_t seed = 3300;
  for (int cluster : {0, 1})
    for (AttentionPath path : {AttentionPath::MlaDecode, AttentionPath::MlaDecodeBf16})
      for (const Shape& sh : shapes) {
        const test::Forced merge(cuda::g_mla_cluster, cluster);
        Case c;
        c.seqs = sh.seqs;
        c.heads = sh.heads, c.hd = 512, c.rope = 64, c.path = path;
        std::vector<float> ref;
        for (const auto& m : modes) {
          SCOPED_TRACE(describe(c) + (cluster ? ", cluster merge" : ", merge kernel") +
                       ", settled " + std::to_string(m[0]) + ", Q pairs " + std::to_string(m[1]) +
                       ", merge gather " + std::to_string(m[2]) + ", Q split2 " +
                       std::to_string(m[3]));
          const test::Forced pairs(cuda::g_mla_q_pairs, m[1]);
          const test::Forced gather(cuda::g_mla_merge_gather, m[2]);
          const test::Forced split2(cuda::g_mla_q_split2, m[3]);
          c.settled = m[0] != 0;
          const Inputs in = make_inputs(c, seed);  // the same inputs, outputs NaN again
          launch(c, in);
          const std::vector<float> out = read_out(c, in);
          if (ref.empty()) {
            ref = out;
            if (path == AttentionPath::MlaDecode)
              EXPECT_TRUE(test::all_close(out, reference(c, in), test::attention_tolerance(),
                                          "vs float64", {in.h.num_tokens, c.heads, c.hd}));
          } else {
            EXPECT_TRUE(test::bits_equal(out, ref));
          }
        }
        ++seed;
      }
}

// DEEPSERVE_MLA_CLUSTER_FIT=1 (run_mla_decode): where the splits' clusters do not all fit at once
// it takes the largest count down to half whose clusters do. W1's batch (8 clusters of 16 on the
// H200), W3's (one cluster: nothing changes), 12 sequences and a 128-head batch, against float64
// (the split boundaries move, so the bits may); the launch must merge in clusters (no merge
// kernel) wherever some count in range fits, which the cluster query answers.
TEST(CudaAttention, MlaDecodeClusterFitMatchesReference) {
  DS_REQUIRE_GPU();
  const test::Forced fit(cuda::g_mla_cluster_fit, 1);
  struct Shape {
    int heads;
    std::vector<test::StepSeq> seqs;
  };
  const Shape shapes[] = {{16, decodes(8, 1400, 8)},
                          {16, {{1, 1088}}},
                          {16, decodes(12, 900, 12)},
                          {128, decodes(4, 700, 4)}};
  const int sms = launch_context().get().sm_count;
  uint32_t seed = 3500;
  for (const Shape& sh : shapes) {
    Case c;
    c.seqs = sh.seqs;
    c.heads = sh.heads, c.hd = 512, c.rope = 64, c.path = AttentionPath::MlaDecode;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, seed++);
    cuda::kern::AttnParams a = cuda::mla_params(mla_params(c, in), in.step.meta);
    a.splits = cuda::mla_decode_splits(a, sms);
    cuda::kern::AttnParams b = a;
    b.splits = cuda::mla_decode_cluster_fit(a);
    const int chosen = b.splits;
    const bool some_fit = cuda::mla_decode_merges_in_cluster(b);
    std::printf("[ fit      ] %s: %d splits -> %d%s\n", describe(c).c_str(), a.splits, chosen,
                some_fit ? ", merged in clusters" : ", merge kernel");
    const int64_t merges = cuda::mla_merge_launches();
    launch(c, in);
    EXPECT_EQ(cuda::mla_merge_launches() - merges, some_fit || a.splits == 1 ? 0 : 1);
    EXPECT_TRUE(test::all_close(read_out(c, in), reference(c, in), test::attention_tolerance(),
                                "vs float64", {in.h.num_tokens, c.heads, c.hd}));
  }
}

// The MLA decode kernel's split count (host code; no GPU needed): with fewer CTAs than SMs the
// grid fills at most one wave, except where the 16-split cap for short contexts binds; long
// contexts may take up to 128 splits; the workloads' shapes get what their comments say.
TEST(MlaDecodePlan, SplitsFillAtMostOneWave) {
  const int sms = 132;
  auto splits = [&](int seqs, int heads, int context) {
    cuda::kern::AttnParams a;
    a.num_seqs = a.num_tokens = seqs;
    a.heads = heads;
    a.block_size = 16;
    a.max_blocks_per_seq = (context + 15) / 16;
    return cuda::mla_decode_splits(a, sms);
  };
  EXPECT_EQ(splits(8, 128, 1282), 2);    // W5: 64 CTAs x 2 = one wave (3 took two)
  EXPECT_EQ(splits(8, 16, 1280), 16);    // W1: 128 CTAs
  EXPECT_EQ(splits(1, 16, 1088), 16);    // W3: the short-context cap
  EXPECT_EQ(splits(256, 16, 1280), 1);   // W2: already more CTAs than SMs
  EXPECT_EQ(splits(1, 16, 32768), 128);  // long: one split per 4 tiles, up to 128
  {
    // Auto's Q / P form: hi + lo unless asked (DEEPSERVE_MLA_BF16_MIN_HEADS, DEEPSERVE_MLA_DECODE).
    cuda::kern::AttnParams a;
    a.heads = 128;
    {
      const test::Forced plain(cuda::g_mla_decode_bf16, 0);
      const test::Forced never(cuda::g_mla_bf16_min_heads, 1 << 30);
      EXPECT_FALSE(cuda::mla_decode_bf16_auto(a));
    }
    {
      const test::Forced plain(cuda::g_mla_decode_bf16, 0);
      const test::Forced many(cuda::g_mla_bf16_min_heads, 64);
      EXPECT_TRUE(cuda::mla_decode_bf16_auto(a));
      a.heads = 16;
      EXPECT_FALSE(cuda::mla_decode_bf16_auto(a));
    }
    const test::Forced asked(cuda::g_mla_decode_bf16, 1);
    EXPECT_TRUE(cuda::mla_decode_bf16_auto(a));
  }
  {
    cuda::kern::AttnParams a;  // W5 with 32 heads a CTA (BF16 Q / P): 32 CTAs x 4
    a.num_seqs = a.num_tokens = 8;
    a.heads = 128;
    a.mla_rows = 32;
    a.block_size = 16;
    a.max_blocks_per_seq = (1282 + 15) / 16;
    EXPECT_EQ(cuda::mla_decode_splits(a, sms), 4);
  }
  for (int seqs = 1; seqs <= 140; ++seqs)
    for (int heads : {16, 32, 128}) {
      const int ctas = seqs * ((heads + 15) / 16), s = splits(seqs, heads, 4096);
      EXPECT_GE(s, 1);
      if (ctas < sms) {
        EXPECT_LE(ctas * s, sms) << seqs << " seqs x " << heads << " heads";
        EXPECT_TRUE(s == 16 || ctas * (s + 1) > sms) << "a split short of a full wave: " << seqs;
      }
    }
}

// The MLA decode kernel with Q and P rounded to BF16 once (MlaDecodeBf16) against float64 on
// the same BF16-rounded queries: what remains is P's rounding, at most 2^-9 of |v| <= 1 for any
// weighted average of values (bound 2.5e-3), over W1's and W2's batches and the kernel's edges
// (contexts around the 64-key tiles, 1 to 20,000 keys, 8 / 32 / 48 / 80 / 128 heads, 32 rope
// dims). The register-Q kernel runs with 16 heads a CTA and with 32 (DEEPSERVE_MLA_ROWS32: two
// halves, the second partly or wholly past the heads at 48 and 80), which must take every shape
// of 32 heads or more with 64 rope dims; the splits merged by the merge kernel and in clusters.
TEST(CudaAttention, MlaDecodeBf16QueriesMatchReference) {
  DS_REQUIRE_GPU();
  const std::vector<test::StepSeq> edges = {{1, 1},   {1, 63},  {1, 64},  {1, 65},
                                            {1, 128}, {1, 129}, {1, 777}, {1, 2049}};
  struct Shape {
    int heads, P;
    std::vector<test::StepSeq> seqs;
  };
  const Shape shapes[] = {{16, 64, decodes(8, 1400, 8)},
                          {16, 64, decodes(256, 1400, 256)},
                          {16, 64, edges},
                          {8, 64, edges},
                          {32, 64, edges},
                          {48, 64, {{1, 700}, {1, 64}, {1, 1}}},
                          {80, 64, decodes(8, 1400, 80)},
                          {128, 64, {{1, 300}, {1, 1}, {1, 1282}}},
                          {128, 64, decodes(8, 1300, 5)},
                          {16, 32, {{1, 100}, {1, 17}}},
                          {16, 64, {{1, 20000}}}};
  // (register-Q kernel, 32 rows, cluster merge)
  const int forms[][3] = {{1, 0, 0}, {1, 1, 0}, {1, 1, 1}, {0, 0, 0}};
  uint32_t seed = 2600;
  for (const auto& f : forms)
    for (const Shape& sh : shapes) {
      const test::Forced kernel(cuda::g_mla_decode_regq, f[0]);
      const test::Forced rows32(cuda::g_mla_rows32, f[1]);
      const test::Forced cluster(cuda::g_mla_cluster, f[2]);
      SCOPED_TRACE(!f[0]  ? "first kernel"
                   : f[1] ? (f[2] ? "register-Q kernel, 32 rows, cluster merge"
                                  : "register-Q kernel, 32 rows, merge kernel")
                          : "register-Q kernel");
      Case c;
      c.seqs = sh.seqs;
      c.heads = sh.heads, c.hd = 512, c.rope = sh.P;
      c.path = AttentionPath::MlaDecodeBf16;
      SCOPED_TRACE(describe(c));
      const Inputs in = make_inputs(c, seed++);
      const cuda::kern::AttnParams a = cuda::mla_params(mla_params(c, in), in.step.meta);
      EXPECT_EQ(cuda::mla_decode_rows(a, true),
                f[0] && f[1] && sh.heads >= 32 && sh.P == 64 ? 32 : 16);
      launch(c, in);
      const std::vector<float> got = read_out(c, in);
      std::vector<float> q = in.q, q_rope = in.q_rope;
      for (float& v : q) v = bf16_to_f32(f32_to_bf16(v));
      for (float& v : q_rope) v = bf16_to_f32(f32_to_bf16(v));
      const std::vector<double> want = test::reference_mla(
          in.h, q, q_rope, in.kv.k_host, c.heads, c.hd, c.rope, c.block_size, in.scale, c.causal);
      EXPECT_TRUE(test::all_close(got, want, {.abs = 2.5e-3, .rel = 0.0}, "vs float64 (BF16 q)",
                                  {in.h.num_tokens, c.heads, c.hd}));
    }
}

TEST(CudaAttention, MlaLongContextSplitK) {
  DS_REQUIRE_GPU();
  for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore}) {
    Case c;
    c.seqs = {{1, 5000}, {8, 5000}};
    c.heads = 16, c.hd = 512, c.rope = 64;
    c.path = path;
    check_case(c, 2200);
  }
}

// A launch captured into a CUDA graph for one step, replayed after the metadata arrays were
// rewritten in place for another step of the same sizes (the engine's decode graphs).
TEST(CudaAttention, GraphReplayWithNewMetadata) {
  DS_REQUIRE_GPU();
  Backend& gpu = test::cuda_backend();
  for (bool mla : {false, true}) {
    Case c;
    c.seqs = {{1, 700}, {1, 30}, {1, 1900}, {1, 5}};
    if (mla)
      c.heads = 16, c.hd = 512, c.rope = 64;
    else
      c.heads = 12, c.kv_heads = 4, c.hd = 128;
    SCOPED_TRACE(describe(c));
    Inputs in = make_inputs(c, 3000 + mla);
    launch(c, in);  // warm-up: sizes the scratch and the kernels' shared-memory limits

    cudaStream_t s = launch_context().stream();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
    if (mla)
      cuda::mla_attention(launch_context().get(), mla_params(c, in), in.step.meta);
    else
      cuda::paged_attention(launch_context().get(), gqa_params(c, in), in.step.meta);
    cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

    // Another step with the same num_seqs, num_tokens and max_blocks_per_seq, fitting the
    // same cache (fewer blocks in all), tables drawn from another shuffle.
    Case c2 = c;
    c2.seqs = {{1, 1890}, {1, 1}, {1, 64}, {1, 600}};
    const test::HostStep h2 = test::make_step(c2.seqs, c.block_size, blocks_needed(c), 77);
    ASSERT_EQ(h2.max_blocks_per_seq, in.h.max_blocks_per_seq);
    for (auto [dst, src] : {std::pair{&in.step.context_lens, &h2.context_lens},
                            std::pair{&in.step.block_tables, &h2.block_tables},
                            std::pair{&in.step.query_start, &h2.query_start},
                            std::pair{&in.step.positions, &h2.positions},
                            std::pair{&in.step.slot_mapping, &h2.slot_mapping}})
      gpu.upload(dst->view, src->data(), src->size() * 4);
    gpu.synchronize();
    in.h = h2;
    cuda_ok(cudaGraphLaunch(exec, s), "graph launch");
    cuda_ok(cudaStreamSynchronize(s), "graph replay");
    const std::vector<float> got = read_out(c, in);
    EXPECT_TRUE(test::all_close(got, reference(c, in), test::attention_tolerance(), "graph replay",
                                {in.h.num_tokens, c.heads, c.hd}));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// The ops through the Backend interface, once the CUDA backend forwards them.
TEST(CudaAttention, ThroughBackend) {
  DS_REQUIRE_GPU();
  Backend& gpu = test::cuda_backend();
  if (!gpu.supports(Op::Attention, DType::BF16) && !gpu.supports(Op::MlaAttention, DType::BF16))
    GTEST_SKIP() << "the CUDA backend does not forward attention yet";
  for (bool mla : {false, true}) {
    if (!gpu.supports(mla ? Op::MlaAttention : Op::Attention, DType::BF16)) continue;
    Case c;
    c.seqs = mla ? mixed_mla() : mixed_gqa();
    if (mla)
      c.heads = 16, c.hd = 512, c.rope = 64;
    else
      c.heads = 12, c.kv_heads = 4, c.hd = 128;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, 4000 + mla);
    if (mla)
      gpu.mla_attention(mla_params(c, in), in.step.meta);
    else
      gpu.attention(gqa_params(c, in), in.step.meta);
    gpu.synchronize();
    EXPECT_TRUE(test::all_close(read_out(c, in), reference(c, in), test::attention_tolerance(),
                                "backend", {in.h.num_tokens, c.heads, c.hd}));
  }
}

// The MLA decode launches of W1 (8 x 1280, 16 heads), W3 (1 x 1088), W2 (256 x 1280) and W5
// (8 x 1282, 128 heads), one each inside cudaProfilerStart/Stop: gpu_run.sh's ncu targets.
TEST(CudaAttention, DISABLED_NcuDecode) {
  DS_REQUIRE_GPU();
  struct Row {
    int n, context, heads;
  };
  for (const Row& r : {Row{8, 1280, 16}, Row{1, 1088, 16}, Row{256, 1280, 16}, Row{8, 1282, 128}}) {
    Case c;
    c.seqs.assign(size_t(r.n), {1, r.context});
    c.heads = r.heads, c.hd = 512, c.rope = 64;
    c.path = AttentionPath::MlaDecode;
    const Inputs in = make_inputs(c, 5100);
    launch(c, in);
    cuda_ok(cudaProfilerStart(), "profiler start");
    launch(c, in);
    cuda_ok(cudaProfilerStop(), "profiler stop");
  }
}

// Kernel times for the workloads' shapes (not a check): run with
// --gtest_also_run_disabled_tests --gtest_filter='*Timing*'. Decode rows report the cache
// bytes read per second; prefill rows the attention FLOP rate (causal: half the square).
TEST(CudaAttention, DISABLED_Timing) {
  DS_REQUIRE_GPU();
  struct Row {
    const char* name;
    Case c;
  };
  auto mla = [](std::vector<test::StepSeq> seqs) {
    Case c;
    c.seqs = std::move(seqs);
    c.heads = 16, c.hd = 512, c.rope = 64;
    return c;
  };
  auto gqa = [](std::vector<test::StepSeq> seqs) {
    Case c;
    c.seqs = std::move(seqs);
    c.heads = 9, c.kv_heads = 3, c.hd = 64;
    return c;
  };
  const std::vector<test::StepSeq> w1(8, {1, 1280}), w2(256, {1, 1280}), pre(8, {1024, 1024});
  const std::vector<test::StepSeq> gdec(64, {1, 1024}), gpre(4, {512, 512});
  const std::vector<test::StepSeq> w3(1, {1, 1088});
  Case w5 = mla(std::vector<test::StepSeq>(8, {1, 1282}));
  w5.heads = 128;  // DeepSeek-V2.5's heads
  const Row rows[] = {
      {"mla W3 decode 1 x 1088", mla(w3)},      {"mla W1 decode 8 x 1280", mla(w1)},
      {"mla W2 decode 256 x 1280", mla(w2)},    {"mla W5 decode 8 x 1282 x 128h", w5},
      {"mla prefill 8 x 1024", mla(pre)},       {"gqa 9/3x64 decode 64 x 1024", gqa(gdec)},
      {"gqa 9/3x64 prefill 4 x 512", gqa(gpre)}};
  cudaStream_t s = launch_context().stream();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::printf("%-30s %6s %10s %12s\n", "shape", "path", "us/call", "rate");
  for (const Row& row : rows)
    for (AttentionPath path : {AttentionPath::Simt, AttentionPath::TensorCore,
                               AttentionPath::MlaDecode, AttentionPath::MlaDecodeBf16})
      for (int regq : kMlaDecodeKernels) {
        const bool mla_decode =
            path == AttentionPath::MlaDecode || path == AttentionPath::MlaDecodeBf16;
        if (mla_decode && (row.c.rope == 0 || row.c.seqs.front().query_len != 1)) continue;
        if (!mla_decode && regq == 0) continue;
        const test::Forced kernel(cuda::g_mla_decode_regq, regq);
        const std::string name = std::string(path_name(path)) + (mla_decode && !regq ? "-v1" : "");
        Case c = row.c;
        c.path = path;
        const Inputs in = make_inputs(c, 5000);
        for (int i = 0; i < 3; ++i) launch(c, in);
        const int iters = 20;
        cudaEventRecord(e0, s);
        for (int i = 0; i < iters; ++i) {
          if (c.rope > 0)
            cuda::mla_attention_on(launch_context().get(), mla_params(c, in), in.step.meta, path);
          else
            cuda::paged_attention_on(launch_context().get(), gqa_params(c, in), in.step.meta, path);
        }
        cudaEventRecord(e1, s);
        cuda_ok(cudaEventSynchronize(e1), "timing");
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, e0, e1);
        const double us = 1000.0 * ms / iters;
        double keys = 0.0, pairs = 0.0;  // cached rows read; (query, key) pairs computed
        for (const auto& q : c.seqs) {
          keys += q.context_len;
          for (int i = 0; i < q.query_len; ++i) pairs += q.context_len - q.query_len + i + 1;
        }
        const int es = int(dtype_info(c.dtype).type_size);
        const double row_bytes =
            c.rope > 0 ? double(c.hd + c.rope) * es : 2.0 * c.kv_heads * c.hd * es;
        const bool decode = in.h.num_tokens == in.h.num_seqs;
        const double flop = pairs * c.heads * 2.0 * (c.rope > 0 ? 2 * c.hd + c.rope : 2 * c.hd);
        if (decode)
          std::printf("%-30s %6s %10.1f %9.0f GB/s\n", row.name, name.c_str(), us,
                      keys * row_bytes / us * 1e-3);
        else
          std::printf("%-30s %6s %10.1f %7.1f TFLOP/s\n", row.name, name.c_str(), us,
                      flop / us * 1e-6);
      }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

}  // namespace
}  // namespace ds
