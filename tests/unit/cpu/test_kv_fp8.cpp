// FP8 KV cache on the CPU backend (--kv-cache-dtype fp8): store_kv writes e4m3 codes and
// per-token scales (split at kv_lora_rank for MLA); attention and mla_attention over that cache
// equal the same ops over an F32 cache holding the dequantized rows bit for bit, and stay
// within FP8 tolerance of the exact F32 cache. Shapes: contexts 1, 7, 97, 1000, block sizes 1
// and 16, decode, whole prompts and chunks after a cached prefix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/backend.h"
#include "backend/kv_fp8.h"

namespace ds {
namespace {

struct Seq {
  int ctx;    // cached tokens after this step
  int n_new;  // tokens of this step (the last n_new of ctx)
};

// A cache of one layer in one dtype, in host memory (the CPU backend's memory).
struct HostKv {
  std::vector<uint8_t> k, v;
  std::vector<float> ks, vs;
  PagedKv kv;
};

HostKv make_kv(DType dtype, int num_blocks, int block_size, int kv_heads, int head_dim, bool latent,
               int rope_split) {
  HostKv h;
  const int64_t slots = int64_t(num_blocks) * block_size;
  h.k.assign(dtype_bytes(dtype, slots * kv_heads * head_dim), 0xee);
  if (!latent) h.v = h.k;
  h.kv.dtype = dtype;
  h.kv.num_blocks = num_blocks;
  h.kv.block_size = block_size;
  h.kv.kv_heads = kv_heads;
  h.kv.head_dim = head_dim;
  h.kv.k = h.k.data();
  h.kv.v = latent ? nullptr : h.v.data();
  if (dtype == DType::F8_E4M3) {
    h.kv.rope_split = rope_split;
    h.ks.assign(size_t(slots * h.kv.k_scale_parts()), -1.0f);
    h.kv.k_scale = h.ks.data();
    if (!latent) {
      h.vs.assign(size_t(slots * kv_heads), -1.0f);
      h.kv.v_scale = h.vs.data();
    }
  }
  return h;
}

// F32 copy of an FP8 cache: every element as kvfp8::dequant gives it.
HostKv dequantized(const HostKv& f) {
  const PagedKv& q = f.kv;
  HostKv d =
      make_kv(DType::F32, q.num_blocks, q.block_size, q.kv_heads, q.head_dim, q.v == nullptr, 0);
  const int64_t slots = int64_t(q.num_blocks) * q.block_size;
  for (int64_t s = 0; s < slots; ++s)
    for (int h = 0; h < q.kv_heads; ++h)
      for (int i = 0; i < q.head_dim; ++i) {
        const int64_t e = (s * q.kv_heads + h) * q.head_dim + i;
        const float k = kvfp8::dequant(f.k[size_t(e)], f.ks[size_t(q.k_scale_index(s, h, i))]);
        std::memcpy(&d.k[size_t(e) * 4], &k, 4);
        if (q.v) {
          const float v = kvfp8::dequant(f.v[size_t(e)], f.vs[size_t(s * q.kv_heads + h)]);
          std::memcpy(&d.v[size_t(e) * 4], &v, 4);
        }
      }
  return d;
}

// Sequences in shuffled blocks, their keys / values (rows of every cached position) and
// this step's queries.
struct Problem {
  int heads, kv_heads, head_dim, block_size, rope;  // rope > 0: MLA with R = head_dim - rope
  std::vector<Seq> seqs;
  int max_blocks = 0, num_blocks = 0, num_tokens = 0, all_tokens = 0;
  std::vector<int32_t> tables, query_start, context_lens, slots_all;
  std::vector<float> k_all, v_all;  // [all_tokens, kv_heads, head_dim]: every cached row
  std::vector<float> q;             // [num_tokens, heads, head_dim]

