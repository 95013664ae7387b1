// GGUF metadata values: typed accessors, printing and the GgufFile getters.
#include "formats/gguf.h"

#include <cinttypes>
#include <cstdio>
#include <limits>

#include "core/error.h"

namespace ds {
namespace {

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
    case GgufType::U8:
      return "u8";
    case GgufType::I8:
      return "i8";
    case GgufType::U16:
      return "u16";
    case GgufType::I16:
      return "i16";
    case GgufType::U32:
      return "u32";
    case GgufType::I32:
      return "i32";
    case GgufType::F32:
      return "f32";
    case GgufType::Bool:
      return "bool";
    case GgufType::String:
      return "string";
    case GgufType::Array:
      return "array";
    case GgufType::U64:
      return "u64";
    case GgufType::I64:
      return "i64";
    case GgufType::F64:
      return "f64";
  }
  return "unknown";
}

std::optional<int64_t> GgufValue::as_int() const {
  if (gguf_is_signed(type)) return std::get<int64_t>(value);
  if (type == GgufType::Bool) return std::get<bool>(value) ? 1 : 0;
  if (gguf_is_unsigned(type)) {
    const uint64_t u = std::get<uint64_t>(value);
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return int64_t(u);
  }
  return std::nullopt;
}

std::optional<double> GgufValue::as_float() const {
  if (gguf_is_float(type)) return std::get<double>(value);
  if (gguf_is_signed(type)) return double(std::get<int64_t>(value));
  if (gguf_is_unsigned(type)) return double(std::get<uint64_t>(value));
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
    if (gguf_is_signed(type)) return std::to_string(std::get<int64_t>(value));
    if (gguf_is_unsigned(type)) return std::to_string(std::get<uint64_t>(value));
    if (gguf_is_float(type)) return format_double(std::get<double>(value));
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
    } else if (gguf_is_signed(array_type)) {
      s += std::to_string(std::get<std::vector<int64_t>>(value)[i]);
    } else if (gguf_is_unsigned(array_type)) {
      s += std::to_string(std::get<std::vector<uint64_t>>(value)[i]);
    } else if (gguf_is_float(array_type)) {
      s += format_double(std::get<std::vector<double>>(value)[i]);
    } else {
      s += quote(std::get<std::vector<std::string>>(value)[i]);
    }
  }
  if (n > max_items) s += ", ... (" + std::to_string(n) + " items)";
  return s + "]";
}

const GgufValue* GgufFile::find(const std::string& key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

std::optional<int64_t> GgufFile::get_int(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (!gguf_is_int(v->type)) wrong_type(*this, key, *v, "an integer");
  const auto i = v->as_int();
  if (!i)
    throw Error(path() + ": GGUF metadata key '" + key + "' value " + v->to_string() +
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
  if (v->type != GgufType::Array ||
      !(gguf_is_int(v->array_type) || v->array_type == GgufType::Bool))
    wrong_type(*this, key, *v, "an array of integers");
  if (!gguf_is_unsigned(v->array_type)) return std::get<std::vector<int64_t>>(v->value);
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
  if (gguf_is_float(v->array_type)) return std::get<std::vector<double>>(v->value);
  if (gguf_is_signed(v->array_type)) {
    const auto& a = std::get<std::vector<int64_t>>(v->value);
    return {a.begin(), a.end()};
  }
  if (gguf_is_unsigned(v->array_type)) {
    const auto& a = std::get<std::vector<uint64_t>>(v->value);
    return {a.begin(), a.end()};
  }
  wrong_type(*this, key, *v, "an array of numbers");
}

}  // namespace ds
