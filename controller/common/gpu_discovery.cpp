#include "common/gpu_discovery.h"

#include <dlfcn.h>

#include <algorithm>
#include <memory>

#include <cuda.h>
#include <fmt/format.h>

#include "common/nvml.h"

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
  decltype(&cuDeviceGetAttribute) get_attribute = nullptr;
  decltype(&cuDriverGetVersion) driver_version = nullptr;
  decltype(&cuGetErrorName) error_name = nullptr;  // optional: only for messages
};

std::string describe(const DriverApi& api, CUresult rc) {
  const char* name = nullptr;
  if (api.error_name != nullptr && api.error_name(rc, &name) == CUDA_SUCCESS && name != nullptr) return name;
  return fmt::format("CUresult {}", static_cast<int>(rc));
}

Discovery discover_cuda(const char* library) {
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
  load_symbol(handle, "cuInit", &api.init, &missing);
  load_symbol(handle, "cuDeviceGetCount", &api.get_count, &missing);
  load_symbol(handle, "cuDeviceGet", &api.get, &missing);
  load_symbol(handle, "cuDeviceGetName", &api.get_name, &missing);
  load_symbol(handle, "cuDeviceGetUuid_v2", &api.get_uuid, &missing);
  load_symbol(handle, "cuDeviceTotalMem_v2", &api.total_mem, &missing);
  load_symbol(handle, "cuDeviceGetAttribute", &api.get_attribute, &missing);
  load_symbol(handle, "cuDriverGetVersion", &api.driver_version, &missing);
  std::string optional_missing;
  load_symbol(handle, "cuGetErrorName", &api.error_name, &optional_missing);
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
  // What the node reports to clients of the control API, nothing more: not
  // knowing it is no reason to manage no GPU.
  if (api.driver_version(&out.cuda_driver_version) != CUDA_SUCCESS) out.cuda_driver_version = 0;
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
    int sms = 0, cc_major = 0, cc_minor = 0;
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
    if (rc == CUDA_SUCCESS) {
      step = "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)";
      rc = api.get_attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    }
    if (rc == CUDA_SUCCESS) {
      step = "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)";
      rc = api.get_attribute(&cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
    }
    if (rc == CUDA_SUCCESS) {
      step = "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)";
      rc = api.get_attribute(&cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
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
    gpu.sm_count = sms;
    gpu.cc_major = cc_major;
    gpu.cc_minor = cc_minor;
    out.gpus.push_back(std::move(gpu));
  }
  return out;
}

// NVML's list (uuid, name, memory, nvml_index) and driver version, or false
// with *problem.
bool discover_nvml(const char* library, std::vector<DiscoveredGpu>* gpus, std::string* driver_version,
                   std::string* problem) {
  std::unique_ptr<Nvml> nvml = Nvml::open(library, problem);
  if (nvml == nullptr) return false;
  const Nvml::Api& api = nvml->api();
  if (api.driver_version != nullptr) {
    char version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = {};
    if (api.driver_version(version, sizeof version) == NVML_SUCCESS) *driver_version = version;
  }
  unsigned count = 0;
  if (nvmlReturn_t rc = api.get_count(&count); rc != NVML_SUCCESS) {
    *problem = fmt::format("nvmlDeviceGetCount_v2 failed: {}", nvml->describe(rc));
    return false;
  }
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev = nullptr;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
    nvmlMemory_t memory{};
    const char* step = "nvmlDeviceGetHandleByIndex_v2";
    nvmlReturn_t rc = api.get_handle(i, &dev);
    if (rc == NVML_SUCCESS) {
      step = "nvmlDeviceGetUUID";
      rc = api.get_uuid(dev, uuid, sizeof uuid);
    }
    if (rc == NVML_SUCCESS) {
      step = "nvmlDeviceGetName";
      rc = api.get_name(dev, name, sizeof name);
    }
    if (rc == NVML_SUCCESS) {
      step = "nvmlDeviceGetMemoryInfo";
      rc = api.get_memory(dev, &memory);
    }
    if (rc != NVML_SUCCESS) {
      // A lost GPU must not hide the others; CUDA may still list it.
      *problem = fmt::format("NVML GPU {}: {} failed: {}", i, step, nvml->describe(rc));
      continue;
    }
    DiscoveredGpu gpu;
    gpu.index = static_cast<int>(i);
    gpu.nvml_index = static_cast<int>(i);
    // NVML prints UUIDs as the CUDA bytes; normalize the case through a parse.
    const auto parsed = parse_gpu_uuid(uuid);
    gpu.uuid = parsed ? format_gpu_uuid(*parsed) : uuid;
    gpu.name = name;
    gpu.memory_bytes = memory.total;
    gpus->push_back(std::move(gpu));
  }
  return true;
}

void append_problem(std::string* problem, const std::string& more) {
  if (more.empty()) return;
  if (!problem->empty()) *problem += "; ";
  *problem += more;
}

}  // namespace

Discovery discover_gpus(const char* cuda_library, const char* nvml_library) {
  Discovery cuda = discover_cuda(cuda_library);
  std::vector<DiscoveredGpu> listed;
  std::string nvml_problem, driver_version;
  if (!discover_nvml(nvml_library, &listed, &driver_version, &nvml_problem)) {
    cuda.nvml_problem = nvml_problem;
    return cuda;  // CUDA alone, as on a node without NVML
  }
  Discovery out;
  out.nvml = true;
  out.driver_version = driver_version;
  out.cuda_driver_version = cuda.cuda_driver_version;
  append_problem(&out.nvml_problem, nvml_problem);  // a GPU NVML could not read
  const bool cuda_answered = cuda.problem.empty() || !cuda.gpus.empty();
  if (!cuda.problem.empty()) append_problem(&out.problem, cuda.problem + " (SM counts unknown)");
  for (DiscoveredGpu& gpu : listed) {
    auto match = std::find_if(cuda.gpus.begin(), cuda.gpus.end(), [&](const DiscoveredGpu& c) { return c.uuid == gpu.uuid; });
    if (match != cuda.gpus.end()) {
      // The driver ordinal is what the config and the interposer's device
      // numbering use; NVML's index follows PCI order and may differ.
      gpu.index = match->index;
      gpu.sm_count = match->sm_count;
      gpu.cc_major = match->cc_major;
      gpu.cc_minor = match->cc_minor;
      if (gpu.memory_bytes == 0) gpu.memory_bytes = match->memory_bytes;
      out.gpus.push_back(std::move(gpu));
    } else if (!cuda_answered) {
      out.gpus.push_back(std::move(gpu));  // CUDA unusable: NVML's index stands in for the ordinal
    } else {
      append_problem(&out.problem, fmt::format("GPU {} (NVML index {}) is listed by NVML but not by the CUDA driver "
                                               "(CUDA_VISIBLE_DEVICES set for fracgpud?): not managed",
                                               gpu.uuid, gpu.nvml_index));
    }
  }
  for (const DiscoveredGpu& c : cuda.gpus) {
    const bool seen = std::any_of(out.gpus.begin(), out.gpus.end(), [&](const DiscoveredGpu& g) { return g.uuid == c.uuid; });
    if (!seen) {
      // NVML could not read it (a lost GPU?) but CUDA can: still a GPU of
      // this node; the health probe will report what NVML says about it.
      out.gpus.push_back(c);
    }
  }
  std::sort(out.gpus.begin(), out.gpus.end(), [](const DiscoveredGpu& a, const DiscoveredGpu& b) { return a.index < b.index; });
  return out;
}

}  // namespace fracgpu::controller
