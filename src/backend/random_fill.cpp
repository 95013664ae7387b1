// Host side of dummy weights and W4A16 / FP8W quantization: the reference the devices match.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/fp8w.h"
#include "backend/w4a16.h"
#include "core/error.h"

namespace ds {

namespace {
// 0 when `name` is unset, else the alignment it forces on every row (for A/Bs).
int64_t forced_row_align(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  const long long a = std::atoll(v);
  if (a < 16 || a > 256 || (a & (a - 1)) != 0)
    throw Error(std::string(name) + "=" + v + ": want a power of two from 16 to 256");
  return int64_t(a);
}
int64_t round_up(int64_t bytes, int64_t a) {
  return (bytes + a - 1) / a * a;
}
// A quantized row's stride: `bytes` on whole 128-byte L2 lines where that pads at most 1/16 of
// the row (then a 128-byte stage chunk of a row never straddles two lines), else on 16 bytes;
// `forced` (> 0) pads every row to that instead.
// W4A16, DeepSeek-V2.5's experts on W5's 20 layers (H100, ebcadb1, 2 rounds each): 981.9 tok/s
// with this rule, 946.1 with 16-byte rows, 965.8 with 32, 981.6 with every row on lines
// (+1.6 GB); gate/up rows 2,640 -> 2,688 bytes took a gate/up item from 54.0 to 49.1 us, down
// rows 800 -> 896 (+12%, left at 800 here) gained nothing (3d24dbd).
// FP8W, DeepSeek-V2-Lite's W1f (same run): 1,392.1 tok/s with 16-byte rows, 1,413.1 with 32,
// 1,423.5 on lines (gate/up 2,112 -> 2,176 bytes, down 1,456 -> 1,536: all within 1/16).
int64_t quantized_row_stride(int64_t bytes, int64_t forced) {
  if (forced > 0) return round_up(bytes, forced);
  const int64_t base = round_up(bytes, 16), line = round_up(bytes, 128);
  return (line - base) * 16 <= base ? line : base;
}
}  // namespace

int64_t w4a16::row_stride(int64_t k) {
  static const int64_t forced = forced_row_align("DEEPSERVE_W4A16_ROW_ALIGN");
  return quantized_row_stride(k / 2 + k / 64, forced);
}

int64_t fp8w::row_stride(int64_t k) {
  static const int64_t forced = forced_row_align("DEEPSERVE_FP8W_ROW_ALIGN");
  return quantized_row_stride(fp8w::code_bytes(k) + fp8w::groups(k) * 4, forced);
}

TensorView w4a16_view(void* data, int64_t rows, int64_t cols, Device device) {
  if (cols % w4a16::kGroup != 0)
    throw UnsupportedError("W4A16 weights need K (" + std::to_string(cols) +
                           ") to be a multiple of " + std::to_string(w4a16::kGroup));
  TensorView t = TensorView::contiguous(data, DType::W4A16, {rows, cols}, device);
  t.stride[0] = w4a16::row_stride(cols);
  return t;
}

size_t w4a16_bytes(int64_t rows, int64_t cols) {
  return size_t(rows) * size_t(w4a16::row_stride(cols));
}

TensorView fp8w_view(void* data, int64_t rows, int64_t cols, Device device) {
  TensorView t = TensorView::contiguous(data, DType::FP8W, {rows, cols}, device);
  t.stride[0] = fp8w::row_stride(cols);
  return t;
}

size_t fp8w_bytes(int64_t rows, int64_t cols) {
  return size_t(rows) * size_t(fp8w::row_stride(cols));
}

void quantize_fp8w_row(const float* x, int64_t K, uint8_t* dst) {
  fp8w::quantize_row(x, K, dst);
}

void dequantize_fp8w_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = fp8w::element(row, K, k);
}

RandomFillShape random_fill_shape(const TensorView& dst, const RandomFill& p) {
  DS_CHECK(dst.ndim >= 1 && dst.ndim <= 3, "fill_random takes a 1-, 2- or 3-D tensor");
  RandomFillShape s;
  s.dims = {1, 1, dst.shape[dst.ndim - 1]};
  if (dst.ndim >= 2) s.dims[1] = dst.shape[dst.ndim - 2];
  if (dst.ndim == 3) s.dims[0] = dst.shape[0];
  s.map = p.map;
  if (s.map == std::array<int64_t, 3>{}) s.map = {s.dims[1] * s.dims[2], s.dims[2], 1};
  s.mul = p.std / w4a16::kSumStd;
  DS_CHECK(p.round_as == DType::F32 || p.round_as == DType::F16 || p.round_as == DType::BF16,
           "fill_random rounds through F32, F16 or BF16");
  if (dst.dtype == DType::W4A16) {
    DS_CHECK(dst.ndim == 2 && dst.row_stride() == w4a16::row_stride(dst.cols()),
             "fill_random: a W4A16 tensor must be a whole [rows, cols] W4A16 view");
  } else if (dst.dtype == DType::FP8W) {
    DS_CHECK(dst.ndim == 2 && dst.row_stride() == fp8w::row_stride(dst.cols()),
             "fill_random: an FP8W tensor must be a whole [rows, cols] FP8W view");
  } else {
    DS_CHECK(dst.dtype == DType::F32 || dst.dtype == DType::F16 || dst.dtype == DType::BF16,
             "fill_random fills F32, F16, BF16, W4A16 or FP8W tensors");
    DS_CHECK(dst.is_contiguous(), "fill_random needs a contiguous tensor");
  }
  return s;
}

