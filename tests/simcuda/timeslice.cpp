// The time-slice model of the simulated driver (README.md, "Time"): how a GPU
// without MPS shares itself between processes.
//
// One context is on the device at a time. The resident one runs its work
// until the work runs out, or until its time slice ends while another context
// has work; then the device switches to the next context with work (round
// robin over process slots), which costs `switch_ns` of idle device. A kernel
// cut at a slice's end resumes when its context is back. Facts behind it:
// ../../docs/sm-time.md#how-a-gpu-shares-its-time (NVIDIA's open kernel
// modules give every channel group a 1024 us slice on Volta and later;
// compute preemption is at instruction level since Pascal).
//
// Work is kept per process slot as two counters (SchedState): kernel time
// enqueued and kernel time served. A process's kernels run in the order it
// launched them, so a kernel is done once `served` reaches the value `queued`
// had just after it was enqueued: that value is where the kernel "ends"
// (Mark::work). Nothing is placed ahead of time: the scheduler is run forward
// to the present whenever someone looks (a launch, a query, a wait, the
// stand-in NVML's sampling, the control API), and only then are residency
// stretches written to the kernel log and the 1 ms bins. A waiter sleeps
// until its work would be done if nobody launched more, then looks again:
// launches by others can only delay it.
#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "sim_internal.h"

namespace simcuda {

namespace {

// Holds one device's scheduler: this process's threads through sched_mu,
// other processes through the OFD lock (dropped by the kernel if we die).
class SchedLock {
 public:
  explicit SchedLock(int dev) : dev_(dev) {
    Process& P = proc();
    P.sched_mu.lock();
    if (P.shared) state_file_lock(kSchedLockByte + dev_);
  }
  ~SchedLock() {
    Process& P = proc();
    if (P.shared) state_file_unlock(kSchedLockByte + dev_);
    P.sched_mu.unlock();
  }
  SchedLock(const SchedLock&) = delete;
  SchedLock& operator=(const SchedLock&) = delete;

