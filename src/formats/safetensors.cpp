#include "formats/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace ds {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "safetensors is little-endian");

constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;
constexpr uint64_t kHeaderStart = 8;
constexpr int kMaxJsonDepth = 32;  // headers nest 3 deep; this bounds memory on hostile input

// The dtype names the format defines; GGML block types are not among them.
std::optional<DType> safetensors_dtype(const std::string& s) {
  static constexpr std::pair<std::string_view, DType> kNames[] = {
      {"F64", DType::F64},   {"F32", DType::F32},         {"F16", DType::F16},
      {"BF16", DType::BF16}, {"F8_E4M3", DType::F8_E4M3}, {"F8_E5M2", DType::F8_E5M2},
      {"I64", DType::I64},   {"I32", DType::I32},         {"I16", DType::I16},
      {"I8", DType::I8},     {"U8", DType::U8},           {"BOOL", DType::Bool},
  };
  for (const auto& [name, t] : kNames)
    if (name == s) return t;
  return std::nullopt;
}

// Parses JSON, rejecting duplicate keys in any object (nlohmann keeps the last silently).
json parse_json(std::string_view text, const std::string& file, uint64_t base) {
  std::vector<std::set<std::string>> keys;
  const json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (depth > kMaxJsonDepth)
      throw FormatError(file, base, "JSON nests deeper than " + std::to_string(kMaxJsonDepth));
    if (ev == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (ev == json::parse_event_t::object_end) {
      keys.pop_back();
    } else if (ev == json::parse_event_t::key && !keys.empty()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second)
        throw FormatError(file, base, "JSON has duplicate key \"" + k + "\"");
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), cb);
  } catch (const json::parse_error& e) {
    const uint64_t at = e.byte > 0 ? base + std::min<uint64_t>(e.byte - 1, text.size()) : base;
    throw FormatError(file, at, std::string("invalid JSON: ") + e.what());
  } catch (const json::exception& e) {  // e.g. a number too large for a double
    throw FormatError(file, base, std::string("invalid JSON: ") + e.what());
  }
}

[[noreturn]] void format_fail(const std::string& file, uint64_t at, const std::string& problem) {
  throw FormatError(file, at, problem);
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

TensorView make_view(const uint8_t* data, DType dtype, const std::vector<int64_t>& shape) {
  if (shape.size() > size_t(kMaxDims))
    throw UnsupportedError("tensor rank " + std::to_string(shape.size()) + " is above " +
                           std::to_string(kMaxDims));
  TensorView t;
  t.data = const_cast<uint8_t*>(data);
  t.dtype = dtype;
  t.ndim = shape.empty() ? 1 : int(shape.size());  // a scalar is shown as [1]
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape.empty() ? 1 : shape[i];
  int64_t s = dtype_info(dtype).type_size;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = s;
    s *= t.shape[d];
  }
  return t;
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  auto mapping = MappedFile::open(path);
  SafetensorsFile f = parse(mapping->bytes(), mapping->path());
  f.file_ = std::move(mapping);
  return f;
}

