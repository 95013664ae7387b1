#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <mutex>
#include <queue>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace ds {

namespace {

// Token texts that end a generated turn (the list llama.cpp recognises by text).
constexpr std::string_view kEogTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>",         "<end_of_turn>",      "<|endoftext|>",
    "<|eom_id|>", "<EOT>",      "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
};

// Recently seen words -> ids. Two generations: when the young one fills up the old one is
// dropped, so a word in steady use survives while memory stays bounded.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 128;
  static constexpr size_t kGenerationSize = 32768;

  bool find(std::string_view word, std::vector<int32_t>& out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = young_.find(std::string(word));
    if (it != young_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return true;
    }
    auto old = old_.find(std::string(word));
    if (old == old_.end()) return false;
    out.insert(out.end(), old->second.begin(), old->second.end());
    // Promote to the young generation; erase first, as inserting may replace old_.
    std::vector<int32_t> ids = std::move(old->second);
    old_.erase(old);
    insert_locked(std::string(word), std::move(ids));
    return true;
  }

  void insert(std::string_view word, std::span<const int32_t> ids) {
    std::lock_guard<std::mutex> lock(mu_);
    insert_locked(std::string(word), std::vector<int32_t>(ids.begin(), ids.end()));
  }

 private:
  void insert_locked(std::string word, std::vector<int32_t> ids) {
    if (young_.size() >= kGenerationSize) {
      old_ = std::move(young_);
      young_ = {};
    }
    young_.emplace(std::move(word), std::move(ids));
  }

  std::mutex mu_;
  std::unordered_map<std::string, std::vector<int32_t>> young_;
  std::unordered_map<std::string, std::vector<int32_t>> old_;
};

// A text range [begin, end) of the input, or a special token already recognised.
struct Fragment {
  int32_t token;  // -1 for text
  size_t begin;
  size_t end;
};

bool is_ascii_space(char c) {
  return std::isspace(static_cast<unsigned char>(c)) != 0;
}

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

struct Tokenizer::Impl {
  struct Merge {
    int32_t rank;
    int32_t result;  // piece id
  };
  explicit Impl(const std::vector<std::string>& patterns) : splitter(patterns) {}

  RegexSplitter splitter;
  // Over piece ids: the strings merging can produce. Ids below vocab_size are vocab tokens;
  // the rest stand for merge results whose text is not in the vocab.
  std::unordered_map<uint64_t, Merge> merges;
  std::array<int32_t, 256> byte_piece{};  // -1 when the byte's character is not a piece
  std::vector<int32_t> special_order;     // special ids, longest text first
  std::vector<uint8_t> lstrip, rstrip;    // per id
  mutable WordCache cache;
};

