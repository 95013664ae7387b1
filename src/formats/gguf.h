// GGUF (v2, v3) reader over a memory-mapped file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "core/dtype.h"
#include "core/mmap.h"
#include "core/tensor.h"

namespace ds {

// gguf_type: the metadata value types of the format.
enum class GgufType : uint32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  Bool = 7,
  String = 8,
  Array = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};
std::string_view gguf_type_name(GgufType t);
inline bool gguf_is_signed(GgufType t) {
  return t == GgufType::I8 || t == GgufType::I16 || t == GgufType::I32 || t == GgufType::I64;
}
inline bool gguf_is_unsigned(GgufType t) {
  return t == GgufType::U8 || t == GgufType::U16 || t == GgufType::U32 || t == GgufType::U64;
}
inline bool gguf_is_int(GgufType t) {
  return gguf_is_signed(t) || gguf_is_unsigned(t);
}
inline bool gguf_is_float(GgufType t) {
  return t == GgufType::F32 || t == GgufType::F64;
}

// A metadata value. Integers are widened to int64/uint64, floats to double; arrays keep
// their element type and hold their elements in the matching vector.
struct GgufValue {
  GgufType type = GgufType::I64;       // matches the default int64_t value
  GgufType array_type = GgufType::U8;  // element type when type == Array
  std::variant<int64_t, uint64_t, double, bool, std::string, std::vector<int64_t>,
               std::vector<uint64_t>, std::vector<double>, std::vector<std::string>,
               std::vector<std::monostate>>  // arrays of arrays: only their length is kept
      value;

  std::optional<int64_t> as_int() const;   // any integer or bool scalar
  std::optional<double> as_float() const;  // any number scalar
  std::optional<std::string> as_string() const;
  size_t array_size() const;
  std::string to_string(size_t max_items = 8) const;  // for `inspect`
};

struct GgufTensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> dims;  // GGUF order: dims[0] is the contiguous dimension (ne0)
  uint64_t offset = 0;        // absolute byte offset in the file
  uint64_t nbytes = 0;
};

class GgufFile {
 public:
  // Maps and parses a file; throws FormatError naming the file and offset when malformed.
  static GgufFile open(const std::filesystem::path& path);
  // Parses bytes already in memory (tests, fuzzing); `name` is used in error messages.
  // The bytes must outlive the returned object.
  static GgufFile parse(std::span<const uint8_t> bytes, const std::string& name);

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  const std::string& path() const { return name_; }

  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const GgufValue* find(const std::string& key) const;
  std::optional<int64_t> get_int(const std::string& key) const;
  std::optional<double> get_float(const std::string& key) const;
  std::optional<std::string> get_string(const std::string& key) const;
  std::optional<bool> get_bool(const std::string& key) const;
  // Empty when missing; throws Error if present with another type.
  const std::vector<std::string>& get_string_array(const std::string& key) const;
  std::vector<int64_t> get_int_array(const std::string& key) const;
  std::vector<double> get_float_array(const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;
  // Row-major CPU view into the mapped data (shape reversed from GGUF's dims).
  TensorView view(const GgufTensorInfo& info) const;
  const std::shared_ptr<MappedFile>& mapping() const { return file_; }

 private:
  std::string name_;
  std::shared_ptr<MappedFile> file_;  // null when parsed from caller-owned bytes
  std::span<const uint8_t> bytes_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace ds