SafetensorsFile SafetensorsFile::parse(std::span<const uint8_t> bytes, const std::string& name) {
  SafetensorsFile f;
  f.name_ = name;
  f.bytes_ = bytes;
  const auto fail = [&name](uint64_t at, const std::string& problem) {
    format_fail(name, at, problem);
  };
  const uint64_t size = bytes.size();
  if (size < kHeaderStart)
    fail(0, "file of " + std::to_string(size) + " bytes is too small for the header length");
  const uint64_t n = read_le64(bytes.data());
  if (n > size - kHeaderStart)
    fail(0, "header length " + std::to_string(n) + " runs past the end of the file (" +
                std::to_string(size) + " bytes)");
  if (n > kMaxHeaderBytes)
    fail(0, "header length " + std::to_string(n) + " is above the limit of " +
                std::to_string(kMaxHeaderBytes));
  const uint64_t data_start = kHeaderStart + n;
  const uint64_t data_size = size - data_start;

  const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + kHeaderStart, n);
  const json header = parse_json(text, name, kHeaderStart);
  if (!header.is_object()) fail(kHeaderStart, "header is not a JSON object");

  struct Range {
    uint64_t begin, end;
  };
  std::vector<Range> ranges;
  try {
    for (const auto& [key, entry] : header.items()) {
      if (key == "__metadata__") {
        if (!entry.is_object()) fail(kHeaderStart, "__metadata__ is not a JSON object");
        for (const auto& [mk, mv] : entry.items()) {
          if (!mv.is_string())
            fail(kHeaderStart, "__metadata__ value for \"" + mk + "\" is not a string");
          f.metadata_.emplace(mk, mv.get<std::string>());
        }
        continue;
      }
      const std::string what = "tensor '" + key + "'";
      if (!entry.is_object()) fail(kHeaderStart, what + ": entry is not a JSON object");
      const auto dt = entry.find("dtype");
      if (dt == entry.end() || !dt->is_string()) fail(kHeaderStart, what + ": missing dtype");
      const auto dtype = safetensors_dtype(dt->get<std::string>());
      if (!dtype) fail(kHeaderStart, what + ": unknown dtype \"" + dt->get<std::string>() + "\"");

      SafetensorsTensor t;
      t.name = key;
      t.dtype = *dtype;
      const auto sh = entry.find("shape");
      if (sh == entry.end() || !sh->is_array()) fail(kHeaderStart, what + ": missing shape");
      const int64_t elem = dtype_info(t.dtype).type_size;
      int64_t bytes = elem;  // non-zero dims times elem must fit, so view strides do too
      bool empty = false;
      for (const json& d : *sh) {
        if (d.is_number_integer() && !d.is_number_unsigned())
          fail(kHeaderStart, what + ": negative dimension " + d.dump());
        if (!d.is_number_unsigned())
          fail(kHeaderStart, what + ": dimension " + d.dump() + " is not an integer");
        const auto v = d.get<uint64_t>();
        if (v > uint64_t(std::numeric_limits<int64_t>::max()) ||
            (v != 0 && __builtin_mul_overflow(bytes, int64_t(v), &bytes)))
          fail(kHeaderStart, what + ": element count overflows 64 bits");
        empty = empty || v == 0;
        t.shape.push_back(int64_t(v));
      }
      const uint64_t expected = empty ? 0 : uint64_t(bytes);

      const auto offs = entry.find("data_offsets");
      if (offs == entry.end() || !offs->is_array() || offs->size() != 2 ||
          !(*offs)[0].is_number_unsigned() || !(*offs)[1].is_number_unsigned())
        fail(kHeaderStart, what + ": data_offsets is not a pair of non-negative integers");
      const auto begin = (*offs)[0].get<uint64_t>();
      const auto end = (*offs)[1].get<uint64_t>();
      if (end < begin)
        fail(kHeaderStart, what + ": data_offsets end " + std::to_string(end) +
                               " is before begin " + std::to_string(begin));
      if (end > data_size)
        fail(kHeaderStart, what + ": data_offsets end " + std::to_string(end) +
                               " is past the end of the data (" + std::to_string(data_size) +
                               " bytes)");
      if (end - begin != expected)
        fail(data_start + begin, what + ": shape " + sh->dump() + " of " + dt->get<std::string>() +
                                     " needs " + std::to_string(expected) +
                                     " bytes but data_offsets span " + std::to_string(end - begin));
      t.offset = data_start + begin;
      t.nbytes = expected;
      f.tensors_.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    fail(kHeaderStart, std::string("malformed header: ") + e.what());
  }

  // File order; ties (empty tensors) by name so the order is deterministic.
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const auto& a, const auto& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.name < b.name;
  });
  const SafetensorsTensor* prev = nullptr;
  for (const auto& t : f.tensors_) {
    if (t.nbytes == 0) continue;
    if (prev && prev->offset + prev->nbytes > t.offset)
      fail(t.offset, "tensor '" + t.name + "' data overlaps tensor '" + prev->name + "'");
    prev = &t;
  }
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

TensorView SafetensorsFile::view(const SafetensorsTensor& t) const {
  DS_CHECK(t.offset <= bytes_.size() && t.nbytes <= bytes_.size() - t.offset,
           "tensor '" + t.name + "' is not inside " + name_);
  return make_view(bytes_.data() + t.offset, t.dtype, t.shape);
}

