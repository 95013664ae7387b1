// GGUF reader: header, metadata, tensor infos and bounds checks over the mapped bytes.
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

constexpr uint32_t kMagic = 0x46554747;              // "GGUF" read as a little-endian u32
constexpr int kMaxArrayDepth = 16;                   // nested arrays deeper than this are rejected
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;          // key length, value type, smallest value
constexpr uint64_t kMaxReserve = uint64_t(1) << 16;  // elements reserved before reading them
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // name length, n_dims, type, offset

bool is_valid_type(uint32_t t) {
  return t <= uint32_t(GgufType::F64);
}

// Fewest bytes a value of type t takes in the file; bounds counts before allocating.
uint64_t min_value_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8:
    case GgufType::I8:
    case GgufType::Bool:
      return 1;
    case GgufType::U16:
    case GgufType::I16:
      return 2;
    case GgufType::U32:
    case GgufType::I32:
    case GgufType::F32:
      return 4;
    case GgufType::U64:
    case GgufType::I64:
    case GgufType::F64:
    case GgufType::String:
      return 8;
    case GgufType::Array:
      return 4 + 8;
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

  // Messages name the field as what + suffix, built only on failure (reads are hot).
  void need(uint64_t n, const std::string& what, const char* suffix = "") const {
    if (n > remaining())
      fail(pos_, "unexpected end of file reading " + what + suffix + " (needs " +
                     std::to_string(n) + " bytes, " + std::to_string(remaining()) + " left)");
  }

  template <typename T>
  T read(const std::string& what, const char* suffix = "") {
    need(sizeof(T), what, suffix);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  void skip(uint64_t n, const std::string& what, const char* suffix = "") {
    need(n, what, suffix);
    pos_ += n;
  }

  // Returns the bytes of a length-prefixed string after checking they are in the file.
  std::string_view read_string_view(const std::string& what, const char* suffix = "") {
    const uint64_t at = pos_;
    if (remaining() < 8) need(8, what + suffix, " length");
    const auto len = read<uint64_t>(what);
    if (len > remaining())
      fail(at, what + suffix + " length " + std::to_string(len) + " runs past end of file (" +
                   std::to_string(remaining()) + " bytes left)");
    const std::string_view s(reinterpret_cast<const char*>(bytes_.data() + pos_), size_t(len));
    pos_ += len;
    return s;
  }
  std::string read_string(const std::string& what, const char* suffix = "") {
    return std::string(read_string_view(what, suffix));
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
    case GgufType::I8:
      return r.read<int8_t>(what);
    case GgufType::I16:
      return r.read<int16_t>(what);
    case GgufType::I32:
      return r.read<int32_t>(what);
    default:
      return r.read<int64_t>(what);
  }
}

uint64_t read_unsigned(Reader& r, GgufType t, const std::string& what) {
  switch (t) {
    case GgufType::U8:
      return r.read<uint8_t>(what);
    case GgufType::U16:
      return r.read<uint16_t>(what);
    case GgufType::U32:
      return r.read<uint32_t>(what);
    default:
      return r.read<uint64_t>(what);
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
      r.read_string_view(what, " string");
    } else if (elem == GgufType::Array) {
      skip_array(r, what, depth + 1);
    } else if (elem == GgufType::Bool) {
      read_bool(r, what);
    } else {
      r.skip(min_value_bytes(elem), what);
    }
  }
}

// Reads n elements with read_one, growing the vector as bytes are actually read, so a count
// that only claims a large size never allocates for it.
template <typename T, typename Fn>
std::vector<T> read_elements(uint64_t n, Fn&& read_one) {
  std::vector<T> a;
  a.reserve(size_t(std::min<uint64_t>(n, kMaxReserve)));
  for (uint64_t i = 0; i < n; ++i) a.push_back(read_one());
  return a;
}

