#include "tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <string>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace ds {

namespace {

// llama.cpp's adapted spellings (case-insensitive groups written as [sS] classes).
constexpr const char* kGpt2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
constexpr const char* kLlama3 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLlama3Hf =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2Hf =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
// The letter ranges DeepSeek's tokenizer.json lists explicitly (Latin, Greek, Cyrillic, ...),
// written as escapes so no editor can normalise the characters.
constexpr const char* kDeepSeekLlmLetters =
    "\\s?[A-Za-z\\x{b5}\\x{c0}-\\x{d6}\\x{d8}-\\x{f6}\\x{f8}-\\x{1ba}\\x{1bc}-\\x{1bf}"
    "\\x{1c4}-\\x{293}\\x{295}-\\x{2af}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37b}-\\x{37d}"
    "\\x{37f}\\x{386}\\x{388}-\\x{38a}\\x{38c}\\x{38e}-\\x{3a1}\\x{3a3}-\\x{3f5}\\x{3f7}-"
    "\\x{481}\\x{48a}-\\x{52f}\\x{531}-\\x{556}\\x{10a0}-\\x{10c5}\\x{13a0}-\\x{13f5}"
    "\\x{13f8}-\\x{13fd}\\x{1c90}-\\x{1cba}\\x{1cbd}-\\x{1cbf}\\x{1d00}-\\x{1d2b}\\x{1d6b}-"
    "\\x{1d77}\\x{1d79}-\\x{1d9a}\\x{1e00}-\\x{1f15}\\x{1f18}-\\x{1f1d}\\x{1f20}-\\x{1f45}"
    "\\x{1f48}-\\x{1f4d}\\x{1f50}-\\x{1f57}\\x{1f59}\\x{1f5b}\\x{1f5d}\\x{1f5f}-\\x{1f7d}"
    "\\x{1f80}-\\x{1fb4}\\x{1fb6}-\\x{1fbc}\\x{1fbe}\\x{1fc2}-\\x{1fc4}\\x{1fc6}-\\x{1fcc}"
    "\\x{1fd0}-\\x{1fd3}\\x{1fd6}-\\x{1fdb}\\x{1fe0}-\\x{1fec}\\x{1ff2}-\\x{1ff4}\\x{1ff6}-"
    "\\x{1ffc}\\x{2102}\\x{2107}\\x{210a}-\\x{2113}\\x{2115}\\x{2119}-\\x{211d}\\x{2124}"
    "\\x{2126}\\x{2128}\\x{212a}-\\x{212d}\\x{212f}-\\x{2134}\\x{2139}\\x{213c}-\\x{213f}"
    "\\x{2145}-\\x{2149}\\x{214e}\\x{2183}\\x{2184}\\x{2c00}-\\x{2c7b}\\x{2c7e}-\\x{2ce4}"
    "\\x{2ceb}-\\x{2cee}\\x{2cf2}\\x{2cf3}\\x{a640}-\\x{a66d}\\x{a680}-\\x{a69b}\\x{a722}-"
    "\\x{a76f}\\x{a771}-\\x{a787}\\x{a78b}-\\x{a78e}\\x{ab70}-\\x{abbf}\\x{fb00}-\\x{fb06}"
    "\\x{fb13}-\\x{fb17}\\x{ff21}-\\x{ff3a}\\x{ff41}-\\x{ff5a}\\x{10400}-\\x{1044f}"
    "\\x{104b0}-\\x{104d3}\\x{104d8}-\\x{104fb}\\x{10c80}-\\x{10cb2}\\x{10cc0}-\\x{10cf2}"
    "\\x{118a0}-\\x{118df}\\x{1e900}-\\x{1e943}]+";
constexpr const char* kDeepSeekLlmPunct =
    "\\s?[!-/:-~\\x{ff01}-\\x{ff0f}\\x{ff1a}-\\x{ff5e}\\x{2018}-\\x{201f}\\x{3000}-"
    "\\x{3002}]+";
constexpr const char* kCjk = "[\\x{4e00}-\\x{9fa5}\\x{800}-\\x{4e00}\\x{ac00}-\\x{d7ff}]+";

// Codes standing for all non-ASCII codepoints of one class in the collapsed text.
constexpr uint8_t kCodeSpace = 0x80;
constexpr uint8_t kCodeLetter = 0x81;
constexpr uint8_t kCodeNumber = 0x82;
constexpr uint8_t kCodePunct = 0x83;
constexpr uint8_t kCodeMark = 0x84;
constexpr uint8_t kCodeSymbol = 0x85;
constexpr uint8_t kCodeOther = 0x86;

uint8_t collapse_code(uint32_t cp) {
  if (cp < 0x80) return static_cast<uint8_t>(cp);
  if (is_whitespace(cp)) return kCodeSpace;
  switch (char_category(cp)) {
    case CharCategory::Letter:
      return kCodeLetter;
    case CharCategory::Number:
      return kCodeNumber;
    case CharCategory::Punctuation:
      return kCodePunct;
    case CharCategory::Mark:
      return kCodeMark;
    case CharCategory::Symbol:
      return kCodeSymbol;
    default:
      return kCodeOther;
  }
}

std::string hex_escape(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "\\x{%x}", v);
  return buf;
}

