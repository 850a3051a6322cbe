// A hostile tenant's writer of its own usage file, for bench/e2e: run beside
// the tenant's load (as a process of the same container, without the
// interposer), it attacks until its time is up:
//
//   usage_attacker dir=TENANT_DIR kind=KIND pid=PID [other_pid=PID] [seconds=S] [start_ns=T]
//
//   kind=false-drain  the slot of process PID says, every 50 us, that it
//                     drained the tenant's current grant, its kernels still
//                     queued
//   kind=past-times | own-pid | contexts
//                     garbage in every word of the slots and GPU entry 0's
//                     requests, 1,000 rounds a second (tests/probe/usage_attack.h)
//   pid=PID           the tenant's process whose slot is attacked (its load);
//                     the attacker waits up to 10 s for its slot
//   other_pid=PID     another PID the contexts garbage names (default: PID)
//   start_ns=T        wait until CLOCK_MONOTONIC T before attacking
//
// Prints rounds=N when done. Exit 0, 2 on bad arguments or when the ledger
// or the slot cannot be found.
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include "gputime.h"
#include "ledger.h"
#include "usage_attack.h"

using namespace fracgpu;

namespace {

uint64_t monotonic_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

int fail(const std::string& why) {
  fprintf(stderr, "usage_attacker: %s\n", why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (eq == std::string::npos) return fail("arguments are key=value, not " + a);
    args[a.substr(0, eq)] = a.substr(eq + 1);
  }
  const std::string dir = args["dir"], kind = args["kind"];
  const int32_t pid = atoi(args["pid"].c_str());
  const int32_t other_pid = args.count("other_pid") ? atoi(args["other_pid"].c_str()) : pid;
  const double seconds = args.count("seconds") ? atof(args["seconds"].c_str()) : 10;
  const auto garbage = usage_attack::parse_garbage(kind);
  if (dir.empty() || pid <= 0 || (kind != "false-drain" && !garbage))
    return fail("needs dir=, pid= and kind=false-drain|past-times|own-pid|contexts");

  ledger::TenantLedger l;
  gputime::Arbiter arbiter;
  char err[256] = {};
  if (ledger::open_ledger(dir.c_str(), ledger::AccessMode::kTenant, nullptr, &l, err, sizeof err) != ledger::LedgerError::kOk)
    return fail(dir + ": " + err);
  const std::string arbiter_path = dir + "/gputime-0";
  if (gputime::open_arbiter(arbiter_path.c_str(), false, true, nullptr, &arbiter, err, sizeof err) !=
      ledger::LedgerError::kOk)
    return fail(arbiter_path + ": " + err);
  const int row = gputime::find_tenant(*arbiter.seg, l.policy != nullptr ? l.policy->tenant : "");
  if (row < 0) return fail(arbiter_path + ": no row for this tenant");

  // The load's slot, once it has registered.
  usage_attack::Target target{l.usage, 0, pid, other_pid, &arbiter.seg->tenants[row]};
  const uint64_t give_up = monotonic_ns() + 10'000'000'000ull;
  bool found = false;
  while (!found && monotonic_ns() < give_up) {
    for (uint32_t s = 0; s < ledger::kMaxSlots && !found; ++s)
      if (l.usage->slots[s].state.load() == ledger::kSlotLive && l.usage->slots[s].pid.load() == pid) {
        target.real = s;
        found = true;
      }
    if (!found) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!found) return fail("no live slot of process " + std::to_string(pid) + " in " + dir + "/usage");

  if (args.count("start_ns")) {
    const uint64_t start = strtoull(args["start_ns"].c_str(), nullptr, 10);
    while (monotonic_ns() < start) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const uint64_t end = monotonic_ns() + static_cast<uint64_t>(seconds * 1e9);
  unsigned seed = 20261129;  // fixed: a run can be replayed
  uint64_t rounds = 0;
  while (monotonic_ns() < end) {
    if (garbage) {
      usage_attack::scribble(*garbage, target, monotonic_ns(), &seed);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      usage_attack::claim_drained(target);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ++rounds;
  }
  if (garbage) usage_attack::restore(target);
  printf("rounds=%llu\n", static_cast<unsigned long long>(rounds));
  return 0;
}