// ---- checkpoints -------------------------------------------------------------

namespace {

// A shard name from an index must stay inside the checkpoint folder.
bool is_safe_shard_name(const std::string& s) {
  if (s.empty() || s.find('\0') != std::string::npos) return false;
  const fs::path p(s);
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) return false;
  for (const auto& part : p)
    if (part == "..") return false;
  return true;
}

}  // namespace

SafetensorsCheckpoint SafetensorsCheckpoint::open(const fs::path& path) {
  SafetensorsCheckpoint c;
  auto add_all = [&c](SafetensorsFile file) {
    const size_t shard = c.shards_.size();
    for (size_t i = 0; i < file.tensors().size(); ++i)
      c.where_.emplace(file.tensors()[i].name, std::make_pair(shard, i));
    c.shards_.push_back(std::move(file));
  };
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    c.dir_ = path.parent_path();
    add_all(SafetensorsFile::open(path));
    return c;
  }
  if (!fs::is_directory(path, ec))
    throw Error(path.string() + ": no such safetensors file or checkpoint folder");
  c.dir_ = path;

  const fs::path index_path = path / "model.safetensors.index.json";
  if (!fs::exists(index_path, ec)) {
    const fs::path single = path / "model.safetensors";
    if (!fs::is_regular_file(single, ec))
      throw Error(path.string() +
                  ": no safetensors checkpoint found (looked for model.safetensors.index.json "
                  "and model.safetensors)");
    add_all(SafetensorsFile::open(single));
    return c;
  }

  const auto mapping = MappedFile::open(index_path);
  const std::string index_name = index_path.string();
  const std::string_view text(reinterpret_cast<const char*>(mapping->data()), mapping->size());
  const json index = parse_json(text, index_name, 0);
  const auto wm = index.is_object() ? index.find("weight_map") : index.end();
  if (!index.is_object() || wm == index.end() || !wm->is_object() || wm->empty())
    throw FormatError(index_name, 0, "no non-empty \"weight_map\" object");

  std::map<std::string, size_t> shard_index;  // shard name -> position in shards_
  for (const auto& [tensor, shard] : wm->items()) {
    if (!shard.is_string())
      throw FormatError(index_name, 0, "weight_map entry for '" + tensor + "' is not a string");
    const auto& s = shard.get_ref<const std::string&>();
    if (!is_safe_shard_name(s))
      throw FormatError(index_name, 0,
                        "shard name \"" + s + "\" is not a relative path inside " + path.string());
    shard_index.emplace(s, 0);
  }
  for (auto& [shard, pos] : shard_index) {
    const fs::path shard_path = path / shard;
    if (!fs::is_regular_file(shard_path, ec))
      throw Error(index_name + ": lists shard \"" + shard + "\" but " + shard_path.string() +
                  " is missing");
    pos = c.shards_.size();
    c.shards_.push_back(SafetensorsFile::open(shard_path));
  }
  for (const auto& [tensor, shard] : wm->items()) {
    const auto& s = shard.get_ref<const std::string&>();
    const size_t pos = shard_index.at(s);
    const SafetensorsFile& file = c.shards_[pos];
    const SafetensorsTensor* t = file.find(tensor);
    if (!t)
      throw Error(index_name + ": says tensor '" + tensor + "' is in shard \"" + s +
                  "\" but that shard does not contain it");
    c.where_.emplace(tensor, std::make_pair(pos, size_t(t - file.tensors().data())));
  }
  return c;
}

std::vector<std::string> SafetensorsCheckpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& [name, loc] : where_) names.push_back(name);
  return names;
}

const SafetensorsTensor& SafetensorsCheckpoint::tensor(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end())
    throw Error("tensor '" + name + "' is not in the checkpoint " + dir_.string());
  return shards_[it->second.first].tensors()[it->second.second];
}

TensorView SafetensorsCheckpoint::view(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end())
    throw Error("tensor '" + name + "' is not in the checkpoint " + dir_.string());
  const SafetensorsFile& f = shards_[it->second.first];
  return f.view(f.tensors()[it->second.second]);
}

uint64_t SafetensorsCheckpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, loc] : where_) total += shards_[loc.first].tensors()[loc.second].nbytes;
  return total;
}

}  // namespace ds
