// Finds the node's GPUs: through NVML first (libnvidia-ml.so.1), and through
// the CUDA driver API (libcuda.so.1) for the driver ordinals and SM counts,
// both loaded at run time so the daemon runs (and reports clearly) on nodes
// without either. Which source gives what: docs/operations.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/uuid.h"

namespace fracgpu::controller {

struct DiscoveredGpu {
  int index = 0;              // CUdevice ordinal as this process sees it (NVML's index if CUDA is unavailable)
  std::string uuid;           // "GPU-..." (format_gpu_uuid)
  std::string name;           // e.g. "NVIDIA H100 80GB HBM3"
  uint64_t memory_bytes = 0;  // NVML's total memory, else cuDeviceTotalMem
  int sm_count = 0;           // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT; 0 when CUDA did not answer
  int nvml_index = -1;        // NVML's (nvidia-smi's) index; -1 when NVML did not list it
  int cc_major = 0;           // compute capability (CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*); 0 when CUDA did not answer
  int cc_minor = 0;
};

struct Discovery {
  std::vector<DiscoveredGpu> gpus;
  // Empty when the GPUs could be listed. Otherwise why not, or what is
  // missing ("cannot load the CUDA driver ...", "cuInit failed: ...").
  std::string problem;
  // Whether NVML listed the GPUs; if not, nvml_problem says why (e.g. "NVML
  // is not available (libnvidia-ml.so.1): ..."): not an error on its own,
  // discovery then relies on CUDA alone and health and audit are off.
  bool nvml = false;
  std::string nvml_problem;
  std::string driver_version;   // nvmlSystemGetDriverVersion ("550.54.15"); empty without NVML
  int cuda_driver_version = 0;  // cuDriverGetVersion (12040 = CUDA 12.4); 0 when CUDA did not answer
};

// NVML: nvmlInit_v2, the driver version, count, and per device its UUID,
// name and memory. CUDA: cuInit, cuDriverGetVersion, cuDeviceGetCount and per
// device cuDeviceGet, cuDeviceGetName, cuDeviceGetUuid_v2,
// cuDeviceTotalMem_v2, the SM count and the compute capability. Merged by UUID:
// NVML's list is the node's GPUs, each given its CUDA ordinal and SM count.
// Creates no context. Never throws; a node with no driver or no GPU yields an
// empty list and a problem (no GPU is not a problem when the driver says so).
Discovery discover_gpus(const char* cuda_library = "libcuda.so.1", const char* nvml_library = "libnvidia-ml.so.1");

}  // namespace fracgpu::controller
