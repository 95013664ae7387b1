#include "backend/backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "backend/cpu/sample.h"
#include "core/argmax.h"
#include "core/tensor_views.h"

namespace ds {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::Embed:
      return "embed";
    case Op::RmsNorm:
      return "rms_norm";
    case Op::MatMul:
      return "matmul";
    case Op::Rope:
      return "rope";
    case Op::StoreKv:
      return "store_kv";
    case Op::Attention:
      return "attention";
    case Op::SiluMul:
      return "silu_mul";
    case Op::Add:
      return "add";
    case Op::BatchedMatMul:
      return "batched_matmul";
    case Op::MlaAttention:
      return "mla_attention";
    case Op::MoeRoute:
      return "moe_route";
    case Op::MoeFfn:
      return "moe_ffn";
  }
  return "?";
}

void Backend::add_rms_norm(TensorView x, const TensorView& y, const TensorView& w, float eps,
                           TensorView out) {
  add(x, y);
  rms_norm(x, w, eps, out);
}

void Backend::norm_matmul(const NormMatmulParams& p) {
  if (p.y.data != nullptr) {
    copy(p.x, p.x_out);
    add_rms_norm(p.x_out, p.y, p.norm, p.eps, p.xn);
  } else {
    rms_norm(p.x, p.norm, p.eps, p.xn);
  }
  matmul(p.xn, p.w, p.out);
}

void Backend::matmul_add_norm(const MatmulNormParams& p) {
  matmul(p.x, p.w, p.out);
  add_norm_after(p.out, p.add_norm);
}

void Backend::add_norm_after(const TensorView& y, const AddNormParams& p) {
  copy(p.r, p.r_out);
  add_rms_norm(p.r_out, y, p.norm, p.eps, p.rn);
}

void Backend::mla_prepare(const MlaPrepareParams& p, const AttentionMeta& meta) {
  const TensorView& kva = p.kva;
  const int64_t R = p.kv_lora_rank, P = kva.cols() - R;
  DS_CHECK(kva.ndim == 2 && R > 0 && P >= 0,
           "mla_prepare: kva " + kva.shape_str() + " with kv_lora_rank " + std::to_string(R));
  TensorView ckv = cols(kva, 0, R);
  rms_norm(ckv, p.norm, p.eps, ckv);
  rope(p.q_rope, meta.positions, p.rope);
  rope(heads_view(cols(kva, R, P), 1, int(P)), meta.positions, p.rope);
  store_kv(heads_view(kva, 1, int(R + P)), TensorView{}, p.cache, meta);
}

void Backend::argmax(const TensorView& logits, TensorView ids) {
  const int64_t R = logits.rows(), V = logits.cols();
  DS_CHECK(logits.dtype == DType::F32 && logits.is_contiguous() && ids.numel() >= R,
           "argmax takes contiguous F32 logits [R, V] and I32 ids [R]");
  std::vector<float> host(static_cast<size_t>(R * V));
  std::vector<int32_t> out(static_cast<size_t>(R));
  download(host.data(), logits, host.size() * 4);
  for (int64_t r = 0; r < R; ++r)
    out[size_t(r)] = int32_t(argmax_first(host.data() + r * V, size_t(V)));
  upload(ids, out.data(), out.size() * 4);
}

void Backend::sample(const TensorView& logits, const SampleRow* rows, TensorView ids) {
  const int64_t R = logits.rows(), V = logits.cols();
  DS_CHECK(logits.dtype == DType::F32 && logits.ndim == 2 && logits.row_stride() % 4 == 0 &&
               ids.numel() >= R,
           "sample takes F32 logits [R, V] (rows may be strided) and I32 ids [R]");
  if (R == 0) return;
  const int64_t ld = logits.row_stride() / 4;
  // One download of the span the rows cover, gaps included.
  std::vector<float> host(size_t((R - 1) * ld + V));
  download(host.data(),
           TensorView::contiguous(logits.data, DType::F32, {int64_t(host.size())}, logits.device),
           host.size() * 4);
  std::vector<SampleRow> params(static_cast<size_t>(R));
  download(params.data(),
           TensorView::contiguous(const_cast<SampleRow*>(rows), DType::U8,
                                  {R * int64_t(sizeof(SampleRow))}, device()),
           params.size() * sizeof(SampleRow));
  std::vector<int32_t> out(static_cast<size_t>(R));
  cpu::sample_rows(host.data(), R, V, ld, params.data(), out.data(), nullptr);
  upload(ids, out.data(), out.size() * 4);
}

int Backend::mark() {
  synchronize();  // a host clock only times work that has finished
  host_marks_ns_.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count());
  return int(host_marks_ns_.size()) - 1;
}

std::vector<double> Backend::mark_times_ms() {
  std::vector<double> t(host_marks_ns_.size());
  for (size_t i = 0; i < t.size(); ++i) t[i] = double(host_marks_ns_[i] - host_marks_ns_[0]) / 1e6;
  return t;
}

void Backend::clear_marks() {
  host_marks_ns_.clear();
}

float yarn_mscale(float factor, float mscale) {
  return factor <= 1.0f ? 1.0f : 0.1f * mscale * std::log(factor) + 1.0f;
}

namespace {
// The rotary dim index whose wavelength makes `rotations` turns over the original context.
double yarn_correction_dim(double rotations, int dim, double base, int max_pos) {
  return dim * std::log(max_pos / (rotations * 2 * M_PI)) / (2 * std::log(base));
}
}  // namespace

std::vector<float> rope_inv_freq(const RopeParams& p) {
  const int dim = p.rotary_dim, half = dim / 2;
  std::vector<float> inv(size_t(std::max(half, 0)));
  // Computed in float like the reference (torch float32 arange / pow), so angles match.
  for (int i = 0; i < half; ++i) {
    const float extra = 1.0f / std::pow(p.theta, float(2 * i) / float(dim));
    inv[size_t(i)] = p.freq_scale * extra;
  }
  if (p.yarn_factor > 0.0f) {
    double low = std::floor(
        yarn_correction_dim(p.yarn_beta_fast, dim, p.theta, p.yarn_original_max_position));
    double high = std::ceil(
        yarn_correction_dim(p.yarn_beta_slow, dim, p.theta, p.yarn_original_max_position));
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    for (int i = 0; i < half; ++i) {
      const float extra = 1.0f / std::pow(p.theta, float(2 * i) / float(dim));
      const float inter = 1.0f / (p.yarn_factor * std::pow(p.theta, float(2 * i) / float(dim)));
      const float ramp = std::clamp(float((i - low) / (high - low)), 0.0f, 1.0f);
      const float mask = 1.0f - ramp;  // 1: keep the original (extrapolated) frequency
      inv[size_t(i)] = inter * (1.0f - mask) + extra * mask;
    }
  }
  return inv;
}

}  // namespace ds
