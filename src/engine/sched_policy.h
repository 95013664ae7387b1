// The scheduler's policies, one small class each, so a deployment can change one alone.
#pragma once

#include <span>

#include "engine/request.h"

namespace ds {

// Who is served first: higher class first, FIFO (arrival order) within a class.
class AdmissionPolicy {
 public:
  // True if `a` is served (admitted, given budget) before `b`. A strict weak order on
  // (priority, arrival, id), fields that never change while a sequence lives.
  bool before(const Sequence& a, const Sequence& b) const;
  // Whether a waiting sequence may preempt a running one to get in: only a lower class.
  bool may_displace(const Sequence& incoming, const Sequence& running) const;
};

// Who gives up its blocks when the cache runs out: the lowest class, then the most recently
// arrived (it has waited least and usually computed least).
class PreemptionPolicy {
 public:
  // nullptr when there is no candidate.
  Sequence* pick(std::span<Sequence* const> candidates) const;
};

// Tokens one step may still compute.
class TokenBudget {
 public:
  explicit TokenBudget(int tokens) : left_(tokens) {}
  int left() const { return left_; }
  // Grants up to `wanted` tokens (a prefill chunk when fewer than wanted are left).
  int take(int wanted);
  void give_back(int tokens) { left_ += tokens; }

 private:
  int left_;
};

}  // namespace ds
