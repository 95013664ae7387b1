// Backend::mla_prepare's base version (what the CPU runs): the same bits as the model's former
// four ops (rms_norm of the latent, rope of q and of the rope key, store_kv of the row) on
// strided views, the values a float64 reference gives, and ProfilingBackend timing it as one op.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/kv_fp8.h"
#include "backend/profiling_backend.h"
#include "core/dtype.h"

namespace ds {
namespace {

constexpr int kR = 96, kP = 16, kNope = 24, kLead = 5, kPad = 3, kBlock = 4, kBlocks = 9;

std::unique_ptr<Backend> cpu() {
  BackendOptions o;
  o.threads = 2;
  return make_cpu_backend(o);
}

TensorView view(void* data, std::initializer_list<int64_t> dims,
                std::initializer_list<int64_t> strides_elems) {
  TensorView v;
  v.data = data;
  v.dtype = DType::F32;
  v.ndim = int(dims.size());
  int i = 0;
  for (int64_t d : dims) v.shape[size_t(i++)] = d;
  i = 0;
  for (int64_t s : strides_elems) v.stride[size_t(i++)] = s * 4;
  return v;
}

// One layer's buffers: kva is columns [kLead, kLead + R + P) of a [T, kLead + R + P + kPad]
// buffer (the fused q_a / kv_a output), q_rope the last P dims of each [nope + P] q head.
struct Inputs {
  int T, H;
  DType cache_dtype;
  std::vector<float> kva_buf, q_buf, norm;
  std::vector<uint8_t> cache;
  std::vector<float> scales;  // FP8
  std::vector<int32_t> slots, positions;
  RopeParams rope;

  Inputs(int tokens, int heads, DType dt, RopeStyle style, uint32_t seed)
      : T(tokens), H(heads), cache_dtype(dt) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> u(0.9f, 1.1f);
    kva_buf.resize(size_t(T * (kLead + kR + kP + kPad)));
    for (auto& x : kva_buf) x = 2.0f * nd(rng);
    q_buf.resize(size_t(T * H * (kNope + kP)));
    for (auto& x : q_buf) x = nd(rng);
    norm.resize(kR);
    for (auto& x : norm) x = u(rng);
    const int64_t slots_total = int64_t(kBlocks) * kBlock;
    cache.assign(size_t(slots_total * (kR + kP) * dtype_info(dt).type_size), 0x5a);
    scales.assign(size_t(slots_total * 2), 7.0f);
    // Tokens go to scattered slots of permuted blocks; token 1 is padding (slot -1).
    const int32_t block_order[] = {6, 2, 8, 0, 5};
    for (int t = 0; t < T; ++t) {
      slots.push_back(block_order[t / kBlock] * kBlock + (t * 3) % kBlock);
      positions.push_back(100 + 37 * t);
    }
    if (T > 1) slots[1] = -1;
    rope.style = style;
    rope.rotary_dim = kP;
    rope.yarn_factor = 40.0f;
    rope.yarn_original_max_position = 4096;
    rope.attn_factor = 0.875f;
  }
  TensorView kva() {
    return view(kva_buf.data() + kLead, {T, kR + kP}, {kLead + kR + kP + kPad, 1});
  }
  TensorView q_rope() {
    return view(q_buf.data() + kNope, {T, H, kP}, {H * (kNope + kP), kNope + kP, 1});
  }
  PagedKv kv() {
    PagedKv p;
    p.k = cache.data();
    p.dtype = cache_dtype;
    p.num_blocks = kBlocks;
    p.block_size = kBlock;
    p.kv_heads = 1;
    p.head_dim = kR + kP;
    if (cache_dtype == DType::F8_E4M3) {
      p.k_scale = scales.data();
      p.rope_split = kR;
    }
    return p;
  }
  AttentionMeta meta() {
    AttentionMeta m;
    m.num_seqs = 1;
    m.num_tokens = T;
    m.slot_mapping = slots.data();
    m.positions = positions.data();
    return m;
  }
  MlaPrepareParams params() {
    MlaPrepareParams p;
    p.kva = kva();
    p.norm = view(norm.data(), {kR}, {1});
    p.eps = 1e-6f;
    p.q_rope = q_rope();
    p.rope = rope;
    p.cache = kv();
    p.kv_lora_rank = kR;
    return p;
  }
  // The model's former sequence, on views built as deepseek_v2.cpp built them.
  void four_ops(Backend& b) {
    const int64_t rs = kLead + kR + kP + kPad;
    TensorView ckv = view(kva_buf.data() + kLead, {T, kR}, {rs, 1});
    b.rms_norm(ckv, view(norm.data(), {kR}, {1}), 1e-6f, ckv);
    b.rope(q_rope(), positions.data(), rope);
    b.rope(view(kva_buf.data() + kLead + kR, {T, 1, kP}, {rs, kP, 1}), positions.data(), rope);
    b.store_kv(view(kva_buf.data() + kLead, {T, 1, kR + kP}, {rs, kR + kP, 1}), TensorView{}, kv(),
               meta());
  }
  bool same(const Inputs& o) const {
    return kva_buf == o.kva_buf && q_buf == o.q_buf && cache == o.cache && scales == o.scales;
  }
};

TEST(MlaPrepare, BaseEqualsTheFourOpsBitForBit) {
  auto be = cpu();
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3})
    for (RopeStyle st : {RopeStyle::Adjacent, RopeStyle::RotateHalf})
      for (int T : {1, 3, 17})
        for (int H : {1, 5}) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " style " + std::to_string(int(st)) + " T " +
                       std::to_string(T) + " H " + std::to_string(H));
          Inputs a(T, H, dt, st, uint32_t(T * 31 + H)), b(T, H, dt, st, uint32_t(T * 31 + H));
          ASSERT_TRUE(a.same(b));
          be->mla_prepare(a.params(), a.meta());
          b.four_ops(*be);
          EXPECT_EQ(a.kva_buf, b.kva_buf);
          EXPECT_EQ(a.q_buf, b.q_buf);
          EXPECT_TRUE(a.cache == b.cache) << "cache bytes differ";
          EXPECT_EQ(a.scales, b.scales);
        }
}

