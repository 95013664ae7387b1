// CPU paged attention kernels: accuracy against float64 math for several head sizes, cache
// dtypes and GQA groups; bit-identical results across ISAs, thread counts and batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>

#include "backend/backend.h"
#include "backend/cpu/cpu_features.h"
#include "core/dtype.h"

namespace ds {
namespace {

struct Seq {
  int ctx;    // cached tokens after this step
  int n_new;  // tokens of this step (the last n_new of ctx)
};

// A paged cache holding random keys/values of some sequences, and this step's queries.
struct Problem {
  int heads, kv_heads, head_dim, block_size;
  DType dtype;
  std::vector<Seq> seqs;
  int max_blocks = 0, num_blocks = 0, num_tokens = 0;
  std::vector<std::vector<float>> keys, vals;  // per sequence [ctx, kv_heads, head_dim]
  std::vector<uint8_t> kc, vc;                 // cache bytes
  std::vector<int32_t> tables, query_start, context_lens;
  std::vector<float> q;  // [num_tokens, heads, head_dim]

  Problem(int h, int kvh, int d, int bs, DType dt, std::vector<Seq> ss, uint32_t seed)
      : heads(h), kv_heads(kvh), head_dim(d), block_size(bs), dtype(dt), seqs(std::move(ss)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (const Seq& s : seqs) max_blocks = std::max(max_blocks, (s.ctx + bs - 1) / bs);
    num_blocks = max_blocks * int(seqs.size()) + 3;
    // Blocks handed out in a scrambled order so tables are not contiguous.
    std::vector<int32_t> order(static_cast<size_t>(num_blocks));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    tables.assign(size_t(max_blocks) * seqs.size(), 0);
    const int64_t es = int64_t(dtype_info(dt).type_size), row = int64_t(kvh) * d;
    kc.assign(size_t(num_blocks * bs * row * es), 0);
    vc = kc;
    size_t next = 0;
    query_start.push_back(0);
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int ctx = seqs[s].ctx;
      for (int b = 0; b < (ctx + bs - 1) / bs; ++b)
        tables[s * size_t(max_blocks) + size_t(b)] = order[next++];
      keys.emplace_back(size_t(ctx * row));
      vals.emplace_back(size_t(ctx * row));
      for (int j = 0; j < ctx; ++j) {
        const int64_t slot = int64_t(tables[s * size_t(max_blocks) + size_t(j / bs)]) * bs + j % bs;
        for (int64_t i = 0; i < row; ++i) {
          // Keep what the cache holds, so the reference sees the same rounded values.
          keys[s][size_t(j * row + i)] = put(kc, slot * row + i, nd(rng));
          vals[s][size_t(j * row + i)] = put(vc, slot * row + i, nd(rng));
        }
      }
      num_tokens += seqs[s].n_new;
      query_start.push_back(num_tokens);
      context_lens.push_back(ctx);
    }
    q.resize(size_t(num_tokens * h * d));
    for (auto& x : q) x = nd(rng);
  }

  float put(std::vector<uint8_t>& cache, int64_t elem, float v) const {
    if (dtype == DType::F32) {
      std::memcpy(&cache[size_t(elem * 4)], &v, 4);
      return v;
    }
    const uint16_t h = dtype == DType::F16 ? f32_to_fp16(v) : f32_to_bf16(v);
    std::memcpy(&cache[size_t(elem * 2)], &h, 2);
    return dtype == DType::F16 ? fp16_to_f32(h) : bf16_to_f32(h);
  }

  // Runs the backend's attention and returns out [num_tokens, heads, head_dim].
  std::vector<float> run(Backend& be, float scale) {
    AttentionMeta meta;
    meta.num_seqs = int(seqs.size());
    meta.num_tokens = num_tokens;
    meta.query_start = query_start.data();
    meta.context_lens = context_lens.data();
    meta.block_tables = tables.data();
    meta.max_blocks_per_seq = max_blocks;
    AttentionParams p;
    std::vector<float> out(q.size(), NAN);
    p.q = TensorView::contiguous(q.data(), DType::F32, {num_tokens, heads, head_dim});
    p.out = TensorView::contiguous(out.data(), DType::F32, {num_tokens, heads, head_dim});
    p.kv = {kc.data(), vc.data(), dtype, num_blocks, block_size, kv_heads, head_dim};
    p.scale = scale;
    be.attention(p, meta);
    return out;
  }

