#include "formats/gguf.h"

#include <algorithm>
#include <bit>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace ds {
namespace {

static_assert(std::endian::native == std::endian::little, "the GGUF reader assumes a LE host");

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr int kMaxArrayDepth = 16;       // nested arrays deeper than this are rejected
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;       // key length, value type, smallest value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // name length, n_dims, type, offset

bool is_valid_type(uint32_t t) { return t <= uint32_t(GgufType::F64); }

bool is_signed_int(GgufType t) {
  return t == GgufType::I8 || t == GgufType::I16 || t == GgufType::I32 || t == GgufType::I64;
}
bool is_unsigned_int(GgufType t) {
  return t == GgufType::U8 || t == GgufType::U16 || t == GgufType::U32 || t == GgufType::U64;
}
bool is_int(GgufType t) { return is_signed_int(t) || is_unsigned_int(t); }
bool is_float(GgufType t) { return t == GgufType::F32 || t == GgufType::F64; }

// Fewest bytes a value of type t takes in the file; bounds counts before allocating.
uint64_t min_value_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8:
    case GgufType::I8:
    case GgufType::Bool: return 1;
    case GgufType::U16:
    case GgufType::I16: return 2;
    case GgufType::U32:
    case GgufType::I32:
    case GgufType::F32: return 4;
    case GgufType::U64:
    case GgufType::I64:
    case GgufType::F64:
    case GgufType::String: return 8;
    case GgufType::Array: return 4 + 8;
  }
  return 1;
}

// Bounds-checked little-endian cursor over the file bytes; every failure names the field.
class Reader {
 public:
  Reader(std::span<const uint8_t> bytes, const std::string& name) : bytes_(bytes), name_(name) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return bytes_.size() - pos_; }

  [[noreturn]] void fail(uint64_t at, const std::string& problem) const {
    throw FormatError(name_, at, problem);
  }

  void need(uint64_t n, const std::string& what) const {
    if (n > remaining())
      fail(pos_, "unexpected end of file reading " + what + " (needs " + std::to_string(n) +
                     " bytes, " + std::to_string(remaining()) + " left)");
  }

  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  void skip(uint64_t n, const std::string& what) {
    need(n, what);
    pos_ += n;
  }

  std::string read_string(const std::string& what) {
    const uint64_t at = pos_;
    const auto len = read<uint64_t>(what + " length");
    if (len > remaining())
      fail(at, what + " length " + std::to_string(len) + " runs past end of file (" +
                   std::to_string(remaining()) + " bytes left)");
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), size_t(len));
    pos_ += len;
    return s;
  }

  GgufType read_type(const std::string& what) {
    const uint64_t at = pos_;
    const auto t = read<uint32_t>(what);
    if (!is_valid_type(t)) fail(at, "unknown " + what + " " + std::to_string(t));
    return GgufType(t);
  }

 private:
  std::span<const uint8_t> bytes_;
  const std::string& name_;
  uint64_t pos_ = 0;
};

int64_t read_signed(Reader& r, GgufType t, const std::string& what) {
  switch (t) {
    case GgufType::I8: return r.read<int8_t>(what);
    case GgufType::I16: return r.read<int16_t>(what);
    case GgufType::I32: return r.read<int32_t>(what);
    default: return r.read<int64_t>(what);
  }
}

uint64_t read_unsigned(Reader& r, GgufType t, const std::string& what) {
  switch (t) {
    case GgufType::U8: return r.read<uint8_t>(what);
    case GgufType::U16: return r.read<uint16_t>(what);
    case GgufType::U32: return r.read<uint32_t>(what);
    default: return r.read<uint64_t>(what);
  }
}

double read_float(Reader& r, GgufType t, const std::string& what) {
  if (t == GgufType::F32) return r.read<float>(what);
  return r.read<double>(what);
}

bool read_bool(Reader& r, const std::string& what) {
  const uint64_t at = r.pos();
  const auto b = r.read<uint8_t>(what);
  if (b > 1) r.fail(at, what + " is a bool with value " + std::to_string(b) + " (not 0 or 1)");
  return b != 0;
}