// Class body (no brackets) for the ASCII members of `cat` plus its collapsed code.
std::string collapsed_category_body(CharCategory cat, uint8_t code) {
  std::string body;
  for (uint32_t c = 0; c < 0x80;) {
    if (char_category(c) != cat || is_whitespace(c)) {
      ++c;
      continue;
    }
    uint32_t end = c;
    while (end + 1 < 0x80 && char_category(end + 1) == cat && !is_whitespace(end + 1)) ++end;
    body += hex_escape(c);
    if (end > c) body += "-" + hex_escape(end);
    c = end + 1;
  }
  return body + hex_escape(code);
}

constexpr const char* kSpaceBodyCollapsed = "\\x{9}-\\x{d}\\x{20}\\x{80}";
constexpr const char* kSpaceBodyUtf =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
    "\\x{205f}\\x{3000}";

// Reads the name of \p{Name} or \pX starting at p[i] (just after the 'p'); advances i past it.
std::string read_property_name(std::string_view p, size_t& i) {
  if (i < p.size() && p[i] == '{') {
    size_t close = p.find('}', i);
    if (close == std::string_view::npos) return {};
    std::string name(p.substr(i + 1, close - i - 1));
    i = close + 1;
    return name;
  }
  if (i < p.size()) return std::string(1, p[i++]);
  return {};
}

// Rewrites a pattern for the collapsed text, or nullopt when it uses something the collapsed
// text cannot answer (non-ASCII literals, \d, \w, \b, \p{Lu}, ...).
std::optional<std::string> translate_collapsed(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size();) {
    const auto c = static_cast<uint8_t>(p[i]);
    if (c >= 0x80) return std::nullopt;
    if (c == '\\') {
      if (i + 1 >= p.size()) return std::nullopt;
      const char d = p[i + 1];
      i += 2;
      std::string body;
      if (d == 'p') {
        std::string name = read_property_name(p, i);
        if (name == "L") {
          body = collapsed_category_body(CharCategory::Letter, kCodeLetter);
        } else if (name == "N") {
          body = collapsed_category_body(CharCategory::Number, kCodeNumber);
        } else if (name == "P") {
          body = collapsed_category_body(CharCategory::Punctuation, kCodePunct);
        } else if (name == "M") {
          body = collapsed_category_body(CharCategory::Mark, kCodeMark);
        } else if (name == "S") {
          body = collapsed_category_body(CharCategory::Symbol, kCodeSymbol);
        } else {
          return std::nullopt;
        }
      } else if (d == 's') {
        body = kSpaceBodyCollapsed;
      } else if (d == 'S') {
        if (in_class) return std::nullopt;
        out += std::string("[^") + kSpaceBodyCollapsed + "]";
        continue;
      } else if (d == 'x') {
        // \xhh or \x{h...}: fine while it names an ASCII codepoint.
        size_t j = i;
        std::string digits;
        if (j < p.size() && p[j] == '{') {
          size_t close = p.find('}', j);
          if (close == std::string_view::npos) return std::nullopt;
          digits = std::string(p.substr(j + 1, close - j - 1));
          j = close + 1;
        } else {
          while (j < p.size() && j < i + 2 && std::isxdigit(static_cast<unsigned char>(p[j])))
            digits += p[j++];
        }
        const bool hex = !digits.empty() && digits.size() <= 6 &&
                         std::all_of(digits.begin(), digits.end(), [](char h) {
                           return std::isxdigit(static_cast<unsigned char>(h)) != 0;
                         });
        if (!hex) return std::nullopt;  // let PCRE2 report it
        const auto value = static_cast<uint32_t>(std::stoul(digits, nullptr, 16));
        if (value >= 0x80) return std::nullopt;
        out += hex_escape(value);
        i = j;
        continue;
      } else if (d == 'r' || d == 'n' || d == 't' || d == 'f' || d == 'e' || d == 'a' ||
                 !std::isalnum(static_cast<unsigned char>(d))) {
        out += '\\';
        out += d;
        continue;
      } else {
        return std::nullopt;
      }
      out += in_class ? body : "[" + body + "]";
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += '[';
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') {
        out += "\\]";
        ++i;
      }
      continue;
    }
    if (c == '[' && in_class) {
      if (i + 1 < p.size() && p[i + 1] == ':') return std::nullopt;  // POSIX class
      out += "\\[";
      ++i;
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += static_cast<char>(c);
    ++i;
  }
  return out;
}

