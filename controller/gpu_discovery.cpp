#include "gpu_discovery.h"

#include <dlfcn.h>

#include <cuda.h>
#include <fmt/format.h>

namespace fracgpu::controller {
namespace {

// The entry points we call, typed from cuda.h so a signature mismatch is a
// compile error rather than a corrupted stack.
struct DriverApi {
  decltype(&cuInit) init = nullptr;
  decltype(&cuDeviceGetCount) get_count = nullptr;
  decltype(&cuDeviceGet) get = nullptr;
  decltype(&cuDeviceGetName) get_name = nullptr;
  decltype(&cuDeviceGetUuid_v2) get_uuid = nullptr;
  decltype(&cuDeviceTotalMem_v2) total_mem = nullptr;
  decltype(&cuGetErrorName) error_name = nullptr;  // optional: only for messages
};

template <typename Fn>
bool load(void* handle, const char* symbol, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (*out == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += symbol;
  }
  return *out != nullptr;
}

std::string describe(const DriverApi& api, CUresult rc) {
  const char* name = nullptr;
  if (api.error_name != nullptr && api.error_name(rc, &name) == CUDA_SUCCESS && name != nullptr) return name;
  return fmt::format("CUresult {}", static_cast<int>(rc));
}

}  // namespace

Discovery discover_gpus(const char* library) {
  Discovery out;
  // Kept open for the life of the process on purpose: unloading the driver
  // after cuInit is unsupported (its threads and atexit handlers stay).
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    out.problem = fmt::format("cannot load the CUDA driver ({}): {}", library, why != nullptr ? why : "unknown error");
    return out;
  }
  DriverApi api;
  std::string missing;
  load(handle, "cuInit", &api.init, &missing);
  load(handle, "cuDeviceGetCount", &api.get_count, &missing);
  load(handle, "cuDeviceGet", &api.get, &missing);
  load(handle, "cuDeviceGetName", &api.get_name, &missing);
  load(handle, "cuDeviceGetUuid_v2", &api.get_uuid, &missing);
  load(handle, "cuDeviceTotalMem_v2", &api.total_mem, &missing);
  std::string optional_missing;
  load(handle, "cuGetErrorName", &api.error_name, &optional_missing);
  if (!missing.empty()) {
    out.problem = fmt::format("the CUDA driver ({}) lacks {}: driver too old?", library, missing);
    return out;
  }

  CUresult rc = api.init(0);
  if (rc == CUDA_ERROR_NO_DEVICE) return out;  // a driver and no GPU: an empty node, not a failure
  if (rc != CUDA_SUCCESS) {
    out.problem = fmt::format("cuInit failed: {}", describe(api, rc));
    return out;
  }
  int count = 0;
  rc = api.get_count(&count);
  if (rc != CUDA_SUCCESS) {
    out.problem = fmt::format("cuDeviceGetCount failed: {}", describe(api, rc));
    return out;
  }
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    char name[256] = {};
    CUuuid uuid{};
    size_t bytes = 0;
    const char* step = "cuDeviceGet";
    rc = api.get(&dev, i);
    if (rc == CUDA_SUCCESS) {
      step = "cuDeviceGetName";
      rc = api.get_name(name, sizeof name - 1, dev);
    }
    if (rc == CUDA_SUCCESS) {
      step = "cuDeviceGetUuid_v2";
      rc = api.get_uuid(&uuid, dev);
    }
    if (rc == CUDA_SUCCESS) {
      step = "cuDeviceTotalMem_v2";
      rc = api.total_mem(&bytes, dev);
    }
    if (rc != CUDA_SUCCESS) {
      // One unreadable GPU must not hide the others: list what we can.
      out.problem = fmt::format("GPU {}: {} failed: {}", i, step, describe(api, rc));
      continue;
    }
    DiscoveredGpu gpu;
    gpu.index = i;
    gpu.uuid = format_gpu_uuid(reinterpret_cast<const uint8_t*>(uuid.bytes));
    gpu.name = name;
    gpu.memory_bytes = bytes;
    out.gpus.push_back(std::move(gpu));
  }
  return out;
}

}  // namespace fracgpu::controller
