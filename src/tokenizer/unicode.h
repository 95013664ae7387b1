// Unicode helpers for the tokenizer: UTF-8, general categories, GPT-2 byte <-> unicode mapping.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ds {

// General category, by its first letter; Cn (unassigned) is kept apart from the other C*.
enum class CharCategory : uint8_t {
  Undefined,
  Letter,
  Number,
  Punctuation,
  Mark,
  Symbol,
  Separator,
  Control,
};

CharCategory char_category(uint32_t cp);
// Unicode's White_Space property (what \s means in Python and Rust regexes).
bool is_whitespace(uint32_t cp);

inline constexpr uint32_t kReplacementChar = 0xFFFD;

// Bytes of the well-formed sequence starting at s[pos], or 0 if s[pos] does not start one
// (bad lead byte, bad continuation, overlong, surrogate, > U+10FFFF, or cut off by the end).
size_t utf8_sequence_length(std::string_view s, size_t pos);
// Where s[pos] starts no well-formed sequence: the length of its maximal subpart, the bytes
// one U+FFFD replaces (Unicode's recommended practice, as Python's errors="replace").
size_t utf8_invalid_length(std::string_view s, size_t pos);
// Decodes the codepoint at s[pos] and advances pos; an ill-formed sequence gives U+FFFD.
uint32_t utf8_decode(std::string_view s, size_t& pos);
void utf8_append(std::string& out, uint32_t cp);
bool utf8_is_valid(std::string_view s);
// Replaces each maximal ill-formed subpart with U+FFFD.
std::string utf8_sanitize(std::string_view s);
// How many of the trailing bytes of s are an incomplete but so far well-formed sequence
// (0..3): the bytes a streaming decoder must hold back until more arrive.
size_t utf8_incomplete_tail(std::string_view s);

// GPT-2's reversible byte <-> printable-codepoint mapping used by byte-level BPE vocabularies.
const std::array<uint32_t, 256>& gpt2_byte_to_codepoint();
// -1 for codepoints that are not in the mapping.
int gpt2_codepoint_to_byte(uint32_t cp);
// Raw bytes -> the vocabulary's byte-level text.
std::string gpt2_bytes_to_text(std::string_view bytes);
// Byte-level text -> raw bytes; codepoints outside the mapping are kept as their UTF-8.
std::string gpt2_text_to_bytes(std::string_view text);

namespace unicode_detail {
struct CategoryRun {
  uint32_t first;
  CharCategory category;
};
extern const CategoryRun kCategoryRuns[];
extern const size_t kCategoryRunCount;
}  // namespace unicode_detail

}  // namespace ds
