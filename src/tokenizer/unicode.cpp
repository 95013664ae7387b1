#include "tokenizer/unicode.h"

#include <algorithm>
#include <vector>

namespace ds {

namespace {

// Categories of U+0000..U+FFFF flattened once, so the common case is one load.
const std::vector<CharCategory>& bmp_categories() {
  static const std::vector<CharCategory> table = [] {
    std::vector<CharCategory> t(0x10000);
    using unicode_detail::kCategoryRunCount;
    using unicode_detail::kCategoryRuns;
    for (size_t i = 0; i < kCategoryRunCount && kCategoryRuns[i].first < 0x10000; ++i) {
      uint32_t end = i + 1 < kCategoryRunCount ? kCategoryRuns[i + 1].first : 0x110000;
      end = std::min<uint32_t>(end, 0x10000);
      std::fill(t.begin() + kCategoryRuns[i].first, t.begin() + end, kCategoryRuns[i].category);
    }
    return t;
  }();
  return table;
}

}  // namespace

CharCategory char_category(uint32_t cp) {
  if (cp < 0x10000) return bmp_categories()[cp];
  if (cp > 0x10FFFF) return CharCategory::Undefined;
  using unicode_detail::kCategoryRunCount;
  using unicode_detail::kCategoryRuns;
  const auto* end = kCategoryRuns + kCategoryRunCount;
  const auto* it = std::upper_bound(kCategoryRuns, end, cp,
                                    [](uint32_t v, const auto& run) { return v < run.first; });
  return (it - 1)->category;
}

bool is_whitespace(uint32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

size_t utf8_sequence_length(std::string_view s, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[pos + i]); };
  const auto cont = [&](size_t i) { return pos + i < s.size() && (byte(i) & 0xC0) == 0x80; };
  uint8_t b0 = byte(0);
  if (b0 < 0x80) return 1;
  if (b0 < 0xC2) return 0;  // continuation byte or overlong 2-byte lead
  if (b0 < 0xE0) return cont(1) ? 2 : 0;
  if (b0 < 0xF0) {
    if (!cont(1) || !cont(2)) return 0;
    uint8_t b1 = byte(1);
    if (b0 == 0xE0 && b1 < 0xA0) return 0;   // overlong
    if (b0 == 0xED && b1 >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (b0 < 0xF5) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    uint8_t b1 = byte(1);
    if (b0 == 0xF0 && b1 < 0x90) return 0;   // overlong
    if (b0 == 0xF4 && b1 >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

size_t utf8_invalid_length(std::string_view s, size_t pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0xC2 || b0 > 0xF4) return 1;
  const size_t need = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  size_t len = 1;
  while (len < need && pos + len < s.size()) {
    const auto b = static_cast<uint8_t>(s[pos + len]);
    uint8_t lo = 0x80, hi = 0xBF;
    if (len == 1) {
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    }
    if (b < lo || b > hi) break;
    ++len;
  }
  return len;
}

uint32_t utf8_decode(std::string_view s, size_t& pos) {
  size_t n = utf8_sequence_length(s, pos);
  const auto byte = [&](size_t i) {
    return static_cast<uint32_t>(static_cast<uint8_t>(s[pos + i]));
  };
  uint32_t cp;
  switch (n) {
    case 1:
      cp = byte(0);
      break;
    case 2:
      cp = ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
      break;
    case 3:
      cp = ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
      break;
    case 4:
      cp = ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) |
           (byte(3) & 0x3F);
      break;
    default:
      cp = kReplacementChar;
      n = utf8_invalid_length(s, pos);
      break;
  }
  pos += n;
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool utf8_is_valid(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    size_t n = utf8_sequence_length(s, pos);
    if (n == 0) return false;
    pos += n;
  }
  return true;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    size_t n = utf8_sequence_length(s, pos);
    if (n == 0) {
      utf8_append(out, kReplacementChar);
      pos += utf8_invalid_length(s, pos);
    } else {
      out.append(s.substr(pos, n));
      pos += n;
    }
  }
  return out;
}

size_t utf8_incomplete_tail(std::string_view s) {
  // A lead byte within the last 3 bytes whose sequence runs past the end, with only valid
  // continuation bytes after it, is a sequence still arriving.
  size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(3, n); ++back) {
    uint8_t b = static_cast<uint8_t>(s[n - back]);
    if ((b & 0xC0) == 0x80) continue;
    size_t need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    if (b < 0xC2 || b >= 0xF5 || need <= back) return 0;
    // Check the bytes seen so far could still become a well-formed sequence.
    if (back >= 2) {
      uint8_t b1 = static_cast<uint8_t>(s[n - back + 1]);
      if ((b == 0xE0 && b1 < 0xA0) || (b == 0xED && b1 >= 0xA0) || (b == 0xF0 && b1 < 0x90) ||
          (b == 0xF4 && b1 >= 0x90))
        return 0;
    }
    return back;
  }
  return 0;
}

const std::array<uint32_t, 256>& gpt2_byte_to_codepoint() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    // Printable Latin-1 bytes map to themselves; the rest go to U+0100 and up, in byte order.
    const auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next = 0x100;
    for (int b = 0; b < 256; ++b) t[b] = printable(b) ? static_cast<uint32_t>(b) : next++;
    return t;
  }();
  return table;
}

int gpt2_codepoint_to_byte(uint32_t cp) {
  static const std::array<int16_t, 0x144> inverse = [] {
    std::array<int16_t, 0x144> inv;
    inv.fill(-1);
    const auto& fwd = gpt2_byte_to_codepoint();
    for (int b = 0; b < 256; ++b) inv[fwd[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

std::string gpt2_bytes_to_text(std::string_view bytes) {
  const auto& fwd = gpt2_byte_to_codepoint();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) utf8_append(out, fwd[static_cast<uint8_t>(c)]);
  return out;
}

std::string gpt2_text_to_bytes(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    size_t start = pos;
    uint32_t cp = utf8_decode(text, pos);
    int b = gpt2_codepoint_to_byte(cp);
    if (b >= 0) {
      out += static_cast<char>(b);
    } else {
      out.append(text.substr(start, pos - start));
    }
  }
  return out;
}

}  // namespace ds