  // Float64 attention of one output row (token t of sequence s, head h).
  std::vector<double> reference(int s, int i, int h, double scale) const {
    const int t = query_start[size_t(s)] + i, d = head_dim;
    const int kvh = h / (heads / kv_heads), pos = seqs[size_t(s)].ctx - seqs[size_t(s)].n_new + i;
    const auto& K = keys[size_t(s)];
    const auto& V = vals[size_t(s)];
    std::vector<double> w(size_t(pos + 1)), o(size_t(d), 0.0);
    double mx = -1e300, sum = 0;
    for (int j = 0; j <= pos; ++j) {
      double dot = 0;
      for (int k = 0; k < d; ++k)
        dot += double(q[size_t((t * heads + h) * d + k)]) * K[size_t((j * kv_heads + kvh) * d + k)];
      w[size_t(j)] = dot * scale;
      mx = std::max(mx, w[size_t(j)]);
    }
    for (auto& x : w) sum += x = std::exp(x - mx);
    for (int j = 0; j <= pos; ++j)
      for (int k = 0; k < d; ++k)
        o[size_t(k)] += w[size_t(j)] * V[size_t((j * kv_heads + kvh) * d + k)];
    for (auto& x : o) x /= sum;
    return o;
  }
};

std::unique_ptr<Backend> backend(int threads, const char* isa = "auto") {
  BackendOptions o;
  o.threads = threads;
  o.isa = isa;
  return make_cpu_backend(o);
}

void expect_matches_reference(Problem& pr, float scale) {
  auto be = backend(2);
  const auto out = pr.run(*be, scale);
  for (size_t s = 0; s < pr.seqs.size(); ++s)
    for (int i = 0; i < pr.seqs[s].n_new; ++i)
      for (int h = 0; h < pr.heads; ++h) {
        const auto ref = pr.reference(int(s), i, h, scale);
        const int t = pr.query_start[s] + i;
        for (int k = 0; k < pr.head_dim; ++k)
          ASSERT_NEAR(out[size_t((t * pr.heads + h) * pr.head_dim + k)], ref[size_t(k)], 2e-5)
              << "seq " << s << " token " << i << " head " << h << " dim " << k;
      }
}

TEST(CpuAttention, MatchesFloat64AcrossHeadSizesAndDtypes) {
  struct Config {
    int heads, kv_heads, head_dim;
    DType dtype;
    int block_size;
  };
  const Config configs[] = {
      {9, 3, 64, DType::F32, 16},  {9, 3, 64, DType::F16, 16}, {4, 2, 128, DType::F32, 16},
      {4, 1, 128, DType::BF16, 8}, {6, 2, 80, DType::F32, 16}, {3, 3, 17, DType::F16, 4},
      {6, 2, 5, DType::F32, 32},
  };
  uint32_t seed = 100;
  for (const Config& c : configs) {
    SCOPED_TRACE("head_dim " + std::to_string(c.head_dim) + " dtype " +
                 std::string(dtype_info(c.dtype).name));
    // A decode, a 17-token prefill chunk on top of a cache, and a fresh 1-token prompt.
    Problem pr(c.heads, c.kv_heads, c.head_dim, c.block_size, c.dtype, {{40, 1}, {53, 17}, {1, 1}},
               seed++);
    expect_matches_reference(pr, 1.0f / std::sqrt(float(c.head_dim)));
  }
}

TEST(CpuAttention, LongContextWithLargeScores) {
  // Scores spread widely, so many softmax weights underflow; 300 keys span several blocks.
  Problem pr(6, 2, 64, 16, DType::F32, {{300, 1}, {300, 3}}, 7);
  for (auto& x : pr.q) x *= 4.0f;
  expect_matches_reference(pr, 0.5f);
}

TEST(CpuAttention, SameBitsOnEveryIsaAndThreadCount) {
  struct Case {
    int hd;
    DType dtype;
  };
  for (const Case c :
       {Case{64, DType::F32}, Case{128, DType::F32}, Case{80, DType::F32}, Case{17, DType::F32},
        Case{64, DType::F16}, Case{80, DType::F16}, Case{64, DType::BF16}, Case{17, DType::BF16}}) {
    const int hd = c.hd;
    Problem pr(9, 3, hd, 16, c.dtype, {{70, 1}, {33, 33}, {90, 5}}, 11);
    const auto base = pr.run(*backend(1, "scalar"), 0.125f);
    for (const char* isa : {"scalar", "avx2", "avx512-vnni"}) {
      if (!cpu::isa_supported(*cpu::isa_from_name(isa))) continue;
      for (int threads : {1, 2, 3}) {
        const auto out = pr.run(*backend(threads, isa), 0.125f);
        EXPECT_EQ(0, std::memcmp(out.data(), base.data(), out.size() * sizeof(float)))
            << "head_dim " << hd << " " << dtype_info(c.dtype).name << " isa " << isa << " threads "
            << threads;
      }
    }
  }
}

TEST(CpuAttention, SequenceAloneEqualsSequenceInBatch) {
  const int heads = 9, kvh = 3, hd = 64;
  // Same cache contents (same seed) for sequence 0; the batch adds two more sequences.
  Problem alone(heads, kvh, hd, 16, DType::F16, {{45, 1}}, 21);
  Problem batch(heads, kvh, hd, 16, DType::F16, {{45, 1}, {120, 24}, {8, 8}}, 22);
  // Copy sequence 0's queries and cache rows into the batched problem.
  const int64_t row = kvh * hd;
  for (int j = 0; j < 45; ++j) {
    const int64_t sa = int64_t(alone.tables[size_t(j / 16)]) * 16 + j % 16;
    const int64_t sb = int64_t(batch.tables[size_t(j / 16)]) * 16 + j % 16;
    std::memcpy(&batch.kc[size_t(sb * row * 2)], &alone.kc[size_t(sa * row * 2)], size_t(row * 2));
    std::memcpy(&batch.vc[size_t(sb * row * 2)], &alone.vc[size_t(sa * row * 2)], size_t(row * 2));
  }
  std::copy_n(alone.q.begin(), heads * hd, batch.q.begin());
  for (int threads : {1, 2, 4}) {
    auto be = backend(threads);
    const auto a = alone.run(*be, 0.125f), b = batch.run(*be, 0.125f);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), size_t(heads * hd) * sizeof(float)))
        << "threads " << threads;
  }
}

