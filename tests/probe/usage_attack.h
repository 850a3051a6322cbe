// What a hostile tenant can write into its own usage file (the one file of
// fracgpu's its containers may write), shared by the GPU-time tests
// (tests/gputime_test.cpp) and the usage_attacker program that bench/e2e
// runs beside a tenant's load.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "fracgpu/gputime_layout.h"
#include "fracgpu/ledger_layout.h"

namespace fracgpu::usage_attack {

enum class Garbage {
  // Every word: timestamps in the past only (a moment ago, seconds ago, 0 or
  // 1), the words that are no timestamps included (grant numbers, start
  // times, the slot high-water mark), all but its real slot's state and PID.
  kPastTimes,
  // Every slot live under the attacker's own PID and start time, the others
  // asking and active now; in every slot, its real one included, entered and
  // drained numbers guessed around the attacker's current grant (seq - 3 ..
  // seq + 3).
  kOwnPidAndGuessedGrants,
  // The words side by side and the slot scan rest on: context counts (0, 1,
  // huge), the slot high-water mark (0, 1, all, beyond), the other slots
  // named after another PID and the attacker's own, and the real slot's
  // state flipped between free and live.
  kContextsAndSlotWords,
};

// The attacker's view: its usage segment (mapped read-write, as its
// container has it), the slot of its process that runs its load, that
// process's PID, another PID to name (another tenant's, where the attacker
// can guess one; else its own), and its tenant's row of the GPU's arbiter
// (read-only).
struct Target {
  ledger::UsageSegment* usage = nullptr;
  uint32_t real = 0;
  int32_t own_pid = 0, other_pid = 0;
  const gputime::TenantTime* row = nullptr;
};

// One round of `kind` into GPU entry 0's words, at time `now_ns`
// (CLOCK_MONOTONIC); `seed` for rand_r.
void scribble(Garbage kind, const Target& t, uint64_t now_ns, unsigned* seed);

// The false drain: the real slot says it drained the tenant's current grant
// (its kernels still queued). One round; the attacker repeats it.
void claim_drained(const Target& t);

// After an attack: the real slot visible again, so that its load can go on
// (hidden, it waits for a grant it is never given: its own loss).
void restore(const Target& t);

// "past-times", "own-pid", "contexts" (the names usage_attacker takes).
std::optional<Garbage> parse_garbage(std::string_view name);

}  // namespace fracgpu::usage_attack
