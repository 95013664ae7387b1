// The CUDA paged attention kernel bodies run on the host: each CTA's threads become
// cooperative fibers (ucontext), __syncthreads / warp shuffles / ballots are barriers over
// them, and mma.sync is emulated from the PTX ISA's m16n8k16 fragment layouts. A fiber runs
// until its next barrier before the next one starts, so a missing barrier reads stale or
// poisoned (NaN) shared memory, and threads that skip a barrier others wait at deadlock and
// are reported. The launch logic (plan, split scratch, merge) is the launcher's own
// (attention_setup.h). Needs no GPU: these tests check indexing, masking, splitting and the
// fragment bookkeeping before any device time is spent.
#include <ucontext.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention_reference.h"
#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/attention_setup.h"
#include "backend/cuda/attention_simt.cuh"

namespace {

enum FiberState { kRunnable, kWaitBlock, kWaitWarp, kDone };

struct Fiber {
  ucontext_t ctx{};
  FiberState state = kRunnable;
  uint64_t gen = 0;
};

constexpr int kSlotWords = 12;  // per lane: up to a[4], b[2], c[4] of an mma
constexpr size_t kStackBytes = 128 * 1024;

// One simulated CTA.
struct SimBlock {
  int n = 0;
  std::vector<Fiber> fibers;
  ucontext_t sched{};
  int cur = 0;
  int block_arrived = 0;
  uint64_t block_gen = 0;
  std::vector<int> warp_arrived;
  std::vector<uint64_t> warp_gen;
  std::vector<std::array<uint32_t, 32 * kSlotWords>> slots;
  ds::cuda::kern::Thread base;
  std::function<void(const ds::cuda::kern::Thread&)> body;
};

SimBlock* g_block = nullptr;

void yield_as(FiberState s) {
  Fiber& f = g_block->fibers[size_t(g_block->cur)];
  f.state = s;
  swapcontext(&f.ctx, &g_block->sched);
}

void fiber_entry() {
  SimBlock& b = *g_block;
  ds::cuda::kern::Thread th = b.base;
  th.tid = b.cur;
  th.lane = b.cur & 31;
  th.warp = b.cur >> 5;
  b.body(th);
  b.fibers[size_t(th.tid)].state = kDone;
}

void warp_barrier() {
  SimBlock& b = *g_block;
  const size_t w = size_t(b.cur >> 5);
  if (++b.warp_arrived[w] == 32) {
    b.warp_arrived[w] = 0;
    ++b.warp_gen[w];
    return;
  }
  b.fibers[size_t(b.cur)].gen = b.warp_gen[w];
  yield_as(kWaitWarp);
}

// Every lane publishes `mine`; returns the words of all 32 lanes.
template <int N>
std::array<std::array<uint32_t, N>, 32> exchange(const std::array<uint32_t, N>& mine) {
  SimBlock& b = *g_block;
  auto& s = b.slots[size_t(b.cur >> 5)];
  const int lane = b.cur & 31;
  for (int k = 0; k < N; ++k) s[size_t(lane * kSlotWords + k)] = mine[size_t(k)];
  warp_barrier();
  std::array<std::array<uint32_t, N>, 32> all;
  for (int l = 0; l < 32; ++l)
    for (int k = 0; k < N; ++k) all[size_t(l)][size_t(k)] = s[size_t(l * kSlotWords + k)];
  warp_barrier();
  return all;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Context switches live in their own frames: locals of a caller of getcontext /
// swapcontext (which return twice) could otherwise be clobbered.
__attribute__((noinline)) void init_fiber(SimBlock& b, int i, std::vector<char>& stack) {
  Fiber& f = b.fibers[size_t(i)];
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack.data();
  f.ctx.uc_stack.ss_size = stack.size();
  f.ctx.uc_link = &b.sched;
  makecontext(&f.ctx, fiber_entry, 0);
}

__attribute__((noinline)) void resume(SimBlock& b, int i) {
  b.cur = i;
  swapcontext(&b.sched, &b.fibers[size_t(i)].ctx);
}

// Runs one CTA of n threads; returns an error message, empty when every thread finished.
std::string run_block(int n, const ds::cuda::kern::Thread& base,
                      std::function<void(const ds::cuda::kern::Thread&)> body) {
  static std::vector<std::vector<char>> stacks;
  if (stacks.size() < size_t(n)) stacks.resize(size_t(n), std::vector<char>(kStackBytes));
  SimBlock b;
  b.n = n;
  b.fibers.resize(size_t(n));
  b.warp_arrived.assign(size_t((n + 31) / 32), 0);
  b.warp_gen.assign(b.warp_arrived.size(), 0);
  b.slots.resize(b.warp_arrived.size());
  b.base = base;
  b.body = std::move(body);
  g_block = &b;
  for (int i = 0; i < n; ++i) init_fiber(b, i, stacks[size_t(i)]);
  std::string error;
  for (;;) {
    bool progressed = false, all_done = true;
    for (int i = 0; i < n; ++i) {
      Fiber& f = b.fibers[size_t(i)];
      if (f.state == kDone) continue;
      all_done = false;
      if (f.state == kWaitBlock && f.gen == b.block_gen) continue;
      if (f.state == kWaitWarp && f.gen == b.warp_gen[size_t(i >> 5)]) continue;
      f.state = kRunnable;
      resume(b, i);
      progressed = true;
    }
    if (all_done) break;
    if (!progressed) {
      error = "deadlock: some threads wait at a barrier the others never reach";
      break;
    }
  }
  g_block = nullptr;
  return error;
}

}  // namespace

// The device primitives of attention_port.cuh, for the fibers above.
namespace ds::cuda::kern {

void sync_block() {
  SimBlock& b = *g_block;
  if (++b.block_arrived == b.n) {
    b.block_arrived = 0;
    ++b.block_gen;
    return;
  }
  b.fibers[size_t(b.cur)].gen = b.block_gen;
  yield_as(kWaitBlock);
}

void sync_warp() {
  warp_barrier();
}

void check_aligned(const void* p, int bytes) {
  if (reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) != 0) {
    std::fprintf(stderr, "misaligned %d-byte access at %p\n", bytes, p);
    std::abort();
  }
}

float shfl_xor(float v, int mask) {
  const auto all = exchange<1>({bits_of(v)});
  return float_of(all[size_t((g_block->cur & 31) ^ mask)][0]);
}

int shfl_up_int(int v, int delta) {
  const auto all = exchange<1>({uint32_t(v)});
  const int lane = g_block->cur & 31;
  return lane >= delta ? int(all[size_t(lane - delta)][0]) : v;
}

int shfl_int(int v, int src) {
  const auto all = exchange<1>({uint32_t(v)});
  return int(all[size_t(src)][0]);
}

unsigned ballot(bool p) {
  const auto all = exchange<1>({p ? 1u : 0u});
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) m |= all[size_t(l)][0] << l;
  return m;
}

