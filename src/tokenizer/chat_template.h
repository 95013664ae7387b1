// Chat prompt formats. Rather than run the model's jinja template, the format is recognised
// from markers in it and rendered by hand (the rendering is checked against jinja2 in tests).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ds {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

enum class ChatTemplateKind {
  ChatML,     // <|im_start|>role\n...<|im_end|>\n
  DeepSeek,   // DeepSeek-V2 / V2.5: "User: ...\n\nAssistant: ...<｜end▁of▁sentence｜>"
  DeepSeek3,  // <｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>
  Llama3,     // <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
  Raw,        // contents concatenated, no markers
};

std::string_view chat_template_kind_name(ChatTemplateKind kind);

// The bos / eos texts the template refers to; empty ones get the format's usual text.
struct ChatTemplateTokens {
  std::string bos;
  std::string eos;
};

class ChatTemplate {
 public:
  // Picks the format from the model's jinja template text (markers like <|im_start|>,
  // "User: " + "Assistant:", <｜User｜>, <|start_header_id|>) and the architecture; unknown or
  // empty -> ChatML with a log_warn naming the fallback. For ChatML, a default system prompt
  // written as a literal in the template is used when the first message is not a system one.
  static ChatTemplate detect(std::string_view jinja_source, std::string_view arch,
                             const ChatTemplateTokens& tokens = {});
  // A given format, e.g. from a command-line flag.
  static ChatTemplate of_kind(ChatTemplateKind kind, const ChatTemplateTokens& tokens = {},
                              std::string default_system = "");

  ChatTemplateKind kind() const { return kind_; }
  const std::string& default_system() const { return default_system_; }
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  // Texts that end the assistant's turn in this format, e.g. "<|im_end|>".
  std::vector<std::string> stop_strings() const;

 private:
  ChatTemplateKind kind_ = ChatTemplateKind::ChatML;
  std::string bos_;
  std::string eos_;
  std::string default_system_;
};

// The default system prompt a ChatML template writes as a literal
// ('<|im_start|>system\n...<|im_end|>'), or "" if it has none.
std::string extract_default_system_prompt(std::string_view jinja_source);

}  // namespace ds
