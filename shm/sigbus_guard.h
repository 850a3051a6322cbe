// Touching shared memory that another party can shrink, without dying of it.
//
// A file mapped MAP_SHARED faults with SIGBUS on any access past its current
// end, and a tenant can truncate the files it may write (its usage file).
// The daemon, the metrics child and `fracgpu status` read and write those
// mappings; a tenant must not be able to kill them by shrinking a file. So
// every access to a tenant-writable mapping from outside the tenant runs
// inside sigbus_guarded(): a SIGBUS raised by that thread while inside jumps
// back out, and the call returns false. The caller then treats the segment as
// corrupt (closes it, reports it, charges nothing from it).
//
// Not for the interposer: a tenant's own processes may be hurt by their own
// tenant's files (that harms nobody else), and a user's process must keep its
// own signal handlers.
//
// The body must not own resources (no allocation, no destructors that
// matter, no locks): a jump out of it skips them. Plain loads and stores of
// the mapping into locals and atomics are what it is for.
#pragma once

#include <setjmp.h>

namespace fracgpu::shm {

struct SigbusFrame {
  sigjmp_buf env;
  SigbusFrame* outer;
};

// The innermost guard of the calling thread, or null.
SigbusFrame*& current_sigbus_frame();

// Installs the process's SIGBUS handler (once; later calls do nothing). A
// SIGBUS outside any guard still kills the process, as it would without it.
void install_sigbus_guard();

// Runs body(); false if a SIGBUS interrupted it. Installs the handler first.
template <class Body>
bool sigbus_guarded(Body&& body) {
  install_sigbus_guard();
  SigbusFrame frame;
  SigbusFrame*& top = current_sigbus_frame();
  frame.outer = top;
  // savesigs = 0: saving the mask is a system call per guard, and the daemon
  // guards every tenant at every pass. Nothing needs restoring: the handler
  // runs with SA_NODEFER and an empty sa_mask, so the jump leaves the mask
  // as it was when the fault came.
  if (sigsetjmp(frame.env, 0) != 0) {
    current_sigbus_frame() = frame.outer;
    return false;
  }
  top = &frame;
  body();
  current_sigbus_frame() = frame.outer;
  return true;
}

}  // namespace fracgpu::shm
