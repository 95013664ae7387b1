// moe_ffn: validation, the per-device expert pointer tables, the scratch layout, and the choice
// between the decode and prefill implementations (the token lists and the combine it launches
// are in moe_lists.cu).
#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/gemm_gguf.cuh"
#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_dequant.cuh"
#include "backend/fp8w.h"
#include "backend/w4a16.h"
#include "core/error.h"

namespace ds::cuda {
namespace {

// A device copy of one experts span's pointers, plus what it was built from.
struct ExpertTable {
  std::vector<moe::ExpertPtrs> host;
  moe::ExpertPtrs* device = nullptr;
  DType dtype = DType::BF16;
  int hidden = 0;
  int inter = 0;
  bool gate_up_same_ld = true;  // every expert's gate and up rows equally spaced
};

struct DeviceState {
  std::map<const ExpertWeights*, ExpertTable> tables;
  std::vector<void*> retired;  // tables replaced while kernels may still read them
  // The prefill path's side streams, their cuBLAS handles, the fork / join events and the
  // expansion chunks' events.
  std::array<cudaStream_t, moe::kPrefillStreams> streams{};
  std::array<cublasHandle_t, moe::kPrefillStreams> cublas{};
  std::array<cudaEvent_t, moe::kPrefillStreams + 1 + moe::kExpandChunks> events{};
  bool prefill_ready = false;
  // The decode path's fused-combine counters, per stream (launches on one stream never overlap).
  std::map<cudaStream_t, int*> tile_done;
};

// Zeroed counters for the fused combine on `stream`: allocated on its first use outside graph
// capture (null while capturing before that: the combine then takes its own launch). The kernel
// leaves them zero.
int* tile_counters(DeviceState& dev, cudaStream_t stream) {
  auto it = dev.tile_done.find(stream);
  if (it != dev.tile_done.end()) return it->second;
  if (stream_capturing(stream)) return nullptr;
  void* d = nullptr;
  moe::check(cudaMalloc(&d, moe::kTileCounters * sizeof(int)), "counter alloc");
  cudaError_t e = cudaMemsetAsync(d, 0, moe::kTileCounters * sizeof(int), stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    cudaFree(d);
    moe::check(e, "counter reset");
  }
  dev.tile_done.emplace(stream, static_cast<int*>(d));
  return static_cast<int*>(d);
}

void prepare_prefill(DeviceState& dev) {
  if (dev.prefill_ready) return;
  for (int i = 0; i < moe::prefill_streams(); ++i) {
    moe::check(cudaStreamCreateWithFlags(&dev.streams[size_t(i)], cudaStreamNonBlocking),
               "prefill stream");
    if (cublasCreate(&dev.cublas[size_t(i)]) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(dev.cublas[size_t(i)], dev.streams[size_t(i)]) != CUBLAS_STATUS_SUCCESS)
      throw Error("cuda moe_ffn: cuBLAS set-up for the prefill streams failed");
  }
  for (cudaEvent_t& e : dev.events)
    moe::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "prefill event");
  dev.prefill_ready = true;
}

// moe_ffn's launcher API is stateless, so the tables (uploaded once per model layer) and
// the cuBLAS handle live here, per device, for the life of the process.
struct MoeRegistry {
  std::mutex mu;
  std::map<int, DeviceState> devices;
};

MoeRegistry& registry() {
  static MoeRegistry* r = new MoeRegistry;  // never destroyed: CUDA may be gone at exit
  return *r;
}

moe::ExpertPtrs expert_ptrs(const ExpertWeights& w) {
  const auto ld = [](const TensorView& t) {  // W4A16, FP8W and GGUF blocks: bytes
    return wq_dtype(t.dtype) || is_gguf_block_type(t.dtype)
               ? t.row_stride()
               : t.row_stride() / int64_t(dtype_info(t.dtype).type_size);
  };
  return {w.gate.data, w.up.data, w.down.data, ld(w.gate), ld(w.up), ld(w.down)};
}

// GGUF blocks: rows only 2-byte aligned (18- and 34-byte blocks), every expert one shape.
void validate_gguf_experts(std::span<const ExpertWeights> experts, const ExpertTable& t) {
  for (const ExpertWeights& w : experts) {
    for (const TensorView* m : {&w.gate, &w.up, &w.down}) {
      DS_CHECK(m->ndim == 2 && m->dtype == t.dtype, "moe_ffn: experts differ in dtype or rank");
      DS_CHECK(reinterpret_cast<uintptr_t>(m->data) % 2 == 0 && m->row_stride() % 2 == 0,
               "moe_ffn: GGUF expert rows must be 2-byte aligned");
    }
    DS_CHECK(w.gate.shape[0] == t.inter && w.gate.shape[1] == t.hidden &&
                 w.up.shape[0] == t.inter && w.up.shape[1] == t.hidden &&
                 w.down.shape[0] == t.hidden && w.down.shape[1] == t.inter,
             "moe_ffn: experts differ in shape");
  }
}

void validate_experts(std::span<const ExpertWeights> experts, ExpertTable& t) {
  const ExpertWeights& e0 = experts[0];
  t.dtype = e0.gate.dtype;
  t.inter = int(e0.gate.shape[0]);
  t.hidden = int(e0.gate.cols());
  const bool w4 = t.dtype == DType::W4A16, q = wq_dtype(t.dtype);
  if (is_gguf_block_type(t.dtype)) return validate_gguf_experts(experts, t);
  if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32 && !q)
    throw UnsupportedError(
        "cuda moe_ffn: expert weights must be BF16, F16, F32, W4A16 or FP8W, not " +
        std::string(dtype_name(t.dtype)));
  if (w4 && (t.hidden % w4a16::kGroup != 0 || t.inter % w4a16::kGroup != 0))
    throw UnsupportedError("cuda moe_ffn: W4A16 experts need hidden and F multiples of 128");
  if (q && (t.hidden % 8 != 0 || t.inter % 8 != 0))
    throw UnsupportedError("cuda moe_ffn: quantized experts need hidden and F multiples of 8");
  const int esize = q ? 1 : int(dtype_info(t.dtype).type_size);
  for (const ExpertWeights& w : experts) {
    for (const TensorView* m : {&w.gate, &w.up, &w.down}) {
      DS_CHECK(m->ndim == 2 && m->dtype == t.dtype, "moe_ffn: experts differ in dtype or rank");
      if (reinterpret_cast<uintptr_t>(m->data) % 16 != 0 || m->row_stride() % 16 != 0)
        throw UnsupportedError("cuda moe_ffn: expert rows must be 16-byte aligned");
      DS_CHECK(m->row_stride() % esize == 0, "moe_ffn: odd expert row stride");
      DS_CHECK(!q || m->row_stride() ==
                         (w4 ? w4a16::row_stride(m->cols()) : fp8w::row_stride(m->cols())),
               "moe_ffn: quantized expert rows must be packed (w4a16 / fp8w layout)");
    }
    DS_CHECK(w.gate.shape[0] == t.inter && w.gate.shape[1] == t.hidden &&
                 w.up.shape[0] == t.inter && w.up.shape[1] == t.hidden &&
                 w.down.shape[0] == t.hidden && w.down.shape[1] == t.inter,
             "moe_ffn: experts differ in shape");
  }
}

