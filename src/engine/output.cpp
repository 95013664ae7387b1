#include "engine/output.h"

#include <algorithm>

namespace ds {

OutputProcessor::OutputProcessor(const Tokenizer* tok, std::vector<std::string> stop,
                                 bool ignore_eos, int32_t eos_id)
    : tok_(tok), ignore_eos_(ignore_eos), eos_id_(eos_id) {
  for (auto& s : stop)
    if (!s.empty()) stop_.push_back(std::move(s));
  if (tok_) detok_.emplace(*tok_);
}

size_t OutputProcessor::pending_stop_prefix() const {
  // Longest suffix of the text that is a proper prefix of a stop string.
  size_t hold = 0;
  const std::string_view text(text_);
  for (const auto& s : stop_)
    for (size_t n = std::min(text.size(), s.size() - 1); n > hold; --n)
      if (text.substr(text.size() - n) == std::string_view(s).substr(0, n)) {
        hold = n;
        break;
      }
  return hold;
}

OutputProcessor::Delta OutputProcessor::push(int32_t id) {
  Delta d;
  if (finished_) return d;
  const bool eog = id == eos_id_ || (tok_ && tok_->is_eog(id));
  if (eog && !ignore_eos_) {
    finished_ = true;
    d.text = close();
    d.finished = true;
    return d;
  }
  if (!detok_) return d;
  const size_t before = text_.size();
  text_ += detok_->push(id);
  size_t ready;
  // Only a match that ends in the new text can be new; earlier text was checked already.
  size_t cut = std::string::npos;
  for (const auto& s : stop_) {
    const size_t from = before > s.size() ? before - s.size() + 1 : 0;
    const size_t at = text_.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    text_.resize(cut);
    finished_ = stopped_ = true;
    d.finished = true;
    ready = text_.size();
  } else {
    ready = text_.size() - pending_stop_prefix();
  }
  if (ready > emitted_) {
    d.text = std::string_view(text_).substr(emitted_, ready - emitted_);
    emitted_ = ready;
  }
  return d;
}

std::string_view OutputProcessor::close() {
  if (detok_ && !stopped_) text_ += detok_->flush();
  detok_.reset();
  const size_t from = std::min(emitted_, text_.size());
  emitted_ = text_.size();
  return std::string_view(text_).substr(from);
}

}  // namespace ds