// m16n8k16 row.col BF16 -> F32 from the fragment layouts (g = lane / 4, t = lane % 4):
// A regs {A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]} (low half = lower column),
// B regs {B[2t..][g], B[2t+8..][g]}, C {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}.
void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const auto all = exchange<10>({a[0], a[1], a[2], a[3], b[0], b[1], bits_of(c[0]), bits_of(c[1]),
                                 bits_of(c[2]), bits_of(c[3])});
  float A[16][16], B[16][8], C[16][8];
  auto lo = [](uint32_t r) { return bf16_to_f32(uint16_t(r & 0xffffu)); };
  auto hi = [](uint32_t r) { return bf16_to_f32(uint16_t(r >> 16)); };
  for (int l = 0; l < 32; ++l) {
    const auto& w = all[size_t(l)];
    const int g = l >> 2, t = l & 3;
    A[g][2 * t] = lo(w[0]);
    A[g][2 * t + 1] = hi(w[0]);
    A[g + 8][2 * t] = lo(w[1]);
    A[g + 8][2 * t + 1] = hi(w[1]);
    A[g][2 * t + 8] = lo(w[2]);
    A[g][2 * t + 9] = hi(w[2]);
    A[g + 8][2 * t + 8] = lo(w[3]);
    A[g + 8][2 * t + 9] = hi(w[3]);
    B[2 * t][g] = lo(w[4]);
    B[2 * t + 1][g] = hi(w[4]);
    B[2 * t + 8][g] = lo(w[5]);
    B[2 * t + 9][g] = hi(w[5]);
    C[g][2 * t] = float_of(w[6]);
    C[g][2 * t + 1] = float_of(w[7]);
    C[g + 8][2 * t] = float_of(w[8]);
    C[g + 8][2 * t + 1] = float_of(w[9]);
  }
  const int lane = g_block->cur & 31, g = lane >> 2, t = lane & 3;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int e = 0; e < 4; ++e) {
    double acc = C[rows[e]][cols[e]];
    for (int k = 0; k < 16; ++k) acc += double(A[rows[e]][k]) * double(B[k][cols[e]]);
    c[e] = float(acc);
  }
}

}  // namespace ds::cuda::kern