// Whether t was built from exactly these views (pointers, strides, dtype, shapes): new
// weights may reuse both the span's and the weights' addresses.
bool table_matches(const ExpertTable& t, std::span<const ExpertWeights> experts) {
  if (!t.device || t.host.size() != experts.size()) return false;
  for (size_t i = 0; i < experts.size(); ++i) {
    const ExpertWeights& w = experts[i];
    if (!(t.host[i] == expert_ptrs(w))) return false;
    for (const TensorView* m : {&w.gate, &w.up, &w.down})
      if (m->dtype != t.dtype || m->ndim != 2) return false;
    if (w.gate.shape[0] != t.inter || w.gate.shape[1] != t.hidden || w.up.shape[0] != t.inter ||
        w.up.shape[1] != t.hidden || w.down.shape[0] != t.hidden || w.down.shape[1] != t.inter)
      return false;
  }
  return true;
}

// The table for this span: built (and uploaded) on first use, rebuilt if the span changed.
const ExpertTable& expert_table(DeviceState& dev, std::span<const ExpertWeights> experts,
                                cudaStream_t stream) {
  ExpertTable& t = dev.tables[experts.data()];
  if (table_matches(t, experts)) return t;
  if (stream_capturing(stream))
    throw Error("cuda moe_ffn: expert tables must be built before graph capture");
  ExpertTable fresh;  // t changes only once the new table is complete
  validate_experts(experts, fresh);
  for (const ExpertWeights& w : experts) {
    fresh.host.push_back(expert_ptrs(w));
    fresh.gate_up_same_ld &= fresh.host.back().gate_ld == fresh.host.back().up_ld;
  }
  const size_t bytes = fresh.host.size() * sizeof(moe::ExpertPtrs);
  void* d = nullptr;
  moe::check(cudaMalloc(&d, bytes), "table alloc");
  fresh.device = static_cast<moe::ExpertPtrs*>(d);
  // Complete before returning, so launches on any stream see it.
  cudaError_t up = cudaMemcpyAsync(d, fresh.host.data(), bytes, cudaMemcpyHostToDevice, stream);
  if (up == cudaSuccess) up = cudaStreamSynchronize(stream);
  if (up != cudaSuccess) {
    cudaFree(d);
    moe::check(up, "table upload");
  }
  if (t.device) dev.retired.push_back(t.device);
  t = std::move(fresh);
  return t;
}