// Reads an array's element type and count, checking the count fits in the bytes left.
std::pair<GgufType, uint64_t> read_array_header(Reader& r, const std::string& what) {
  const GgufType elem = r.read_type(what + " element type");
  const uint64_t at = r.pos();
  const auto n = r.read<uint64_t>(what + " element count");
  if (n > r.remaining() / min_value_bytes(elem))
    r.fail(at, what + " has " + std::to_string(n) + " elements of type " +
                   std::string(gguf_type_name(elem)) + ", more than the " +
                   std::to_string(r.remaining()) + " bytes left can hold");
  return {elem, n};
}

// Skips a nested array's elements; only the outer array's length is kept.
void skip_array(Reader& r, const std::string& what, int depth) {
  const uint64_t at = r.pos();
  if (depth > kMaxArrayDepth)
    r.fail(at, what + " nests arrays deeper than " + std::to_string(kMaxArrayDepth));
  const auto [elem, n] = read_array_header(r, what);
  for (uint64_t i = 0; i < n; ++i) {
    if (elem == GgufType::String) {
      const uint64_t len_at = r.pos();
      const auto len = r.read<uint64_t>(what + " string length");
      if (len > r.remaining())
        r.fail(len_at, what + " string length " + std::to_string(len) + " runs past end of file");
      r.skip(len, what + " string");
    } else if (elem == GgufType::Array) {
      skip_array(r, what, depth + 1);
    } else if (elem == GgufType::Bool) {
      read_bool(r, what);
    } else {
      r.skip(min_value_bytes(elem), what);
    }
  }
}

GgufValue read_array(Reader& r, const std::string& what) {
  GgufValue v;
  v.type = GgufType::Array;
  const auto [elem, n] = read_array_header(r, what);
  v.array_type = elem;
  if (is_signed_int(elem) || elem == GgufType::Bool) {
    std::vector<int64_t> a(n);
    for (auto& x : a) x = elem == GgufType::Bool ? read_bool(r, what) : read_signed(r, elem, what);
    v.value = std::move(a);
  } else if (is_unsigned_int(elem)) {
    std::vector<uint64_t> a(n);
    for (auto& x : a) x = read_unsigned(r, elem, what);
    v.value = std::move(a);
  } else if (is_float(elem)) {
    std::vector<double> a(n);
    for (auto& x : a) x = read_float(r, elem, what);
    v.value = std::move(a);
  } else if (elem == GgufType::String) {
    std::vector<std::string> a(n);
    for (auto& x : a) x = r.read_string(what + " string");
    v.value = std::move(a);
  } else {
    for (uint64_t i = 0; i < n; ++i) skip_array(r, what, 2);
    v.value = std::vector<std::monostate>(n);
  }
  return v;
}

GgufValue read_value(Reader& r, GgufType type, const std::string& what) {
  GgufValue v;
  v.type = type;
  if (is_signed_int(type)) {
    v.value = read_signed(r, type, what);
  } else if (is_unsigned_int(type)) {
    v.value = read_unsigned(r, type, what);
  } else if (is_float(type)) {
    v.value = read_float(r, type, what);
  } else if (type == GgufType::Bool) {
    v.value = read_bool(r, what);
  } else if (type == GgufType::String) {
    v.value = r.read_string(what);
  } else {
    v = read_array(r, what);
  }
  return v;
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string format_double(double d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", d);
  return buf;
}

// Row-major view over GGUF dims (dims[0] contiguous); a 0-d tensor is shown as [1].
TensorView make_view(const uint8_t* data, DType dtype, const std::vector<int64_t>& dims) {
  TensorView t;
  t.data = const_cast<uint8_t*>(data);
  t.dtype = dtype;
  t.ndim = dims.empty() ? 1 : int(dims.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = dims.empty() ? 1 : dims[t.ndim - 1 - i];
  const auto& info = dtype_info(dtype);
  t.stride[t.ndim - 1] = info.block_size == 1 ? info.type_size : 0;
  auto s = int64_t(dtype_bytes(dtype, t.shape[t.ndim - 1]));
  for (int d = t.ndim - 2; d >= 0; --d) {
    t.stride[d] = s;
    s *= t.shape[d];
  }
  return t;
}

[[noreturn]] void wrong_type(const GgufFile& f, const std::string& key, const GgufValue& v,
                             const std::string& expected) {
  std::string got(gguf_type_name(v.type));
  if (v.type == GgufType::Array) got += " of " + std::string(gguf_type_name(v.array_type));
  throw Error(f.path() + ": GGUF metadata key '" + key + "' has type " + got + ", expected " +
              expected);
}

}  // namespace

std::string_view gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::U8: return "u8";
    case GgufType::I8: return "i8";
    case GgufType::U16: return "u16";
    case GgufType::I16: return "i16";
    case GgufType::U32: return "u32";
    case GgufType::I32: return "i32";
    case GgufType::F32: return "f32";
    case GgufType::Bool: return "bool";
    case GgufType::String: return "string";
    case GgufType::Array: return "array";
    case GgufType::U64: return "u64";
    case GgufType::I64: return "i64";
    case GgufType::F64: return "f64";
  }
  return "unknown";
}

