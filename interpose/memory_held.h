// The charge for memory that the driver holds on the process's behalf and
// sizes itself: a stream-ordered pool's reserve, a device's graph memory
// cache. Allocations make it grow inside the driver call; it shrinks when
// the driver decides (synchronize, trim, destroy). The driver reports what it
// holds (`holds`), so the charge is kept in two parts:
//
//   inflight  reservations of calls still inside the driver, each at least
//             what that call can make the holding grow by;
//   settled   the rest, at least what the driver held when last asked.
//
// Invariant: at every instant, holds <= settled + inflight, and the ledger
// holds at least settled + inflight for it. So the device never holds more
// than the ledger says, and the ledger never passes the quota.
//
//   begin(r)  the caller has reserved r in the ledger: inflight += r, then
//             the driver call (which grows the holding by at most r);
//   end(r)    settled += r, then inflight -= r (the sum never drops while
//             the reservation moves); a failed call gives r back instead;
//   settle    settled := holds when holds is lower (the slack goes back to
//             the ledger), or charges what the driver took beyond every
//             reservation (outside the model: reported, never hidden).
//
// Lowering `settled` to a figure read from the driver is safe only if no
// call ended (moved its reservation into `settled`) between reading
// `settled` and writing it: that call's growth might postdate the figure.
// A call that ends always raises `settled`, and only settle lowers it, so a
// compare-and-swap from the value read before the figure, with settles run
// one at a time, proves it. Settles are serialized by a flag that nobody
// waits on in the common path: a thread that finds a settle running leaves
// a request, which the running one serves before it lets go. Only a caller
// that must know the settle is done (a refused reservation, about to try
// again) waits for the flag.
#pragma once

#include <atomic>
#include <cstdint>

namespace fracgpu::interpose {

// Holds `flag` for a scope, yielding while another thread holds it. Slow
// paths only (registering a pool, deprecated calls): nothing common waits.
class SpinGuard {
 public:
  explicit SpinGuard(std::atomic<bool>& flag);
  ~SpinGuard() { flag_.store(false, std::memory_order_release); }
  SpinGuard(const SpinGuard&) = delete;
  SpinGuard& operator=(const SpinGuard&) = delete;

 private:
  std::atomic<bool>& flag_;
};

class HeldCharge {
 public:
  // What the driver holds now, or false if it cannot tell (the charge then
  // stays as it is: never lowered on a guess).
  using HoldsFn = bool (*)(const void* arg, uint64_t* bytes);

  enum class Settled {
    kDone,    // the charge covers what the driver holds
    kExcess,  // the driver held more than every reservation allowed and the
              // quota refused it: charged anyway (it is in use), caller undoes
  };

  void begin(uint64_t reserved) { inflight_.fetch_add(reserved, std::memory_order_seq_cst); }
  // succeeded: the reservation joins the settled charge; otherwise it is
  // given back to the ledger's `gpu` entry.
  void end(uint64_t reserved, bool succeeded, int gpu);

  // Brings the settled charge to what `holds` reports. wait = false: never
  // blocks (a running settle serves the request). wait = true: returns after
  // a settle that started after the call has finished.
  Settled settle(int gpu, HoldsFn holds, const void* arg, bool wait);

  // Holds off every settle until unlock_settles (for a caller about to make
  // `holds` meaningless, e.g. destroying a pool whose handle may be reused).
  void lock_settles();
  void unlock_settles();

  // Empties the settled charge and returns it, for the caller to give back.
  uint64_t take_settled() { return settled_.exchange(0, std::memory_order_seq_cst); }
  uint64_t settled() const { return settled_.load(std::memory_order_relaxed); }
  uint64_t inflight() const { return inflight_.load(std::memory_order_relaxed); }

  // Forgets everything (a forked child). Not thread-safe.
  void reset();

 private:
  Settled settle_once(int gpu, HoldsFn holds, const void* arg);

  std::atomic<uint64_t> settled_{0};
  std::atomic<uint64_t> inflight_{0};
  std::atomic<bool> settling_{false};  // one settle at a time
  std::atomic<bool> wanted_{false};    // a settle was asked for while one ran
};

}  // namespace fracgpu::interpose
