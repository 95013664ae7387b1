// Request and sequence state shared by the scheduler, the block manager and the engine.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace ds {

using SeqId = int64_t;

// Service classes: higher classes are admitted first and preempted last.
enum class Priority : uint8_t { LatencyCritical = 0, Standard = 1, Batch = 2 };

// "latency-critical", "standard", "batch" (the CLI and API spelling).
inline std::string_view priority_name(Priority p) {
  switch (p) {
    case Priority::LatencyCritical:
      return "latency-critical";
    case Priority::Standard:
      return "standard";
    case Priority::Batch:
      return "batch";
  }
  return "?";
}

inline std::optional<Priority> parse_priority(std::string_view name) {
  for (Priority p : {Priority::LatencyCritical, Priority::Standard, Priority::Batch})
    if (name == priority_name(p)) return p;
  return std::nullopt;
}

enum class FinishReason : uint8_t {
  Stop,       // EOS or a stop string (decided by the engine)
  Length,     // max_tokens reached
  Cancelled,  // abort()
  Rejected,   // could never be served (see the reason in StepPlan::rejected)
  Error,      // the engine failed while serving it (the server's fault, not the request's)
};

// "stop", "length", "cancelled", "rejected", "error" (the OpenAI spelling where one exists).
inline std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop:
      return "stop";
    case FinishReason::Length:
      return "length";
    case FinishReason::Cancelled:
      return "cancelled";
    case FinishReason::Rejected:
      return "rejected";
    case FinishReason::Error:
      return "error";
  }
  return "?";
}

// What the engine submits to the scheduler.
struct Request {
  SeqId id = 0;
  std::vector<int32_t> prompt;
  int max_tokens = 128;  // generated tokens at most (>= 1)
  Priority priority = Priority::Standard;
};

enum class SeqStatus : uint8_t {
  Waiting,  // queued, or preempted and waiting to be recomputed; holds no blocks
  Running,  // holds blocks; scheduled every step until finished or preempted
};

// One sequence of tokens being generated. The scheduler owns it; the engine reads it.
struct Sequence {
  SeqId id = 0;
  Priority priority = Priority::Standard;
  uint64_t arrival = 0;         // arrival order; FIFO within a class (forks share the parent's)
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int num_prompt_tokens = 0;
  int max_tokens = 0;
  // Leading tokens whose K/V are in the cache. The last token of a decoding sequence is not:
  // it was just sampled and is computed in the next step.
  int num_computed = 0;
  int num_scheduled = 0;       // tokens in the step in flight (0 between steps)
  int num_cached_prompt = -1;  // prompt tokens served by the prefix cache at first admission
  int num_preemptions = 0;
  SeqStatus status = SeqStatus::Waiting;

  int num_tokens() const { return int(tokens.size()); }
  int num_output() const { return num_tokens() - num_prompt_tokens; }
  std::span<const int32_t> prompt() const {
    return std::span(tokens).first(size_t(num_prompt_tokens));
  }
  std::span<const int32_t> output() const {
    return std::span(tokens).subspan(size_t(num_prompt_tokens));
  }
  // Tokens still to compute before the next token can be sampled (1 when decoding).
  int num_uncomputed() const { return num_tokens() - num_computed; }
};

}  // namespace ds