std::optional<int64_t> GgufValue::as_int() const {
  if (is_signed_int(type)) return std::get<int64_t>(value);
  if (type == GgufType::Bool) return std::get<bool>(value) ? 1 : 0;
  if (is_unsigned_int(type)) {
    const uint64_t u = std::get<uint64_t>(value);
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return int64_t(u);
  }
  return std::nullopt;
}

std::optional<double> GgufValue::as_float() const {
  if (is_float(type)) return std::get<double>(value);
  if (is_signed_int(type)) return double(std::get<int64_t>(value));
  if (is_unsigned_int(type)) return double(std::get<uint64_t>(value));
  return std::nullopt;
}

std::optional<std::string> GgufValue::as_string() const {
  if (type == GgufType::String) return std::get<std::string>(value);
  return std::nullopt;
}

size_t GgufValue::array_size() const {
  if (type != GgufType::Array) return 0;
  if (const auto* a = std::get_if<std::vector<int64_t>>(&value)) return a->size();
  if (const auto* a = std::get_if<std::vector<uint64_t>>(&value)) return a->size();
  if (const auto* a = std::get_if<std::vector<double>>(&value)) return a->size();
  if (const auto* a = std::get_if<std::vector<std::string>>(&value)) return a->size();
  if (const auto* a = std::get_if<std::vector<std::monostate>>(&value)) return a->size();
  return 0;
}

std::string GgufValue::to_string(size_t max_items) const {
  if (type != GgufType::Array) {
    if (is_signed_int(type)) return std::to_string(std::get<int64_t>(value));
    if (is_unsigned_int(type)) return std::to_string(std::get<uint64_t>(value));
    if (is_float(type)) return format_double(std::get<double>(value));
    if (type == GgufType::Bool) return std::get<bool>(value) ? "true" : "false";
    return quote(std::get<std::string>(value));
  }
  const size_t n = array_size();
  if (array_type == GgufType::Array) return "[" + std::to_string(n) + " arrays]";
  std::string s = "[";
  for (size_t i = 0; i < n && i < max_items; ++i) {
    if (i) s += ", ";
    if (array_type == GgufType::Bool) {
      s += std::get<std::vector<int64_t>>(value)[i] ? "true" : "false";
    } else if (is_signed_int(array_type)) {
      s += std::to_string(std::get<std::vector<int64_t>>(value)[i]);
    } else if (is_unsigned_int(array_type)) {
      s += std::to_string(std::get<std::vector<uint64_t>>(value)[i]);
    } else if (is_float(array_type)) {
      s += format_double(std::get<std::vector<double>>(value)[i]);
    } else {
      s += quote(std::get<std::vector<std::string>>(value)[i]);
    }
  }
  if (n > max_items) s += ", ... (" + std::to_string(n) + " items)";
  return s + "]";
}

GgufFile GgufFile::open(const std::filesystem::path& path) {
  auto mapping = MappedFile::open(path);
  GgufFile f = parse(mapping->bytes(), mapping->path());
  f.file_ = std::move(mapping);
  return f;
}

