// HeldCharge (memory_held.h says why it is exact).
#include "memory_held.h"

#include <sched.h>

#include "log.h"
#include "tenant.h"

namespace fracgpu::interpose {

namespace {

// Charges with the ledger directly, not through reserve(): a refusal there
// settles every pool, which would wait for the settle this thread is running.
bool charge_now(int gpu, uint64_t bytes) {
  return gpu >= 0 && ledger::try_charge(tenant_of(gpu).ledger, entry_of(gpu),
                                        static_cast<uint32_t>(tenant_of(gpu).slot), bytes);
}

void charge_anyway(int gpu, uint64_t bytes) {
  if (gpu >= 0 && bytes != 0)
    ledger::force_charge(*tenant_of(gpu).ledger.usage, entry_of(gpu), static_cast<uint32_t>(tenant_of(gpu).slot),
                         bytes);
}

}  // namespace

SpinGuard::SpinGuard(std::atomic<bool>& flag) : flag_(flag) {
  while (flag_.exchange(true, std::memory_order_acquire)) sched_yield();
}

void HeldCharge::end(uint64_t reserved, bool succeeded, int gpu) {
  if (succeeded) {
    // Raise first: settled + inflight never drops below the charge while the
    // reservation moves, and a settle that read `settled` before this sees
    // its compare-and-swap fail.
    settled_.fetch_add(reserved, std::memory_order_seq_cst);
    inflight_.fetch_sub(reserved, std::memory_order_seq_cst);
    return;
  }
  inflight_.fetch_sub(reserved, std::memory_order_seq_cst);
  unreserve(gpu, reserved);
}

HeldCharge::Settled HeldCharge::settle_once(int gpu, HoldsFn holds, const void* arg) {
  for (;;) {
    // Order matters: `settled` before the driver's figure (see the header),
    // `inflight` after it, so that a call that ended in between is counted
    // at least once in settled + inflight.
    uint64_t settled = settled_.load(std::memory_order_seq_cst);
    uint64_t held = 0;
    if (!holds(arg, &held)) return Settled::kDone;
    const uint64_t inflight = inflight_.load(std::memory_order_seq_cst);
    if (held < settled) {
      if (!settled_.compare_exchange_strong(settled, held, std::memory_order_seq_cst)) continue;
      unreserve(gpu, settled - held);
      return Settled::kDone;
    }
    if (held <= settled + inflight) return Settled::kDone;
    // The driver holds more than was settled plus every reservation still in
    // a call. If `settled` moved meanwhile, that is a call ending: read again.
    if (settled_.load(std::memory_order_seq_cst) != settled) continue;
    // Otherwise the driver grew the holding by more than a call reserved
    // (its rounding is not what we assume). The memory is in use: charge it,
    // over the quota if need be, so that the ledger says what the device
    // holds; the caller undoes what it can.
    const uint64_t missing = held - settled;
    const bool fits = charge_now(gpu, missing);
    if (!fits) charge_anyway(gpu, missing);
    if (!settled_.compare_exchange_strong(settled, held, std::memory_order_seq_cst)) {
      unreserve(gpu, missing);
      continue;
    }
    FRACGPU_LOG_ONCE(LogLevel::kError,
                     "the driver took more memory for a pool or graph cache than the allocation reserved: charged "
                     "after the fact");
    return fits ? Settled::kDone : Settled::kExcess;
  }
}

HeldCharge::Settled HeldCharge::settle(int gpu, HoldsFn holds, const void* arg, bool wait) {
  // A request, then the flag; the holder lets go, then looks for requests.
  // All sequentially consistent: of a requester that finds the flag taken
  // and a holder letting go, one sees the other (no request is lost).
  wanted_.store(true, std::memory_order_seq_cst);
  Settled result = Settled::kDone;
  for (;;) {
    if (settling_.exchange(true, std::memory_order_seq_cst)) {
      if (!wait) return result;  // the running settle will serve the request
      sched_yield();
      continue;
    }
    while (wanted_.exchange(false, std::memory_order_seq_cst))
      if (settle_once(gpu, holds, arg) == Settled::kExcess) result = Settled::kExcess;
    settling_.store(false, std::memory_order_seq_cst);
    if (!wanted_.load(std::memory_order_seq_cst)) return result;
  }
}

void HeldCharge::lock_settles() {
  while (settling_.exchange(true, std::memory_order_seq_cst)) sched_yield();
}

void HeldCharge::unlock_settles() { settling_.store(false, std::memory_order_seq_cst); }

void HeldCharge::reset() {
  settled_.store(0, std::memory_order_relaxed);
  inflight_.store(0, std::memory_order_relaxed);
  settling_.store(false, std::memory_order_relaxed);
  wanted_.store(false, std::memory_order_relaxed);
}

}  // namespace fracgpu::interpose
