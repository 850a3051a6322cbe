// Asks a real NVIDIA driver library (no GPU needed) how it answers lookups,
// and prints every answer, one per line, tab-separated:
//
//   path  symbol  cudaVersion  flags  result  status  owner
//
// where owner is "<library file>:<symbol>" of the address handed out (dladdr),
// or "-" for none. run_conformance.py runs it with and without libfracgpu.so
// preloaded and compares the two: the interposer must hand out its own hook
// of exactly the variant the driver picked, refuse exactly where the driver
// refuses, and leave everything else untouched.
//
//   conformance_probe cuda NAMES     cuGetProcAddress (v1), cuGetProcAddress_v2
//                                    with and without a status pointer, for
//                                    every name in NAMES (one a line, "NAME" or
//                                    "NAME few": few versions, for names not
//                                    hooked) and every cudaVersion and flags
//                                    value below; and dlsym of every name
//   conformance_probe nvml NAMES     dlsym of every name on libnvidia-ml.so.1
//   conformance_probe cudart LIB     loads the CUDA runtime LIB and has it
//                                    initialize (cudaGetDeviceCount); what it
//                                    obtains is recorded by record_getproc.so
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "owner.h"

namespace {

// Every cudaVersion a CUDA release (2.0 to 13.0) or its runtime passes.
constexpr int kVersions[] = {2000,  2010,  2020,  2030,  2100,  2200,  2300,  3000,  3010,  3020,  3200,
                             4000,  4010,  4020,  5000,  5050,  5500,  6000,  6050,  6500,  7000,  7050,
                             7500,  8000,  9000,  9010,  9020,  9200,  10000, 10010, 10020, 10100, 10200,
                             11000, 11010, 11020, 11030, 11040, 11050, 11060, 11070, 11080, 12000, 12010,
                             12020, 12030, 12040, 12050, 12060, 12080, 12090, 13000};
// For names not hooked: that they pass through untouched needs no more.
constexpr int kFewVersions[] = {2000, 11030, 12000, 12090, 13000};
// CU_GET_PROC_ADDRESS_DEFAULT, _LEGACY_STREAM, _PER_THREAD_DEFAULT_STREAM,
// and one the driver must refuse.
constexpr unsigned long long kFlags[] = {0, 1, 2, 4};

using GetProc = int (*)(const char*, void**, int, unsigned long long);
using GetProc2 = int (*)(const char*, void**, int, unsigned long long, int*);

std::vector<std::string> read_names(const char* path) {
  std::vector<std::string> names;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) names.push_back(line);
  return names;
}

int cuda(const char* names_path) {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) {
    fprintf(stderr, "conformance_probe: %s\n", dlerror());
    return 2;
  }
  const auto v1 = reinterpret_cast<GetProc>(dlsym(driver, "cuGetProcAddress"));
  const auto v2 = reinterpret_cast<GetProc2>(dlsym(driver, "cuGetProcAddress_v2"));
  printf("entry\tcuGetProcAddress\t-\t-\t-\t-\t%s\n", owner(reinterpret_cast<void*>(v1)).c_str());
  printf("entry\tcuGetProcAddress_v2\t-\t-\t-\t-\t%s\n", owner(reinterpret_cast<void*>(v2)).c_str());
  // Lookups before cuInit, as the runtime makes them; then cuInit, which
  // answers CUDA_ERROR_NO_DEVICE without a GPU (printed, not required).
  const std::vector<std::string> names = read_names(names_path);
  for (const std::string& line : names) {
    const size_t space = line.find(' ');
    const std::string name = line.substr(0, space);
    const bool few = space != std::string::npos;
    const char* s = name.c_str();
    std::vector<int> versions(std::begin(kVersions), std::end(kVersions));
    if (few) versions.assign(std::begin(kFewVersions), std::end(kFewVersions));
    for (int version : versions) {
      for (unsigned long long flags : kFlags) {
        void* fn = nullptr;
        if (v1 != nullptr) {
          const int r = v1(s, &fn, version, flags);
          printf("v1\t%s\t%d\t%llu\t%d\t-\t%s\n", s, version, flags, r, owner(r == 0 ? fn : nullptr).c_str());
        }
        if (v2 != nullptr) {
          int status = -1;
          fn = nullptr;
          int r = v2(s, &fn, version, flags, &status);
          printf("v2\t%s\t%d\t%llu\t%d\t%d\t%s\n", s, version, flags, r, status, owner(r == 0 ? fn : nullptr).c_str());
          fn = nullptr;
          r = v2(s, &fn, version, flags, nullptr);
          printf("v2-nostatus\t%s\t%d\t%llu\t%d\t-\t%s\n", s, version, flags, r, owner(r == 0 ? fn : nullptr).c_str());
        }
      }
    }
    printf("dlsym\t%s\t-\t-\t-\t-\t%s\n", s, owner(dlsym(driver, s)).c_str());
  }
  const auto init = reinterpret_cast<int (*)(unsigned)>(dlsym(driver, "cuInit"));
  printf("cuInit\t-\t-\t-\t%d\t-\t-\n", init != nullptr ? init(0) : -1);
  return 0;
}

int nvml(const char* names_path) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    fprintf(stderr, "conformance_probe: %s\n", dlerror());
    return 2;
  }
  for (const std::string& name : read_names(names_path))
    printf("dlsym\t%s\t-\t-\t-\t-\t%s\n", name.c_str(), owner(dlsym(lib, name.c_str())).c_str());
  return 0;
}

int cudart(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    fprintf(stderr, "conformance_probe: %s\n", dlerror());
    return 2;
  }
  const auto count = reinterpret_cast<int (*)(int*)>(dlsym(lib, "cudaGetDeviceCount"));
  int n = -1;
  printf("cudaGetDeviceCount\t-\t-\t-\t%d\t-\t%d\n", count != nullptr ? count(&n) : -1, n);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && strcmp(argv[1], "cuda") == 0) return cuda(argv[2]);
  if (argc == 3 && strcmp(argv[1], "nvml") == 0) return nvml(argv[2]);
  if (argc == 3 && strcmp(argv[1], "cudart") == 0) return cudart(argv[2]);
  fprintf(stderr, "usage: conformance_probe cuda NAMES | nvml NAMES | cudart LIBCUDART\n");
  return 64;
}
