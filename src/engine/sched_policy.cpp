#include "engine/sched_policy.h"

#include <algorithm>
#include <tuple>

namespace ds {

bool AdmissionPolicy::before(const Sequence& a, const Sequence& b) const {
  return std::tuple(a.priority, a.arrival, a.id) < std::tuple(b.priority, b.arrival, b.id);
}

bool AdmissionPolicy::may_displace(const Sequence& incoming, const Sequence& running) const {
  return incoming.priority < running.priority;  // enum order: LatencyCritical first
}

Sequence* PreemptionPolicy::pick(std::span<Sequence* const> candidates) const {
  Sequence* victim = nullptr;
  for (Sequence* s : candidates)
    if (!victim || std::tuple(s->priority, s->arrival, s->id) >
                       std::tuple(victim->priority, victim->arrival, victim->id))
      victim = s;
  return victim;
}

int TokenBudget::take(int wanted) {
  const int n = std::min(wanted, left_);
  left_ -= n;
  return n;
}

}  // namespace ds
