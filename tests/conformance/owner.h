// Names the code at an address as "<library>:<symbol>" (dladdr), the way
// conformance_probe and record_getproc.so print what a lookup handed out.
#pragma once

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>

inline std::string owner(void* address) {
  if (address == nullptr) return "-";
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "?:?";
  const char* base = strrchr(info.dli_fname, '/');
  std::string lib = base != nullptr ? base + 1 : info.dli_fname;
  // The real library's file is versioned (libcuda.so.535.261.03): name it
  // by its soname's stem so both runs print the same.
  if (lib.rfind("libcuda.so", 0) == 0) lib = "libcuda";
  if (lib.rfind("libnvidia-ml.so", 0) == 0) lib = "libnvidia-ml";
  // An address that is not a symbol's start is printed as an offset: it must
  // then be identical in both runs.
  if (info.dli_saddr != address || info.dli_sname == nullptr) {
    char buf[64];
    snprintf(buf, sizeof buf, "+%#lx", static_cast<unsigned long>(static_cast<char*>(address) -
                                                                 static_cast<char*>(info.dli_fbase)));
    return lib + ":" + buf;
  }
  return lib + ":" + info.dli_sname;
}