namespace ds {
namespace {

namespace kern = cuda::kern;

// A grid of CTAs run one after another; shared memory poisoned with NaN bytes per CTA.
template <typename Body>
void sim_grid(unsigned gx, unsigned gy, unsigned gz, int threads, int smem_bytes, Body body) {
  std::vector<uint8_t> smem(size_t(std::max(smem_bytes, 16)));
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        std::fill(smem.begin(), smem.end(), uint8_t(0xff));
        kern::Thread base;
        base.nthreads = threads;
        base.bx = int(x);
        base.by = int(y);
        base.bz = int(z);
        const std::string err =
            run_block(threads, base, [&](const kern::Thread& th) { body(th, smem.data()); });
        ASSERT_TRUE(err.empty()) << err << " (block " << x << ", " << y << ", " << z << ")";
      }
}

// The launcher's run() (attention.cu) with simulated launches. Returns the plan it used.
cuda::WorkPlan sim_attention(kern::AttnParams a, bool tensor_cores, int sm_count) {
  const cuda::WorkPlan w = tensor_cores
                               ? cuda::plan_for(a, kern::kMmaRows, kern::kMmaKeys, sm_count)
                               : cuda::plan_for(a, kern::kSimtRows, kern::kSimtKeys, sm_count);
  cuda::apply_plan(w, a);
  std::vector<float> scratch(cuda::split_scratch_bytes(a) / 4 + 1,
                             std::numeric_limits<float>::quiet_NaN());
  cuda::bind_split_scratch(a, scratch.data());
  const unsigned gz = unsigned(a.kv_heads * a.nhc * a.ndv);
  if (tensor_cores) {
    const bool lo = a.cache_type != kern::kCacheBF16, sep = a.v != nullptr;
    const int bytes = kern::mma_layout(a.dim, a.dvc, lo, sep).bytes;
    sim_grid(w.tiles, unsigned(a.splits), gz, kern::kMmaThreads, bytes,
             [&](const kern::Thread& th, uint8_t* smem) {
               if (lo && sep) kern::mma_attention<true, true>(a, th, smem);
               if (lo && !sep) kern::mma_attention<true, false>(a, th, smem);
               if (!lo && sep) kern::mma_attention<false, true>(a, th, smem);
               if (!lo && !sep) kern::mma_attention<false, false>(a, th, smem);
             });
  } else {
    const int bytes = kern::simt_layout(a.dim, a.dvc, a.v != nullptr).bytes;
    sim_grid(w.tiles, unsigned(a.splits), gz, kern::kSimtThreads, bytes,
             [&](const kern::Thread& th, uint8_t* smem) {
               if (a.dvc <= 64)
                 kern::simt_attention<2>(a, th, smem);
               else if (a.dvc <= 128)
                 kern::simt_attention<4>(a, th, smem);
               else if (a.dvc <= 256)
                 kern::simt_attention<8>(a, th, smem);
               else
                 kern::simt_attention<16>(a, th, smem);
             });
  }
  if (a.splits > 1) {
    const kern::MergeParams m = cuda::merge_params(a);
    sim_grid(unsigned(a.num_tokens * a.heads), 1, 1, 128, 0,
             [&](const kern::Thread& th, uint8_t*) { kern::merge_splits(m, th); });
  }
  return w;
}

struct SimCase {
  std::vector<test::StepSeq> seqs;
  int heads = 4, kv_heads = 2, hd = 20;  // MLA: kv_heads unused, hd = R
  int rope = 0;                          // MLA rope dims P (0: a GQA case)
  int block_size = 4;
  DType dtype = DType::F32;
  bool causal = true;
  bool tensor_cores = false;
  int sm_count = 1;  // larger forces more context splits
  int min_splits = 1;
  bool strided = false;  // q rows inside a wider buffer, out rows padded; MLA q_rope too
};

std::string describe(const SimCase& c) {
  std::string s = std::string(c.rope ? "mla" : "gqa") + " heads " + std::to_string(c.heads) +
                  (c.rope ? " R " + std::to_string(c.hd) + " P " + std::to_string(c.rope)
                          : "/" + std::to_string(c.kv_heads) + " hd " + std::to_string(c.hd)) +
                  " bs " + std::to_string(c.block_size) + " " + std::string(dtype_name(c.dtype)) +
                  (c.tensor_cores ? " mma" : " simt") + (c.causal ? "" : " non-causal") + " sms " +
                  std::to_string(c.sm_count) + " seqs";
  for (const auto& q : c.seqs)
    s += " " + std::to_string(q.query_len) + "/" + std::to_string(q.context_len);
  return s;
}

// Runs a case through the simulated kernels and compares with the float64 reference.
void run_case(const SimCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  Backend& host = test::cpu_backend();  // its buffers are plain host memory
  int blocks = 0;
  for (const auto& q : c.seqs) blocks += (q.context_len + c.block_size - 1) / c.block_size;
  const test::HostStep h = test::make_step(c.seqs, c.block_size, blocks + 3, seed);
  const test::BackendStep step = test::upload_step(host, h);
  const bool mla = c.rope > 0;
  const int T = h.num_tokens, H = c.heads;
  const float scale = 1.5f / std::sqrt(float(c.hd + c.rope));

  test::KvSpec spec;
  spec.dtype = c.dtype;
  spec.num_blocks = blocks + 3;
  spec.block_size = c.block_size;
  spec.kv_heads = mla ? 1 : c.kv_heads;
  spec.head_dim = c.hd + c.rope;
  spec.latent = mla;
  const test::BackendKv kv = test::random_paged_kv(host, spec, seed + 1, mla ? c.hd : 0);

  const std::vector<float> q = test::random_floats(size_t(T * H * c.hd), seed + 2);
  const std::vector<float> qr = test::random_floats(size_t(T * H * c.rope), seed + 3);
  // Strided: q is heads [1, 1 + H) of a [T, H + 2, hd] buffer; out rows have 8 floats of pad.
  const int pad = c.strided ? 8 : 0, wide = c.strided ? H + 2 : H;
  std::vector<float> qbuf(size_t(T * wide * c.hd), 5.0f);
  for (int t = 0; t < T; ++t)
    for (int hh = 0; hh < H; ++hh)
      for (int d = 0; d < c.hd; ++d)
        qbuf[size_t((t * wide + hh + (c.strided ? 1 : 0)) * c.hd + d)] =
            q[size_t((t * H + hh) * c.hd + d)];
  std::vector<float> outbuf(size_t(T * H * (c.hd + pad)), std::numeric_limits<float>::quiet_NaN());
  const TensorView qv = test::strided_view(
      test::make_view(qbuf.data(), DType::F32, {T, wide, c.hd}), {T, H, c.hd},
      {int64_t(wide) * c.hd * 4, int64_t(c.hd) * 4, 4}, c.strided ? c.hd * 4 : 0);
  const TensorView ov =
      test::strided_view(test::make_view(outbuf.data(), DType::F32, {T, H, c.hd + pad}),
                         {T, H, c.hd}, {int64_t(H) * (c.hd + pad) * 4, int64_t(c.hd + pad) * 4, 4});

  // Strided MLA: q_rope is dims [16, 16 + P) of each head of a [T, H, 16 + P] buffer, as the
  // model's q_pe view into q = [q_nope | q_pe] per head.
  const int nope = c.strided ? 16 : 0, qk = nope + c.rope;
  std::vector<float> qrbuf(size_t(T * H * qk), 5.0f);
  for (int r = 0; r < T * H; ++r)
    for (int d = 0; d < c.rope; ++d) qrbuf[size_t(r * qk + nope + d)] = qr[size_t(r * c.rope + d)];
  kern::AttnParams a;
  std::vector<double> want;
  if (mla) {
    MlaAttentionParams p;
    p.q_latent = qv;
    p.q_rope =
        test::strided_view(test::make_view(qrbuf.data(), DType::F32, {T, H, qk}), {T, H, c.rope},
                           {int64_t(H) * qk * 4, int64_t(qk) * 4, 4}, int64_t(nope) * 4);
    p.out = ov;
    p.cache = kv.kv;
    p.kv_lora_rank = c.hd;
    p.scale = scale;
    p.causal = c.causal;
    a = cuda::mla_params(p, step.meta);
    want = test::reference_mla(h, q, qr, kv.k_host, H, c.hd, c.rope, c.block_size, scale, c.causal);
  } else {
    AttentionParams p;
    p.q = qv;
    p.out = ov;
    p.kv = kv.kv;
    p.scale = scale;
    p.causal = c.causal;
    a = cuda::gqa_params(p, step.meta);
    want = test::reference_attention(h, q, kv.k_host, kv.v_host, H, c.kv_heads, c.hd, c.block_size,
                                     scale, c.causal);
  }
  const cuda::WorkPlan w = sim_attention(a, c.tensor_cores, c.sm_count);
  EXPECT_GE(w.splits, c.min_splits);
  std::vector<float> out;
  for (size_t r = 0; r < size_t(T * H); ++r) {
    for (int d = 0; d < c.hd; ++d) out.push_back(outbuf[r * size_t(c.hd + pad) + size_t(d)]);
    for (int d = c.hd; d < c.hd + pad; ++d)
      EXPECT_TRUE(std::isnan(outbuf[r * size_t(c.hd + pad) + size_t(d)])) << "pad written";
  }
  // FP8 rows are scaled up to 6.25 (so their scales differ): outputs are that much larger.
  const test::Tolerance tol = test::attention_tolerance();
  const test::Tolerance fp8_tol{8 * tol.abs, tol.rel};
  EXPECT_TRUE(test::all_close(out, want, c.dtype == DType::F8_E4M3 ? fp8_tol : tol, "attention",
                              {T, H, c.hd}));
}

std::vector<test::StepSeq> mixed_seqs() {
  // A decode, a prefill chunk after a cached prefix, a whole prompt, one spanning 3 key tiles.
  return {{1, 9}, {5, 12}, {3, 3}, {2, 70}};
}

TEST(CudaAttentionSim, GqaSimt) {
  uint32_t seed = 100;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int bs : {1, 4}) {
      SimCase c;
      c.seqs = mixed_seqs();
      c.dtype = dt;
      c.block_size = bs;
      run_case(c, seed++);
    }
}