 private:
  int dev_;
};

SchedState& in_force(DevSched& d) { return d.copies[d.current.load(std::memory_order_acquire) & 1]; }

// Makes `next` the copy in force: written whole into the other copy first, so
// a process killed at any instruction leaves one complete copy in force.
void commit(DevSched& d, const SchedState& next) {
  const uint32_t cur = d.current.load(std::memory_order_acquire) & 1;
  std::memcpy(static_cast<void*>(&d.copies[cur ^ 1]), &next, sizeof next);
  d.current.store(cur ^ 1, std::memory_order_release);
}

struct Params {
  uint64_t slice;
  uint64_t switch_cost;
  // The slice of slot r's context: its own where its process set one (the
  // driver lets a process set its own channel groups' slice), else the
  // device's.
  uint64_t slice_of(int r) const {
    const uint64_t own = S()->slots[r].own_slice_ns.load(std::memory_order_relaxed);
    return own != 0 ? std::max<uint64_t>(own, 1000) : slice;
  }
};

Params params() {
  const SharedState* s = S();
  return {std::max<uint64_t>(s->timeslice_ns, 1000), s->switch_ns};
}

// Slots with work the device may run: pending work and a live owner (a dead
// process's work is dropped, as the driver tears its context down).
struct Pending {
  uint64_t bits[kMaxSlots / 64] = {};
  void set(int i) { bits[i / 64] |= 1ull << (i % 64); }
  void clear(int i) { bits[i / 64] &= ~(1ull << (i % 64)); }
  bool has(int i) const { return i >= 0 && (bits[i / 64] >> (i % 64) & 1) != 0; }
  bool any_other_than(int i) const {
    for (int w = 0; w < kMaxSlots / 64; ++w) {
      uint64_t b = bits[w];
      if (i >= 0 && i / 64 == w) b &= ~(1ull << (i % 64));
      if (b != 0) return true;
    }
    return false;
  }
  // The next slot with work after `i`, cyclically (i itself last); -1: none.
  int after(int i) const {
    for (int k = 1; k <= kMaxSlots; ++k) {
      const int j = ((i < 0 ? -1 : i) + k + kMaxSlots) % kMaxSlots;
      if (has(j)) return j;
    }
    return -1;
  }
};

Pending pending_of(SchedState& s, bool drop_dead) {
  Pending p;
  const SharedState* st = S();
  for (int i = 0; i < kMaxSlots; ++i) {
    if (s.served[i] >= s.queued[i]) continue;
    if (drop_dead && st->slots[i].state.load(std::memory_order_acquire) != kSlotLive) {
      s.served[i] = s.queued[i];
      continue;
    }
    p.set(i);
  }
  return p;
}

inline constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

// Runs `s` forward to `until` with no new work arriving. `ran(slot, start,
// end, pos0)` is told every stretch a slot ran. With stop_slot >= 0, stops as
// soon as that slot's served reaches stop_pos and returns that instant;
// otherwise returns `until`. Bounded: a projection that would take more than
// kMaxSteps steps returns kNever.
template <class Ran>
uint64_t run(SchedState& s, Pending& p, const Params& k, uint64_t until, Ran&& ran, int stop_slot = -1,
             uint64_t stop_pos = 0) {
  constexpr int kMaxSteps = 1 << 20;
  uint64_t t = s.now;
  for (int step = 0; step < kMaxSteps; ++step) {
    if (stop_slot >= 0 && s.served[stop_slot] >= stop_pos) return t;
    if (t >= until) {
      s.now = until;
      return until;
    }
    if (s.switch_until > t) {  // switching: nothing runs
      if (until < s.switch_until) {
        s.now = until;
        return until;
      }
      t = s.switch_until;
      s.slice_start = t;
      continue;
    }
    const int r = s.resident;
    if (!p.has(r)) {
      const int next = p.after(r);
      if (next < 0) {  // idle: nobody has work
        s.now = until;
        return stop_slot >= 0 ? kNever : until;
      }
      // The resident's work ran out: the next context is switched in at once.
      s.resident = next;
      s.switch_until = t + k.switch_cost;
      s.slice_start = s.switch_until;
      continue;
    }
    const bool others = p.any_other_than(r);
    uint64_t end = t + (s.queued[r] - s.served[r]);
    uint64_t slice_end = kNever;
    if (others) {
      // Alone, the resident's slice renews at each expiry; a context that
      // has work waits at most until the current slice ends.
      const uint64_t slice = k.slice_of(r);
      if (t >= s.slice_start + slice) s.slice_start += (t - s.slice_start) / slice * slice;
      slice_end = s.slice_start + slice;
      end = std::min(end, slice_end);
    }
    end = std::min(end, until);
    if (stop_slot == r) end = std::min(end, t + (stop_pos - s.served[r]));
    if (end > t) ran(r, t, end, s.served[r]);
    s.served[r] += end - t;
    if (end > t) s.last_end = end;
    t = end;
    if (s.served[r] >= s.queued[r]) {
      p.clear(r);
    } else if (others && t == slice_end) {
      // Slice over with others waiting: the kernel is cut, the next comes in.
      s.resident = p.after(r);
      s.switch_until = t + k.switch_cost;
      s.slice_start = s.switch_until;
    }
  }
  return kNever;
}

// Runs the device forward to `now` and records who ran (lock held), with
// `change` applied to the state before it is committed (one commit per
// call: a launch's enqueue rides on the advance's).
template <class Change>
SchedState advance_locked(int dev, uint64_t now, Change&& change) {
  SharedState* st = S();
  DevSched& d = st->sched[dev];
  SchedState s = in_force(d);
  struct Stretch {
    int32_t slot;
    uint64_t start, end, pos0;
  };
  Stretch ran_buf[64];
  size_t n = 0;
  const auto flush = [&] {
    for (size_t i = 0; i < n; ++i)
      record_residency(dev, st->slots[ran_buf[i].slot].pid.load(std::memory_order_relaxed), ran_buf[i].slot,
                       ran_buf[i].start, ran_buf[i].end, ran_buf[i].pos0, now);
    n = 0;
  };
  const bool moved = now > s.now;
  if (moved) {
    Pending p = pending_of(s, true);
    run(s, p, params(), now, [&](int slot, uint64_t a, uint64_t b, uint64_t pos0) {
      if (n == std::size(ran_buf)) flush();
      ran_buf[n++] = {slot, a, b, pos0};
    });
  }
  const bool changed = change(s);
  if (moved || changed) commit(d, s);
  flush();  // after the commit: a process killed in between loses a record, never doubles one
  return s;
}

SchedState snapshot_advanced(int dev) {
  return advance_locked(dev, now_ns(), [](SchedState&) { return false; });
}

}  // namespace

// The environment variable `name` as a whole number of microseconds in
// [lo, hi], in ns; nothing where it is unset, or where it is not such a
// number (then `bad` says why).
static std::optional<uint64_t> env_micros_ns(const char* name, uint64_t lo, uint64_t hi, std::string* bad) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long us = std::strtoull(v, &end, 10);
  if (errno != 0 || end == v || *end != 0 || us < lo || us > hi) {
    *bad = std::string(name) + "=" + v + " is not a whole number of microseconds in [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "]";
    return std::nullopt;
  }
  return us * 1000;
}

