// Chat formats against templates rendered by jinja2 (tools/make_tokenizer_fixtures.py).
#include <gtest/gtest.h>

#include <cctype>

#include "tokenizer/chat_template.h"
#include "tokenizer_test_util.h"

namespace ds {
namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

TEST(ChatTemplate, MatchesJinja2Renderings) {
  auto rows = test::read_jsonl(test::fixture_path("chat_templates.jsonl"));
  ASSERT_GE(rows.size(), 40u);
  for (const auto& row : rows) {
    const std::string name = row.at("name");
    ChatTemplateTokens tokens{row.at("bos"), row.at("eos")};
    auto t = ChatTemplate::detect(row.at("template").get<std::string>(),
                                  row.at("arch").get<std::string>(), tokens);
    EXPECT_EQ(chat_template_kind_name(t.kind()), lower(row.at("kind"))) << name;
    std::vector<ChatMessage> messages;
    for (const auto& m : row.at("messages")) messages.push_back({m.at("role"), m.at("content")});
    const bool gen = row.at("add_generation_prompt");
    EXPECT_EQ(t.apply(messages, gen), row.at("rendered").get<std::string>())
        << name << " add_generation_prompt=" << gen << " first role " << messages[0].role;
  }
}

TEST(ChatTemplate, DefaultSystemPromptComesFromTheTemplate) {
  // SmolLM2's template, as stored in its GGUF (a real newline inside the literal).
  const std::string smollm2 =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
      "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
  EXPECT_EQ(extract_default_system_prompt(smollm2),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  // Escaped newline and a spliced (non-default) system message before the literal one.
  EXPECT_EQ(extract_default_system_prompt(
                "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
                "{{ \"<|im_start|>system\\nBe nice, it's \\\"fine\\\".<|im_end|>\\n\" }}"),
            "Be nice, it's \"fine\".");
  EXPECT_EQ(extract_default_system_prompt("{{'<|im_start|>' + role}}"), "");

  auto t = ChatTemplate::detect(smollm2, "llama");
  EXPECT_EQ(t.kind(), ChatTemplateKind::ChatML);
  EXPECT_EQ(t.apply({{"user", "Hi"}}, true),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.apply({{"system", "S"}, {"user", "Hi"}}, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  EXPECT_EQ(t.stop_strings(), std::vector<std::string>{"<|im_end|>"});
}

TEST(ChatTemplate, DeepSeekV2Format) {
  auto t = ChatTemplate::detect(
      "{{ bos_token }}{% for m in messages %}{{ 'User: ' + m['content'] }}{% endfor %}"
      "{{ 'Assistant:' }}",
      "deepseek2");
  EXPECT_EQ(t.kind(), ChatTemplateKind::DeepSeek);
  EXPECT_EQ(t.apply({{"system", "Sys"}, {"user", "Q"}, {"assistant", "A"}, {"user", "Q2"}}, true),
            "<｜begin▁of▁sentence｜>Sys\n\nUser: Q\n\nAssistant: A<｜end▁of▁sentence｜>User: "
            "Q2\n\nAssistant:");
  EXPECT_EQ(t.stop_strings(), std::vector<std::string>{"<｜end▁of▁sentence｜>"});
}

TEST(ChatTemplate, FallbacksAndOtherKinds) {
  EXPECT_EQ(ChatTemplate::detect("", "llama").kind(), ChatTemplateKind::ChatML);
  EXPECT_EQ(ChatTemplate::detect("{{ messages }}", "qwen2").kind(), ChatTemplateKind::ChatML);
  EXPECT_EQ(ChatTemplate::detect("", "deepseek2").kind(), ChatTemplateKind::DeepSeek);
  EXPECT_EQ(ChatTemplate::detect("", "deepseek_v2").kind(), ChatTemplateKind::DeepSeek);
  EXPECT_EQ(ChatTemplate::detect("<｜User｜>", "deepseek2").kind(), ChatTemplateKind::DeepSeek3);
  auto llama3 = ChatTemplate::detect("<|start_header_id|>", "llama");
  EXPECT_EQ(llama3.kind(), ChatTemplateKind::Llama3);
  EXPECT_EQ(llama3.apply({{"user", " hi \n"}}, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(llama3.stop_strings(), std::vector<std::string>{"<|eot_id|>"});
  auto raw = ChatTemplate::of_kind(ChatTemplateKind::Raw);
  EXPECT_EQ(raw.apply({{"user", "a"}, {"assistant", "b"}}, true), "ab");
  EXPECT_TRUE(raw.stop_strings().empty());
}

}  // namespace
}  // namespace ds
