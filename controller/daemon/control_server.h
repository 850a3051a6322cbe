// The control API's transport in fracgpud: the Unix socket
// <run_dir>/control.sock, who may connect, and the framing
// (control/protocol.h). What each request does is the daemon's
// (Daemon::handle_control); this only carries lines in and replies out.
//
// Everything here runs on the daemon's main thread, between ticks, and
// never blocks it: every descriptor is non-blocking, a connection's bytes
// are read as they come and kept until a newline, and a client that stalls
// (sends nothing, or reads no reply, for control::kIdleTimeout) or sends
// more than control::kMaxRequestBytes without a newline is dropped. So
// requests run one at a time, in the same thread as reloads and ticks: two
// creates racing for the last capacity are decided in order.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <poll.h>

#include "state/run_dir.h"

namespace fracgpu::controller {

// Who may use the socket: root, the daemon's own user, and members of
// [daemon] control_group (the peer's primary group as the kernel reports
// it, or a user the group lists as a member).
struct ControlAccess {
  uid_t daemon_uid = 0;
  std::optional<gid_t> group;
  std::vector<uid_t> members;

  bool allows(uid_t uid, gid_t gid) const;
};

// A connected peer, as SO_PEERCRED gave it at connect().
struct ControlPeer {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

class ControlServer {
 public:
  // One request line (without its newline) -> the reply object's JSON text.
  using Handler = std::function<std::string(const std::string& line, const ControlPeer& peer)>;

  // Most connections open at once; beyond, a new one is told so and closed.
  static constexpr size_t kMaxConnections = 64;
  // Most requests of one connection served per pass, so one client's
  // pipelined requests cannot hold the loop.
  static constexpr int kRequestsPerPass = 16;

  ControlServer() = default;
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Makes the socket in the private .tmp/ of `run` (nobody can connect
  // there), sets its mode (0600, or 0660 with the group), listens, and
  // renames it to <run_dir>/control.sock, replacing a stale one.
  bool start(const DaemonRunDir& run, const ControlAccess& access, std::string* error);
  // A reload's new access rules: the socket's group and mode follow.
  bool set_access(const ControlAccess& access, std::string* error);
  // Closes every connection and removes the socket (if still ours).
  void stop();
  bool running() const { return listen_fd_ >= 0; }

  // The descriptors the main loop polls to wake up for clients.
  void add_poll_fds(std::vector<struct pollfd>* fds) const;
  // The earliest instant (CLOCK_MONOTONIC ns) a connection times out;
  // UINT64_MAX if none is open.
  uint64_t next_deadline() const;
  // Accepts, reads, answers and writes whatever is ready now, and drops
  // connections past their deadline. Never blocks.
  void serve(uint64_t now_ns, const Handler& handler);

  size_t connections() const { return connections_.size(); }

 private:
  struct Connection {
    int fd = -1;
    ControlPeer peer;
    std::string in;
    std::string out;
    uint64_t deadline_ns = 0;
    bool closing = false;  // close once `out` is written
  };
  void accept_new(uint64_t now_ns);
  // False when the connection is to be dropped now.
  bool serve_one(Connection& c, uint64_t now_ns, const Handler& handler);
  bool flush(Connection& c, uint64_t now_ns);
  bool apply_access(int dirfd, const char* name, const ControlAccess& access, std::string* error);

  int listen_fd_ = -1;
  int root_fd_ = -1;  // the run dir (borrowed from the daemon's DaemonRunDir)
  std::string shown_path_;
  struct stat socket_file_ {};  // the socket's file, as made
  ControlAccess access_;
  std::vector<Connection> connections_;
  uint64_t accept_paused_until_ns_ = 0;  // accept() failed for want of resources: not before then
};

}  // namespace fracgpu::controller
