// Rewrites a GGUF file with its float weight matrices re-quantized to a GGML block type
// (quants.cpp's reference quantizers: Q4_0, Q4_1, Q8_0): header and metadata copied byte for
// byte, tensor infos rewritten, data re-laid out at the file's alignment. Kept as they are:
// tensors whose rows are not whole blocks, 1-D tensors, the routers, the attn_k_b / attn_v_b
// halves (the binder permutes those element-wise), and a block's experts unless all of them
// can change. For the GPU tests' quantized DeepSeek-V2 fixtures.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "core/dtype.h"

namespace ds::test {

class GgufBytes {
 public:
  explicit GgufBytes(const std::vector<uint8_t>& b) : b_(b) {}
  template <typename T>
  T get() {
    if (at_ + sizeof(T) > b_.size()) throw std::runtime_error("gguf: truncated");
    T v;
    std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string str() {
    const auto n = get<uint64_t>();
    std::string s(reinterpret_cast<const char*>(b_.data() + at_), size_t(n));
    at_ += size_t(n);
    return s;
  }
  // Skips one metadata value of GGUF type `type`.
  void skip_value(uint32_t type) {
    static constexpr int kSize[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (type == 8) {
      str();
    } else if (type == 9) {
      const auto et = get<uint32_t>();
      const auto n = get<uint64_t>();
      for (uint64_t i = 0; i < n; ++i) skip_value(et);
    } else if (type < 13) {
      at_ += size_t(kSize[type]);
    } else {
      throw std::runtime_error("gguf: bad value type");
    }
  }
  size_t at() const { return at_; }

 private:
  const std::vector<uint8_t>& b_;
  size_t at_ = 0;
};

inline void requantize_gguf(const std::filesystem::path& src, const std::filesystem::path& dst,
                            DType to) {
  std::ifstream in(src, std::ios::binary);
  const std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), {});
  GgufBytes r(b);
  r.get<uint32_t>();  // magic
  r.get<uint32_t>();  // version
  const auto n_tensors = r.get<uint64_t>(), n_kv = r.get<uint64_t>();
  uint64_t align = 32;
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = r.str();
    const auto type = r.get<uint32_t>();
    if (key == "general.alignment" && type == 4) {
      align = r.get<uint32_t>();
      continue;
    }
    r.skip_value(type);
  }
  const size_t kv_end = r.at();
  struct Info {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    uint64_t offset;
  };
  std::vector<Info> infos;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    Info t;
    t.name = r.str();
    const auto nd = r.get<uint32_t>();
    for (uint32_t d = 0; d < nd; ++d) t.dims.push_back(r.get<uint64_t>());
    t.type = r.get<uint32_t>();
    t.offset = r.get<uint64_t>();
    infos.push_back(t);
  }
  const size_t data0 = (r.at() + align - 1) / align * align;
  const int bs = dtype_info(to).block_size;
  const auto moe_family = [](const std::string& n) {  // "blk.N." of an expert tensor, or ""
    if (n.find("_exps") == std::string::npos && n.find("_shexp") == std::string::npos)
      return std::string();
    return n.substr(0, n.find('.', 4) + 1);
  };
  const auto qualifies = [&](const Info& t) {
    const DType from = *dtype_from_ggml(t.type);
    return t.dims.size() >= 2 && t.dims[0] % uint64_t(bs) == 0 &&
           (from == DType::F32 || from == DType::F16 || from == DType::BF16) &&
           t.name.find("attn_k_b") == std::string::npos &&
           t.name.find("ffn_gate_inp") == std::string::npos &&  // the router: F32 in llama.cpp
           t.name.find("attn_v_b") == std::string::npos;
  };
  // A block's routed and shared experts go to one moe_ffn, which needs one dtype: all or none.
  std::vector<std::string> mixed;
  for (const Info& t : infos)
    if (!moe_family(t.name).empty() && !qualifies(t)) mixed.push_back(moe_family(t.name));
  std::vector<uint8_t> data;
  std::vector<Info> out_infos;
  for (const Info& t : infos) {
    const DType from = *dtype_from_ggml(t.type);
    uint64_t n = 1;
    for (uint64_t d : t.dims) n *= d;
    const std::string fam = moe_family(t.name);
    const bool quant =
        qualifies(t) && (fam.empty() || std::find(mixed.begin(), mixed.end(), fam) == mixed.end());
    data.resize((data.size() + align - 1) / align * align);
    Info o = t;
    o.offset = data.size();
    const uint8_t* p = b.data() + data0 + t.offset;
    if (!quant) {
      data.insert(data.end(), p, p + dtype_bytes(from, int64_t(n)));
    } else {
      o.type = dtype_to_ggml(to);
      const int64_t k = int64_t(t.dims[0]), rows = int64_t(n) / k;
      std::vector<float> row(static_cast<size_t>(k));
      std::vector<uint8_t> q(dtype_bytes(to, k));
      const size_t es = dtype_info(from).type_size;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < k; ++c) {
          const uint8_t* e = p + size_t(i * k + c) * es;
          uint16_t h;
          std::memcpy(&h, e, 2);
          float f;
          if (from == DType::F32)
            std::memcpy(&f, e, 4);
          else
            f = from == DType::F16 ? fp16_to_f32(h) : bf16_to_f32(h);
          row[size_t(c)] = f;
        }
        cpu::quantize_row_ref(to, row.data(), q.data(), k);
        data.insert(data.end(), q.begin(), q.end());
      }
    }
    out_infos.push_back(o);
  }
  std::vector<uint8_t> out(b.begin(), b.begin() + std::ptrdiff_t(kv_end));
  auto put = [&](const void* v, size_t n) {
    const auto* c = static_cast<const uint8_t*>(v);
    out.insert(out.end(), c, c + n);
  };
  for (const Info& t : out_infos) {
    const uint64_t len = t.name.size();
    put(&len, 8);
    put(t.name.data(), t.name.size());
    const auto nd = uint32_t(t.dims.size());
    put(&nd, 4);
    put(t.dims.data(), t.dims.size() * 8);
    put(&t.type, 4);
    put(&t.offset, 8);
  }
  out.resize((out.size() + align - 1) / align * align);
  out.insert(out.end(), data.begin(), data.end());
  std::ofstream(dst, std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), std::streamsize(out.size()));
}

}  // namespace ds::test
