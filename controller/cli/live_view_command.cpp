#include "cli/live_view_command.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <ctime>

#include <pthread.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <fmt/format.h>

#include "state/status.h"

namespace fracgpu::controller {
namespace {

uint64_t monotonic_now() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

std::string wall_clock() {
  const time_t now = time(nullptr);
  struct tm tm {};
  localtime_r(&now, &tm);
  char text[64] = {};
  strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S %Z", &tm);
  return text;
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "this node";
  return name;
}

// All of `text` to stdout; false once it cannot be written (a closed pipe,
// a terminal that went away).
bool write_all(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDOUT_FILENO, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Where frames go. On a terminal: the cursor hidden and line wrap off while
// the view runs (a line wider than the window is cut, not wrapped onto the
// next), each frame drawn over the last from the top left; the terminal is
// given back as it was by leave() (and the destructor, whatever ends the view).
class Screen {
 public:
  explicit Screen(bool tty) : tty_(tty) { enter(); }
  ~Screen() { leave(); }
  Screen(const Screen&) = delete;
  Screen& operator=(const Screen&) = delete;

  void enter() {
    if (!tty_ || entered_) return;
    entered_ = true;
    write_all("\x1b[?25l\x1b[?7l\x1b[H\x1b[2J");  // hide the cursor, no wrap, clear
  }

  // Wrap back on, cursor shown, and the shell's prompt on the line below the frame.
  void leave() {
    if (!tty_ || !entered_) return;
    entered_ = false;
    write_all("\x1b[?7h\x1b[?25h\r\n");
  }

  bool draw(std::vector<std::string> lines) {
    if (!tty_) {
      std::string out = frames_++ > 0 ? "\n" : "";  // a blank line between frames
      for (const std::string& line : lines) out += line + "\n";
      return write_all(out);
    }
    // As many lines as the window has rows: one more would scroll it.
    struct winsize ws {};
    const size_t rows = ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0 ? ws.ws_row : 24;
    if (lines.size() > rows) {
      const size_t keep = std::max<size_t>(rows, 2) - 1;
      const size_t more = lines.size() - keep;
      lines.resize(keep);
      lines.push_back(fmt::format("... {} more line{}: enlarge the window", more, more == 1 ? "" : "s"));
    }
    std::string out = "\x1b[H";  // home
    for (size_t i = 0; i < lines.size(); ++i) {
      out += lines[i];
      out += "\x1b[K";  // clear what the last frame left on this line
      if (i + 1 < lines.size()) out += "\r\n";
    }
    out += "\x1b[J";  // and below
    return write_all(out);
  }

 private:
  bool tty_;
  bool entered_ = false;
  unsigned frames_ = 0;
};

// The signals the view waits for (blocked, taken by sigtimedwait), and the
// mask to restore when it ends.
class Signals {
 public:
  explicit Signals(bool tty) {
    sigemptyset(&set_);
    for (const int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set_, sig);
    if (tty)
      for (const int sig : {SIGWINCH, SIGTSTP, SIGCONT}) sigaddset(&set_, sig);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~Signals() {
    // Whatever arrived after the last wait is not wanted any more.
    struct timespec zero {};
    while (sigtimedwait(&set_, nullptr, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  Signals(const Signals&) = delete;
  Signals& operator=(const Signals&) = delete;

  // Waits until CLOCK_MONOTONIC `deadline_ns` or a signal; 0 at the deadline.
  int wait_until(uint64_t deadline_ns) {
    for (;;) {
      const uint64_t now = monotonic_now();
      if (now >= deadline_ns) return 0;
      const uint64_t left = deadline_ns - now;
      struct timespec ts {};
      ts.tv_sec = static_cast<time_t>(left / 1'000'000'000);
      ts.tv_nsec = static_cast<long>(left % 1'000'000'000);
      const int sig = sigtimedwait(&set_, nullptr, &ts);
      if (sig > 0) return sig;
      if (errno != EINTR && errno != EAGAIN) return 0;
    }
  }

 private:
  sigset_t set_;
  sigset_t old_;
};

}  // namespace

int run_live_view(const LiveViewOptions& options) {
  std::string error;
  std::optional<StatusReport> report = collect_status(options.run_dir, &error);
  if (!report) {
    fmt::print(stderr, "fracgpu: {}\n", error);
    return kStatusNoRunDir;
  }
  const bool tty = isatty(STDOUT_FILENO) == 1;
  LiveFrameInfo info;
  info.title = options.title;
  info.node = host_name();
  info.interval_s = options.interval_s;
  info.order = options.order;
  // Readings every interval/n, n chosen so that a reading is never more
  // than kLiveMaxReadingPeriodNs from the next: the 1 s window has readings
  // to span it whatever the interval. A frame every n readings.
  const auto interval_ns = static_cast<uint64_t>(std::llround(options.interval_s * 1e9));
  const uint64_t per_frame =
      std::max<uint64_t>(1, (interval_ns + kLiveMaxReadingPeriodNs - 1) / kLiveMaxReadingPeriodNs);
  const uint64_t tick_ns = interval_ns / per_frame;

  // A reader that goes away (`| head`) ends the view with a write error,
  // exit 0, as documented: not SIGPIPE's death (141).
  signal(SIGPIPE, SIG_IGN);
  Signals signals(tty);
  Screen screen(tty);
  GpuTimeReadings readings;
  std::vector<std::string> frame;
  unsigned frames = 0;
  uint64_t next = monotonic_now();
  for (uint64_t tick = 0;; ++tick) {
    if (tick > 0) report = collect_status(options.run_dir, &error);
    const uint64_t now = monotonic_now();
    if (report)
      readings.record(*report, now);
    else
      readings.clear();
    if (tick % per_frame == 0) {
      info.clock = wall_clock();
      frame = live_view_lines(report, error, readings, info);
      if (!screen.draw(frame)) return kStatusOk;  // nobody reads any more
      if (options.count != 0 && ++frames >= options.count) return kStatusOk;
    }
    next += tick_ns;
    // Behind by more than a reading (suspended, a slow disk): carry on from
    // now rather than catching up in a burst.
    if (const uint64_t t = monotonic_now(); t > next + tick_ns) next = t;
    for (int sig; (sig = signals.wait_until(next)) != 0;) {
      switch (sig) {
        case SIGINT:
        case SIGTERM:
        case SIGHUP:
          return kStatusOk;  // ~Screen gives the terminal back
        case SIGTSTP:  // Ctrl-Z: stop with the terminal as it was; on fg, draw again
          screen.leave();
          raise(SIGSTOP);
          screen.enter();
          screen.draw(frame);
          break;
        case SIGCONT:  // continued (bg/fg): the screen may hold anything now
          screen.leave();
          screen.enter();
          screen.draw(frame);
          break;
        case SIGWINCH:  // resized: the same frame, fitted again
          screen.draw(frame);
          break;
        default: break;
      }
    }
  }
}

}  // namespace fracgpu::controller
