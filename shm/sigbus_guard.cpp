#include "sigbus_guard.h"

#include <signal.h>

#include <atomic>
#include <cstring>

namespace fracgpu::shm {
namespace {

thread_local SigbusFrame* t_frame = nullptr;
std::atomic<bool> g_installed{false};

void on_sigbus(int sig, siginfo_t*, void*) {
  SigbusFrame* frame = t_frame;
  if (frame != nullptr) siglongjmp(frame->env, 1);
  // Not ours: die of it as if no handler were installed.
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

SigbusFrame*& current_sigbus_frame() { return t_frame; }

void install_sigbus_guard() {
  if (g_installed.load(std::memory_order_acquire)) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  // SA_NODEFER: SIGBUS stays deliverable while the handler runs, so the
  // jump out of it (which does not restore a mask) leaves it unblocked for
  // the next guard. sigbus_guarded() relies on this.
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, nullptr);
  g_installed.store(true, std::memory_order_release);
}

}  // namespace fracgpu::shm
