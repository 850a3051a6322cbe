// Preloaded first (before libfracgpu.so, when that is preloaded too): records
// every cuGetProcAddress / cuGetProcAddress_v2 lookup the CUDA runtime makes,
// and what it was handed, into the file named by CONFORMANCE_RECORD, in
// conformance_probe's format:
//
//   path  symbol  cudaVersion  flags  result  status  owner
//
// The runtime finds the driver's lookup functions with dlsym and every other
// entry point through them; so this library's dlsym hands out recording
// wrappers of the two lookup functions it would have returned (the driver's,
// or the interposer's hooks), and a lookup that returns a lookup function
// gets a wrapper too. Everything else is passed on untouched.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "owner.h"

namespace {

using DlsymFn = void* (*)(void*, const char*);
using GetProc = int (*)(const char*, void**, int, unsigned long long);
using GetProc2 = int (*)(const char*, void**, int, unsigned long long, int*);

GetProc g_v1 = nullptr;
GetProc2 g_v2 = nullptr;
std::mutex g_mu;

// The dlsym the runtime would have reached without this library: the
// interposer's when it is preloaded (a versioned lookup past this library
// skips its unversioned export), else glibc's.
DlsymFn next_dlsym() {
  static const DlsymFn next = [] {
    void* glibc = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (glibc == nullptr) glibc = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    auto found = reinterpret_cast<DlsymFn>(glibc);
    if (void* interposer = dlopen("libfracgpu.so", RTLD_NOW | RTLD_NOLOAD))
      if (void* theirs = found(interposer, "dlsym")) found = reinterpret_cast<DlsymFn>(theirs);
    return found;
  }();
  return next;
}

int record_v1(const char* symbol, void** pfn, int version, unsigned long long flags);
int record_v2(const char* symbol, void** pfn, int version, unsigned long long flags, int* status);

// A lookup function handed out is replaced by its recording wrapper.
void wrap_lookup(void** pfn) {
  if (pfn == nullptr || *pfn == nullptr) return;
  Dl_info info{};
  if (dladdr(*pfn, &info) == 0 || info.dli_sname == nullptr || info.dli_saddr != *pfn) return;
  if (strcmp(info.dli_sname, "cuGetProcAddress_v2") == 0) {
    g_v2 = reinterpret_cast<GetProc2>(*pfn);
    *pfn = reinterpret_cast<void*>(&record_v2);
  } else if (strcmp(info.dli_sname, "cuGetProcAddress") == 0) {
    g_v1 = reinterpret_cast<GetProc>(*pfn);
    *pfn = reinterpret_cast<void*>(&record_v1);
  }
}

void record(const char* path, const char* symbol, int version, unsigned long long flags, int result,
            const int* status, void* handed) {
  const char* file = getenv("CONFORMANCE_RECORD");
  if (file == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  FILE* f = fopen(file, "a");
  if (f == nullptr) return;
  char st[16] = "-";
  if (status != nullptr) snprintf(st, sizeof st, "%d", *status);
  fprintf(f, "%s\t%s\t%d\t%llu\t%d\t%s\t%s\n", path, symbol != nullptr ? symbol : "(null)", version, flags, result,
          st, owner(result == 0 ? handed : nullptr).c_str());
  fclose(f);
}

int record_v1(const char* symbol, void** pfn, int version, unsigned long long flags) {
  const int r = g_v1(symbol, pfn, version, flags);
  record("v1", symbol, version, flags, r, nullptr, pfn != nullptr ? *pfn : nullptr);
  if (r == 0) wrap_lookup(pfn);
  return r;
}

int record_v2(const char* symbol, void** pfn, int version, unsigned long long flags, int* status) {
  const int r = g_v2(symbol, pfn, version, flags, status);
  record(status != nullptr ? "v2" : "v2-nostatus", symbol, version, flags, r, status, pfn != nullptr ? *pfn : nullptr);
  if (r == 0) wrap_lookup(pfn);
  return r;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void* dlsym(void* handle, const char* symbol) {
  void* address = next_dlsym()(handle, symbol);
  if (address == nullptr) return address;
  if (strcmp(symbol, "cuGetProcAddress_v2") == 0) {
    record("dlsym", symbol, 0, 0, 0, nullptr, address);
    g_v2 = reinterpret_cast<GetProc2>(address);
    return reinterpret_cast<void*>(&record_v2);
  }
  if (strcmp(symbol, "cuGetProcAddress") == 0) {
    record("dlsym", symbol, 0, 0, 0, nullptr, address);
    g_v1 = reinterpret_cast<GetProc>(address);
    return reinterpret_cast<void*>(&record_v1);
  }
  return address;
}