GgufValue read_array(Reader& r, const std::string& what) {
  GgufValue v;
  v.type = GgufType::Array;
  const auto header = read_array_header(r, what);
  const GgufType elem = header.first;  // named: clang 14 lambdas cannot capture bindings
  const uint64_t n = header.second;
  v.array_type = elem;
  if (elem == GgufType::Bool) {
    v.value = read_elements<int64_t>(n, [&] { return int64_t(read_bool(r, what)); });
  } else if (gguf_is_signed(elem)) {
    v.value = read_elements<int64_t>(n, [&] { return read_signed(r, elem, what); });
  } else if (gguf_is_unsigned(elem)) {
    v.value = read_elements<uint64_t>(n, [&] { return read_unsigned(r, elem, what); });
  } else if (gguf_is_float(elem)) {
    v.value = read_elements<double>(n, [&] { return read_float(r, elem, what); });
  } else if (elem == GgufType::String) {
    v.value = read_elements<std::string>(n, [&] { return r.read_string(what, " string"); });
  } else {
    for (uint64_t i = 0; i < n; ++i) skip_array(r, what, 2);
    v.value = std::vector<std::monostate>(n);  // n <= bytes read / 12
  }
  return v;
}

GgufValue read_value(Reader& r, GgufType type, const std::string& what) {
  GgufValue v;
  v.type = type;
  if (gguf_is_signed(type)) {
    v.value = read_signed(r, type, what);
  } else if (gguf_is_unsigned(type)) {
    v.value = read_unsigned(r, type, what);
  } else if (gguf_is_float(type)) {
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

// Element count, or nullopt when the non-zero dims times the type size pass int64 (even for
// an empty tensor), so that any view's strides and element count fit too.
std::optional<int64_t> checked_numel(const std::vector<int64_t>& dims, int64_t type_size) {
  int64_t bytes = type_size;
  bool empty = false;
  for (const int64_t d : dims) {
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(bytes, d, &bytes)) {
      return std::nullopt;
    }
  }
  return empty ? 0 : bytes / type_size;
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

}  // namespace

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
    if (!gguf_is_int(a->type) || !v || *v <= 0 || !std::has_single_bit(uint64_t(*v)))
      r.fail(alignment_at,
             "general.alignment must be a power-of-two integer, got " + a->to_string());
    f.alignment_ = uint64_t(*v);
  }

  // Field offsets kept for error messages after all infos are read.
  struct InfoAt {
    uint64_t dims_at, offset_at;
  };
  std::vector<InfoAt> info_at;
  f.tensors_.reserve(size_t(std::min(tensor_count, kMaxReserve)));
  info_at.reserve(size_t(std::min(tensor_count, kMaxReserve)));
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
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_at = r.pos();
      const auto dim = r.read<uint64_t>(what + " dimension");
      if (dim > uint64_t(std::numeric_limits<int64_t>::max()))
        r.fail(dim_at, what + " dimension " + std::to_string(dim) + " is too large");
      t.dims.push_back(int64_t(dim));
    }
    const uint64_t type_at = r.pos();
    const auto ggml_type = r.read<uint32_t>(what + " type");
    const auto dtype = dtype_from_ggml(ggml_type);
    if (!dtype)
      r.fail(type_at,
             what + " has unknown or unsupported ggml type id " + std::to_string(ggml_type));
    t.dtype = *dtype;
    const uint64_t offset_at = r.pos();
    t.offset = r.read<uint64_t>(what + " data offset");

    const auto& dinfo = dtype_info(t.dtype);
    const auto numel = checked_numel(t.dims, dinfo.type_size);
    if (!numel) r.fail(dims_at, what + " element count overflows 64 bits");
    const int64_t row = t.dims.empty() ? 1 : t.dims[0];
    if (row % dinfo.block_size != 0)
      r.fail(dims_at, what + " row of " + std::to_string(row) +
                          " elements is not a whole number of " + std::string(dinfo.name) +
                          " blocks of " + std::to_string(dinfo.block_size));
    t.nbytes = uint64_t(*numel / dinfo.block_size) * uint64_t(dinfo.type_size);
    if (t.offset % f.alignment_ != 0)
      r.fail(offset_at, what + " data offset " + std::to_string(t.offset) +
                            " is not a multiple of the alignment " + std::to_string(f.alignment_));
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
