// What a hostile tenant does to everything it can reach, for the
// hostile-tenant test (tests/hostile_tenant_test.cpp): run as root inside a
// container's view (its tenant directory mounted read-only, its usage file
// read-write, nothing else of fracgpu's visible, no CAP_SYS_ADMIN), it
// keeps attacking until its time is up:
//
//   hostile_tenant DIR SECONDS SEED TARGET
//
//   plant      symlinks (to TARGET: a host file the daemon must never
//              touch), FIFOs and hard links under every name the daemon uses
//              (and its temporaries) in DIR, unlink and rename what is
//              there: each success is counted (all should fail)
//   truncate   usage to 0 bytes, then back to its size a moment later
//   random     random bytes at random offsets of usage
//   targeted   extreme values (0, 1, all ones, timestamps far in the future
//              and past, huge virtual times) over a random run of 8-byte
//              words of usage: counters, timestamps, indexes, PIDs
//   grow       usage grown far past its size (filling the filesystem)
//
// Prints one line per action kind, `<kind>=<attempts>/<successes>`, and
// `planted=<n>` for names it managed to create or remove in DIR.
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

uint64_t monotonic_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

struct Counts {
  long attempts = 0, successes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: hostile_tenant DIR SECONDS SEED TARGET\n");
    return 2;
  }
  const std::string dir = argv[1];
  const double seconds = atof(argv[2]);
  std::mt19937_64 rng(strtoull(argv[3], nullptr, 10));
  const std::string usage = dir + "/usage";
  const std::string target = argv[4];
  struct stat st {};
  if (stat(usage.c_str(), &st) != 0) {
    fprintf(stderr, "%s: %s\n", usage.c_str(), strerror(errno));
    return 2;
  }
  const off_t size = st.st_size;
  std::vector<std::string> names{"usage", "policy", "node", "gputime-0", "gputime-1", "gputime-2", ".tmp",
                                 "placement.json", "health.json", "fracgpud.pid"};
  for (const char* base : {"usage", "policy", "node", "gputime"})
    for (int pid = 1; pid < 64; pid += 7) names.push_back(std::string(base) + ".tmp." + std::to_string(pid));
  Counts plant, truncate_c, random_c, targeted, grow;
  long planted = 0;
  const uint64_t end = monotonic_ns() + static_cast<uint64_t>(seconds * 1e9);
  while (monotonic_ns() < end) {
    const int fd = open(usage.c_str(), O_RDWR | O_CLOEXEC);
    switch (rng() % 5) {
      case 0: {  // plant and remove
        const std::string& name = names[rng() % names.size()];
        const std::string path = dir + "/" + name;
        ++plant.attempts;
        const int what = static_cast<int>(rng() % 5);
        int rc = -1;
        if (what == 0) rc = symlink(target.c_str(), path.c_str());
        if (what == 1) rc = mkfifo(path.c_str(), 0666);
        if (what == 2) rc = link(usage.c_str(), path.c_str());
        if (what == 3) rc = unlink(path.c_str());
        if (what == 4) rc = rename(usage.c_str(), path.c_str());
        if (rc == 0) {
          ++plant.successes;
          ++planted;
          fprintf(stderr, "hostile: %s on %s succeeded\n",
                  what == 0 ? "symlink" : what == 1 ? "mkfifo" : what == 2 ? "link" : what == 3 ? "unlink" : "rename",
                  path.c_str());
        }
        break;
      }
      case 1:  // shrink, then restore
        ++truncate_c.attempts;
        if (fd >= 0 && ftruncate(fd, 0) == 0) {
          ++truncate_c.successes;
          usleep(static_cast<useconds_t>(rng() % 20000));
          if (ftruncate(fd, size) != 0) perror("hostile: restore");
        }
        break;
      case 2: {  // random bytes
        ++random_c.attempts;
        unsigned char junk[256];
        for (auto& b : junk) b = static_cast<unsigned char>(rng());
        const off_t at = static_cast<off_t>(rng() % static_cast<uint64_t>(size));
        const size_t n = std::min<size_t>(1 + rng() % sizeof junk, static_cast<size_t>(size - at));
        if (fd >= 0 && pwrite(fd, junk, n, at) == static_cast<ssize_t>(n)) ++random_c.successes;
        break;
      }
      case 3: {  // extreme values over a run of words
        ++targeted.attempts;
        const uint64_t now = monotonic_ns();
        const uint64_t values[] = {0, 1, ~0ull, now + 1000ull * 1000000000ull, now > 1000000000000ull ? now - 1000000000000ull : 1,
                                   now, 1ull << 62, 0x7fffffff, 255, 256};
        const off_t words = size / 8;
        const off_t first = static_cast<off_t>(rng() % static_cast<uint64_t>(words));
        const off_t count = std::min<off_t>(1 + static_cast<off_t>(rng() % 512), words - first);
        const uint64_t v = values[rng() % (sizeof values / sizeof values[0])];
        bool ok = fd >= 0;
        for (off_t w = 0; ok && w < count; ++w) ok = pwrite(fd, &v, 8, (first + w) * 8) == 8;
        if (ok) ++targeted.successes;
        break;
      }
      default: {  // fill the filesystem through the one writable file
        ++grow.attempts;
        const char byte = 'x';
        if (fd >= 0 && pwrite(fd, &byte, 1, static_cast<off_t>(64 + rng() % 1024) << 20) == 1) ++grow.successes;
        std::vector<char> chunk(1 << 20, 'y');
        for (int i = 0; fd >= 0 && i < 8; ++i)
          if (pwrite(fd, chunk.data(), chunk.size(), size + (static_cast<off_t>(rng() % 256) << 20)) < 0) break;
        break;
      }
    }
    if (fd >= 0) close(fd);
    usleep(static_cast<useconds_t>(200 + rng() % 2000));
  }
  printf("plant=%ld/%ld\ntruncate=%ld/%ld\nrandom=%ld/%ld\ntargeted=%ld/%ld\ngrow=%ld/%ld\nplanted=%ld\n",
         plant.attempts, plant.successes, truncate_c.attempts, truncate_c.successes, random_c.attempts,
         random_c.successes, targeted.attempts, targeted.successes, grow.attempts, grow.successes, planted);
  return 0;
}
