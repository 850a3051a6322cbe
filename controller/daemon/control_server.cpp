#include "daemon/control_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "control/protocol.h"

namespace fracgpu::controller {
namespace {

namespace proto = fracgpu::control;

constexpr uint64_t kRequestTimeoutNs = static_cast<uint64_t>(proto::kRequestTimeout.count()) * 1'000'000;

uint64_t monotonic_now_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

std::string error_reply(const char* code, const std::string& message) {
  return nlohmann::json{{"ok", false}, {"code", code}, {"error", message}}.dump() + "\n";
}

// `busy`, with when to ask again: a client that waits that long is let in
// (or told again); one that comes back sooner is refused at once.
std::string busy_reply(const std::string& message, uint64_t retry_after_ns) {
  return nlohmann::json{{"ok", false},
                        {"code", proto::code::kBusy},
                        {"error", message},
                        {"retry_after_ms", (retry_after_ns + 999'999) / 1'000'000}}
             .dump() +
         "\n";
}

std::string denied_message(const ControlPeer& peer) {
  return fmt::format("uid {} (gid {}) may not use fracgpud's control API: it is for root, the daemon's user and "
                     "[daemon] control_group",
                     peer.uid, peer.gid);
}

// Best effort, for a connection about to be closed: its buffer is empty,
// so a short line goes out whole or not at all.
void send_and_close(int fd, const std::string& line) {
  [[maybe_unused]] const ssize_t n = ::send(fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::close(fd);
}

}  // namespace

bool ControlAccess::allows(uid_t uid, gid_t gid) const {
  if (privileged(uid)) return true;
  if (!group) return false;
  return gid == *group || std::find(members.begin(), members.end(), uid) != members.end();
}

ControlServer::~ControlServer() { stop(); }

bool ControlServer::apply_access(int dirfd, const char* name, const ControlAccess& access, std::string* error) {
  // Group first, then the mode that lets it in: never a moment where a
  // group that is not the control group may connect.
  const gid_t group = access.group ? *access.group : getegid();
  if (fchownat(dirfd, name, static_cast<uid_t>(-1), group, AT_SYMLINK_NOFOLLOW) != 0 ||
      fchmodat(dirfd, name, access.group ? 0660 : 0600, 0) != 0) {
    *error = fmt::format("cannot set the owner group or mode of {}: {}", shown_path_, strerror(errno));
    return false;
  }
  return true;
}

bool ControlServer::start(const DaemonRunDir& run, const ControlAccess& access, std::string* error) {
  stop();
  shown_path_ = run.path + "/" + proto::kSocketName;
  const std::string temp_name = fmt::format("{}.{}", proto::kSocketName, getpid());
  const int private_dir = run.private_dir.get();
  unlinkat(private_dir, temp_name.c_str(), 0);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = fmt::format("control socket: {}", strerror(errno));
    return false;
  }
  // Bound in the private directory (0700): nobody can connect before the
  // mode and group are right. Reached through the directory's descriptor,
  // so the run dir's path may be longer than sun_path.
  struct sockaddr_un addr {};
  addr.sun_family = AF_UNIX;
  const std::string bind_path = fmt::format("/proc/self/fd/{}/{}", private_dir, temp_name);
  if (bind_path.size() >= sizeof addr.sun_path) {
    ::close(fd);
    *error = "control socket: path too long";
    return false;
  }
  memcpy(addr.sun_path, bind_path.c_str(), bind_path.size() + 1);
  std::string why;
  if (::bind(fd, reinterpret_cast<const struct sockaddr*>(&addr), sizeof addr) != 0) {
    why = fmt::format("bind: {}", strerror(errno));
  } else if (!apply_access(private_dir, temp_name.c_str(), access, &why)) {
  } else if (fstatat(private_dir, temp_name.c_str(), &socket_file_, AT_SYMLINK_NOFOLLOW) != 0) {
    why = fmt::format("stat: {}", strerror(errno));
  } else if (::listen(fd, 64) != 0) {
    why = fmt::format("listen: {}", strerror(errno));
  } else if (renameat(private_dir, temp_name.c_str(), run.root.get(), proto::kSocketName) != 0) {
    why = fmt::format("cannot move it into place: {}", strerror(errno));
  }
  if (!why.empty()) {
    ::close(fd);
    unlinkat(private_dir, temp_name.c_str(), 0);
    *error = fmt::format("control socket {}: {}", shown_path_, why);
    return false;
  }
  listen_fd_ = fd;
  root_fd_ = run.root.get();
  access_ = access;
  return true;
}

bool ControlServer::set_access(const ControlAccess& access, std::string* error) {
  if (listen_fd_ < 0) return false;
  // The peers are checked against the new rules even if the file keeps its
  // old mode: both gates must let a client through.
  access_ = access;
  for (Connection& c : connections_) c.denied = !access_.allows(c.peer.uid, c.peer.gid);
  return apply_access(root_fd_, proto::kSocketName, access, error);
}

void ControlServer::stop() {
  for (Connection& c : connections_) ::close(c.fd);
  connections_.clear();
  if (listen_fd_ < 0) return;
  // Removed only while it is still the socket this server made. (A
  // socket's descriptor has an inode of its own, not the file's.)
  struct stat by_name {};
  if (fstatat(root_fd_, proto::kSocketName, &by_name, AT_SYMLINK_NOFOLLOW) == 0 && S_ISSOCK(by_name.st_mode) &&
      by_name.st_ino == socket_file_.st_ino && by_name.st_dev == socket_file_.st_dev)
    unlinkat(root_fd_, proto::kSocketName, 0);
  ::close(listen_fd_);
  listen_fd_ = -1;
}

void ControlServer::add_poll_fds(std::vector<struct pollfd>* fds) const {
  if (listen_fd_ < 0) return;
  if (accept_paused_until_ns_ == 0) fds->push_back({listen_fd_, POLLIN, 0});
  for (const Connection& c : connections_) {
    short events = 0;
    if (!c.out.empty()) events |= POLLOUT;
    else if (!c.closing) events |= POLLIN;
    fds->push_back({c.fd, events, 0});
  }
}

uint64_t ControlServer::next_deadline() const {
  uint64_t next = accept_paused_until_ns_ != 0 ? accept_paused_until_ns_ : UINT64_MAX;
  for (const Connection& c : connections_) {
    // Requests already buffered (beyond one pass's share) are served at once.
    if (c.out.empty() && c.has_request()) return 0;
    next = std::min(next, c.deadline_ns);
  }
  return next;
}

bool ControlServer::evict_stalled(uint64_t now_ns, const std::function<bool(const Connection&)>& eligible) {
  Connection* victim = nullptr;
  bool gone = false;
  for (Connection& c : connections_) {
    // One with replies unread has been served: its deadline deals with it.
    if (!eligible(c) || c.closing || !c.out.empty()) continue;
    if (!read_available(c)) {  // the peer went away: its place is free now
      victim = &c;
      gone = true;
      break;
    }
    // Its whole request may be waiting unread: then it is not stalled.
    if (c.has_request()) continue;
    if (victim == nullptr || c.deadline_ns < victim->deadline_ns) victim = &c;
  }
  if (victim == nullptr || (!gone && victim->deadline_ns + kStalledNs > now_ns + kRequestTimeoutNs)) return false;
  // It never completed a request since its last reply: nothing it asked was done, so it may simply ask again.
  send_and_close(victim->fd, busy_reply("connection closed to make room for another: every connection was taken "
                                        "and this one sent no whole request in time",
                                        0));
  connections_.erase(connections_.begin() + (victim - connections_.data()));
  return true;
}

bool ControlServer::admit(const ControlPeer& peer, uint64_t now_ns, std::string* why) {
  if (!access_.privileged(peer.uid)) {
    size_t of_user = 0, of_others = 0;
    for (const Connection& c : connections_) {
      of_user += c.peer.uid == peer.uid;
      of_others += !access_.privileged(c.peer.uid);
    }
    if (of_user >= kMaxConnectionsPerUser &&
        !evict_stalled(now_ns, [&](const Connection& c) { return c.peer.uid == peer.uid; })) {
      *why = fmt::format("uid {} has {} connections open already: try again", peer.uid, kMaxConnectionsPerUser);
      return false;
    }
    if (of_others >= kMaxConnections - kReservedConnections &&
        !evict_stalled(now_ns, [&](const Connection& c) { return !access_.privileged(c.peer.uid); })) {
      *why = fmt::format("too many connections open ({}, the rest kept for root): try again",
                         kMaxConnections - kReservedConnections);
      return false;
    }
  }
  const bool privileged = access_.privileged(peer.uid);
  if (connections_.size() >= kMaxConnections &&
      !evict_stalled(now_ns, [&](const Connection& c) { return privileged || !access_.privileged(c.peer.uid); })) {
    *why = fmt::format("too many connections open ({}): try again", kMaxConnections);
    return false;
  }
  return true;
}

void ControlServer::refuse_busy(int fd, const ControlPeer& peer, const std::string& why, uint64_t now_ns) {
  if (access_.privileged(peer.uid)) {
    // Only root's and the daemon's user's own connections fill the room
    // kept for them: no back-off, they are trusted to pace themselves.
    send_and_close(fd, busy_reply(why, kMinRetryAfterNs));
    return;
  }
  UserTurn& user = users_[peer.uid];
  // A refusal soon after the last back-off ended doubles it: a user that
  // keeps the daemon full is told to come back less and less often.
  const bool again = user.refused_until_ns != 0 && now_ns < user.refused_until_ns + kBackoffMemoryNs;
  user.backoff_ns = again ? std::min(user.backoff_ns * 2, kMaxRetryAfterNs) : kMinRetryAfterNs;
  user.refused_until_ns = now_ns + user.backoff_ns;
  send_and_close(fd, busy_reply(why, user.backoff_ns));
}

void ControlServer::accept_new(uint64_t now_ns, uint64_t stop_ns) {
  if (accept_paused_until_ns_ > now_ns) return;
  accept_paused_until_ns_ = 0;
  for (size_t accepted = 0; accepted < kAcceptsPerPass; ++accepted) {
    // The clock is read every few accepts: one costs a few microseconds.
    if (accepted % 8 == 7 && monotonic_now_ns() >= stop_ns) return;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors (or memory): the pending connection stays in the
      // backlog and the socket stays readable. Waiting a moment keeps the
      // loop from spinning on it.
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
        accept_paused_until_ns_ = now_ns + 100'000'000;
      return;
    }
    struct ucred cred {};
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred) {
      ::close(fd);
      continue;
    }
    const ControlPeer peer{cred.pid, cred.uid, cred.gid};
    if (!access_.allows(peer.uid, peer.gid)) {
      send_and_close(fd, error_reply(proto::code::kDenied, denied_message(peer)));
      continue;
    }
    // Told to come back later and back already: refused without looking
    // for room (which may read every connection).
    if (const auto user = users_.find(peer.uid); user != users_.end() && now_ns < user->second.refused_until_ns) {
      send_and_close(fd, busy_reply(fmt::format("uid {} was refused for want of room and came back too soon", peer.uid),
                                    user->second.refused_until_ns - now_ns));
      continue;
    }
    if (std::string why; !admit(peer, now_ns, &why)) {
      refuse_busy(fd, peer, why, now_ns);
      continue;
    }
    Connection c;
    c.fd = fd;
    c.peer = peer;
    c.deadline_ns = now_ns + kRequestTimeoutNs;
    connections_.push_back(std::move(c));
  }
}

bool ControlServer::flush(Connection& c, uint64_t now_ns) {
  while (!c.out.empty()) {
    const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out.erase(0, static_cast<size_t>(n));
      c.deadline_ns = now_ns + kRequestTimeoutNs;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);  // full: later; else the peer is gone
  }
  return true;
}

bool ControlServer::read_available(Connection& c) {
  while (!c.has_request() && c.in.size() < proto::kMaxRequestBytes) {
    char buf[16384];
    const size_t room = std::min(sizeof buf, proto::kMaxRequestBytes - c.in.size());
    const ssize_t n = ::recv(c.fd, buf, room, MSG_DONTWAIT);
    if (n > 0) {
      c.in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
  return true;
}

bool ControlServer::next_request(Connection& c) {
  if (c.has_request()) return true;
  if (c.closing || c.drained) return false;
  // End of file or an error: what came whole is answered, then it closes.
  if (!read_available(c)) c.closing = true;
  if (c.has_request()) return true;
  c.drained = true;
  if (c.in.size() >= proto::kMaxRequestBytes) {
    c.out += error_reply(proto::code::kInvalid, fmt::format("request longer than {} bytes without a newline: "
                                                            "connection closed",
                                                            proto::kMaxRequestBytes));
    c.in.clear();
    c.closing = true;
  }
  return false;
}

bool ControlServer::take_request(Connection& c, uint64_t now_ns, const Handler& handler) {
  const size_t newline = c.in.find('\n');
  const std::string line = c.in.substr(0, newline);
  c.in.erase(0, newline + 1);
  c.deadline_ns = now_ns + kRequestTimeoutNs;
  ++c.served_in_pass;
  if (c.denied) {
    c.out += error_reply(proto::code::kDenied, denied_message(c.peer) + " (access withdrawn by a reload)");
    c.in.clear();
    c.closing = true;
    return false;
  }
  std::string reply;
  try {
    reply = handler(line, c.peer);
  } catch (const std::exception& e) {
    reply = error_reply(proto::code::kInternal, e.what());
    reply.pop_back();
  }
  c.out += reply;
  c.out += '\n';
  return true;
}

bool ControlServer::handle_requests(uint64_t now_ns, uint64_t stop_ns, const Handler& handler) {
  // Who may be served this pass: replies of earlier passes first (they are
  // committed); a client that reads none gets no more served.
  for (Connection& c : connections_) {
    // One closing (end of file) still has the requests it sent whole answered.
    c.servable = flush(c, now_ns) && c.out.empty() && (!c.closing || c.has_request());
    c.drained = false;
    c.served_in_pass = 0;
  }
  bool handled = false, taken = false;
  // At least one request a pass, whatever the clock says.
  const auto time_left = [&] { return !taken || monotonic_now_ns() < stop_ns; };
  const auto ready = [&](Connection& c) {
    return c.servable && c.served_in_pass < kRequestsPerPass && next_request(c);
  };
  // Root's and the daemon's user's first: the kubelet plugin waits for no
  // other user.
  for (Connection& c : connections_) {
    if (!access_.privileged(c.peer.uid)) continue;
    while (ready(c) && time_left()) {
      handled |= take_request(c, now_ns, handler);
      taken = true;
    }
  }
  // Then the other users in turn, starting after the one served last, one
  // request each a round, from each user's connections in turn.
  std::map<uid_t, std::vector<size_t>> by_user;
  for (size_t i = 0; i < connections_.size(); ++i)
    if (connections_[i].servable && !access_.privileged(connections_[i].peer.uid))
      by_user[connections_[i].peer.uid].push_back(i);
  std::vector<uid_t> order;
  for (const auto& [uid, theirs] : by_user) order.push_back(uid);
  if (last_user_served_)
    std::rotate(order.begin(), std::upper_bound(order.begin(), order.end(), *last_user_served_), order.end());
  for (bool progress = true; progress;) {
    progress = false;
    for (const uid_t uid : order) {
      const std::vector<size_t>& theirs = by_user[uid];
      UserTurn& user = users_[uid];
      for (size_t tried = 0; tried < theirs.size(); ++tried) {
        const size_t pick = (user.next_connection + tried) % theirs.size();
        Connection& c = connections_[theirs[pick]];
        if (!ready(c)) continue;
        if (!time_left()) return handled;
        handled |= take_request(c, now_ns, handler);
        taken = true;
        user.next_connection = pick + 1;
        last_user_served_ = uid;
        progress = true;
        break;
      }
    }
  }
  return handled;
}

bool ControlServer::finish(Connection& c, uint64_t now_ns) {
  if (!flush(c, now_ns)) return false;
  if (c.closing) return (!c.out.empty() || c.has_request()) && now_ns < c.deadline_ns;
  // Past its deadline with a reply unread: dropped, whatever it has queued
  // behind it (a client that pipelines requests and never reads would
  // otherwise be kept for ever, its deadline past, the loop polling it).
  if (now_ns < c.deadline_ns || (c.out.empty() && c.has_request())) return true;
  // Past its deadline, but its whole request may be waiting unread (the
  // pass ran out of time before reaching it): that waits for a later pass.
  return c.out.empty() && read_available(c) && c.has_request();
}

void ControlServer::serve(uint64_t now_ns, uint64_t stop_ns, const Handler& handler, const Commit& commit) {
  if (listen_fd_ < 0) return;
  stop_ns = std::min(stop_ns, now_ns + kPassBudgetNs);
  // Accepting may take half the pass: requests get the rest, whatever
  // connects.
  accept_new(now_ns, std::min(stop_ns, now_ns + kPassBudgetNs / 2));
  if (users_.size() > 4 * kMaxConnections) {
    // Users seen once and gone: forgotten once their back-off is long over.
    std::erase_if(users_, [&](const auto& entry) {
      return now_ns >= entry.second.refused_until_ns + kBackoffMemoryNs &&
             std::none_of(connections_.begin(), connections_.end(),
                          [&](const Connection& c) { return c.peer.uid == entry.first; });
    });
  }
  if (handle_requests(now_ns, stop_ns, handler)) commit();
  // Only now are their replies sent.
  const uint64_t after = monotonic_now_ns();
  for (size_t i = 0; i < connections_.size();) {
    if (finish(connections_[i], after)) {
      ++i;
      continue;
    }
    ::close(connections_[i].fd);
    connections_.erase(connections_.begin() + static_cast<ptrdiff_t>(i));
  }
}

}  // namespace fracgpu::controller
