#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "core/error.h"
#include "engine/generator.h"
#include "tokenizer/chat_template.h"

namespace ds {

int run_chat(const ChatOptions& o) {
  Session s = open_session(o.model, 0);
  const Tokenizer* tok = s.loaded.tokenizer.get();
  if (!tok) throw Error(s.loaded.path + " has no tokenizer; chat needs one");
  const ChatTemplate tmpl = ChatTemplate::detect(s.loaded.chat_template, s.loaded.config.arch);
  Generator gen(*s.loaded.model, *s.backend, tok, *s.cache);
  const bool tty = isatty(0);
  std::vector<ChatMessage> history;
  if (!o.system.empty()) history.push_back({"system", o.system});
  if (tty)
    std::fprintf(
        stderr, "deepserve chat: %s. /reset clears, /exit or Ctrl-D quits.\n",
        s.loaded.config.name.empty() ? s.loaded.path.c_str() : s.loaded.config.name.c_str());
  for (;;) {
    if (tty) std::fprintf(stderr, "\n> ");
    std::string line;
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      history.resize(o.system.empty() ? 0 : 1);
      continue;
    }
    if (line.empty()) continue;
    history.push_back({"user", line});
    GenerateRequest req;
    req.prompt = tok->encode(tmpl.apply(history, true), tok->add_bos_default(), true);
    req.max_tokens = o.max_tokens;
    req.sampling = o.sampling;
    req.stop = tmpl.stop_strings();
    if (int64_t(req.prompt.size()) + 1 >= gen.context_capacity()) {
      std::fprintf(stderr, "(the conversation no longer fits the context; /reset to start over)\n");
      history.pop_back();
      continue;
    }
    GenerateResult r = gen.generate(req, [](int32_t, std::string_view delta) {
      std::fwrite(delta.data(), 1, delta.size(), stdout);
      std::fflush(stdout);
      return true;
    });
    std::printf("\n");
    std::fflush(stdout);
    if (tty)
      std::fprintf(stderr, "[%zu tokens, %.1f tok/s]\n", r.tokens.size(), r.decode_tokens_per_s());
    history.push_back({"assistant", r.text});
  }
  return 0;
}

}  // namespace ds