TEST(CudaAttentionSim, GqaSimtShapesAndSplits) {
  SimCase c;
  c.seqs = mixed_seqs();
  c.heads = 3, c.kv_heads = 1, c.hd = 64;
  run_case(c, 200);
  c.heads = 6, c.kv_heads = 2, c.hd = 36, c.sm_count = 40, c.min_splits = 2;
  run_case(c, 201);
  c.seqs = {{1, 40}, {1, 1}, {1, 75}};  // decode: one token per tile, binary-search mapping
  c.heads = 2, c.kv_heads = 1, c.hd = 8;
  run_case(c, 202);
  c.causal = false;
  run_case(c, 203);
}

TEST(CudaAttentionSim, GqaTensorCores) {
  uint32_t seed = 300;
  for (DType dt : {DType::BF16, DType::F32, DType::F16}) {
    SimCase c;
    c.seqs = mixed_seqs();
    c.tensor_cores = true;
    c.dtype = dt;
    run_case(c, seed++);
  }
  SimCase c;
  c.seqs = mixed_seqs();
  c.tensor_cores = true;
  c.dtype = DType::BF16;
  c.heads = 3, c.kv_heads = 1, c.hd = 40, c.sm_count = 30, c.min_splits = 2;
  run_case(c, 310);
  c.seqs = {{1, 40}, {1, 33}};
  c.heads = 20, c.kv_heads = 1, c.hd = 16, c.sm_count = 1, c.min_splits = 1;  // 2 head chunks
  run_case(c, 311);
}