GgufFile GgufFile::parse(std::span<const uint8_t> bytes, const std::string& name) {
  GgufFile f;
  f.name_ = name;
  f.bytes_ = bytes;
  Reader r(bytes, f.name_);

  const auto magic = r.read<uint32_t>("magic");
  if (magic != kMagic) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "bad magic 0x%08" PRIx32 ", expected \"GGUF\"", magic);
    r.fail(0, buf);
  }
  const auto version = r.read<uint32_t>("version");
  if (version == 1) r.fail(4, "GGUF version 1 is not supported (only versions 2 and 3)");
  if (version != 2 && version != 3) {
    const uint32_t swapped = __builtin_bswap32(version);
    if (swapped >= 1 && swapped <= 3) r.fail(4, "big-endian GGUF files are not supported");
    r.fail(4, "unsupported GGUF version " + std::to_string(version) + " (only 2 and 3)");
  }
  f.version_ = version;

  const auto tensor_count = r.read<uint64_t>("tensor count");
  const auto kv_count = r.read<uint64_t>("metadata count");
  if (tensor_count > r.remaining() / kMinTensorInfoBytes)
    r.fail(8, "tensor count " + std::to_string(tensor_count) + " is more than the file can hold");
  if (kv_count > r.remaining() / kMinKvBytes)
    r.fail(16, "metadata count " + std::to_string(kv_count) + " is more than the file can hold");

  uint64_t alignment_at = 0;
  for (uint64_t i = 0; i < kv_count; ++i) {
    const uint64_t key_at = r.pos();
    std::string key = r.read_string("metadata key");
    const std::string what = "value of metadata key '" + key + "'";
    const GgufType type = r.read_type("type of metadata key '" + key + "'");
    const uint64_t value_at = r.pos();
    GgufValue v = read_value(r, type, what);
    if (f.metadata_.count(key)) r.fail(key_at, "duplicate metadata key '" + key + "'");
    if (key == "general.alignment") alignment_at = value_at;
    f.metadata_.emplace(std::move(key), std::move(v));
  }

  if (const GgufValue* a = f.find("general.alignment")) {
    const auto v = a->as_int();
    if (!is_int(a->type) || !v || *v <= 0 || !std::has_single_bit(uint64_t(*v)))
      r.fail(alignment_at,
             "general.alignment must be a power-of-two integer, got " + a->to_string());
    f.alignment_ = uint64_t(*v);
  }

  // Field offsets kept for error messages after all infos are read.
  struct InfoAt {
    uint64_t dims_at, offset_at;
  };
  std::vector<InfoAt> info_at;
  f.tensors_.reserve(tensor_count);
  info_at.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo t;
    const uint64_t name_at = r.pos();
    t.name = r.read_string("tensor name");
    const std::string what = "tensor '" + t.name + "'";
    const uint64_t ndims_at = r.pos();
    const auto n_dims = r.read<uint32_t>(what + " n_dims");
    if (n_dims > uint32_t(kMaxDims))
      r.fail(ndims_at, what + " has " + std::to_string(n_dims) + " dimensions, more than " +
                           std::to_string(kMaxDims));
    const uint64_t dims_at = r.pos();
    int64_t numel = 1;
    bool overflow = false;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_at = r.pos();
      const auto dim = r.read<uint64_t>(what + " dimension");
      if (dim > uint64_t(std::numeric_limits<int64_t>::max()))
        r.fail(dim_at, what + " dimension " + std::to_string(dim) + " is too large");
      t.dims.push_back(int64_t(dim));
      overflow = overflow || __builtin_mul_overflow(numel, int64_t(dim), &numel);
    }
    const uint64_t type_at = r.pos();
    const auto ggml_type = r.read<uint32_t>(what + " type");
    const auto dtype = dtype_from_ggml(ggml_type);
    if (!dtype)
      r.fail(type_at, what + " has unknown or unsupported ggml type id " +
                          std::to_string(ggml_type));
    t.dtype = *dtype;
    const uint64_t offset_at = r.pos();
    t.offset = r.read<uint64_t>(what + " data offset");

    if (overflow) r.fail(dims_at, what + " element count overflows 64 bits");
    const auto& dinfo = dtype_info(t.dtype);
    const int64_t row = t.dims.empty() ? 1 : t.dims[0];
    if (row % dinfo.block_size != 0)
      r.fail(dims_at, what + " row of " + std::to_string(row) + " elements is not a whole number of " +
                          std::string(dinfo.name) + " blocks of " +
                          std::to_string(dinfo.block_size));
    if (__builtin_mul_overflow(uint64_t(numel / dinfo.block_size), uint64_t(dinfo.type_size),
                               &t.nbytes))
      r.fail(dims_at, what + " byte size overflows 64 bits");
    if (t.offset % f.alignment_ != 0)
      r.fail(offset_at, what + " data offset " + std::to_string(t.offset) +
                            " is not a multiple of the alignment " +
                            std::to_string(f.alignment_));
    if (!f.tensor_index_.emplace(t.name, f.tensors_.size()).second)
      r.fail(name_at, "duplicate tensor name '" + t.name + "'");
    f.tensors_.push_back(std::move(t));
    info_at.push_back({dims_at, offset_at});
  }

  // The data section starts at the next multiple of the alignment; it may lie past the end
  // of the file only when no tensor needs it.
  const uint64_t end_of_infos = r.pos();
  f.data_offset_ = (end_of_infos + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  const uint64_t size = bytes.size();
  for (size_t i = 0; i < f.tensors_.size(); ++i) {
    GgufTensorInfo& t = f.tensors_[i];
    const uint64_t rel = t.offset;
    uint64_t end = 0;
    if (__builtin_add_overflow(f.data_offset_, rel, &t.offset) ||
        __builtin_add_overflow(t.offset, t.nbytes, &end) || end > size)
      r.fail(info_at[i].offset_at,
             "tensor '" + t.name + "' data (offset " + std::to_string(rel) + " + " +
                 std::to_string(t.nbytes) + " bytes after the data section at " +
                 std::to_string(f.data_offset_) + ") runs past the end of the file (" +
                 std::to_string(size) + " bytes)");
  }

  std::vector<size_t> order(f.tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return f.tensors_[a].offset < f.tensors_[b].offset; });
  const GgufTensorInfo* prev = nullptr;
  for (const size_t i : order) {
    const GgufTensorInfo& t = f.tensors_[i];
    if (t.nbytes == 0) continue;
    if (prev && prev->offset + prev->nbytes > t.offset)
      r.fail(info_at[i].offset_at,
             "tensor '" + t.name + "' data overlaps tensor '" + prev->name + "'");
    prev = &t;
  }
  return f;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

