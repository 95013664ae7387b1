// Turns a request's sampled token ids into text: streaming detokenization (never a broken
// UTF-8 sequence), end-of-generation tokens and stop strings (text ends before the match;
// text that may be the start of a stop string is held back until it is decided).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace ds {

class OutputProcessor {
 public:
  // tok may be null (token-id models): then there is no text and no stop strings.
  OutputProcessor(const Tokenizer* tok, std::vector<std::string> stop, bool ignore_eos,
                  int32_t eos_id);

  struct Delta {
    std::string_view text;  // newly final text (may be empty)
    bool finished = false;  // an EOS token or a stop string ended the output
  };
  // Feeds one generated token. After finished, further pushes are ignored.
  Delta push(int32_t id);
  // Ends the output for another reason (length, cancel): releases held-back text.
  std::string_view close();

  const std::string& text() const { return text_; }
  bool finished() const { return finished_; }

 private:
  size_t pending_stop_prefix() const;

  const Tokenizer* tok_;
  std::vector<std::string> stop_;
  bool ignore_eos_;
  int32_t eos_id_;
  std::optional<StreamingDetokenizer> detok_;
  std::string text_;
  size_t emitted_ = 0;  // bytes of text_ already returned
  bool finished_ = false;
  bool stopped_ = false;  // by a stop string: the text after the match is dropped
};

}  // namespace ds
