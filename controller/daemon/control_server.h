// The control API's transport in fracgpud: the Unix socket
// <run_dir>/control.sock, who may connect, and the framing
// (control/protocol.h). What each request does is the daemon's
// (Daemon::handle_control); this only carries lines in and replies out.
//
// Everything here runs on the daemon's main thread, between ticks, and
// never blocks it: every descriptor is non-blocking, a connection's bytes
// are read as they come and kept until a newline. Requests run one at a
// time, in the same thread as reloads and ticks: two creates racing for the
// last capacity are decided in order.
//
// No client can hold the loop: a pass accepts at most kAcceptsPerPass
// connections and for at most half of its budget, then handles requests
// until kPassBudgetNs (and never past the next tick) has passed, checking
// the time before each request, and resumes next pass with what it did not
// reach. Root's and the daemon's user's (the kubelet plugin's) requests are
// taken first; the others' in turn by user (SO_PEERCRED's uid), one request
// of each user a round, so a user's share does not grow with its
// connections. A connection has control::kRequestTimeout from its connect
// or its last reply to send a whole request (trickled bytes do not extend
// it), or it is dropped; one whose whole request is waiting is never
// dropped for want of a turn. The 64 connections are shared so that root
// and the daemon's user get one whatever other users hold, and whatever
// stalled connections anyone holds. A refused user is told when to come
// back (retry_after_ms) and, until then, is refused at once whatever it
// sends: reconnecting sooner buys nothing and costs the loop an accept.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
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
  // Root or the daemon's user: the connections kept back are theirs.
  bool privileged(uid_t uid) const { return uid == 0 || uid == daemon_uid; }
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
  // Called once a pass, after its requests were handled and before any of
  // their replies is sent: the daemon commits what they changed there, so
  // no reply tells of a change not yet in force.
  using Commit = std::function<void()>;

  // Most connections open at once.
  static constexpr size_t kMaxConnections = 64;
  // Of those, the ones only root and the daemon's user may take: the
  // kubelet plugin gets in whatever other users hold.
  static constexpr size_t kReservedConnections = 8;
  // Most connections of one user other than root and the daemon's.
  static constexpr size_t kMaxConnectionsPerUser = 16;
  // With every connection taken, a new one replaces the connection that has
  // waited longest for a whole request, once that wait is this long (a
  // client that sends its request as it connects never waits this long).
  static constexpr uint64_t kStalledNs = 1'000'000'000;
  // Most requests of one connection served per pass, so one client's
  // pipelined requests cannot crowd out the others'.
  static constexpr int kRequestsPerPass = 16;
  // Most time a pass spends handling requests (at least one is handled):
  // then the daemon ticks if due, and the rest wait for the next pass.
  static constexpr uint64_t kPassBudgetNs = 10'000'000;
  // Most connections a pass accepts (the listen backlog's size: a pass
  // empties it), and for at most half of kPassBudgetNs: a connect storm
  // waits in the kernel's backlog instead of holding the loop.
  static constexpr size_t kAcceptsPerPass = 64;
  // A user refused for want of room is told to come back after this (as
  // "retry_after_ms" in its `busy` reply), twice as long again at each
  // refusal that comes within kBackoffMemoryNs of the previous one's end,
  // up to kMaxRetryAfterNs. Until then, its connections are refused at once.
  static constexpr uint64_t kMinRetryAfterNs = 50'000'000;
  static constexpr uint64_t kMaxRetryAfterNs = 1'600'000'000;
  static constexpr uint64_t kBackoffMemoryNs = 5'000'000'000;

  ControlServer() = default;
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Makes the socket in the private .tmp/ of `run` (nobody can connect
  // there), sets its mode (0600, or 0660 with the group), listens, and
  // renames it to <run_dir>/control.sock, replacing a stale one.
  bool start(const DaemonRunDir& run, const ControlAccess& access, std::string* error);
  // A reload's new access rules: the socket's group and mode follow, and
  // every open connection's peer is checked again: one no longer allowed
  // is refused (`denied`) at its next request and closed.
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
  // connections past their deadline. Handles requests until kPassBudgetNs
  // has passed or `stop_ns` (CLOCK_MONOTONIC, the next tick) has come,
  // whichever is first, but at least one: root's and the daemon's user's
  // first, then the other users' in turn. Never blocks.
  void serve(uint64_t now_ns, uint64_t stop_ns, const Handler& handler, const Commit& commit);

  size_t connections() const { return connections_.size(); }

 private:
  struct Connection {
    int fd = -1;
    ControlPeer peer;
    std::string in;
    std::string out;
    // Connect, last request taken or last reply bytes sent, plus
    // control::kRequestTimeout; bytes received do not move it.
    uint64_t deadline_ns = 0;
    bool closing = false;  // close once `out` is written
    bool denied = false;   // a reload took its peer's access away
    // This pass: whether it may be served (its earlier replies are all
    // sent), how many of its requests were, and whether it has no whole
    // request left to read (then it is not asked again until next pass).
    bool servable = false;
    bool drained = false;
    int served_in_pass = 0;
    bool has_request() const { return in.find('\n') != std::string::npos; }
  };
  // A user other than root and the daemon's: where its next request is
  // taken from, and its back-off after a refusal.
  struct UserTurn {
    size_t next_connection = 0;  // among its connections, in their order
    uint64_t refused_until_ns = 0;
    uint64_t backoff_ns = 0;  // the last retry-after it was given
  };
  // Accepts until the backlog is empty, kAcceptsPerPass were, or `stop_ns`.
  void accept_new(uint64_t now_ns, uint64_t stop_ns);
  // Room for a new connection of `peer`, making it by replacing a stalled
  // connection where the limits allow; false (with *why) if there is none.
  bool admit(const ControlPeer& peer, uint64_t now_ns, std::string* why);
  // Tells a refused peer (`busy`) when to come back, and closes its
  // connection; a user other than root and the daemon's is held to that.
  void refuse_busy(int fd, const ControlPeer& peer, const std::string& why, uint64_t now_ns);
  // Closes the connection that has waited longest for a whole request among
  // those `eligible` says, if it has waited kStalledNs. True if one was.
  bool evict_stalled(uint64_t now_ns, const std::function<bool(const Connection&)>& eligible);
  // Reads what is there, never more than one request's bound. False when
  // the peer is done (end of file or an error).
  bool read_available(Connection& c);
  // Handles requests for the pass: privileged connections' first, then the
  // other users' in turn. True if any was handled.
  bool handle_requests(uint64_t now_ns, uint64_t stop_ns, const Handler& handler);
  // Whether `c` has a whole request to serve now, reading it if it came;
  // a request over the size bound is answered `invalid` and closes it.
  bool next_request(Connection& c);
  // Takes and answers one whole request; its reply goes to `out`, unsent.
  // True if the handler ran.
  bool take_request(Connection& c, uint64_t now_ns, const Handler& handler);
  // Writes what it can of `out`; false when the connection is to be dropped now.
  bool finish(Connection& c, uint64_t now_ns);
  bool flush(Connection& c, uint64_t now_ns);
  bool apply_access(int dirfd, const char* name, const ControlAccess& access, std::string* error);

  int listen_fd_ = -1;
  int root_fd_ = -1;  // the run dir (borrowed from the daemon's DaemonRunDir)
  std::string shown_path_;
  struct stat socket_file_ {};  // the socket's file, as made
  ControlAccess access_;
  std::vector<Connection> connections_;
  uint64_t accept_paused_until_ns_ = 0;  // accept() failed for want of resources: not before then
  std::map<uid_t, UserTurn> users_;
  // The user whose request was taken last: the next pass starts after it.
  std::optional<uid_t> last_user_served_;
};

}  // namespace fracgpu::controller