// store_kv writes f32_to_fp16 / f32_to_bf16 of every value on every ISA: ties, subnormals,
// overflow to infinity and values that round up into the next binade included.
TEST(CpuAttention, StoreKvRoundsLikeTheScalarConversions) {
  const int kvh = 3, hd = 40, T = 5;  // 40: two 16-lane vectors and a tail
  std::vector<float> k(size_t(T * kvh * hd)), v(k.size());
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const float specials[] = {0.0f,        -0.0f,      65504.0f,
                            65520.0f,    -70000.0f,  6e-8f,
                            3e-8f,       -1e-5f,     1.0009765625f + 0.00048828125f,
                            1e-40f,      3.4e38f,    -2.5e-39f,
                            1.00390625f, 0.99999994f};
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = i < std::size(specials) ? specials[i] : nd(rng) * 100.0f;
    v[i] = i < std::size(specials) ? -specials[i] : nd(rng) * 1e-4f;
  }
  std::vector<int32_t> slots = {3, 0, 7, 1, 6};
  AttentionMeta meta;
  meta.num_tokens = T;
  meta.slot_mapping = slots.data();
  for (DType dt : {DType::F16, DType::BF16}) {
    for (const char* isa : {"scalar", "avx2", "avx512-vnni"}) {
      if (!cpu::isa_supported(*cpu::isa_from_name(isa))) continue;
      std::vector<uint16_t> kc(size_t(8 * kvh * hd), 0xdead), vc = kc;
      const PagedKv kv{kc.data(), vc.data(), dt, 1, 8, kvh, hd};
      backend(2, isa)->store_kv(TensorView::contiguous(k.data(), DType::F32, {T, kvh, hd}),
                                TensorView::contiguous(v.data(), DType::F32, {T, kvh, hd}), kv,
                                meta);
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < kvh * hd; ++i) {
          const size_t src = size_t(t * kvh * hd + i),
                       dst = size_t(slots[size_t(t)] * kvh * hd + i);
          auto want = [&](float x) { return dt == DType::F16 ? f32_to_fp16(x) : f32_to_bf16(x); };
          ASSERT_EQ(kc[dst], want(k[src])) << isa << " k " << k[src];
          ASSERT_EQ(vc[dst], want(v[src])) << isa << " v " << v[src];
        }
    }
  }
}

}  // namespace
}  // namespace ds
