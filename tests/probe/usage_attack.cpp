#include "usage_attack.h"

#include <cstddef>
#include <cstdlib>

namespace fracgpu::usage_attack {
namespace {

constexpr uint64_t kSecond = 1'000'000'000ull;
constexpr size_t kWords = 8;  // a ProcessSlot, a GpuTimeRequest
static_assert(sizeof(ledger::ProcessSlot) == kWords * 8 && sizeof(ledger::GpuTimeRequest) == kWords * 8);

// Relaxed stores through atomic_ref: the words are shared with the daemon
// and the tenant's own processes, as a hostile process would write them.
void put(void* base, size_t word, uint64_t value) {
  std::atomic_ref<uint64_t>(static_cast<uint64_t*>(base)[word]).store(value, std::memory_order_relaxed);
}

}  // namespace

void scribble(Garbage kind, const Target& t, uint64_t now, unsigned* seed) {
  ledger::UsageSegment& u = *t.usage;
  auto past = [&]() -> uint64_t {
    switch (rand_r(seed) % 4) {
      case 0: return now - 1 - rand_r(seed) % 2'000'000;        // a moment ago
      case 1: return now - (1 + rand_r(seed) % 10) * kSecond;  // seconds ago
      case 2: return 0;
      default: return 1;
    }
  };
  auto* header = reinterpret_cast<uint64_t*>(&u);
  const size_t high_word = offsetof(ledger::UsageSegment, slot_high_water) / 8;
  if (kind == Garbage::kPastTimes) {
    put(header, high_word, past());
    for (uint32_t s = 0; s < ledger::kMaxSlots; ++s)
      for (size_t w = 0; w < kWords; ++w) {
        // Not the real slot's state and PID: that would only hide its own
        // process from the daemon, and it asks for nothing then.
        if (s != t.real || w != 0) put(&u.slots[s], w, past());
        put(&u.gputime[0][s], w, past());
      }
    return;
  }
  const uint64_t seq = gputime::grant_seq(t.row->grant.load());
  if (kind == Garbage::kOwnPidAndGuessedGrants) {
    const uint64_t start = u.slots[t.real].start_time.load();
    u.slot_high_water.store(ledger::kMaxSlots);
    for (uint32_t s = 0; s < ledger::kMaxSlots; ++s) {
      ledger::ProcessSlot& slot = u.slots[s];
      ledger::GpuTimeRequest& r = u.gputime[0][s];
      slot.state.store(ledger::kSlotLive);
      slot.pid.store(t.own_pid);
      slot.start_time.store(start);
      slot.host_pid.store(t.own_pid);
      r.entered_grant.store(seq - 3 + rand_r(seed) % 7);
      r.drained_grant.store(seq - 3 + rand_r(seed) % 7);
      if (s == t.real) continue;  // its own process keeps asking and launching
      r.want_since_ns.store(now - rand_r(seed) % 1'000'000);
      r.poll_ns.store(now);
      r.last_active_ns.store(now);
      r.contexts.store(1);
    }
    return;
  }
  const uint32_t highs[] = {0, 1, ledger::kMaxSlots, UINT32_MAX};
  u.slot_high_water.store(highs[rand_r(seed) % 4]);
  const uint64_t contexts[] = {0, 1, UINT64_MAX, 1ull << 32};
  for (uint32_t s = 0; s < ledger::kMaxSlots; ++s) {
    u.gputime[0][s].contexts.store(contexts[rand_r(seed) % 4]);
    ledger::ProcessSlot& slot = u.slots[s];
    if (s == t.real) {
      slot.state.store(rand_r(seed) % 2 == 0 ? ledger::kSlotFree : ledger::kSlotLive);
      continue;
    }
    const int32_t pid = rand_r(seed) % 2 == 0 ? t.other_pid : t.own_pid;
    slot.state.store(ledger::kSlotLive);
    slot.pid.store(pid);
    slot.host_pid.store(pid);
    u.gputime[0][s].poll_ns.store(now);
    u.gputime[0][s].entered_grant.store(seq);
  }
}

void claim_drained(const Target& t) {
  t.usage->gputime[0][t.real].drained_grant.store(gputime::grant_seq(t.row->grant.load()));
}

void restore(const Target& t) {
  t.usage->slot_high_water.store(ledger::kMaxSlots);
  t.usage->slots[t.real].state.store(ledger::kSlotLive);
}

std::optional<Garbage> parse_garbage(std::string_view name) {
  if (name == "past-times") return Garbage::kPastTimes;
  if (name == "own-pid") return Garbage::kOwnPidAndGuessedGrants;
  if (name == "contexts") return Garbage::kContextsAndSlotWords;
  return std::nullopt;
}

}  // namespace fracgpu::usage_attack
