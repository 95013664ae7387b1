// What the engine and server tests share: the tokens one request produced.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "engine/engine.h"

namespace ds::test {

// Drains a request's events: its generated token ids, in order; the final event must carry
// no error.
inline std::vector<int32_t> collect_tokens(RequestHandle& h) {
  std::vector<int32_t> toks;
  while (auto ev = h.next()) {
    if (ev->token >= 0) toks.push_back(ev->token);
    if (ev->final) {
      EXPECT_TRUE(ev->error.empty()) << ev->error;
    }
  }
  return toks;
}

}  // namespace ds::test
