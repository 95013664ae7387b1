// 4-bit GPTQ and AWQ checkpoints' packed linears (`qweight`, `qzeros`, `scales`, `g_idx`
// beside where `weight` would be), unpacked row by row into floats or, where exact, W4A16.
//
// GPTQ: qweight int32 [K/8, N], element (k, n) at bits 4*(k%8) of qweight[k/8, n]; qzeros
// int32 [G, N/8], zero of column n at bits 4*(n%8) (v1 stores zero - 1); scales F16 [G, N];
// g_idx int32 [K] (group of input k). AWQ GEMM: qweight int32 [K, N/8] and qzeros [G, N/8]
// packed along N, nibble i of word c holding column 8c + {0, 2, 4, 6, 1, 3, 5, 7}[i]; scales
// F16 [G, N]. Both: w[n, k] = (q(k, n) - zero(g(k), n)) * scale(g(k), n).
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "model/config.h"

namespace ds {

class WeightSource;

class Int4Checkpoint {
 public:
  // From the tensors themselves (g_idx may be an empty view: groups are k / group_size).
  Int4Checkpoint(const Int4Format& f, const std::string& stem, TensorView qweight,
                 TensorView qzeros, TensorView scales, TensorView g_idx, int64_t N, int64_t K);
  // `<stem>qweight` and friends of the weight `<stem>weight`; throws UnsupportedError naming
  // a missing tensor or a shape that does not match [N, K] (N, K < 0: taken from qweight).
  static Int4Checkpoint of(const WeightSource& w, const Int4Format& f, const std::string& stem,
                           int64_t N = -1, int64_t K = -1);

  int64_t rows() const { return N_; }
  int64_t cols() const { return K_; }
  int code(int64_t k, int64_t n) const;  // q(k, n), 0..15
  int zero(int64_t g, int64_t n) const;  // with v1's + 1
  float scale(int64_t g, int64_t n) const;
  int64_t group(int64_t k) const;
  void row(int64_t n, float* out) const;  // row n of w [N, K], exactly
  // Why W4A16 (code - 8, BF16 scale per 128 inputs) cannot hold this weight, "" when it can:
  // GPTQ, every zero 8, groups of 128 along k in order.
  const std::string& w4a16_blocker() const { return blocker_; }
  // Row n as a W4A16 row: codes copied, scales F16 -> BF16 (relative 2^-9 at most).
  void w4a16_row(int64_t n, uint8_t* dst) const;

 private:
  std::string find_blocker() const;
  static uint32_t word(const TensorView& t, int64_t i);

  Int4Format f_;
  TensorView qweight_, qzeros_, scales_, g_idx_;
  int64_t N_, K_, G_;
  std::string blocker_;
};

}  // namespace ds
