#include "daemon/control_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "control/protocol.h"

namespace fracgpu::controller {
namespace {

namespace proto = fracgpu::control;

constexpr uint64_t kIdleNs = static_cast<uint64_t>(proto::kIdleTimeout.count()) * 1'000'000;

std::string error_reply(const char* code, const std::string& message) {
  return nlohmann::json{{"ok", false}, {"code", code}, {"error", message}}.dump() + "\n";
}

// Best effort, for a connection about to be closed: its buffer is empty,
// so a short line goes out whole or not at all.
void send_and_close(int fd, const std::string& line) {
  [[maybe_unused]] const ssize_t n = ::send(fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::close(fd);
}

}  // namespace

bool ControlAccess::allows(uid_t uid, gid_t gid) const {
  if (uid == 0 || uid == daemon_uid) return true;
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
  if (!apply_access(root_fd_, proto::kSocketName, access, error)) return false;
  access_ = access;
  return true;
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
    if (c.out.empty() && !c.closing && c.in.find('\n') != std::string::npos) return 0;
    next = std::min(next, c.deadline_ns);
  }
  return next;
}

void ControlServer::accept_new(uint64_t now_ns) {
  if (accept_paused_until_ns_ > now_ns) return;
  accept_paused_until_ns_ = 0;
  for (;;) {
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
    if (!access_.allows(cred.uid, cred.gid)) {
      send_and_close(fd, error_reply(proto::code::kDenied,
                                     fmt::format("uid {} (gid {}) may not use fracgpud's control API: it is for root, "
                                                 "the daemon's user and [daemon] control_group",
                                                 cred.uid, cred.gid)));
      continue;
    }
    if (connections_.size() >= kMaxConnections) {
      send_and_close(fd, error_reply(proto::code::kInternal,
                                     fmt::format("too many connections open ({}): try again", kMaxConnections)));
      continue;
    }
    Connection c;
    c.fd = fd;
    c.peer = {cred.pid, cred.uid, cred.gid};
    c.deadline_ns = now_ns + kIdleNs;
    connections_.push_back(std::move(c));
  }
}

bool ControlServer::flush(Connection& c, uint64_t now_ns) {
  while (!c.out.empty()) {
    const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out.erase(0, static_cast<size_t>(n));
      c.deadline_ns = now_ns + kIdleNs;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);  // full: later; else the peer is gone
  }
  return true;
}

bool ControlServer::serve_one(Connection& c, uint64_t now_ns, const Handler& handler) {
  if (!flush(c, now_ns)) return false;
  if (!c.out.empty()) return now_ns < c.deadline_ns;  // the client reads no reply: wait, not past the deadline
  if (c.closing) return false;

  bool peer_done = false;
  // Read what is there, but never hold more than one request's bound.
  while (c.in.find('\n') == std::string::npos && c.in.size() < proto::kMaxRequestBytes) {
    char buf[16384];
    const size_t room = std::min(sizeof buf, proto::kMaxRequestBytes - c.in.size());
    const ssize_t n = ::recv(c.fd, buf, room, MSG_DONTWAIT);
    if (n > 0) {
      c.in.append(buf, static_cast<size_t>(n));
      c.deadline_ns = now_ns + kIdleNs;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    peer_done = true;  // end of file, or an error: answer what came whole, then close
    break;
  }

  for (int served = 0; served < kRequestsPerPass; ++served) {
    const size_t newline = c.in.find('\n');
    if (newline == std::string::npos) break;
    const std::string line = c.in.substr(0, newline);
    c.in.erase(0, newline + 1);
    std::string reply;
    try {
      reply = handler(line, c.peer);
    } catch (const std::exception& e) {
      reply = error_reply(proto::code::kInternal, e.what());
      reply.pop_back();
    }
    c.out += reply;
    c.out += '\n';
  }
  if (c.in.find('\n') == std::string::npos && c.in.size() >= proto::kMaxRequestBytes) {
    c.out += error_reply(proto::code::kInvalid, fmt::format("request longer than {} bytes without a newline: "
                                                            "connection closed",
                                                            proto::kMaxRequestBytes));
    c.in.clear();
    c.closing = true;
  }
  if (peer_done) c.closing = true;
  if (!flush(c, now_ns)) return false;
  if (c.closing && c.out.empty()) return false;
  return now_ns < c.deadline_ns;
}

void ControlServer::serve(uint64_t now_ns, const Handler& handler) {
  if (listen_fd_ < 0) return;
  accept_new(now_ns);
  for (size_t i = 0; i < connections_.size();) {
    if (serve_one(connections_[i], now_ns, handler)) {
      ++i;
      continue;
    }
    ::close(connections_[i].fd);
    connections_.erase(connections_.begin() + static_cast<ptrdiff_t>(i));
  }
}

}  // namespace fracgpu::controller
