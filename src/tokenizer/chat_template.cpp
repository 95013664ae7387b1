#include "tokenizer/chat_template.h"

#include "core/log.h"
#include "tokenizer/unicode.h"

namespace ds {

namespace {

constexpr std::string_view kDeepSeekBos = "<｜begin▁of▁sentence｜>";
constexpr std::string_view kDeepSeekEos = "<｜end▁of▁sentence｜>";
constexpr std::string_view kLlama3Bos = "<|begin_of_text|>";
constexpr std::string_view kLlama3Eot = "<|eot_id|>";

bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

// What Python's str.strip() (jinja's `trim`) treats as whitespace.
bool is_py_space(uint32_t cp) {
  return is_whitespace(cp) || (cp >= 0x1C && cp <= 0x1F);
}

std::string py_strip(std::string_view s) {
  size_t begin = 0;
  size_t end = s.size();
  for (size_t pos = 0; pos < s.size();) {
    size_t start = pos;
    if (!is_py_space(utf8_decode(s, pos))) {
      begin = start;
      break;
    }
    begin = pos;
  }
  // Scan forward remembering where the last non-space character ends.
  size_t last_end = begin;
  for (size_t pos = begin; pos < s.size();) {
    uint32_t cp = utf8_decode(s, pos);
    if (!is_py_space(cp)) last_end = pos;
  }
  end = last_end;
  return std::string(s.substr(begin, end - begin));
}

// Jinja string-literal escapes.
std::string unescape_literal(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 >= s.size()) {
      out += s[i];
      continue;
    }
    char c = s[++i];
    switch (c) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      default:
        out += c;
        break;  // \' \" \\ and anything else: the character itself
    }
  }
  return out;
}

}  // namespace

std::string_view chat_template_kind_name(ChatTemplateKind kind) {
  switch (kind) {
    case ChatTemplateKind::ChatML:
      return "chatml";
    case ChatTemplateKind::DeepSeek:
      return "deepseek";
    case ChatTemplateKind::DeepSeek3:
      return "deepseek3";
    case ChatTemplateKind::Llama3:
      return "llama3";
    case ChatTemplateKind::Raw:
      return "raw";
  }
  return "raw";
}

std::string extract_default_system_prompt(std::string_view src) {
  constexpr std::string_view kOpen = "<|im_start|>system";
  constexpr std::string_view kClose = "<|im_end|>";
  for (size_t at = src.find(kOpen); at != std::string_view::npos; at = src.find(kOpen, at + 1)) {
    // Must open a quoted literal: '<|im_start|>system\n...<|im_end|>' with nothing spliced in.
    if (at == 0 || (src[at - 1] != '\'' && src[at - 1] != '"')) continue;
    const char quote = src[at - 1];
    size_t body = at + kOpen.size();
    if (src.substr(body, 1) == "\n") {
      body += 1;
    } else if (src.substr(body, 2) == "\\n") {
      body += 2;
    } else {
      continue;
    }
    size_t close = src.find(kClose, body);
    if (close == std::string_view::npos) continue;
    std::string_view text = src.substr(body, close - body);
    bool spliced = false;
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] == '\\') {
        ++i;
      } else if (text[i] == quote || text[i] == '{' || text[i] == '}') {
        spliced = true;
        break;
      }
    }
    if (!spliced && !text.empty()) return unescape_literal(text);
  }
  return {};
}

ChatTemplate ChatTemplate::of_kind(ChatTemplateKind kind, const ChatTemplateTokens& tokens,
                                   std::string default_system) {
  ChatTemplate t;
  t.kind_ = kind;
  t.bos_ = tokens.bos;
  t.eos_ = tokens.eos;
  if (kind == ChatTemplateKind::DeepSeek || kind == ChatTemplateKind::DeepSeek3) {
    if (t.bos_.empty()) t.bos_ = kDeepSeekBos;
    if (t.eos_.empty()) t.eos_ = kDeepSeekEos;
  } else if (kind == ChatTemplateKind::Llama3) {
    if (t.bos_.empty()) t.bos_ = kLlama3Bos;
    if (t.eos_.empty()) t.eos_ = kLlama3Eot;
  }
  t.default_system_ = std::move(default_system);
  return t;
}

ChatTemplate ChatTemplate::detect(std::string_view src, std::string_view arch,
                                  const ChatTemplateTokens& tokens) {
  if (contains(src, "<|im_start|>"))
    return of_kind(ChatTemplateKind::ChatML, tokens, extract_default_system_prompt(src));
  if (contains(src, "<｜User｜>") || contains(src, "<｜Assistant｜>"))
    return of_kind(ChatTemplateKind::DeepSeek3, tokens);
  if (contains(src, "<|start_header_id|>")) return of_kind(ChatTemplateKind::Llama3, tokens);
  if (contains(src, "User: ") && contains(src, "Assistant:"))
    return of_kind(ChatTemplateKind::DeepSeek, tokens);
  if (src.empty() && (arch == "deepseek2" || arch == "deepseek_v2")) {
    log_warn("chat template: the model has none; using the DeepSeek-V2 format for arch " +
             std::string(arch));
    return of_kind(ChatTemplateKind::DeepSeek, tokens);
  }
  log_warn(std::string("chat template: ") +
           (src.empty() ? "the model has none" : "format not recognised") +
           "; falling back to ChatML (<|im_start|>role ... <|im_end|>)");
  return of_kind(ChatTemplateKind::ChatML, tokens);
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) const {
  std::string out;
  switch (kind_) {
    case ChatTemplateKind::ChatML:
      if (!default_system_.empty() && !messages.empty() && messages[0].role != "system")
        out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      for (const auto& m : messages)
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case ChatTemplateKind::DeepSeek:
      out += bos_;
      for (const auto& m : messages) {
        if (m.role == "user") {
          out += "User: " + m.content + "\n\n";
        } else if (m.role == "assistant") {
          out += "Assistant: " + m.content + eos_;
        } else if (m.role == "system") {
          out += m.content + "\n\n";
        }
      }
      if (add_generation_prompt) out += "Assistant:";
      break;
    case ChatTemplateKind::DeepSeek3: {
      // System prompts go first, joined by blank lines, whatever their position.
      std::string system;
      bool first = true;
      for (const auto& m : messages) {
        if (m.role != "system") continue;
        system += (first ? "" : "\n\n") + m.content;
        first = false;
      }
      out += bos_ + system;
      for (const auto& m : messages) {
        if (m.role == "user") {
          out += "<｜User｜>" + m.content;
        } else if (m.role == "assistant") {
          out += "<｜Assistant｜>" + m.content + eos_;
        }
      }
      if (add_generation_prompt) out += "<｜Assistant｜>";
      break;
    }
    case ChatTemplateKind::Llama3:
      for (size_t i = 0; i < messages.size(); ++i) {
        if (i == 0) out += bos_;
        out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
               py_strip(messages[i].content) + "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatTemplateKind::Raw:
      for (const auto& m : messages) out += m.content;
      break;
  }
  return out;
}

std::vector<std::string> ChatTemplate::stop_strings() const {
  switch (kind_) {
    case ChatTemplateKind::ChatML:
      return {"<|im_end|>"};
    case ChatTemplateKind::DeepSeek:
    case ChatTemplateKind::DeepSeek3:
      return {eos_};
    case ChatTemplateKind::Llama3:
      return {"<|eot_id|>"};
    case ChatTemplateKind::Raw:
      return {};
  }
  return {};
}

}  // namespace ds