TEST(CudaAttentionSim, MlaSimt) {
  SimCase c;
  c.seqs = mixed_seqs();
  c.heads = 3, c.hd = 32, c.rope = 8;
  run_case(c, 400);
  c.dtype = DType::BF16, c.block_size = 1, c.sm_count = 20, c.min_splits = 2;
  run_case(c, 401);
}

TEST(CudaAttentionSim, MlaTensorCores) {
  SimCase c;
  c.seqs = mixed_seqs();
  c.heads = 3, c.hd = 32, c.rope = 8, c.tensor_cores = true, c.dtype = DType::BF16;
  run_case(c, 500);
  c.dtype = DType::F32;
  run_case(c, 501);
  c.seqs = {{1, 70}, {1, 5}};
  c.heads = 16, c.dtype = DType::BF16, c.sm_count = 8, c.min_splits = 2;
  run_case(c, 502);
  c.seqs = {{2, 36}};
  c.heads = 1, c.hd = 72, c.rope = 16, c.sm_count = 1, c.min_splits = 1;
  run_case(c, 503);
}

// FP8 cache: codes and per-token scales read by both kernel families (GQA K and V scales
// per head, MLA latent and rope scales), with splits and block size 1.
TEST(CudaAttentionSim, Fp8Cache) {
  uint32_t seed = 900;
  for (bool mma : {false, true})
    for (int bs : {1, 4}) {
      SimCase c;
      c.seqs = mixed_seqs();
      c.dtype = DType::F8_E4M3;
      c.tensor_cores = mma;
      c.block_size = bs;
      c.heads = 6, c.kv_heads = 2, c.hd = 36;
      run_case(c, seed++);
      c.heads = 3, c.hd = 32, c.rope = 8;  // MLA
      run_case(c, seed++);
      c.sm_count = 20, c.min_splits = 2;
      run_case(c, seed++);
    }
}