float random_fill_value(const RandomFill& p, const RandomFillShape& s, int64_t a, int64_t b,
                        int64_t c) {
  const float v = w4a16::random_value(p.seed, uint64_t(a * s.map[0] + b * s.map[1] + c * s.map[2]),
                                      p.mean, s.mul);
  switch (p.round_as) {
    case DType::BF16:
      return w4a16::from_bf16(w4a16::to_bf16(v));
    case DType::F16:
      return fp16_to_f32(f32_to_fp16(v));
    default:
      return v;
  }
}

void quantize_w4a16_row(const float* x, int64_t K, uint8_t* dst) {
  DS_CHECK(K % w4a16::kGroup == 0, "W4A16 rows are whole groups of 128");
  auto* scales = dst + K / 2;
  for (int64_t g = 0; g < K / w4a16::kGroup; ++g) {
    uint16_t s = 0;
    w4a16::quantize_group(x + g * w4a16::kGroup, dst + g * (w4a16::kGroup / 2), &s);
    scales[2 * g] = uint8_t(s & 0xff);
    scales[2 * g + 1] = uint8_t(s >> 8);
  }
  for (int64_t i = K / 2 + K / 64; i < w4a16::row_stride(K); ++i) dst[i] = 0;
}

void dequantize_w4a16_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = w4a16::element(row, K, k);
}

void slice_packed_row(DType dt, const uint8_t* row, int64_t K, int64_t begin, int64_t n,
                      uint8_t* dst) {
  constexpr int64_t G = 128;
  static_assert(w4a16::kGroup == G && fp8w::kGroup == G, "one group size");
  DS_CHECK(row_scaled_dtype(dt), "slice_packed_row takes W4A16 or FP8W");
  DS_CHECK(begin >= 0 && n > 0 && begin % G == 0 && n % G == 0 && begin + n <= K,
           "packed column slices are whole groups of 128 inside the row");
  const bool w4 = dt == DType::W4A16;
  const int64_t stride = w4 ? w4a16::row_stride(n) : fp8w::row_stride(n);
  std::memset(dst, 0, size_t(stride));
  // Codes: half a byte (W4A16) or one byte (FP8W) per column; then one scale per group
  // (BF16, 2 bytes, right after the codes; F32, 4 bytes, after the padded codes).
  const int64_t code_from = w4 ? begin / 2 : begin, code_n = w4 ? n / 2 : n;
  std::memcpy(dst, row + code_from, size_t(code_n));
  const int64_t sb = w4 ? 2 : 4;
  const int64_t src_scales = w4 ? K / 2 : fp8w::code_bytes(K);
  const int64_t dst_scales = w4 ? n / 2 : fp8w::code_bytes(n);
  std::memcpy(dst + dst_scales, row + src_scales + (begin / G) * sb, size_t((n / G) * sb));
}

void Backend::fill_random(TensorView dst, const RandomFill& p) {
  const RandomFillShape s = random_fill_shape(dst, p);
  const int64_t rows = s.dims[0] * s.dims[1], C = s.dims[2];
  const size_t row_bytes = size_t(dst.row_stride());
  std::vector<uint8_t> host(size_t(rows) * row_bytes);
  std::vector<float> vals(static_cast<size_t>(C));
  for (int64_t a = 0; a < s.dims[0]; ++a)
    for (int64_t b = 0; b < s.dims[1]; ++b) {
      for (int64_t c = 0; c < C; ++c) vals[size_t(c)] = random_fill_value(p, s, a, b, c);
      uint8_t* out = host.data() + size_t(a * s.dims[1] + b) * row_bytes;
      if (dst.dtype == DType::W4A16) {
        quantize_w4a16_row(vals.data(), C, out);
      } else if (dst.dtype == DType::FP8W) {
        quantize_fp8w_row(vals.data(), C, out);
      } else {
        for (int64_t c = 0; c < C; ++c) {
          const float v = vals[size_t(c)];
          if (dst.dtype == DType::F32) {
            std::memcpy(out + c * 4, &v, 4);
          } else {
            const uint16_t h = dst.dtype == DType::BF16 ? f32_to_bf16(v) : f32_to_fp16(v);
            std::memcpy(out + c * 2, &h, 2);
          }
        }
      }
    }
  upload(dst, host.data(), host.size());
}

}  // namespace ds