Tokenizer::Tokenizer(TokenizerSpec spec)
    : tokens_(std::move(spec.tokens)),
      types_(std::move(spec.types)),
      pre_(spec.pre),
      ignore_merges_(spec.ignore_merges),
      add_prefix_space_(spec.add_prefix_space),
      bos_id_(spec.bos_id),
      eos_id_(spec.eos_id),
      add_bos_(spec.add_bos),
      chat_template_(std::move(spec.chat_template)) {
  const auto n = static_cast<int32_t>(tokens_.size());
  if (n == 0) throw Error("tokenizer: empty vocabulary");
  if (types_.empty()) types_.assign(tokens_.size(), TokenType::Normal);
  if (types_.size() != tokens_.size())
    throw Error("tokenizer: " + std::to_string(types_.size()) + " token types for " +
                std::to_string(n) + " tokens");
  const auto valid = [n](int32_t id) { return id >= 0 && id < n; };
  if (!valid(bos_id_)) bos_id_ = -1;
  if (!valid(eos_id_)) eos_id_ = -1;

  std::vector<std::string> patterns = spec.split_patterns;
  if (patterns.empty()) patterns = pre_tokenizer_patterns(pre_);
  impl_ = std::make_unique<Impl>(patterns);

  for (int32_t id = 0; id < n; ++id) {
    if (!tokens_[id].empty()) text_to_id_[tokens_[id]] = id;  // later ids win, as in llama.cpp
  }

  // End-of-generation tokens; their text marks them as control tokens whatever the file says.
  std::unordered_set<int32_t> eog;
  if (valid(eos_id_)) eog.insert(eos_id_);
  for (int32_t id : spec.extra_eog_ids)
    if (valid(id)) eog.insert(id);
  for (std::string_view t : kEogTexts) {
    auto it = text_to_id_.find(std::string(t));
    if (it == text_to_id_.end()) continue;
    eog.insert(it->second);
    types_[it->second] = TokenType::Control;
  }
  eog_ids_.assign(eog.begin(), eog.end());
  std::sort(eog_ids_.begin(), eog_ids_.end());

  bytes_.resize(tokens_.size());
  for (int32_t id = 0; id < n; ++id) {
    const std::string& t = tokens_[id];
    switch (types_[id]) {
      case TokenType::Control:
      case TokenType::Unknown:
      case TokenType::UserDefined:
        bytes_[id] = t;
        break;
      case TokenType::Unused:
        break;
      case TokenType::Byte:
        if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>') {
          bytes_[id] = std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
        } else {
          bytes_[id] = gpt2_text_to_bytes(t);
        }
        break;
      default:
        bytes_[id] = gpt2_text_to_bytes(t);
        break;
    }
  }

  // Merge table over piece ids; the first of duplicate merges wins, as in llama.cpp.
  std::unordered_map<std::string, int32_t> extra_ids;
  auto piece_of = [&](const std::string& text) -> int32_t {
    if (auto it = text_to_id_.find(text); it != text_to_id_.end()) return it->second;
    return extra_ids.emplace(text, n + static_cast<int32_t>(extra_ids.size())).first->second;
  };
  impl_->merges.reserve(spec.merges.size());
  for (size_t rank = 0; rank < spec.merges.size(); ++rank) {
    const auto& [left, right] = spec.merges[rank];
    int32_t a = piece_of(left);
    int32_t b = piece_of(right);
    int32_t ab = piece_of(left + right);
    impl_->merges.emplace(pair_key(a, b), Impl::Merge{static_cast<int32_t>(rank), ab});
  }

  const auto& byte_cp = gpt2_byte_to_codepoint();
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    utf8_append(ch, byte_cp[b]);
    auto it = text_to_id_.find(ch);
    impl_->byte_piece[b] = it != text_to_id_.end() ? it->second : -1;
  }

  impl_->lstrip.assign(tokens_.size(), 0);
  impl_->rstrip.assign(tokens_.size(), 0);
  for (int32_t id : spec.lstrip_ids)
    if (valid(id)) impl_->lstrip[id] = 1;
  for (int32_t id : spec.rstrip_ids)
    if (valid(id)) impl_->rstrip[id] = 1;
  for (int32_t id = 0; id < n; ++id) {
    if (is_special(id) && !tokens_[id].empty()) impl_->special_order.push_back(id);
  }
  std::stable_sort(impl_->special_order.begin(), impl_->special_order.end(),
                   [&](int32_t a, int32_t b) { return tokens_[a].size() > tokens_[b].size(); });
}

Tokenizer::~Tokenizer() = default;

void Tokenizer::check_id(int32_t id) const {
  if (id < 0) throw Error("tokenizer: negative token id " + std::to_string(id));
}

TokenType Tokenizer::token_type(int32_t id) const {
  check_id(id);
  return has_token(id) ? types_[id] : TokenType::Unused;
}

bool Tokenizer::is_special(int32_t id) const {
  TokenType t = token_type(id);
  return t == TokenType::Control || t == TokenType::Unknown || t == TokenType::UserDefined;
}

bool Tokenizer::is_eog(int32_t id) const {
  return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id);
}

const std::string& Tokenizer::token_text(int32_t id) const {
  static const std::string kNone;
  check_id(id);
  return has_token(id) ? tokens_[id] : kNone;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  check_id(id);
  return has_token(id) ? bytes_[id] : std::string();
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  auto it = text_to_id_.find(std::string(text));
  if (it == text_to_id_.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    check_id(id);
    if (!has_token(id)) continue;
    if (skip_special && (types_[id] == TokenType::Control || types_[id] == TokenType::Unknown))
      continue;
    out += bytes_[id];
  }
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos,
                                       bool parse_special) const {
  std::string sanitized;
  if (!utf8_is_valid(text)) {
    sanitized = utf8_sanitize(text);
    text = sanitized;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);

  // Special tokens are cut out first, longest text first across the whole input (llama.cpp's
  // order), so a longer token wins over a shorter one inside it.
  std::vector<Fragment> frags{{-1, 0, text.size()}};
  std::vector<Fragment> next;
  for (int32_t id : impl_->special_order) {
    const TokenType type = types_[id];
    if (!parse_special && (type == TokenType::Control || type == TokenType::Unknown)) continue;
    const std::string& needle = tokens_[id];
    if (text.find(needle) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& f : frags) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      size_t pos = f.begin;
      while (true) {
        size_t hit = text.substr(0, f.end).find(needle, pos);
        if (hit == std::string_view::npos) break;
        size_t left_end = hit;
        if (impl_->lstrip[id])
          while (left_end > pos && is_ascii_space(text[left_end - 1])) --left_end;
        if (left_end > pos) next.push_back({-1, pos, left_end});
        next.push_back({id, hit, hit + needle.size()});
        pos = hit + needle.size();
        if (impl_->rstrip[id])
          while (pos < f.end && is_ascii_space(text[pos])) ++pos;
      }
      if (pos < f.end) next.push_back({-1, pos, f.end});
    }
    frags.swap(next);
  }
  for (const Fragment& f : frags) {
    if (f.token >= 0) {
      out.push_back(f.token);
    } else {
      encode_text(text.substr(f.begin, f.end - f.begin), out);
    }
  }
  return out;
}

void Tokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  std::string prefixed;
  if (add_prefix_space_ && !text.empty() && text[0] != ' ') {
    prefixed = " " + std::string(text);
    text = prefixed;
  }
  for (const auto& [b, e] : impl_->splitter.split(text)) encode_word(text.substr(b, e - b), out);
}

void Tokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  if (cacheable && impl_->cache.find(word, out)) return;
  const size_t out_start = out.size();
  const int32_t n = vocab_size();

  auto it = ignore_merges_ ? text_to_id_.find(gpt2_bytes_to_text(word)) : text_to_id_.end();
  if (it != text_to_id_.end()) {
    out.push_back(it->second);
  } else {
    // One symbol per byte, linked in a list; merges are taken lowest rank first, leftmost
    // first among equals, from a heap of candidate pairs checked for staleness when popped.
    struct Symbol {
      int32_t piece;  // -1: a byte whose character is not in the vocab; it never merges
      int32_t prev, next;
      uint32_t begin, len;  // bytes of `word` it covers; len 0 once merged into its left
    };
    struct Candidate {
      int32_t rank, left, right, left_piece, right_piece, result;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : left > o.left;
      }
    };
    const auto size = static_cast<int32_t>(word.size());
    std::vector<Symbol> sym(word.size());
    for (int32_t i = 0; i < size; ++i) {
      sym[i] = {impl_->byte_piece[static_cast<uint8_t>(word[i])], i - 1, i + 1 < size ? i + 1 : -1,
                static_cast<uint32_t>(i), 1};
    }
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    auto consider = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0 || sym[l].piece < 0 || sym[r].piece < 0) return;
      auto m = impl_->merges.find(pair_key(sym[l].piece, sym[r].piece));
      if (m == impl_->merges.end()) return;
      heap.push({m->second.rank, l, r, sym[l].piece, sym[r].piece, m->second.result});
    };
    for (int32_t i = 0; i + 1 < size; ++i) consider(i, i + 1);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      Symbol& l = sym[c.left];
      Symbol& r = sym[c.right];
      if (l.len == 0 || r.len == 0 || l.next != c.right || l.piece != c.left_piece ||
          r.piece != c.right_piece)
        continue;
      l.piece = c.result;
      l.len += r.len;
      r.len = 0;
      l.next = r.next;
      if (r.next >= 0) sym[r.next].prev = c.left;
      consider(l.prev, c.left);
      consider(c.left, l.next);
    }
    for (int32_t i = 0; i != -1; i = sym[i].next) {
      const Symbol& s = sym[i];
      if (s.piece >= 0 && s.piece < n) {
        out.push_back(s.piece);
        continue;
      }
      // Not a vocab token: fall back to single-character tokens of its text, dropping the
      // characters the vocab lacks (llama.cpp does the same).
      const std::string text = gpt2_bytes_to_text(word.substr(s.begin, s.len));
      for (char ch : text) {
        auto t = text_to_id_.find(std::string(1, ch));
        if (t != text_to_id_.end()) out.push_back(t->second);
      }
    }
  }
  if (cacheable) impl_->cache.insert(word, std::span<const int32_t>(out).subspan(out_start));
}

std::unique_ptr<Tokenizer> Tokenizer::create(TokenizerSpec spec) {
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(spec)));
}

StreamingDetokenizer::StreamingDetokenizer(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string StreamingDetokenizer::push(int32_t id) {
  // An id past the tokenizer (a padded model vocabulary) stands for no bytes: it leaves the
  // held-back UTF-8 tail as it was.
  if (!tok_.has_token(id)) {
    tok_.token_type(id);  // still refuses negative ids
    return {};
  }
  const TokenType type = tok_.token_type(id);
  if (skip_special_ && (type == TokenType::Control || type == TokenType::Unknown)) return {};
  pending_ += tok_.token_bytes(id);
  // Emit every complete sequence; keep a tail that may still complete; a sequence that can
  // no longer complete becomes U+FFFD now rather than stalling the stream.
  std::string out;
  const size_t keep = utf8_incomplete_tail(pending_);
  const std::string_view ready(pending_.data(), pending_.size() - keep);
  for (size_t pos = 0; pos < ready.size();) {
    size_t n = utf8_sequence_length(ready, pos);
    if (n > 0) {
      out.append(ready.substr(pos, n));
      pos += n;
    } else {
      utf8_append(out, kReplacementChar);
      pos += utf8_invalid_length(ready, pos);
    }
  }
  pending_.erase(0, ready.size());
  return out;
}

std::string StreamingDetokenizer::flush() {
  std::string out = utf8_sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace ds