TEST(CudaAttentionSim, StridedViews) {
  for (bool tc : {false, true}) {
    SimCase c;
    c.seqs = mixed_seqs();
    c.strided = true;
    c.tensor_cores = tc;
    run_case(c, 650);
    c.heads = 4, c.hd = 32, c.rope = 8, c.sm_count = 10;
    run_case(c, 651);
  }
}

TEST(CudaAttentionSim, ManySequencesTileScan) {
  // More than 32 sequences (the tile scan loops), some with no query this step.
  std::vector<test::StepSeq> seqs;
  const std::vector<int32_t> lens = test::random_ints(40, 600, 0, 3);
  for (size_t i = 0; i < lens.size(); ++i) seqs.push_back({lens[i], lens[i] + int(i % 7) * 5});
  seqs.push_back({2, 2});
  for (bool tc : {false, true}) {
    SimCase c;
    c.seqs = seqs;
    c.tensor_cores = tc;
    c.heads = 4, c.kv_heads = 2, c.hd = 8;
    run_case(c, 601);
  }
}

// One whole prompt of 1..64 tokens at once, as a model's prefill runs it, with heads that do
// not divide a CTA's 16 rows (3 heads: 5 tokens per tile), so tiles start mid-block and the
// last tile is partial. The MLA case is the tiny DeepSeek-V2 fixture's (R 32, P 8, q_rope a
// strided view, block size 16).
TEST(CudaAttentionSim, WholePromptSweep) {
  for (bool tc : {true, false})
    for (DType dt : {DType::BF16, DType::F32})
      for (int T = 1; T <= 64; T += tc ? 1 : 3) {
        SimCase c;
        c.seqs = {{T, T}};
        c.heads = 3, c.hd = 32, c.rope = 8, c.block_size = 16, c.strided = true;
        c.tensor_cores = tc, c.dtype = dt, c.sm_count = 132;
        run_case(c, 800 + uint32_t(T));
      }
  for (bool tc : {true, false})
    for (int hd : {16, 24})
      for (auto [heads, kv] : {std::pair{3, 1}, std::pair{6, 2}})
        for (int T : {1, 2, 5, 8, 15, 16, 17, 20, 21, 23, 31, 32, 33, 40, 47, 48, 49, 64}) {
          SimCase c;
          c.seqs = {{T, T}};
          c.heads = heads, c.kv_heads = kv, c.hd = hd, c.block_size = 16;
          c.tensor_cores = tc, c.dtype = DType::BF16, c.sm_count = 132;
          run_case(c, 900 + uint32_t(T));
        }
}

