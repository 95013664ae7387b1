#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/chat_template.h"

namespace ds {

int run_chat(const ChatOptions& o) {
  Session s = open_session(o.model, o.engine);
  const Tokenizer* tok = s.loaded.tokenizer.get();
  if (!tok) throw Error(s.loaded.path + " has no tokenizer; chat needs one");
  const ChatTemplate tmpl = ChatTemplate::detect(s.loaded.chat_template, s.loaded.config.arch);
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
    EngineRequest req;
    req.prompt = tok->encode(tmpl.apply(history, true), tok->add_bos_default(), true);
    req.max_tokens = o.max_tokens;
    req.sampling = o.sampling;
    req.stop = tmpl.stop_strings();
    if (int64_t(req.prompt.size()) + 1 >= s.engine->kv_capacity_tokens()) {
      std::fprintf(stderr, "(the conversation no longer fits the context; /reset to start over)\n");
      history.pop_back();
      continue;
    }
    auto h = s.engine->submit(std::move(req));
    std::string reply;
    EngineEvent fin;
    while (auto ev = h->next()) {
      std::fwrite(ev->text.data(), 1, ev->text.size(), stdout);
      std::fflush(stdout);
      reply += ev->text;
      if (ev->final) fin = std::move(*ev);
    }
    std::printf("\n");
    std::fflush(stdout);
    if (!fin.error.empty()) std::fprintf(stderr, "(%s)\n", fin.error.c_str());
    if (tty)
      std::fprintf(stderr, "[%d tokens, %.1f tok/s, %d prompt tokens reused]\n",
                   fin.usage.completion_tokens, fin.timings.decode_tokens_per_s(),
                   fin.usage.cached_prompt_tokens);
    history.push_back({"assistant", reply});
  }
  return 0;
}

}  // namespace ds