// For PCRE2's UTF mode: only \s and \S change, to Unicode's White_Space like the collapsed path.
std::string translate_utf(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 's') {
        out += in_class ? std::string(kSpaceBodyUtf) : std::string("[") + kSpaceBodyUtf + "]";
      } else if (d == 'S' && !in_class) {
        out += std::string("[^") + kSpaceBodyUtf + "]";
      } else {
        out += c;
        out += d;
      }
      i += 2;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
    ++i;
  }
  return out;
}

}  // namespace

struct RegexSplitter::Pattern {
  std::string source;
  bool collapsed = false;
  pcre2_code* code = nullptr;
  ~Pattern() { pcre2_code_free(code); }
};

std::optional<PreTokenizer> pre_tokenizer_from_name(std::string_view name) {
  if (name == "default") return PreTokenizer::Default;
  if (name == "gpt2" || name == "gpt-2" || name == "phi-2") return PreTokenizer::Gpt2;
  if (name == "llama3" || name == "llama-v3" || name == "llama-bpe" || name == "falcon3")
    return PreTokenizer::Llama3;
  if (name == "deepseek-llm") return PreTokenizer::DeepSeekLlm;
  if (name == "deepseek-coder") return PreTokenizer::DeepSeekCoder;
  if (name == "smollm" || name == "starcoder" || name == "refact" || name == "command-r")
    return PreTokenizer::SmolLM;
  if (name == "qwen2" || name == "deepseek-r1-qwen" || name == "stablelm2")
    return PreTokenizer::Qwen2;
  return std::nullopt;
}

std::string_view pre_tokenizer_name(PreTokenizer pre) {
  switch (pre) {
    case PreTokenizer::Gpt2:
      return "gpt-2";
    case PreTokenizer::Llama3:
      return "llama-bpe";
    case PreTokenizer::DeepSeekLlm:
      return "deepseek-llm";
    case PreTokenizer::DeepSeekCoder:
      return "deepseek-coder";
    case PreTokenizer::SmolLM:
      return "smollm";
    case PreTokenizer::Qwen2:
      return "qwen2";
    case PreTokenizer::Default:
      return "default";
    case PreTokenizer::Custom:
      return "custom";
  }
  return "custom";
}