  Problem(int h, int kvh, int d, int bs, int rp, std::vector<Seq> ss, uint32_t seed)
      : heads(h), kv_heads(kvh), head_dim(d), block_size(bs), rope(rp), seqs(std::move(ss)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (const Seq& s : seqs) max_blocks = std::max(max_blocks, (s.ctx + bs - 1) / bs);
    num_blocks = max_blocks * int(seqs.size()) + 3;
    std::vector<int32_t> order(static_cast<size_t>(num_blocks));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    tables.assign(size_t(max_blocks) * seqs.size(), 0);
    size_t next = 0;
    query_start.push_back(0);
    for (size_t s = 0; s < seqs.size(); ++s) {
      for (int b = 0; b < (seqs[s].ctx + bs - 1) / bs; ++b)
        tables[s * size_t(max_blocks) + size_t(b)] = order[next++];
      for (int j = 0; j < seqs[s].ctx; ++j)
        slots_all.push_back(tables[s * size_t(max_blocks) + size_t(j / bs)] * bs + j % bs);
      num_tokens += seqs[s].n_new;
      query_start.push_back(num_tokens);
      context_lens.push_back(seqs[s].ctx);
    }
    all_tokens = int(slots_all.size());
    // Rows with a spread of magnitudes (some outliers) so scales differ row to row; for MLA
    // the rope part is much smaller than the latent, which its own scale must keep accurate.
    const size_t row = size_t(kvh) * size_t(d);
    k_all.resize(size_t(all_tokens) * row);
    v_all.resize(k_all.size());
    for (size_t t = 0; t < size_t(all_tokens); ++t) {
      const float mag = std::exp(0.3f * nd(rng));
      for (size_t i = 0; i < row; ++i) {
        const bool rope_dim = rope > 0 && int(i) >= d - rope;
        k_all[t * row + i] = nd(rng) * mag * (rope_dim ? 0.01f : 1.0f) * (i % 37 == 5 ? 6 : 1);
        v_all[t * row + i] = nd(rng) * mag;
      }
    }
    q.resize(size_t(num_tokens) * size_t(h) * size_t(d));
    for (auto& x : q) x = nd(rng);
    if (rope > 0)  // MLA queries: the rope part is scaled up as the model's q_pe would be
      for (size_t i = 0; i < q.size(); ++i)
        if (int(i % size_t(d)) >= d - rope) q[i] *= 30.0f;
  }

  AttentionMeta step_meta() const {
    AttentionMeta m;
    m.num_seqs = int(seqs.size());
    m.num_tokens = num_tokens;
    m.query_start = query_start.data();
    m.context_lens = context_lens.data();
    m.block_tables = tables.data();
    m.max_blocks_per_seq = max_blocks;
    return m;
  }

  // Stores every cached row (plus a padding token with slot -1) into kv.
  void fill(Backend& be, const HostKv& kv) {
    std::vector<int32_t> slots = slots_all;
    slots.push_back(-1);
    const int64_t n = all_tokens + 1;
    std::vector<float> k = k_all, v = v_all;
    k.resize(size_t(n) * size_t(kv_heads * head_dim), 1e6f);
    v.resize(k.size(), 1e6f);
    AttentionMeta m;
    m.num_tokens = int(n);
    m.slot_mapping = slots.data();
    be.store_kv(TensorView::contiguous(k.data(), DType::F32, {n, kv_heads, head_dim}),
                TensorView::contiguous(v.data(), DType::F32, {n, kv_heads, head_dim}), kv.kv, m);
  }