SchedParams sched_params_from_env() {
  SchedParams p;
  static std::atomic<bool> warned{false};
  const auto warn = [](const std::string& msg) {
    if (!warned.exchange(true)) std::fprintf(stderr, "simcuda: %s\n", msg.c_str());
  };
  if (const char* v = std::getenv("SIMCUDA_SCHED"); v != nullptr && *v != 0) {
    if (std::strcmp(v, "queue") == 0) {
      p.model = kModelQueue;
    } else if (std::strcmp(v, "timeslice") != 0) {
      warn(std::string("SIMCUDA_SCHED=") + v + " unknown (timeslice or queue); using timeslice");
    }
  }
  const auto micros = [&](const char* name, uint64_t& out, uint64_t lo, uint64_t hi) {
    std::string bad;
    if (const std::optional<uint64_t> ns = env_micros_ns(name, lo, hi, &bad)) out = *ns;
    if (!bad.empty()) warn(bad + "; using the default");
  };
  micros("SIMCUDA_TIMESLICE_US", p.timeslice_ns, 1, 1000000);
  micros("SIMCUDA_SWITCH_US", p.switch_ns, 0, 100000);
  return p;
}

uint64_t own_slice_from_env() {
  std::string bad;
  const std::optional<uint64_t> ns = env_micros_ns("SIMCUDA_OWN_TIMESLICE_US", 1, 1000000, &bad);
  if (!bad.empty()) std::fprintf(stderr, "simcuda: %s; using the device's slice\n", bad.c_str());
  return ns.value_or(0);
}

bool timeslice_model() { return S()->model == kModelTimeslice; }

uint64_t timeslice_enqueue(int dev, uint64_t duration_ns) {
  const int slot = proc().slot;
  SchedLock lock(dev);
  const SchedState s = advance_locked(dev, now_ns(), [&](SchedState& next) {
    next.queued[slot] += duration_ns;
    return true;
  });
  return s.queued[slot];
}

void advance_device(int dev) {
  if (!timeslice_model()) return;
  SchedLock lock(dev);
  snapshot_advanced(dev);
}

bool mark_done(int dev, const Mark& m) {
  if (now_ns() < m.time) return false;
  if (m.work == 0 || !timeslice_model()) return true;
  SchedLock lock(dev);
  return snapshot_advanced(dev).served[proc().slot] >= m.work;
}

void wait_mark(int dev, const Mark& m) {
  if (m.work == 0 || !timeslice_model()) {
    sleep_until(m.time);
    return;
  }
  const int slot = proc().slot;
  while (true) {
    uint64_t wake = 0;
    {
      SchedLock lock(dev);
      SchedState s = snapshot_advanced(dev);
      if (s.served[slot] >= m.work) break;
      // When it would be done if nobody launched more: others' launches can
      // only push that later, so waking then is never too late.
      Pending p = pending_of(s, false);
      wake = run(s, p, params(), kNever, [](int, uint64_t, uint64_t, uint64_t) {}, slot, m.work);
      if (wake == kNever) wake = now_ns() + 1000000;  // should not happen: look again in 1 ms
    }
    sleep_until(wake);
  }
  sleep_until(m.time);
}

uint64_t mark_done_at(int dev, const Mark& m) {
  if (m.work == 0 || !timeslice_model()) return m.time;
  // The residency stretch of this process that served the point m.work.
  const Process& P = proc();
  const KernelLog& log = S()->kernel_logs[dev];
  const uint64_t next = log.next.load(std::memory_order_acquire);
  const uint64_t oldest = next > kKernelLogEntries ? next - kKernelLogEntries : 0;
  for (uint64_t i = next; i-- > oldest;) {
    const KernelRecord& rec = log.records[i % kKernelLogEntries];
    if (rec.seq.load(std::memory_order_acquire) != i + 1 || rec.slot != P.slot) continue;
    const uint64_t start = rec.start.load(std::memory_order_relaxed);
    const uint64_t end = rec.end.load(std::memory_order_relaxed);
    const uint64_t pos0 = rec.pos0.load(std::memory_order_relaxed);
    if (pos0 < m.work && m.work <= pos0 + (end - start)) return std::max(m.time, start + (m.work - pos0));
    if (pos0 + (end - start) < m.work) break;  // older stretches end earlier still
  }
  return m.time;
}

uint64_t projected_idle_ns(int dev) {
  if (!timeslice_model()) return S()->devices[dev].busy_until.load(std::memory_order_acquire);
  SchedLock lock(dev);
  SchedState s = snapshot_advanced(dev);
  Pending p = pending_of(s, false);
  run(s, p, params(), kNever / 2, [](int, uint64_t, uint64_t, uint64_t) {});
  return s.last_end;
}

void timeslice_forget_slot(int slot) {
  if (!timeslice_model()) return;
  for (uint32_t dev = 0; dev < S()->device_count; ++dev) {
    SchedLock lock(static_cast<int>(dev));
    SchedState s = in_force(S()->sched[dev]);
    s.served[slot] = s.queued[slot];
    commit(S()->sched[dev], s);
  }
}

}  // namespace simcuda
