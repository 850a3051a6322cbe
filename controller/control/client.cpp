#include "control/client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <thread>

#include "control/protocol.h"

namespace fracgpu::control {
namespace {

using Clock = std::chrono::steady_clock;

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

Reply unreachable(const std::string& socket_path, std::string_view what) {
  Reply reply;
  reply.code = code::kUnreachable;
  reply.error = socket_path + ": " + std::string(what);
  reply.body = nlohmann::json::object();
  return reply;
}

std::string errno_text(int err) { return std::strerror(err); }

// Milliseconds left before `deadline`, at least 0, for poll().
int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : left > 1'000'000 ? 1'000'000 : static_cast<int>(left);
}

// Waits for `events` on `fd` until `deadline`: true when ready, false with
// *why otherwise.
bool wait_for(int fd, short events, Clock::time_point deadline, std::string* why) {
  for (;;) {
    struct pollfd pfd = {fd, events, 0};
    const int n = ::poll(&pfd, 1, ms_left(deadline));
    if (n > 0) return true;
    if (n == 0) {
      *why = "no reply in time";
      return false;
    }
    if (errno != EINTR) {
      *why = "poll: " + errno_text(errno);
      return false;
    }
  }
}

// One connection, one request (`payload`, its newline included), one reply.
Reply call_once(const std::string& socket_path, const std::string& payload, Clock::time_point deadline) {
  // A path too long for sun_path is reached through its directory: the
  // kernel resolves /proc/self/fd/N/<name> like the path itself.
  std::string connect_path = socket_path;
  int dir_fd = -1;
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (connect_path.size() >= sizeof addr.sun_path) {
    const size_t slash = socket_path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : socket_path.substr(0, slash);
    dir_fd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0) return unreachable(socket_path, "cannot open its directory: " + errno_text(errno));
    connect_path = "/proc/self/fd/" + std::to_string(dir_fd) + "/" + socket_path.substr(slash + 1);
    if (connect_path.size() >= sizeof addr.sun_path) {
      ::close(dir_fd);
      return unreachable(socket_path, "socket name too long");
    }
  }
  const Fd dir_guard(dir_fd);
  std::memcpy(addr.sun_path, connect_path.c_str(), connect_path.size() + 1);

  const Fd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) return unreachable(socket_path, "socket: " + errno_text(errno));
  // A blocking connect to a Unix socket waits while the listener's backlog
  // is full, at most SO_SNDTIMEO: that bounds it by the deadline.
  {
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
    struct timeval tv = {};
    tv.tv_sec = left > 0 ? left / 1'000'000 : 0;
    tv.tv_usec = left > 0 ? left % 1'000'000 : 1;
    ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  int rc;
  do {
    rc = ::connect(sock.get(), reinterpret_cast<const struct sockaddr*>(&addr), sizeof addr);
  } while (rc != 0 && errno == EINTR && Clock::now() < deadline);
  if (rc != 0) {
    const int err = errno;
    return unreachable(socket_path, err == EAGAIN || err == EWOULDBLOCK ? std::string("connect: timed out")
                                                                        : "connect: " + errno_text(err));
  }
  const int flags = ::fcntl(sock.get(), F_GETFL);
  if (flags < 0 || ::fcntl(sock.get(), F_SETFL, flags | O_NONBLOCK) != 0)
    return unreachable(socket_path, "fcntl: " + errno_text(errno));

  std::string why;
  for (size_t sent = 0; sent < payload.size();) {
    const ssize_t n = ::send(sock.get(), payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_for(sock.get(), POLLOUT, deadline, &why)) return unreachable(socket_path, why);
      continue;
    }
    // The daemon may have answered and closed before reading (a peer it
    // refuses): its reply is still there to read.
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) break;
    return unreachable(socket_path, "send: " + errno_text(errno));
  }

  std::string received;
  size_t newline = std::string::npos;
  while (newline == std::string::npos) {
    char buf[16384];
    const ssize_t n = ::recv(sock.get(), buf, sizeof buf, 0);
    if (n > 0) {
      const size_t scanned = received.size();
      received.append(buf, static_cast<size_t>(n));
      newline = received.find('\n', scanned);
      if (newline == std::string::npos && received.size() > kMaxReplyBytes)
        return unreachable(socket_path, "reply longer than the protocol allows");
      continue;
    }
    if (n == 0) return unreachable(socket_path, "connection closed before a reply");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_for(sock.get(), POLLIN, deadline, &why)) return unreachable(socket_path, why);
      continue;
    }
    return unreachable(socket_path, "recv: " + errno_text(errno));
  }

  nlohmann::json body = nlohmann::json::parse(std::string_view(received).substr(0, newline), nullptr, false);
  if (!body.is_object() || !body.contains("ok") || !body["ok"].is_boolean())
    return unreachable(socket_path, "the reply is not a control API reply");
  Reply reply;
  reply.ok = body["ok"].get<bool>();
  const auto text = [&](const char* key) {
    const auto it = body.find(key);
    return it != body.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  if (!reply.ok) {
    reply.code = text("code");
    if (reply.code.empty()) reply.code = code::kInternal;
    reply.field = text("field");
    reply.error = text("error");
  }
  reply.body = std::move(body);
  return reply;
}

}  // namespace

std::string socket_path_in(const std::string& run_dir) { return run_dir + "/" + kSocketName; }

Reply call(const std::string& socket_path, const nlohmann::json& request, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string payload;
  try {
    payload = request.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const std::exception& e) {
    return unreachable(socket_path, std::string("cannot encode the request: ") + e.what());
  }
  payload += '\n';
  if (payload.size() > kMaxRequestBytes) {
    // Refused here, the daemon never asked: a bad request, not a daemon away.
    Reply reply;
    reply.code = code::kInvalid;
    reply.error = "the request is " + std::to_string(payload.size()) + " bytes, above the " +
                  std::to_string(kMaxRequestBytes) + " the daemon reads (fewer or shorter annotations?)";
    reply.body = nlohmann::json::object();
    return reply;
  }
  // Busy: refused before the request was read, so asked again, a little
  // later each time, and never before the daemon said to (it refuses a user
  // that comes back sooner at once), while the timeout allows.
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    Reply reply = call_once(socket_path, payload, deadline);
    if (reply.code != code::kBusy) return reply;
    auto pause = backoff;
    if (const auto hint = reply.body.find("retry_after_ms"); hint != reply.body.end() && hint->is_number_unsigned())
      pause = std::max(pause, std::chrono::milliseconds(std::min<uint64_t>(hint->get<uint64_t>(), 60'000)));
    if (Clock::now() + pause >= deadline) return reply;
    std::this_thread::sleep_for(pause);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

}  // namespace fracgpu::control
