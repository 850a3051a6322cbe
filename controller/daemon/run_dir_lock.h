// One fracgpud per run dir. Two daemons on one run dir would fight over every
// policy (and a reload of one would be undone by the other), so the daemon
// takes an exclusive flock(2) on the run dir's lock directory (`.lock`, made
// 0700 and checked to be the daemon user's) before it writes anything else
// there, and holds it for its whole life.
//
// Why a directory of its own, and flock:
//  - the pid file's lock alone did not hold: after `rm fracgpud.pid` a second
//    daemon created a new file and locked that. The lock directory is never
//    replaced or removed by the daemon;
//  - nobody but the daemon's user can open a 0700 directory, so nobody else
//    can hold a lock on it. The run dir itself (0755) would not do: any user
//    of the host could open it and hold a shared flock that keeps every
//    daemon out. Tenants never see either (a container mounts only its own
//    tenant directory);
//  - a flock belongs to the open file description, not to the process: no
//    close() of another descriptor of the directory drops it, unlike the
//    POSIX record locks of the pid file and ledgers. It is inherited by
//    fork() though: a child must close its copy (the metrics endpoint's child
//    closes every descriptor it does not need), or the lock would outlive the
//    daemon as long as the child does.
// The kernel drops it when the daemon dies, however it dies.
#pragma once

#include <sys/types.h>

#include <string>

namespace fracgpu::controller {

// The lock directory, in the run dir.
inline constexpr const char* kLockDirName = ".lock";

class RunDirLock {
 public:
  RunDirLock() = default;
  ~RunDirLock() { release(); }
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

  // Locks `run_dir` (which must exist; its lock directory is made if
  // missing) without waiting. False and *error if another process holds it
  // ("another fracgpud (pid N) already manages ...", the PID when it can be
  // told) or the lock directory cannot be made or opened (not ours, say).
  bool acquire(const std::string& run_dir, std::string* error);
  void release();

  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// The PID (in our PID namespace) holding a flock on the file open at `fd`,
// from /proc/locks; 0 if it cannot be told.
pid_t flock_holder(int fd);

}  // namespace fracgpu::controller
