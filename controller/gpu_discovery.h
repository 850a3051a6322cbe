// Finds the node's GPUs through the CUDA driver API, loaded at run time so the
// daemon runs (and reports clearly) on nodes without a driver.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "uuid.h"

namespace fracgpu::controller {

struct DiscoveredGpu {
  int index = 0;              // CUdevice ordinal as this process sees it
  std::string uuid;           // "GPU-..." (format_gpu_uuid)
  std::string name;           // e.g. "NVIDIA H100 80GB HBM3"
  uint64_t memory_bytes = 0;  // cuDeviceTotalMem
};

struct Discovery {
  std::vector<DiscoveredGpu> gpus;
  // Empty when the driver answered. Otherwise why no GPU could be listed
  // ("libcuda.so.1 not found: ...", "cuInit failed: CUDA_ERROR_NO_DEVICE").
  std::string problem;
};

// dlopen()s `library`, then cuInit, cuDeviceGetCount and, per device,
// cuDeviceGet, cuDeviceGetName, cuDeviceGetUuid_v2 and cuDeviceTotalMem_v2.
// Creates no context. Never throws; a node with no driver or no GPU yields an
// empty list and a problem (no GPU is not a problem when the driver says so).
Discovery discover_gpus(const char* library = "libcuda.so.1");

}  // namespace fracgpu::controller