  std::vector<float> run(Backend& be, const HostKv& kv) const {
    const int64_t T = num_tokens, H = heads;
    std::vector<float> out(size_t(T * H * (rope > 0 ? head_dim - rope : head_dim)), NAN);
    if (rope == 0) {
      AttentionParams p;
      p.q = TensorView::contiguous(const_cast<float*>(q.data()), DType::F32, {T, H, head_dim});
      p.out = TensorView::contiguous(out.data(), DType::F32, {T, H, head_dim});
      p.kv = kv.kv;
      p.scale = 1.0f / std::sqrt(float(head_dim));
      be.attention(p, step_meta());
      return out;
    }
    const int64_t R = head_dim - rope, P = rope;
    std::vector<float> ql(size_t(T * H * R)), qr(size_t(T * H * P));
    for (int64_t r = 0; r < T * H; ++r) {
      std::copy_n(q.begin() + r * head_dim, R, ql.begin() + r * R);
      std::copy_n(q.begin() + r * head_dim + R, P, qr.begin() + r * P);
    }
    MlaAttentionParams p;
    p.q_latent = TensorView::contiguous(ql.data(), DType::F32, {T, H, R});
    p.q_rope = TensorView::contiguous(qr.data(), DType::F32, {T, H, P});
    p.out = TensorView::contiguous(out.data(), DType::F32, {T, H, R});
    p.cache = kv.kv;
    p.kv_lora_rank = int(R);
    p.scale = 1.0f / std::sqrt(float(head_dim));
    be.mla_attention(p, step_meta());
    return out;
  }
};

struct Shape {
  int heads, kv_heads, head_dim, block_size, rope;
};

// Contexts 1, 7, 97 and 1000: decodes, whole prompts and chunks after a cached prefix.
std::vector<Seq> awkward_seqs() {
  return {{1, 1}, {7, 7}, {97, 97}, {1000, 1}, {97, 30}, {1000, 37}};
}

std::vector<Shape> shapes() {
  return {{6, 2, 64, 16, 0}, {3, 3, 80, 1, 0},   {4, 1, 128, 16, 0},
          {5, 1, 72, 16, 8}, {3, 1, 576, 1, 64}, {16, 1, 576, 16, 64}};
}

class KvFp8 : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend({2});
};

TEST_F(KvFp8, StoreWritesCodesAndPerTokenScales) {
  for (const Shape& s : shapes()) {
    SCOPED_TRACE("heads " + std::to_string(s.heads) + " hd " + std::to_string(s.head_dim));
    Problem pr(s.heads, s.kv_heads, s.head_dim, s.block_size, s.rope, awkward_seqs(), 7);
    const int split = s.rope > 0 ? s.head_dim - s.rope : 0;
    HostKv f8 = make_kv(DType::F8_E4M3, pr.num_blocks, s.block_size, s.kv_heads, s.head_dim,
                        s.rope > 0, split);
    pr.fill(*be, f8);
    const PagedKv& kv = f8.kv;
    const size_t row = size_t(s.kv_heads) * size_t(s.head_dim);
    double worst = 0;  // largest error relative to the part's absmax
    for (size_t t = 0; t < size_t(pr.all_tokens); ++t) {
      const int64_t slot = pr.slots_all[t];
      for (int h = 0; h < s.kv_heads; ++h) {
        const float* x = &pr.k_all[t * row + size_t(h) * size_t(s.head_dim)];
        std::vector<uint8_t> codes(size_t(s.head_dim));
        float sc[2] = {0, 0};
        kvfp8::quantize_head(x, s.head_dim, split, codes.data(), sc);
        const uint8_t* got = &f8.k[size_t(slot) * row + size_t(h) * size_t(s.head_dim)];
        ASSERT_EQ(0, std::memcmp(got, codes.data(), codes.size())) << "token " << t;
        for (int part = 0; part < (split > 0 ? 2 : 1); ++part) {
          const int i0 = part == 0 ? 0 : split, i1 = split > 0 && part == 0 ? split : s.head_dim;
          float amax = 0;
          for (int i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(x[i]));
          const float stored = f8.ks[size_t(kv.k_scale_index(slot, h, i0))];
          ASSERT_EQ(stored, sc[part]);
          EXPECT_FLOAT_EQ(stored, amax / 448.0f);
          for (int i = i0; i < i1; ++i)
            worst = std::max(
                worst, std::fabs(double(kvfp8::dequant(got[i], stored)) - x[i]) / double(amax));
        }
        if (kv.v) {
          const uint8_t* gv = &f8.v[size_t(slot) * row + size_t(h) * size_t(s.head_dim)];
          const float* y = &pr.v_all[t * row + size_t(h) * size_t(s.head_dim)];
          kvfp8::quantize_head(y, s.head_dim, 0, codes.data(), sc);
          ASSERT_EQ(0, std::memcmp(gv, codes.data(), codes.size()));
          ASSERT_EQ(f8.vs[size_t(slot) * size_t(s.kv_heads) + size_t(h)], sc[0]);
        }
      }
    }
    // e4m3 keeps 3 mantissa bits: at most half a step, 1/16 of a value near the absmax.
    EXPECT_LE(worst, 1.0 / 16 + 1e-6);
    EXPECT_GT(worst, 1e-3);
    // Slots no token maps to (the padding token, unused blocks) keep their fill.
    size_t untouched = 0;
    for (float x : f8.ks) untouched += x == -1.0f;
    EXPECT_EQ(untouched, (size_t(pr.num_blocks * s.block_size) - size_t(pr.all_tokens)) *
                             size_t(kv.k_scale_parts()));
  }
}

TEST_F(KvFp8, AttentionEqualsTheDequantizedF32Cache) {
  uint32_t seed = 100;
  for (const Shape& s : shapes()) {
    SCOPED_TRACE("heads " + std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) + " hd " +
                 std::to_string(s.head_dim) + " rope " + std::to_string(s.rope) + " bs " +
                 std::to_string(s.block_size));
    Problem pr(s.heads, s.kv_heads, s.head_dim, s.block_size, s.rope, awkward_seqs(), seed++);
    const int split = s.rope > 0 ? s.head_dim - s.rope : 0;
    HostKv f8 = make_kv(DType::F8_E4M3, pr.num_blocks, s.block_size, s.kv_heads, s.head_dim,
                        s.rope > 0, split);
    HostKv f32 =
        make_kv(DType::F32, pr.num_blocks, s.block_size, s.kv_heads, s.head_dim, s.rope > 0, 0);
    pr.fill(*be, f8);
    pr.fill(*be, f32);
    const HostKv deq = dequantized(f8);
    const std::vector<float> got = pr.run(*be, f8), same = pr.run(*be, deq),
                             exact = pr.run(*be, f32);
    ASSERT_EQ(got.size(), same.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], same[i]) << "element " << i;
    // Against the unquantized cache: FP8 error, averaged by the softmax and the value sum.
    double err2 = 0, ref2 = 0, worst = 0, peak = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = double(got[i]) - exact[i];
      err2 += d * d;
      ref2 += double(exact[i]) * exact[i];
      worst = std::max(worst, std::fabs(d));
      peak = std::max(peak, std::fabs(double(exact[i])));
    }
    const double rel_rms = std::sqrt(err2 / ref2);
    EXPECT_LT(rel_rms, 0.06);  // measured 0.018 .. 0.040 on these shapes
    EXPECT_LT(worst, 0.15 * peak);
    EXPECT_GT(rel_rms, 1e-4);  // the cache really is 8-bit
  }
}

TEST_F(KvFp8, ScalesArePerTokenAndPart) {
  // One token of huge latent values must not cost another token, or the rope part, accuracy.
  Problem pr(2, 1, 80, 16, 16, {{3, 3}}, 5);
  for (int i = 0; i < 64; ++i) pr.k_all[size_t(i)] *= 1000.0f;  // token 0's latent
  HostKv f8 = make_kv(DType::F8_E4M3, pr.num_blocks, 16, 1, 80, true, 64);
  pr.fill(*be, f8);
  const HostKv deq = dequantized(f8);
  for (int t = 0; t < 3; ++t)
    for (int i = 0; i < 80; ++i) {
      const float x = pr.k_all[size_t(t * 80 + i)];
      float amax = 0;
      for (int j = i < 64 ? 0 : 64; j < (i < 64 ? 64 : 80); ++j)
        amax = std::max(amax, std::fabs(pr.k_all[size_t(t * 80 + j)]));
      float y;
      std::memcpy(&y, &deq.k[size_t(pr.slots_all[size_t(t)] * 80 + i) * 4], 4);
      EXPECT_LE(std::fabs(y - x), amax / 16) << "token " << t << " dim " << i;
    }
}

}  // namespace
}  // namespace ds