std::vector<std::string> pre_tokenizer_patterns(PreTokenizer pre) {
  switch (pre) {
    case PreTokenizer::Gpt2:
      return {kGpt2};
    case PreTokenizer::Llama3:
      return {kLlama3};
    case PreTokenizer::DeepSeekLlm:
      return {"[\r\n]", kDeepSeekLlmLetters, kDeepSeekLlmPunct, "\\s+$", kCjk, "\\p{N}+"};
    case PreTokenizer::DeepSeekCoder:
      return {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", kCjk, "\\p{N}"};
    case PreTokenizer::SmolLM:
      return {"\\p{N}", kGpt2};
    case PreTokenizer::Qwen2:
      return {kQwen2};
    case PreTokenizer::Default:
      return {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"};
    case PreTokenizer::Custom:
      return {};
  }
  return {};
}

PreTokenizer pre_tokenizer_from_patterns(const std::vector<std::string>& patterns) {
  using V = std::vector<std::string>;
  if (patterns == V{kLlama3Hf}) return PreTokenizer::Llama3;
  if (patterns == V{kQwen2Hf}) return PreTokenizer::Qwen2;
  for (PreTokenizer pre : {PreTokenizer::Gpt2, PreTokenizer::Llama3, PreTokenizer::DeepSeekLlm,
                           PreTokenizer::DeepSeekCoder, PreTokenizer::SmolLM, PreTokenizer::Qwen2,
                           PreTokenizer::Default}) {
    if (patterns == pre_tokenizer_patterns(pre)) return pre;
  }
  return PreTokenizer::Custom;
}

RegexSplitter::RegexSplitter(const std::vector<std::string>& patterns) {
  for (const auto& source : patterns) {
    auto pat = std::make_unique<Pattern>();
    pat->source = source;
    std::string compiled;
    uint32_t options = PCRE2_DOLLAR_ENDONLY;
    if (auto collapsed = translate_collapsed(source)) {
      compiled = *collapsed;
      pat->collapsed = true;
      any_collapsed_ = true;
    } else {
      compiled = translate_utf(source);
      options |= PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
      any_utf_ = true;
    }
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    pat->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(),
                              options, &err, &err_offset, nullptr);
    if (!pat->code) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(err, msg.data(), msg.size());
      throw Error("tokenizer: bad split regex '" + source +
                  "': " + reinterpret_cast<const char*>(msg.data()) + " at offset " +
                  std::to_string(err_offset));
    }
    pcre2_jit_compile(pat->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
    patterns_.push_back(std::move(pat));
  }
}

RegexSplitter::~RegexSplitter() = default;

namespace {

using MatchData = std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)>;

// Cuts subject[0, len) into matches and gaps, appending [begin, end) ranges (offset by `base`)
// to `out`. `char_len(i)` is the length of the character at i in subject units.
template <typename CharLen>
void split_one(const pcre2_code* code, pcre2_match_data* md, const uint8_t* subject, size_t len,
               uint32_t base, CharLen char_len, std::vector<TextSpan>& out) {
  size_t start = 0;
  size_t last_end = 0;
  while (start <= len) {
    int rc = pcre2_match(code, subject, len, start, 0, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(code, subject, len, start, PCRE2_NO_JIT, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw Error("tokenizer: regex match failed with PCRE2 error " + std::to_string(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t ms = ov[0], me = ov[1];
    if (ms > last_end) out.emplace_back(base + last_end, base + ms);
    if (me > ms) {
      out.emplace_back(base + ms, base + me);
      start = me;
    } else {
      if (ms >= len) break;
      start = ms + char_len(ms);  // an empty match cuts the text but consumes nothing
    }
    last_end = std::max(last_end, me);
  }
  if (last_end < len) out.emplace_back(base + last_end, base + len);
}

}  // namespace

std::vector<TextSpan> RegexSplitter::split(std::string_view text) const {
  // Pieces are kept in codepoint units while splitting; cp_byte maps them back to bytes.
  std::vector<uint32_t> cp_byte;
  cp_byte.reserve(text.size() + 1);
  std::string collapsed;
  // UTF-mode patterns see non-ASCII whitespace as \v, as llama.cpp's std::wregex path does.
  std::string utf_text;
  std::vector<uint32_t> utf_cp_byte;
  std::vector<uint32_t> utf_byte_cp;
  for (size_t pos = 0; pos < text.size();) {
    cp_byte.push_back(static_cast<uint32_t>(pos));
    const size_t start = pos;
    uint32_t cp = utf8_decode(text, pos);
    if (any_collapsed_) collapsed += static_cast<char>(collapse_code(cp));
    if (any_utf_) {
      utf_cp_byte.push_back(static_cast<uint32_t>(utf_text.size()));
      if (cp >= 0x80 && is_whitespace(cp)) {
        utf_text += '\v';
      } else {
        utf_text.append(text.substr(start, pos - start));
      }
      utf_byte_cp.resize(utf_text.size(), static_cast<uint32_t>(cp_byte.size() - 1));
    }
  }
  const auto num_cps = static_cast<uint32_t>(cp_byte.size());
  cp_byte.push_back(static_cast<uint32_t>(text.size()));
  if (any_utf_) {
    utf_byte_cp.push_back(num_cps);
    utf_cp_byte.push_back(static_cast<uint32_t>(utf_text.size()));
  }

  std::vector<TextSpan> pieces;
  if (num_cps > 0) pieces.emplace_back(0, num_cps);
  std::vector<TextSpan> next;
  for (const auto& pat : patterns_) {
    MatchData md(pcre2_match_data_create_from_pattern(pat->code, nullptr), &pcre2_match_data_free);
    next.clear();
    for (const auto& [b, e] : pieces) {
      if (pat->collapsed) {
        split_one(
            pat->code, md.get(), reinterpret_cast<const uint8_t*>(collapsed.data()) + b, e - b,
            static_cast<uint32_t>(b), [](size_t) { return size_t{1}; }, next);
      } else {
        // Runs on UTF-8 bytes, then maps the byte ranges back to codepoints.
        const size_t first = next.size();
        const size_t off = utf_cp_byte[b];
        const size_t len = utf_cp_byte[e] - off;
        std::string_view piece(utf_text.data() + off, len);
        split_one(
            pat->code, md.get(), reinterpret_cast<const uint8_t*>(piece.data()), len, 0,
            [&](size_t i) { return std::max<size_t>(1, utf8_sequence_length(piece, i)); }, next);
        for (size_t k = first; k < next.size(); ++k) {
          next[k] = {utf_byte_cp[off + next[k].first], utf_byte_cp[off + next[k].second]};
        }
      }
    }
    pieces.swap(next);
  }
  for (auto& [b, e] : pieces) {
    b = cp_byte[b];
    e = cp_byte[e];
  }
  return pieces;
}

}  // namespace ds