// The production shapes: DeepSeek-V2 MLA (R 512, P 64, 16 heads), an R of 1024 (two value
// chunks per token), Llama-style GQA with head_dim 80 / 128 / 256.
TEST(CudaAttentionSim, RealShapes) {
  uint32_t seed = 700;
  for (bool tc : {false, true}) {
    SimCase c;
    c.tensor_cores = tc;
    c.seqs = {{1, 70}, {3, 40}};
    c.heads = 16, c.hd = 512, c.rope = 64, c.dtype = DType::BF16, c.block_size = 16;
    run_case(c, seed++);
    c.seqs = {{1, 35}};
    c.heads = 2, c.hd = 1024, c.rope = 64, c.sm_count = 4;
    run_case(c, seed++);
    c.rope = 0, c.sm_count = 1;
    c.seqs = {{1, 70}, {3, 40}};
    c.heads = 12, c.kv_heads = 4, c.hd = 128;
    run_case(c, seed++);
    c.heads = 4, c.kv_heads = 2, c.hd = 256, c.dtype = DType::F32;
    run_case(c, seed++);
    c.heads = 3, c.kv_heads = 3, c.hd = 80, c.dtype = DType::F16;
    run_case(c, seed++);
  }
}

// Random split partials of one token's rows (split 0 always has keys; empty(s, h): split s saw
// no key of head h) and the merge kernel's output from them.
struct MergeCase {
  std::vector<float> part_o, part_ml, ref;
};
template <typename Empty>
MergeCase merge_case(int S, int heads, int dv, std::mt19937& rng, const Empty& empty) {
  std::uniform_real_distribution<float> val(-3.0f, 3.0f), mx(-6.0f, 6.0f), sum(0.5f, 40.0f);
  MergeCase c;
  c.part_o.resize(size_t(S) * heads * dv);
  c.part_ml.resize(size_t(S) * heads * 2);
  for (float& v : c.part_o) v = val(rng);
  for (int s = 0; s < S; ++s)
    for (int h = 0; h < heads; ++h) {
      const bool e = s > 0 && empty(s, h);
      c.part_ml[(size_t(s) * heads + h) * 2] = e ? -INFINITY : mx(rng);
      c.part_ml[(size_t(s) * heads + h) * 2 + 1] = e ? 0.0f : sum(rng);
    }
  c.ref.assign(size_t(heads) * dv, std::numeric_limits<float>::quiet_NaN());
  kern::MergeParams m;
  m.part_o = c.part_o.data();
  m.part_ml = c.part_ml.data();
  m.out = reinterpret_cast<uint8_t*>(c.ref.data());
  m.out_ts = int64_t(heads) * dv * 4;
  m.out_hs = dv * 4;
  m.num_tokens = 1;
  m.heads = heads;
  m.dv = dv;
  m.splits = S;
  sim_grid(unsigned(heads), 1, 1, 128, 0,
           [&](const kern::Thread& th, uint8_t*) { kern::merge_splits(m, th); });
  return c;
}

