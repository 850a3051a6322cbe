#include "visible_devices.h"

#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "log.h"
#include "nvml_hooks.h"
#include "tenant.h"

namespace fracgpu::interpose {

namespace {

constexpr int kMaxVisible = kMaxDevices;  // what a process may number (tenant.h)
constexpr size_t kUuidText = 41;  // "GPU-", 32 hex digits, 4 dashes, NUL
using UuidText = char[kUuidText];
// Beside CUDA_VISIBLE_DEVICES, for the programs a process starts: the value
// we set it to, and the user's own (absent: the user set none).
constexpr const char* kSetByUsVar = "FRACGPU_VISIBLE_DEVICES_SET";
constexpr const char* kAskedVar = "FRACGPU_VISIBLE_DEVICES_ASKED";

std::atomic<bool> g_driver_initialized{false};
pthread_mutex_t g_choosing = PTHREAD_MUTEX_INITIALIZER;

void format_uuid(const uint8_t u[16], UuidText out) {
  snprintf(out, kUuidText, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
           u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

// The tenants' GPUs as this process numbers them: those NVML lists, in its
// order, then the others in the order of the grants. Their number.
int tenant_gpus(UuidText* out) {
  uint8_t granted[kMaxVisible][16];
  const int n = granted_gpus(granted, kMaxVisible);
  if (n == 0) return 0;
  uint8_t order[kMaxDevices][16];
  const int known = nvml_gpu_order(order, kMaxDevices);
  bool placed[kMaxVisible] = {};
  int count = 0;
  for (int i = 0; i < known; ++i)
    for (int g = 0; g < n; ++g)
      if (!placed[g] && memcmp(order[i], granted[g], 16) == 0) {
        format_uuid(granted[g], out[count++]);
        placed[g] = true;
      }
  for (int g = 0; g < n; ++g)
    if (!placed[g]) format_uuid(granted[g], out[count++]);
  return count;
}

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

struct Selection {
  int chosen[kMaxVisible];  // indices into the tenant's GPUs, in the value's order
  int count = 0;
  const char* stop = nullptr;  // the entry that ended the list early, or null
  size_t stop_length = 0;
  bool twice = false;  // an entry named a GPU already listed: none at all
};

// The GPU an entry names among `gpus`, or -1. By UUID: the entry must start
// with "GPU-" and be the start of exactly one of them (hex digits of either
// case). By index: read like strtoul (blanks around it, a '+', and anything
// after the digits ignored), within [0, n).
int named_gpu(const char* entry, size_t length, bool by_uuid, const UuidText* gpus, int n) {
  if (by_uuid) {
    if (length < 4 || strncmp(entry, "GPU-", 4) != 0 || length >= kUuidText) return -1;
    int found = -1;
    for (int g = 0; g < n; ++g) {
      size_t i = 0;
      while (i < length && lower(entry[i]) == lower(gpus[g][i])) ++i;
      if (i < length) continue;
      if (found >= 0) return -1;  // a prefix two GPUs share names neither
      found = g;
    }
    return found;
  }
  size_t i = 0;
  while (i < length && is_blank(entry[i])) ++i;
  if (i < length && entry[i] == '+') ++i;
  if (i == length || entry[i] < '0' || entry[i] > '9') return -1;  // not a number, or negative
  long index = 0;
  for (; i < length && entry[i] >= '0' && entry[i] <= '9' && index < n; ++i) index = index * 10 + (entry[i] - '0');
  return index < n ? static_cast<int>(index) : -1;
}

// CUDA_VISIBLE_DEVICES read as the driver reads it (tests/simcuda models the
// same reading), against the tenant's GPUs as if they were the node's: a
// comma-separated list, of GPU UUIDs if the first entry is one ("GPU-"),
// else of indices; it ends at the first entry that names none of them (an
// entry of the other kind included); a GPU named twice leaves none. "MIG-"
// entries name MIG devices, which fracgpu does not grant: none.
void select_visible(const char* value, const UuidText* gpus, int n, Selection* s) {
  const bool by_uuid = strncmp(value, "GPU-", 4) == 0;
  const char* entry = value;
  for (;;) {
    const char* comma = strchr(entry, ',');
    const size_t length = comma != nullptr ? static_cast<size_t>(comma - entry) : strlen(entry);
    const int g = strncmp(value, "MIG-", 4) == 0 ? -1 : named_gpu(entry, length, by_uuid, gpus, n);
    if (g < 0) {
      s->stop = entry;
      s->stop_length = length;
      return;
    }
    for (int i = 0; i < s->count; ++i)
      if (s->chosen[i] == g) {
        s->twice = true;
        s->count = 0;
        return;
      }
    s->chosen[s->count++] = g;
    if (comma == nullptr) return;
    entry = comma + 1;
  }
}

// "GPU-...,GPU-..." of the GPUs chosen.
void join(const UuidText* gpus, const int* chosen, int count, char* out, size_t size) {
  size_t at = 0;
  out[0] = '\0';
  for (int i = 0; i < count && at < size; ++i)
    at += static_cast<size_t>(snprintf(out + at, size - at, "%s%s", i > 0 ? "," : "", gpus[chosen[i]]));
}

CUresult choose_locked() {
  UuidText gpus[kMaxVisible];
  const int n = tenant_gpus(gpus);
  char who[1200];
  tenants_text(who, sizeof who);
  if (n == 0) {
    log_line(LogLevel::kError, "cuInit refused (CUDA_ERROR_NO_DEVICE): no GPU is granted to %s", who);
    return CUDA_ERROR_NO_DEVICE;
  }
  int all[kMaxVisible];
  for (int g = 0; g < n; ++g) all[g] = g;
  char theirs[kMaxVisible * kUuidText];
  join(gpus, all, n, theirs, sizeof theirs);

  Selection s;
  const char* user = getenv("CUDA_VISIBLE_DEVICES");
  // A program started by one of ours inherits the value we set there: the
  // GPUs granted then, which a resize may have changed since. That value is
  // not the user's choice; the one we kept beside it is (none: the user set
  // nothing), and it chooses again among the GPUs granted now.
  const char* set_by_us = getenv(kSetByUsVar);
  const bool inherited = user != nullptr && set_by_us != nullptr && strcmp(user, set_by_us) == 0;
  if (inherited) user = getenv(kAskedVar);
  if (user == nullptr) {
    for (int g = 0; g < n; ++g) s.chosen[s.count++] = g;
  } else {
    select_visible(user, gpus, n, &s);
  }
  if (s.count == 0) {
    if (user != nullptr && user[0] == '\0') return CUDA_ERROR_NO_DEVICE;  // no GPU asked for, as the driver answers
    // An inherited choice is quoted as the user made it, and said to be
    // one: the variable itself shows what we set for the parent.
    log_line(LogLevel::kError,
             "cuInit refused (CUDA_ERROR_NO_DEVICE): CUDA_VISIBLE_DEVICES=\"%.300s\"%s%s%s %s the %d GPU(s) of %s "
             "(%s): its indices number those GPUs from 0, its UUIDs must be theirs",
             user, inherited ? " (as a parent process was given it, kept in " : "", inherited ? kAskedVar : "",
             inherited ? ")" : "", s.twice ? "names a GPU twice among" : "selects none of", n, who, theirs);
    return CUDA_ERROR_NO_DEVICE;
  }
  if (s.stop != nullptr && user != nullptr)
    log_line(LogLevel::kWarn,
             "CUDA_VISIBLE_DEVICES=\"%.300s\": \"%.*s\" is none of the %d GPU(s) of %s (%s), so the list ends before "
             "it, as the driver reads it",
             user, static_cast<int>(s.stop_length > 100 ? 100 : s.stop_length), s.stop, n, who, theirs);
  char value[kMaxVisible * kUuidText];
  join(gpus, s.chosen, s.count, value, sizeof value);
  // What the user asked for and what we set, for the programs this one
  // starts (above). The user's value is copied first: setenv may replace
  // the string it points to.
  bool kept = true;
  if (user == nullptr) {
    unsetenv(kAskedVar);
  } else {
    char asked[kMaxVisible * kUuidText + 64];
    kept = snprintf(asked, sizeof asked, "%s", user) < static_cast<int>(sizeof asked) &&
           setenv(kAskedVar, asked, 1) == 0;
  }
  // Not kept (a value too long to copy): a program started by this one
  // takes what it inherits for the user's choice, as before.
  if (!kept || setenv(kSetByUsVar, value, 1) != 0) unsetenv(kSetByUsVar);
  const char* now = getenv("CUDA_VISIBLE_DEVICES");
  if (now == nullptr || strcmp(now, value) != 0) {
    // The driver reads the variable with getenv at its first cuInit, which
    // has not happened yet. Threads reading the environment meanwhile see
    // the old value or the new one: glibc's setenv keeps old strings alive.
    if (setenv("CUDA_VISIBLE_DEVICES", value, 1) != 0) {
      log_line(LogLevel::kError, "cuInit refused (CUDA_ERROR_OPERATING_SYSTEM): cannot set CUDA_VISIBLE_DEVICES");
      return CUDA_ERROR_OPERATING_SYSTEM;
    }
  }
  log_line(LogLevel::kInfo, "CUDA_VISIBLE_DEVICES=%s: GPUs of %s", value, who);
  return CUDA_SUCCESS;
}

}  // namespace

CUresult choose_visible_devices() {
  if (g_driver_initialized.load(std::memory_order_acquire)) return CUDA_SUCCESS;
  pthread_mutex_lock(&g_choosing);
  const CUresult result = g_driver_initialized.load(std::memory_order_acquire) ? CUDA_SUCCESS : choose_locked();
  pthread_mutex_unlock(&g_choosing);
  return result;
}

void note_driver_initialized() { g_driver_initialized.store(true, std::memory_order_release); }

}  // namespace fracgpu::interpose
