// The fused MLA prepare kernel (CudaBackend::mla_prepare: latent RMS norm, rope of q and of the
// rope key, latent cache store in one launch) against the four separate CUDA ops it replaces
// (Backend::mla_prepare, the base version) on identical inputs: kva (with its row padding and
// the columns around it), q (all of it) and the whole cache must be the same bytes. Covers
// decode and prefill token counts, 16 and 128 heads, both rope styles with DeepSeek-V2's YaRN,
// BF16 / F16 / F32 caches, block sizes 16 and 64, permuted blocks, a padding token (slot -1),
// other latent widths and a partial rotary_dim; FP8 caches take the four-op path.
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/switches.h"
#include "gpu_test_util.h"

namespace ds {
namespace {

// The backend takes the fused kernel only when asked (until it is measured): these tests ask.
struct FusedOn {
  FusedOn() { cuda::g_mla_prepare.force(1); }
  ~FusedOn() { cuda::g_mla_prepare.force(-1); }
};

constexpr int kLead = 24, kPad = 8;  // kva sits at column kLead of a row padded by kPad

struct PrepCase {
  int T = 1, H = 16, R = 512, P = 64, rotary = 64, nope = 128, block_size = 16;
  RopeStyle style = RopeStyle::RotateHalf;
  DType cache = DType::BF16;
  bool padded = true;
};

std::string describe(const PrepCase& c) {
  return "T " + std::to_string(c.T) + " H " + std::to_string(c.H) + " R " + std::to_string(c.R) +
         " P " + std::to_string(c.P) + " rot " + std::to_string(c.rotary) + " bs " +
         std::to_string(c.block_size) + " style " + std::to_string(int(c.style)) + " " +
         std::string(dtype_name(c.cache)) + (c.padded ? " padded" : "");
}

// Sequences giving T new tokens at varied positions (YaRN's long range included).
std::vector<test::StepSeq> seqs_for(int T) {
  if (T == 1) return {{1, 3999}};
  if (T == 3) return {{1, 1}, {1, 70}, {1, 129}};
  if (T == 17) return {{5, 20}, {1, 1}, {11, 40}};
  if (T == 300) return {{260, 300}, {40, 1000}};
  return {{T, T + 5}};
}

RopeParams deepseek_rope(const PrepCase& c) {
  RopeParams p;
  p.style = c.style;
  p.rotary_dim = c.rotary;
  p.theta = 10000.0f;
  p.yarn_factor = 40.0f;
  p.yarn_original_max_position = 4096;
  p.yarn_beta_fast = 32.0f;
  p.yarn_beta_slow = 1.0f;
  p.attn_factor = yarn_mscale(40.0f, 1.0f);  // not 1, so the cos/sin scaling is exercised
  return p;
}

struct Outputs {
  std::vector<uint8_t> kva, q, cache, scales;
};

// Runs the fused op (fused = true) or the base four-op version on fresh copies of one case's
// inputs and returns every buffer it may write. h is the step (slot mapping with a hole).
Outputs run_case(const PrepCase& c, const test::HostStep& h, int num_blocks, bool fused,
                 uint32_t seed) {
  Backend& gpu = test::cuda_backend();
  const int64_t T = c.T, W = c.R + c.P, width = c.padded ? kLead + W + kPad : W;
  const int64_t lead = c.padded ? kLead : 0, qk = c.nope + c.P;
  // Sharp inputs: latent rows of varied magnitude, norm weights 1 +- 0.1.
  std::vector<float> kva = test::random_floats(size_t(T * width), seed, -3.0f, 3.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < width; ++i) kva[size_t(t * width + i)] *= 0.25f + float(t % 5);
  const std::vector<float> q = test::random_floats(size_t(T * c.H * qk), seed + 1, -2.0f, 2.0f);
  const std::vector<float> norm = test::random_floats(size_t(c.R), seed + 2, 0.9f, 1.1f);
  test::BackendTensor tkva = test::upload_floats(gpu, DType::F32, {T, width}, kva);
  test::BackendTensor tq = test::upload_floats(gpu, DType::F32, {T, c.H, qk}, q);
  test::BackendTensor tnorm = test::upload_floats(gpu, DType::F32, {c.R}, norm);
  test::KvSpec spec;
  spec.dtype = c.cache;
  spec.num_blocks = num_blocks;
  spec.block_size = c.block_size;
  spec.head_dim = int(W);
  spec.latent = true;
  test::BackendKv kv = test::random_paged_kv(gpu, spec, seed + 3, c.R);
  const test::BackendStep step = test::upload_step(gpu, h);

  MlaPrepareParams p;
  p.kva = test::view_of(tkva, {T, W}, {width, 1}, lead);
  p.norm = tnorm.view;
  p.eps = 1e-6f;
  p.q_rope = test::view_of(tq, {T, c.H, c.P}, {c.H * qk, qk, 1}, c.nope);
  p.rope = deepseek_rope(c);
  p.cache = kv.kv;
  p.kv_lora_rank = c.R;
  if (fused)
    gpu.mla_prepare(p, step.meta);
  else
    gpu.Backend::mla_prepare(p, step.meta);
  gpu.synchronize();
  Outputs o;
  o.kva = test::download_bytes(gpu, tkva);
  o.q = test::download_bytes(gpu, tq);
  o.cache = test::download_bytes(gpu, kv.k);
  if (c.cache == DType::F8_E4M3) o.scales = test::download_bytes(gpu, kv.ks);
  return o;
}

// Bytes equal, else the first differing byte's index (for the failure message).
::testing::AssertionResult same_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                                      const char* what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      return ::testing::AssertionFailure()
             << what << ": byte " << i << " differs (" << int(a[i]) << " vs " << int(b[i]) << ")";
  return ::testing::AssertionSuccess();
}

void check_case(const PrepCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  const std::vector<test::StepSeq> seqs = seqs_for(c.T);
  int blocks = 3;
  for (const auto& s : seqs) blocks += (s.context_len + c.block_size - 1) / c.block_size;
  test::HostStep h = test::make_step(seqs, c.block_size, blocks, seed + 10);
  ASSERT_EQ(h.num_tokens, c.T);
  if (c.T >= 3) h.slot_mapping[1] = -1;  // a padding token: normalized and rotated, not stored
  const Outputs fused = run_case(c, h, blocks, true, seed);
  const Outputs four = run_case(c, h, blocks, false, seed);
  EXPECT_TRUE(same_bytes(fused.kva, four.kva, "kva"));
  EXPECT_TRUE(same_bytes(fused.q, four.q, "q"));
  EXPECT_TRUE(same_bytes(fused.cache, four.cache, "cache"));
  EXPECT_TRUE(same_bytes(fused.scales, four.scales, "fp8 scales"));

  // Independent of the four ops: every stored token's cache row is its kva row in the cache
  // dtype (so the op did store, and stored the final values).
  if (c.cache == DType::F8_E4M3) return;
  const int64_t W = c.R + c.P, width = c.padded ? kLead + W + kPad : W;
  const int64_t lead = c.padded ? kLead : 0;
  const size_t es = test::element_bytes(c.cache);
  for (int t = 0; t < c.T; ++t) {
    const int32_t slot = h.slot_mapping[size_t(t)];
    if (slot < 0) continue;
    std::vector<float> row(static_cast<size_t>(W));
    std::memcpy(row.data(), fused.kva.data() + size_t((t * width + lead) * 4), size_t(W) * 4);
    const std::vector<uint8_t> want = test::encode(c.cache, row);
    ASSERT_EQ(0, std::memcmp(fused.cache.data() + size_t(slot) * size_t(W) * es, want.data(),
                             want.size()))
        << "token " << t << " slot " << slot;
  }
}

TEST(CudaMlaPrepare, FusedMatchesFourOpsBitForBit) {
  DS_REQUIRE_GPU();
  const FusedOn fused_on;
  uint32_t seed = 100;
  for (int T : {1, 3, 17, 300})
    for (int H : {16, 128})
      for (RopeStyle st : {RopeStyle::Adjacent, RopeStyle::RotateHalf})
        for (DType dt : {DType::BF16, DType::F32})
          for (int bs : {16, 64}) {
            PrepCase c;
            c.T = T;
            c.H = H;
            c.style = st;
            c.cache = dt;
            c.block_size = bs;
            c.padded = (T + bs) % 3 != 0;
            check_case(c, seed++);
          }
}

// F16 caches, other latent widths (the norm's thread count changes with R: 32, 384 and 1024
// threads) and a rotary_dim below the rope dims (the tail is stored unrotated).
TEST(CudaMlaPrepare, OtherWidthsDtypesAndPartialRotary) {
  DS_REQUIRE_GPU();
  const FusedOn fused_on;
  uint32_t seed = 500;
  const PrepCase base;
  std::vector<PrepCase> cases;
  for (int T : {1, 17}) {
    PrepCase c = base;
    c.T = T;
    c.cache = DType::F16;
    cases.push_back(c);
    c.R = 96;
    c.P = 32;
    c.rotary = 32;
    c.H = 3;
    cases.push_back(c);
    c.R = 1536;
    c.cache = DType::BF16;
    cases.push_back(c);
    c.R = 4100;
    c.style = RopeStyle::Adjacent;
    cases.push_back(c);
    c = base;
    c.T = T;
    c.rotary = 32;
    c.style = RopeStyle::Adjacent;
    cases.push_back(c);
    c.style = RopeStyle::RotateHalf;
    c.nope = 0;  // q_rope fills each q head
    cases.push_back(c);
  }
  for (const PrepCase& c : cases) check_case(c, seed++);
}

// An FP8 cache takes the four-op path inside the CUDA backend; results still match.
TEST(CudaMlaPrepare, Fp8CacheFallsBackAndMatches) {
  DS_REQUIRE_GPU();
  const FusedOn fused_on;
  uint32_t seed = 900;
  for (int T : {1, 17})
    for (RopeStyle st : {RopeStyle::Adjacent, RopeStyle::RotateHalf}) {
      PrepCase c;
      c.T = T;
      c.style = st;
      c.cache = DType::F8_E4M3;
      check_case(c, seed++);
    }
}

// DEEPSERVE_MLA_PREPARE_PAIRS: q's rope pairs in parts, one CTA each, only the first also doing
// the latent, the key and the cache row. The same bytes as the four ops for parts that divide the
// pairs evenly or not (128 heads x 32 pairs in parts of 512, 1,000 and 4,096; 3 heads in parts
// of 1 pair), at decode sizes with a padding token, and at 300 tokens (past the split's reach).
TEST(CudaMlaPrepare, QPairsInPartsChangeNothing) {
  DS_REQUIRE_GPU();
  const FusedOn fused_on;
  uint32_t seed = 1700;
  for (long long per : {512LL, 1000LL, 4096LL, 1LL})
    for (int T : {1, 3, 17, 300}) {
      if (per == 1 && T == 300) continue;
      SCOPED_TRACE("pairs per CTA " + std::to_string(per));
      const test::Forced pairs(cuda::g_mla_prepare_pairs, per);
      PrepCase c;
      c.T = T;
      c.H = per == 1 ? 3 : 128;
      c.style = T % 2 ? RopeStyle::RotateHalf : RopeStyle::Adjacent;
      c.cache = T == 3 ? DType::F16 : DType::BF16;
      check_case(c, seed++);
    }
}

// DEEPSERVE_ROW_REGS=1 (the token's loads at once, the norm weight, angles and slot before the
// wait): the fused kernel's bytes either way, over decode and prefill token counts, 16 and 128
// heads (one and two rounds of q's pairs), both rope styles, the cache dtypes, a padding token,
// and the widths it takes (R = 96, 512) or leaves to the loop (R = 1,536: 384 threads).
TEST(CudaMlaPrepare, RegisterRowsChangeNothing) {
  DS_REQUIRE_GPU();
  const FusedOn fused_on;
  uint32_t seed = 1300;
  std::vector<PrepCase> cases;
  for (int T : {1, 3, 17, 300})
    for (int H : {16, 128})
      for (RopeStyle st : {RopeStyle::Adjacent, RopeStyle::RotateHalf}) {
        PrepCase c;
        c.T = T;
        c.H = H;
        c.style = st;
        c.cache = T == 3 ? DType::F16 : T == 17 ? DType::F32 : DType::BF16;
        c.padded = T != 17;
        cases.push_back(c);
      }
  PrepCase narrow;
  narrow.R = 96, narrow.P = 32, narrow.rotary = 32, narrow.H = 3, narrow.T = 17;
  cases.push_back(narrow);
  narrow.nope = 0, narrow.rotary = 16;  // a tail of rope dims stored unrotated
  cases.push_back(narrow);
  PrepCase wide;
  wide.R = 1536;
  cases.push_back(wide);
  for (const PrepCase& c : cases) {
    SCOPED_TRACE(describe(c));
    const std::vector<test::StepSeq> seqs = seqs_for(c.T);
    int blocks = 3;
    for (const auto& sq : seqs) blocks += (sq.context_len + c.block_size - 1) / c.block_size;
    test::HostStep h = test::make_step(seqs, c.block_size, blocks, seed + 10);
    if (c.T >= 3) h.slot_mapping[1] = -1;
    cuda::g_row_regs.force(0);
    const Outputs loop = run_case(c, h, blocks, true, seed);
    cuda::g_row_regs.force(1);
    const int64_t before = cuda::row_regs_launches();
    const Outputs regs = run_case(c, h, blocks, true, seed);
    const bool took = cuda::row_regs_launches() > before;
    cuda::g_row_regs.force(-1);
    EXPECT_EQ(took, c.R <= 512) << "the register-row kernel ran where it applies, and only there";
    EXPECT_TRUE(same_bytes(regs.kva, loop.kva, "kva"));
    EXPECT_TRUE(same_bytes(regs.q, loop.q, "q"));
    EXPECT_TRUE(same_bytes(regs.cache, loop.cache, "cache"));
    ++seed;
  }
}

// A slot outside the cache is reported at the next synchronize, as store_kv reports it.
TEST(CudaMlaPrepare, OutOfRangeSlotIsReported) {
  DS_REQUIRE_GPU();
  const FusedOn fused_on;
  Backend& gpu = test::cuda_backend();
  PrepCase c;
  c.T = 3;
  const std::vector<test::StepSeq> seqs = seqs_for(3);
  test::HostStep h = test::make_step(seqs, c.block_size, 20, 7);
  h.slot_mapping[2] = 20 * c.block_size;  // one past the end
  const int64_t W = c.R + c.P;
  test::BackendTensor tkva =
      test::upload_floats(gpu, DType::F32, {3, W}, test::random_floats(size_t(3 * W), 1));
  test::BackendTensor tq = test::upload_floats(gpu, DType::F32, {3, c.H, c.P},
                                               test::random_floats(size_t(3 * c.H * c.P), 2));
  test::BackendTensor tnorm =
      test::upload_floats(gpu, DType::F32, {c.R}, std::vector<float>(size_t(c.R), 1.0f));
  test::KvSpec spec;
  spec.num_blocks = 20;
  spec.block_size = c.block_size;
  spec.head_dim = int(W);
  spec.latent = true;
  test::BackendKv kv = test::random_paged_kv(gpu, spec, 3);
  const test::BackendStep step = test::upload_step(gpu, h);
  MlaPrepareParams p;
  p.kva = tkva.view;
  p.norm = tnorm.view;
  p.q_rope = tq.view;
  p.rope = deepseek_rope(c);
  p.cache = kv.kv;
  p.kv_lora_rank = c.R;
  gpu.mla_prepare(p, step.meta);
  EXPECT_THROW(gpu.synchronize(), Error);
  gpu.synchronize();  // the report was consumed
}

}  // namespace
}  // namespace ds