// The MLA decode kernel's in-cluster merge (merge_cluster_items, DEEPSERVE_MLA_CLUSTER=1) shares
// a head chunk's rows x dims out among the cluster's CTAs: every item of an existing row merged
// exactly once, rows past the heads left alone, and each value the merge kernel's bits, with
// splits that saw no key (max -inf) among them.
TEST(CudaAttentionSim, ClusterMergeMatchesTheMergeKernel) {
  constexpr int kRows = 16, kDv = 512, kThreads = 256;
  std::mt19937 rng(41);
  for (int S : {2, 3, 7, 9, 16}) {
    for (int heads : {16, 13}) {
      SCOPED_TRACE("splits " + std::to_string(S) + " heads " + std::to_string(heads));
      const MergeCase mc = merge_case(S, heads, kDv, rng, [](int s, int) { return s % 4 == 3; });
      const std::vector<float>&part_o = mc.part_o, &part_ml = mc.part_ml, &ref = mc.ref;

      std::vector<float> got(size_t(kRows) * kDv, std::numeric_limits<float>::quiet_NaN());
      std::vector<int> stores(size_t(kRows) * kDv, 0);
      const auto at = [&](int s, int row) { return (size_t(s) * heads + size_t(row)) * 2; };
      for (int z = 0; z < S; ++z)
        for (int tid = 0; tid < kThreads; ++tid)
          kern::merge_cluster_items(
              S, z, tid, kThreads, kRows, kDv, [&](int row) { return row < heads; },
              [&](int s, int row) { return part_ml[at(s, row)]; },
              [&](int s, int row) { return part_ml[at(s, row) + 1]; },
              [&](int s, int row, int d, float(&o)[4]) {
                for (int e = 0; e < 4; ++e)
                  o[e] = part_o[(size_t(s) * heads + size_t(row)) * kDv + size_t(d + e)];
              },
              [&](int row, int d, const float(&acc)[4]) {
                for (int e = 0; e < 4; ++e) {
                  got[size_t(row) * kDv + size_t(d + e)] = acc[e];
                  ++stores[size_t(row) * kDv + size_t(d + e)];
                }
              });
      for (int row = 0; row < kRows; ++row)
        for (int d = 0; d < kDv; ++d) {
          const size_t i = size_t(row) * kDv + size_t(d);
          ASSERT_EQ(stores[i], row < heads ? 1 : 0) << "row " << row << " dim " << d;
          if (row < heads)
            ASSERT_EQ(std::memcmp(&got[i], &ref[i], 4), 0)
                << "row " << row << " dim " << d << ": " << got[i] << " vs " << ref[i];
        }
    }
  }
}

// The MLA decode's gathered in-cluster merge (merge_gathered, DEEPSERVE_MLA_MERGE_GATHER=1): each
// row's factors and 1 / sum from every split's max and sum (merge_row_factors), then each 4-dim
// item summed from the splits' values (merge_sum_factors) give the merge kernel's bits, with
// splits that saw no key (max -inf) among them and values of empty splits left as NaN (never
// read).
TEST(CudaAttentionSim, GatheredClusterMergeMatchesTheMergeKernel) {
  constexpr int kDv = 512, kMaxS = 16;
  std::mt19937 rng(43);
  for (int S : {2, 3, 7, 9, 16}) {
    const int heads = 13;
    SCOPED_TRACE("splits " + std::to_string(S));
    const MergeCase mc =
        merge_case(S, heads, kDv, rng, [](int s, int h) { return s % 4 == 3 || h == 5; });
    const std::vector<float>&part_o = mc.part_o, &part_ml = mc.part_ml, &ref = mc.ref;
    for (int row = 0; row < heads; ++row) {
      const auto at = [&](int s) { return (size_t(s) * heads + size_t(row)) * 2; };
      float fac[kMaxS];
      const float inv = kern::merge_row_factors(
          S, [&](int s) { return part_ml[at(s)]; }, [&](int s) { return part_ml[at(s) + 1]; },
          [&](int s, float f) { fac[s] = f; });
      for (int d = 0; d < kDv; d += 4) {
        float o[kMaxS][4];
        for (int s = 0; s < kMaxS; ++s)
          for (int e = 0; e < 4; ++e)
            o[s][e] = s < S && fac[s] != -INFINITY
                          ? part_o[(size_t(s) * heads + size_t(row)) * kDv + size_t(d + e)]
                          : std::numeric_limits<float>::quiet_NaN();
        float acc[4];
        kern::merge_sum_factors<4, kMaxS>(
            S, [&](int s) { return fac[s]; }, o, inv, acc);
        for (int e = 0; e < 4; ++e) {
          const size_t i = size_t(row) * kDv + size_t(d + e);
          ASSERT_EQ(std::memcmp(&acc[e], &ref[i], 4), 0)
              << "row " << row << " dim " << d + e << ": " << acc[e] << " vs " << ref[i];
        }
      }
    }
  }
}

}  // namespace
}  // namespace ds