// Independent of the four ops: float64 norm and rotation, and the cache holding the result.
TEST(MlaPrepare, MatchesFloat64AndStoresTheRow) {
  auto be = cpu();
  const int T = 9, H = 3;
  for (RopeStyle st : {RopeStyle::Adjacent, RopeStyle::RotateHalf}) {
    Inputs in(T, H, DType::F32, st, 5), orig(T, H, DType::F32, st, 5);
    be->mla_prepare(in.params(), in.meta());
    const std::vector<float> inv = rope_inv_freq(in.rope);
    const int64_t rs = kLead + kR + kP + kPad;
    auto rotated = [&](const float* x, int i, int t) {  // dim i of a rotated P-vector
      const int half = kP / 2;
      const bool adj = st == RopeStyle::Adjacent;
      const int pair = adj ? i / 2 : i % half;
      const int a = adj ? 2 * pair : pair, b = adj ? 2 * pair + 1 : pair + half;
      const double ang = double(in.positions[size_t(t)]) * inv[size_t(pair)];
      const double c = std::cos(ang) * 0.875, s = std::sin(ang) * 0.875;
      return i == a ? x[a] * c - x[b] * s : x[a] * s + x[b] * c;
    };
    for (int t = 0; t < T; ++t) {
      const float* x0 = orig.kva_buf.data() + t * rs + kLead;
      const float* x1 = in.kva_buf.data() + t * rs + kLead;
      double ss = 0;
      for (int i = 0; i < kR; ++i) ss += double(x0[i]) * x0[i];
      const double inv_rms = 1.0 / std::sqrt(ss / kR + 1e-6);
      for (int i = 0; i < kR; ++i)
        ASSERT_NEAR(x1[i], x0[i] * inv_rms * in.norm[size_t(i)], 2e-5) << "t " << t << " i " << i;
      for (int i = 0; i < kP; ++i)
        ASSERT_NEAR(x1[kR + i], rotated(x0 + kR, i, t), 2e-4) << "t " << t << " k dim " << i;
      for (int i = 0; i < kLead; ++i) ASSERT_EQ(x1[i - kLead], x0[i - kLead]);
      for (int i = 0; i < kPad; ++i) ASSERT_EQ(x1[kR + kP + i], x0[kR + kP + i]);
      for (int h = 0; h < H; ++h) {
        const size_t q0 = size_t((t * H + h) * (kNope + kP));
        for (int i = 0; i < kNope; ++i)
          ASSERT_EQ(in.q_buf[q0 + size_t(i)], orig.q_buf[q0 + size_t(i)]);
        for (int i = 0; i < kP; ++i)
          ASSERT_NEAR(in.q_buf[q0 + size_t(kNope + i)], rotated(&orig.q_buf[q0 + kNope], i, t),
                      2e-4);
      }
      const int32_t slot = in.slots[size_t(t)];
      if (slot >= 0) {
        ASSERT_EQ(0, std::memcmp(in.cache.data() + size_t(slot) * (kR + kP) * 4, x1, (kR + kP) * 4))
            << "token " << t;
      }
    }
    // Slots no token maps to keep their contents (the padding token stored nothing).
    std::vector<bool> used(size_t(kBlocks * kBlock), false);
    for (int32_t s : in.slots)
      if (s >= 0) used[size_t(s)] = true;
    for (size_t s = 0; s < used.size(); ++s)
      if (!used[s]) {
        ASSERT_EQ(0, std::memcmp(in.cache.data() + s * (kR + kP) * 4,
                                 orig.cache.data() + s * (kR + kP) * 4, (kR + kP) * 4))
            << "slot " << s;
      }
  }
}

TEST(MlaPrepare, ProfilingBackendTimesItAsOneOp) {
  auto be = cpu();
  ProfilingBackend prof(*be);
  Inputs a(3, 2, DType::BF16, RopeStyle::RotateHalf, 3),
      b(3, 2, DType::BF16, RopeStyle::RotateHalf, 3);
  std::vector<float> table(8, 1.0f), emb(4);
  const int32_t id = 1;
  prof.embed(view(table.data(), {2, 4}, {4, 1}), &id, 1, view(emb.data(), {1, 4}, {4, 1}));
  prof.mla_prepare(a.params(), a.meta());
  b.four_ops(*be);
  EXPECT_TRUE(a.same(b));
  const OpProfile p = prof.profile();
  ASSERT_TRUE(p.step);
  std::map<std::string, double> kinds;
  for (const auto& r : p.step->kinds) kinds[r.kind] = r.calls;
  EXPECT_EQ(kinds["mla_prepare"], 1);
  EXPECT_EQ(kinds.count("rms_norm") + kinds.count("rope") + kinds.count("store_kv"), 0u);
  bool labeled = false;
  for (const auto& r : p.step->ops)
    labeled |= r.label == "mla_prepare [3,112] q_rope [3,2,16] BF16";
  EXPECT_TRUE(labeled);
}

}  // namespace
}  // namespace ds
