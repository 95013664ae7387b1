// Test-only writers that build GGUF and safetensors files byte by byte, so tests can make
// both valid files and precisely broken ones.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "formats/gguf.h"

namespace ds::test {

// Little-endian byte buffer.
struct Bytes {
  std::vector<uint8_t> data;

  template <typename T>
  Bytes& put(T v) {
    const size_t at = data.size();
    data.resize(at + sizeof(T));
    std::memcpy(data.data() + at, &v, sizeof(T));
    return *this;
  }
  Bytes& str(std::string_view s) {
    put<uint64_t>(s.size());
    data.insert(data.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& raw(const std::vector<uint8_t>& b) {
    data.insert(data.end(), b.begin(), b.end());
    return *this;
  }
  size_t size() const { return data.size(); }
};

template <typename T>
void put_at(std::vector<uint8_t>& b, size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof(T));
}

struct GgufTensorSpec {
  std::string name;
  std::vector<uint64_t> dims;  // GGUF order, dims[0] contiguous
  uint32_t ggml_type = 0;
  std::vector<uint8_t> data;
  std::optional<uint64_t> offset;  // relative to the data section; default: next aligned
};

// Where the builder put each field, for tests that patch one.
struct GgufLayout {
  size_t kv_start = 0;
  std::vector<size_t> kv_pos;  // start of each key
  size_t infos_start = 0;
  std::vector<size_t> info_pos, ndims_pos, type_pos, offset_pos;
  size_t data_start = 0;
};

class GgufBuilder {
 public:
  uint32_t version = 3;
  uint64_t alignment = 32;  // padding used; add a general.alignment kv when it is not 32
  std::optional<uint64_t> tensor_count, kv_count;  // override the counts written

  // Value bytes are written as given after the key and type id.
  GgufBuilder& kv_raw(const std::string& key, uint32_t type, const Bytes& value) {
    kvs_.push_back({key, type, value.data});
    return *this;
  }
  template <typename T>
  GgufBuilder& kv(const std::string& key, GgufType type, T v) {
    return kv_raw(key, uint32_t(type), Bytes().put<T>(v));
  }
  GgufBuilder& kv_str(const std::string& key, std::string_view s) {
    return kv_raw(key, uint32_t(GgufType::String), Bytes().str(s));
  }
  template <typename T>
  GgufBuilder& kv_array(const std::string& key, GgufType elem, const std::vector<T>& v) {
    Bytes b;
    b.put<uint32_t>(uint32_t(elem)).put<uint64_t>(v.size());
    for (const T& x : v) b.put<T>(x);
    return kv_raw(key, uint32_t(GgufType::Array), b);
  }
  GgufBuilder& kv_str_array(const std::string& key, const std::vector<std::string>& v) {
    Bytes b;
    b.put<uint32_t>(uint32_t(GgufType::String)).put<uint64_t>(v.size());
    for (const auto& s : v) b.str(s);
    return kv_raw(key, uint32_t(GgufType::Array), b);
  }
  GgufBuilder& alignment_kv(uint32_t a) {
    alignment = a;
    return kv("general.alignment", GgufType::U32, a);
  }
  GgufBuilder& tensor(GgufTensorSpec t) {
    tensors_.push_back(std::move(t));
    return *this;
  }

  std::vector<uint8_t> build(GgufLayout* layout = nullptr) const {
    GgufLayout l;
    Bytes b;
    b.put<uint32_t>(0x46554747).put<uint32_t>(version);
    b.put<uint64_t>(tensor_count.value_or(tensors_.size()));
    b.put<uint64_t>(kv_count.value_or(kvs_.size()));
    l.kv_start = b.size();
    for (const auto& kv : kvs_) {
      l.kv_pos.push_back(b.size());
      b.str(kv.key).put<uint32_t>(kv.type).raw(kv.value);
    }
    l.infos_start = b.size();
    std::vector<uint64_t> offsets;
    uint64_t next = 0;
    for (const auto& t : tensors_) {
      const uint64_t off = t.offset.value_or(next);
      offsets.push_back(off);
      next = pad(std::max(next, off + t.data.size()));
      l.info_pos.push_back(b.size());
      b.str(t.name);
      l.ndims_pos.push_back(b.size());
      b.put<uint32_t>(uint32_t(t.dims.size()));
      for (const uint64_t d : t.dims) b.put<uint64_t>(d);
      l.type_pos.push_back(b.size());
      b.put<uint32_t>(t.ggml_type);
      l.offset_pos.push_back(b.size());
      b.put<uint64_t>(off);
    }
    l.data_start = pad(b.size());
    b.data.resize(l.data_start, 0);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const size_t at = l.data_start + offsets[i];
      if (b.data.size() < at + tensors_[i].data.size())
        b.data.resize(at + tensors_[i].data.size(), 0);
      std::copy(tensors_[i].data.begin(), tensors_[i].data.end(), b.data.begin() + long(at));
    }
    if (!tensors_.empty()) b.data.resize(std::max<size_t>(b.data.size(), l.data_start + next), 0);
    if (layout) *layout = l;
    return b.data;
  }

 private:
  struct Kv {
    std::string key;
    uint32_t type;
    std::vector<uint8_t> value;
  };
  uint64_t pad(uint64_t x) const { return (x + alignment - 1) / alignment * alignment; }
  std::vector<Kv> kvs_;
  std::vector<GgufTensorSpec> tensors_;
};

// Element i of type T at p; a memcpy because file data need not be aligned for T.
template <typename T>
T load(const void* p, size_t i = 0) {
  T v;
  std::memcpy(&v, static_cast<const uint8_t*>(p) + i * sizeof(T), sizeof(T));
  return v;
}

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A safetensors file: 8-byte header length, the header text, then the data.
inline std::vector<uint8_t> safetensors_bytes(const std::string& header,
                                              const std::vector<uint8_t>& data,
                                              std::optional<uint64_t> header_len = {}) {
  Bytes b;
  b.put<uint64_t>(header_len.value_or(header.size()));
  b.data.insert(b.data.end(), header.begin(), header.end());
  b.raw(data);
  return b.data;
}

// A fresh folder under the system temp dir, removed when the test ends.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("ds_formats_" + std::to_string(rd()) + "_" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path write(const std::string& name, const std::vector<uint8_t>& bytes) const {
    const auto p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return p;
  }
  std::filesystem::path write_text(const std::string& name, const std::string& text) const {
    return write(name, std::vector<uint8_t>(text.begin(), text.end()));
  }

 private:
  std::filesystem::path path_;
};

// Runs fn and returns the FormatError it throws; fails the test if it throws nothing else.
template <typename Fn>
std::optional<FormatError> catch_format_error(Fn&& fn) {
  try {
    fn();
  } catch (const FormatError& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected FormatError, got: " << e.what();
    return std::nullopt;
  }
  ADD_FAILURE() << "expected FormatError, nothing was thrown";
  return std::nullopt;
}

}  // namespace ds::test
