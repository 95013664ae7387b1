#include "model/gptq.h"

#include <cstring>

#include "backend/w4a16.h"
#include "core/error.h"
#include "model/binder.h"
#include "model/weights.h"

namespace ds {
namespace {

// Nibble of column n%8 in an AWQ word: the inverse of the packing order {0, 2, 4, 6, 1, 3, 5, 7}.
constexpr int kAwqNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

void expect(bool ok, const std::string& stem, const std::string& what) {
  if (!ok) throw UnsupportedError("4-bit tensor '" + stem + "weight': " + what);
}

std::string dims(const TensorView& t) {
  return t.shape_str();
}

}  // namespace

Int4Checkpoint::Int4Checkpoint(const Int4Format& f, const std::string& stem, TensorView qweight,
                               TensorView qzeros, TensorView scales, TensorView g_idx, int64_t N,
                               int64_t K)
    : f_(f), qweight_(qweight), qzeros_(qzeros), scales_(scales), g_idx_(g_idx), N_(N), K_(K) {
  const bool gptq = f.kind == Int4Format::Kind::Gptq;
  const int64_t gs = f.group_size == -1 ? K : f.group_size;
  G_ = (K + gs - 1) / gs;
  expect(K % 8 == 0 && N % 8 == 0, stem, "N and K must be multiples of 8");
  expect(qweight.dtype == DType::I32 && qweight.ndim == 2 && qweight.is_contiguous() &&
             qweight.shape[0] == (gptq ? K / 8 : K) && qweight.shape[1] == (gptq ? N : N / 8),
         stem,
         "qweight " + dims(qweight) + " is not I32 " + (gptq ? "[K/8, N]" : "[K, N/8]") +
             " for [N, K] = [" + std::to_string(N) + ", " + std::to_string(K) + "]");
  expect(
      scales.ndim == 2 && scales.is_contiguous() && scales.shape[1] == N &&
          (scales.dtype == DType::F16 || scales.dtype == DType::BF16 || scales.dtype == DType::F32),
      stem, "scales " + dims(scales) + " is not a float [groups, N]");
  if (g_idx_.data) {  // groups come from g_idx, whatever group_size says
    expect(g_idx.dtype == DType::I32 && g_idx.numel() == K, stem, "g_idx is not I32 [K]");
    G_ = scales.shape[0];
  }
  expect(scales.shape[0] == G_, stem,
         "scales " + dims(scales) + " has not " + std::to_string(G_) + " groups");
  expect(qzeros.dtype == DType::I32 && qzeros.ndim == 2 && qzeros.is_contiguous() &&
             qzeros.shape[0] == G_ && qzeros.shape[1] == N / 8,
         stem, "qzeros " + dims(qzeros) + " is not I32 [groups, N/8]");
  for (int64_t k = 0; g_idx_.data && k < K; ++k)
    expect(group(k) >= 0 && group(k) < G_, stem, "g_idx out of range");
  blocker_ = find_blocker();
}

Int4Checkpoint Int4Checkpoint::of(const WeightSource& w, const Int4Format& f,
                                  const std::string& stem, int64_t N, int64_t K) {
  auto need = [&](const char* what) {
    const auto t = w.find(stem + what);
    expect(t.has_value(), stem, std::string("no ") + stem + what + " beside " + stem + "qweight");
    return *t;
  };
  const TensorView qw = need("qweight");
  const bool gptq = f.kind == Int4Format::Kind::Gptq;
  if (N < 0 && qw.ndim == 2) N = gptq ? qw.shape[1] : qw.shape[1] * 8;
  if (K < 0 && qw.ndim == 2) K = gptq ? qw.shape[0] * 8 : qw.shape[0];
  TensorView g_idx{};
  if (f.kind == Int4Format::Kind::Gptq)
    if (const auto g = w.find(stem + "g_idx")) g_idx = *g;
  return Int4Checkpoint(f, stem, qw, need("qzeros"), need("scales"), g_idx, N, K);
}

uint32_t Int4Checkpoint::word(const TensorView& t, int64_t i) {
  uint32_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(t.data) + i * 4, 4);
  return v;
}

int Int4Checkpoint::code(int64_t k, int64_t n) const {
  if (f_.kind == Int4Format::Kind::Gptq)
    return int(word(qweight_, (k / 8) * N_ + n) >> (4 * (k % 8)) & 15);
  return int(word(qweight_, k * (N_ / 8) + n / 8) >> (4 * kAwqNibble[n % 8]) & 15);
}

int Int4Checkpoint::zero(int64_t g, int64_t n) const {
  const int nib = f_.kind == Int4Format::Kind::Gptq ? int(n % 8) : kAwqNibble[n % 8];
  const int z = int(word(qzeros_, g * (N_ / 8) + n / 8) >> (4 * nib) & 15);
  return f_.zeros_minus_one ? z + 1 : z;
}

float Int4Checkpoint::scale(int64_t g, int64_t n) const {
  return host_element(scales_, g * N_ + n);
}

int64_t Int4Checkpoint::group(int64_t k) const {
  if (g_idx_.data) return int64_t(int32_t(word(g_idx_, k)));
  return f_.group_size == -1 ? 0 : k / f_.group_size;
}

void Int4Checkpoint::row(int64_t n, float* out) const {
  for (int64_t k = 0; k < K_; ++k) {
    const int64_t g = group(k);
    out[k] = float(code(k, n) - zero(g, n)) * scale(g, n);
  }
}

std::string Int4Checkpoint::find_blocker() const {
  if (f_.kind == Int4Format::Kind::Awq) return "AWQ (zero points)";
  if (K_ % w4a16::kGroup != 0) return "K is not a multiple of 128";
  for (int64_t k = 0; k < K_; ++k)
    if (group(k) != k / w4a16::kGroup)
      return g_idx_.data ? "act-order g_idx / groups other than 128" : "group size not 128";
  for (int64_t g = 0; g < G_; ++g)
    for (int64_t n = 0; n < N_; ++n)
      if (zero(g, n) != 8) return "zero points other than 8";
  return "";
}

void Int4Checkpoint::w4a16_row(int64_t n, uint8_t* dst) const {
  DS_CHECK(blocker_.empty(), "w4a16_row: " + blocker_);
  std::memset(dst, 0, size_t(w4a16::row_stride(K_)));
  for (int64_t k = 0; k < K_; k += 2) dst[k / 2] = uint8_t(code(k, n) | code(k + 1, n) << 4);
  for (int64_t g = 0; g < K_ / w4a16::kGroup; ++g) {
    const uint16_t s = w4a16::to_bf16(scale(g, n));
    std::memcpy(dst + K_ / 2 + 2 * g, &s, 2);
  }
}

}  // namespace ds