// Carves 256-byte aligned pieces out of one scratch allocation.
class Carver {
 public:
  explicit Carver(uint8_t* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += (size_t(count) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
  size_t used() const { return used_; }

 private:
  uint8_t* base_;
  size_t used_ = 0;
};

struct Scratch {
  moe::TokenLists lists;
  float* part = nullptr;   // split
  float* h = nullptr;      // decode
  float* y = nullptr;      // decode, grouped
  void* act = nullptr;     // prefill; grouped: x in BF16; streamed: gathered x
  float* gu = nullptr;     // prefill
  void* h16 = nullptr;     // grouped: silu(g) * u; prefill: gathered x
  void* wslots = nullptr;  // prefill on quantized experts: their BF16 expansions
};

// Lays out the scratch (twice: once with a null base to size it); tile_rows: of the grouped
// paths' tile table.
size_t layout(uint8_t* base, int64_t n, int E, int H, int F, MoeFfnPath path, int tile_rows,
              int64_t expand_slots, Scratch& s) {
  Carver c(base);
  s.lists.offsets = c.take<int>(E + 1);
  s.lists.active = c.take<int>(E);
  s.lists.n_active = c.take<int>(1);
  s.lists.sorted_token = c.take<int>(n);
  s.lists.pos = c.take<int>(n);
  if (path == MoeFfnPath::Prefill) {
    s.h16 = c.take<uint16_t>(n * H);  // gathered x
    s.act = c.take<uint16_t>(n * F);
    s.gu = c.take<float>(n * std::max(2 * F, H));
    if (expand_slots > 0) s.wslots = c.take<uint16_t>(expand_slots * 3 * F * H);
  } else if (path == MoeFfnPath::Grouped || path == MoeFfnPath::Streamed ||
             path == MoeFfnPath::Wide) {
    s.lists.tile_rows = tile_rows;
    const int64_t tiles = moe::max_tiles(n, E, s.lists.tile_rows);
    s.lists.tile_expert = c.take<int>(tiles);
    s.lists.tile_begin = c.take<int>(tiles);
    s.lists.n_tiles = c.take<int>(1);
    s.lists.sched = c.take<int>(tiles + 1);
    s.act = c.take<uint16_t>(n * H);
    s.h16 = c.take<uint16_t>(n * F);
    s.y = c.take<float>(n * H);
  } else if (path == MoeFfnPath::Split) {
    s.part = c.take<float>(n * moe::split_strips(F) * H);
  } else {
    s.h = c.take<float>(n * F);
    s.y = c.take<float>(n * H);
  }
  return c.used();
}

}  // namespace

bool moe_ffn(const Context& ctx, const MoeFfnParams& p, const AddNormArgs* post) {
  return moe_ffn(ctx, p, MoeFfnPath::Auto, kMoeAllStages, post);
}

bool moe_ffn(const Context& ctx, const MoeFfnParams& p, MoeFfnPath path, int stages,
             const AddNormArgs* post) {
  const int64_t T = p.x.rows();
  const int64_t E = int64_t(p.experts.size());
  const int k = int(p.ids.cols());
  DS_CHECK(p.x.dtype == DType::F32 && p.out.dtype == DType::F32 && p.ids.dtype == DType::I32 &&
               p.weights.dtype == DType::F32,
           "moe_ffn dtypes: x, out, weights F32; ids I32");
  DS_CHECK(p.ids.rows() == T && p.weights.rows() == T && p.weights.cols() == k &&
               p.out.rows() == T && p.out.cols() == p.x.cols(),
           "moe_ffn shapes: x " + p.x.shape_str() + ", ids " + p.ids.shape_str() + ", weights " +
               p.weights.shape_str() + ", out " + p.out.shape_str());
  DS_CHECK(p.ids.is_contiguous() && p.weights.is_contiguous(),
           "moe_ffn: ids and weights must be contiguous");
  DS_CHECK(p.x.row_stride() % 4 == 0 && p.out.row_stride() % 4 == 0, "moe_ffn: misaligned rows");
  DS_CHECK(E >= 1 && k >= 1, "moe_ffn: no experts");
  if (E > moe::kMaxExperts)
    throw UnsupportedError("cuda moe_ffn: at most " + std::to_string(moe::kMaxExperts) +
                           " experts");
  DS_CHECK(ctx.scratch != nullptr, "moe_ffn: context without scratch");
  DS_CHECK(post == nullptr || T <= kAddNormMaxRows, "moe_ffn: too many rows to add and norm");
  if (T == 0) return false;

  int device = 0;
  moe::check(cudaGetDevice(&device), "get device");
  MoeRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto [it, fresh] = reg.devices.try_emplace(device);
  DeviceState& dev = it->second;
  if (fresh) {
    if (stream_capturing(ctx.stream)) {
      reg.devices.erase(it);
      throw Error("cuda moe_ffn: first call on a device must happen before graph capture");
    }
    moe::prepare_decode_kernels();
    moe::prepare_split_kernels();
    moe::prepare_grouped_kernels();
  }
  const ExpertTable& table = expert_table(dev, p.experts, ctx.stream);
  const int H = table.hidden;
  const int F = table.inter;
  DS_CHECK(p.x.cols() == H, "moe_ffn: x has " + std::to_string(p.x.cols()) +
                                " columns, experts take " + std::to_string(H));
  const int S = p.num_shared;
  DS_CHECK(S >= 0 && S < E, "moe_ffn: num_shared out of range");
  const int ks = k + S;  // slots per token: routed, then shared
  const int64_t n = T * ks;

  const bool bf16 = table.dtype == DType::BF16;
  // Quantized experts: the tensor-core kernels of moe_wq.cu, or, for prefill-sized steps, the
  // prefill path on BF16 expansions (wq_dequant.cuh).
  const bool quant = wq_dtype(table.dtype);
  if (path == MoeFfnPath::Auto && !quant) {
    path = moe_auto_path(bf16, T, k, S, stream_capturing(ctx.stream), g_moe_prefill_wide.on(),
                         g_moe_split.on());
    // Streamed reads gate and up rows with one stride: otherwise the grouped kernels.
    if (path == MoeFfnPath::Streamed && !table.gate_up_same_ld) path = MoeFfnPath::Grouped;
  }
  if (path == MoeFfnPath::Split && (quant || is_gguf_block_type(table.dtype)))
    throw UnsupportedError("cuda moe_ffn: the split path takes BF16 or F16 experts");
  if (path == MoeFfnPath::Streamed && !quant && !(bf16 && table.gate_up_same_ld))
    throw UnsupportedError(
        "cuda moe_ffn: the streamed path takes BF16 experts with gate and up rows equally "
        "spaced");
  // Quantized experts on the prefill path: their expansions' slots (all E, or a ring of whole
  // chunks where the layer does not fit the cap; a forced Prefill path past even two chunks
  // takes all E). Auto also keeps the step's scratch within what the pool can give now: a
  // smaller ring, else the in-register kernels.
  int64_t expand_slots = 0;
  if (quant) {
    const bool forced = path == MoeFfnPath::Prefill;
    bool expand =
        forced || (path == MoeFfnPath::Auto &&
                   wq_dequant_moe(n, int(E), table.dtype, H, F, moe::kExpandChunks, ctx.stream));
    if (expand) {
      expand_slots = moe_wq_expand_slots(int(E), H, F, moe::kExpandChunks);
      if (expand_slots == 0) expand_slots = E;
      if (!forced && ctx.scratch_room) {
        Scratch probe;
        expand_slots =
            moe_wq_slots_within(expand_slots, moe_wq_chunk_experts(E, moe::kExpandChunks),
                                ctx.scratch_room(kScratchMoe), [&](int64_t slots) {
                                  return layout(nullptr, n, int(E), H, F, MoeFfnPath::Prefill,
                                                moe::kTileM, slots, probe);
                                });
        expand = expand_slots > 0;
      }
    }
    DS_CHECK(!expand || !stream_capturing(ctx.stream),
             "moe_ffn: the prefill path cannot be captured");
    path = expand ? MoeFfnPath::Prefill : MoeFfnPath::Grouped;
  } else if (path == MoeFfnPath::Prefill || path == MoeFfnPath::Grouped ||
             path == MoeFfnPath::Wide) {
    if (!bf16)
      throw UnsupportedError(std::string("cuda moe_ffn: the ") +
                             (path == MoeFfnPath::Prefill ? "prefill" : "grouped") +
                             " path needs BF16 experts");
    DS_CHECK(path != MoeFfnPath::Prefill || !stream_capturing(ctx.stream),
             "moe_ffn: the prefill path cannot be graph-captured");
  }
  const bool prefill = path == MoeFfnPath::Prefill;
  if (prefill) prepare_prefill(dev);

  // Tile rows: 128 for Wide; 32 for Grouped's BF16 kernels on steps of up to 256 tokens
  // (g_moe_tile32; the quantized and streamed kernels take 64-row tiles only).
  const int tile_rows =
      path == MoeFfnPath::Wide ? moe::kWideTileM
      : path == MoeFfnPath::Grouped && !quant && g_moe_tile32.on() && T <= moe::kSmallTileMaxTokens
          ? moe::kSmallTileM
          : moe::kTileM;
  Scratch s;
  const size_t bytes = layout(nullptr, n, int(E), H, F, path, tile_rows, expand_slots, s);
  auto* base = static_cast<uint8_t*>(ctx.scratch(kScratchMoe, bytes));
  layout(base, n, int(E), H, F, path, tile_rows, expand_slots, s);

  // Decode steps of a few assignments: the gate/up kernel builds the token lists itself.
  const bool warp_lists = (path == MoeFfnPath::Decode || path == MoeFfnPath::Split) &&
                          !is_gguf_block_type(table.dtype) && n <= moe::kWarpListMax &&
                          g_moe_warp_lists.on();
  // Down kernels read the lists early and ask L2 for their weight rows (FfnProblem::prefetch);
  // not when the kernel just before them writes the lists.
  const int64_t prefetch = prefill || is_gguf_block_type(table.dtype) || warp_lists
                               ? 0
                               : pdl::prefetch_bytes(pdl::PrefetchKind::MoeDown);
  if (!warp_lists)
    moe::launch_token_lists(p.ids.ptr<int32_t>(), T, k, S, int(E), s.lists, ctx.stream,
                            p.expert_base);
  moe::FfnProblem problem;
  problem.x = p.x.ptr<float>();
  problem.x_stride = p.x.row_stride() / 4;
  problem.num_tokens = T;
  problem.num_experts = int(E);
  problem.top_k = ks;
  problem.hidden = H;
  problem.inter = F;
  problem.lists = s.lists;
  problem.prefetch = prefetch;
  const float* y = nullptr;
  int64_t y_stride = H;
  if (path == MoeFfnPath::Grouped || path == MoeFfnPath::Streamed || path == MoeFfnPath::Wide) {
    moe::GroupedFfnArgs a;
    a.experts = table.device;
    static_cast<moe::FfnProblem&>(a) = problem;
    a.num_shared = S;
    a.xa = s.act;
    a.h = s.h16;
    a.y = s.y;
    // Streamed: BF16 experts through the small-token variants of the quantized kernels
    // (weights as the 16-row mma operand, 8 or 16 tokens per CTA).
    if (quant || path == MoeFfnPath::Streamed)
      moe::launch_wq_ffn(a, table.dtype, ctx.stream);
    else
      moe::launch_grouped_ffn(a, ctx.stream);
    y = s.y;
  } else if (prefill) {
    moe::PrefillFfnArgs a;
    a.experts = table.host.data();
    a.cublas = dev.cublas.data();
    a.streams = dev.streams.data();
    a.events = dev.events.data();
    a.expand_events = dev.events.data() + moe::kPrefillStreams + 1;
    a.num_streams = moe::prefill_streams();
    static_cast<moe::FfnProblem&>(a) = problem;
    a.xg = s.h16;
    a.act = s.act;
    a.gu = s.gu;
    a.ld_gu = std::max(2 * F, H);
    if (quant) {
      a.wdtype = table.dtype;
      a.experts_device = table.device;
      a.wslots = s.wslots;
      a.wslot_count = expand_slots;
    }
    moe::run_prefill_ffn(a, ctx.stream);
    y = s.gu;
    y_stride = a.ld_gu;
  } else {
    moe::DecodeFfnArgs a;
    a.experts = table.device;
    a.kind = table.dtype == DType::BF16  ? moe::WeightKind::BF16
             : table.dtype == DType::F16 ? moe::WeightKind::F16
                                         : moe::WeightKind::F32;
    static_cast<moe::FfnProblem&>(a) = problem;
    a.h = s.h;
    a.y = s.y;
    a.sm_count = ctx.sm_count;
    a.routed = k;
    a.stages = stages;
    if (warp_lists) {
      a.ids = p.ids.ptr<int32_t>();
      a.expert_base = p.expert_base;
    }
    // The combine in a kernel of the path: Split's reduce, or the down kernel (one launch fewer).
    const bool split = path == MoeFfnPath::Split;
    const bool gguf = is_gguf_block_type(table.dtype);
    if (split || (!gguf && g_moe_fused_combine.on())) {
      a.out = p.out.ptr<float>();
      a.out_stride = p.out.row_stride() / 4;
      a.weights = p.weights.ptr<float>();
    }
    if (split) {
      a.part = s.part;
      a.prefetch_down = g_moe_split_prefetch.on();
      moe::launch_split_ffn(a, ctx.stream);
      return false;
    }
    if (gguf) {
      moe::launch_gguf_ffn(a, table.dtype, ctx.stream);
    } else {
      if (a.out != nullptr) a.tile_done = tile_counters(dev, ctx.stream);
      if (a.tile_done != nullptr && post != nullptr && stages == kMoeAllStages) a.post = *post;
      // The combine in the down kernel, and the add and norm with it where asked.
      if (moe::launch_decode_ffn(a, ctx.stream)) return a.post.counter != nullptr;
    }
    y = s.y;
  }
  moe::launch_combine(y, s.lists.pos, p.weights.ptr<float>(), T, k, S, H, p.out.ptr<float>(),
                      p.out.row_stride() / 4, ctx.stream, y_stride);
  return false;
}

}  // namespace ds::cuda