std::optional<int64_t> GgufFile::get_int(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (!is_int(v->type)) wrong_type(*this, key, *v, "an integer");
  const auto i = v->as_int();
  if (!i) throw Error(path() + ": GGUF metadata key '" + key + "' value " + v->to_string() +
                      " does not fit in int64");
  return i;
}

std::optional<double> GgufFile::get_float(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  const auto d = v->as_float();
  if (!d) wrong_type(*this, key, *v, "a number");
  return d;
}

std::optional<std::string> GgufFile::get_string(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufType::String) wrong_type(*this, key, *v, "a string");
  return std::get<std::string>(v->value);
}

std::optional<bool> GgufFile::get_bool(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufType::Bool) wrong_type(*this, key, *v, "a bool");
  return std::get<bool>(v->value);
}

const std::vector<std::string>& GgufFile::get_string_array(const std::string& key) const {
  static const std::vector<std::string> kEmpty;
  const GgufValue* v = find(key);
  if (!v) return kEmpty;
  if (v->type != GgufType::Array || v->array_type != GgufType::String)
    wrong_type(*this, key, *v, "an array of strings");
  return std::get<std::vector<std::string>>(v->value);
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return {};
  if (v->type != GgufType::Array || !(is_int(v->array_type) || v->array_type == GgufType::Bool))
    wrong_type(*this, key, *v, "an array of integers");
  if (!is_unsigned_int(v->array_type)) return std::get<std::vector<int64_t>>(v->value);
  const auto& u = std::get<std::vector<uint64_t>>(v->value);
  std::vector<int64_t> out;
  out.reserve(u.size());
  for (const uint64_t x : u) {
    if (x > uint64_t(std::numeric_limits<int64_t>::max()))
      throw Error(path() + ": GGUF metadata key '" + key + "' holds " + std::to_string(x) +
                  ", which does not fit in int64");
    out.push_back(int64_t(x));
  }
  return out;
}

std::vector<double> GgufFile::get_float_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return {};
  if (v->type != GgufType::Array) wrong_type(*this, key, *v, "an array of numbers");
  if (is_float(v->array_type)) return std::get<std::vector<double>>(v->value);
  if (is_signed_int(v->array_type)) {
    const auto& a = std::get<std::vector<int64_t>>(v->value);
    return {a.begin(), a.end()};
  }
  if (is_unsigned_int(v->array_type)) {
    const auto& a = std::get<std::vector<uint64_t>>(v->value);
    return {a.begin(), a.end()};
  }
  wrong_type(*this, key, *v, "an array of numbers");
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

TensorView GgufFile::view(const GgufTensorInfo& info) const {
  DS_CHECK(info.offset <= bytes_.size() && info.nbytes <= bytes_.size() - info.offset,
           "tensor '" + info.name + "' is not inside " + name_);
  return make_view(bytes_.data() + info.offset, info.dtype, info.dims);
}

}  // namespace ds
