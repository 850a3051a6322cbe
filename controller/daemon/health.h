// GPU liveness, probed through NVML by fracgpud every [daemon] health_interval
// (docs/operations.md). A GPU is unhealthy while NVML cannot reach it, its
// temperature or power cannot be read, or its volatile uncorrected ECC counter
// is above zero; and from a critical Xid on, until an operator clears the
// GPU's fence (`fracgpu gpu clear`): the fence is a file under the run dir, so
// it outlives daemon restarts. The daemon turns an unhealthy GPU into GpuPolicy::unavailable in every tenant
// ledger that has it, so new processes are refused at cuInit.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <spdlog/logger.h>

#include "daemon/audit.h"
#include "daemon/memory_audit.h"
#include "fracgpu/ledger_layout.h"
#include "common/gpu_discovery.h"
#include "common/nvml.h"

namespace fracgpu::controller {

// Xids that report an application's own fault (illegal address, MMU fault
// caused by a kernel, ...), not the GPU's: they do not make it unhealthy.
// The same set NVIDIA's Kubernetes device plugin skips by default.
inline const std::set<uint64_t> kApplicationXids = {13, 31, 43, 45, 68, 109};

struct GpuHealth {
  int index = 0;     // driver ordinal (DiscoveredGpu::index)
  std::string uuid;  // "GPU-..."
  bool healthy = true;
  ledger::GpuUnavailableReason reason = ledger::kGpuAvailable;
  uint32_t detail = 0;     // Xid or ECC count
  std::string why;         // one line; empty while healthy
  uint64_t since_unix = 0; // when the current state began (wall clock, seconds)
  // Last readings; -1 when unreadable.
  int64_t temperature_c = -1;
  int64_t power_mw = -1;
  int64_t ecc_uncorrected = -1;
  uint64_t xid_events = 0;     // critical Xids seen since fracgpud started
  uint64_t last_xid = 0;
};

// A critical Xid fences its GPU: <run_dir>/fences/<GPU UUID>, a small JSON
// file (uuid, index, xid, why, since_unix) written when the Xid is seen. A
// starting daemon reads it back, so the GPU stays unhealthy across restarts
// and crashes; removing the file (`fracgpu gpu clear`) clears the fence at
// the next probe.
inline constexpr const char* kFencesDirName = "fences";
struct XidFence {
  uint64_t xid = 0;
  std::string why;
  uint64_t since_unix = 0;
};
std::string xid_fence_path(const std::string& run_dir, const std::string& uuid);
// nullopt when there is no fence; a file that cannot be parsed, or is
// refused (not a regular file of the run dir's owner), still fences.
std::optional<XidFence> read_xid_fence(const std::string& run_dir, const std::string& uuid);

class HealthMonitor {
 public:
  // `nvml` may be null (no NVML): then nothing is probed and every GPU is
  // healthy but those an Xid fence left on disk keeps fenced (until it is
  // cleared); available() says NVML is missing. `run_dir`: where Xid fences
  // live (empty: not persisted, as before).
  HealthMonitor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log, std::string run_dir = {});
  ~HealthMonitor();
  HealthMonitor(const HealthMonitor&) = delete;
  HealthMonitor& operator=(const HealthMonitor&) = delete;

  bool available() const { return nvml_ != nullptr; }
  // Probes every GPU once. Logs each change of state once (warn when a GPU
  // turns unhealthy, info when it recovers). Returns true if any changed.
  bool probe();
  const std::vector<GpuHealth>& gpus() const { return gpus_; }
  const GpuHealth* find(const std::string& uuid) const;

 private:
  struct Probe {
    ledger::GpuUnavailableReason reason = ledger::kGpuAvailable;
    uint32_t detail = 0;
    std::string why;
  };
  Probe probe_one(GpuHealth& gpu, nvmlDevice_t* handle);
  void drain_xid_events();
  void fence(size_t i, uint64_t xid);
  void check_fences_cleared();

  Nvml* nvml_;
  std::string run_dir_;
  spdlog::logger& log_;
  std::vector<GpuHealth> gpus_;
  std::vector<nvmlDevice_t> handles_;  // parallel to gpus_; null until found
  std::vector<bool> registered_;       // Xid events registered for the GPU
  nvmlEventSet_t events_ = nullptr;
  std::vector<std::string> sticky_xid_;  // parallel to gpus_: why, once a critical Xid was seen
  std::vector<bool> fenced_on_disk_;     // parallel to gpus_: its fence file exists (so removing it clears)
};

// What fracgpud last found is written to <run_dir>/health.json
// (kHealthFileName, state/run_dir.h) after every probe and audit.
struct NodeChecks {
  bool nvml = false;
  std::string nvml_problem;
  std::vector<GpuHealth> gpus;
  AuditAction audit_action = AuditAction::kReport;
  std::vector<AuditFinding> findings;
  MemoryAuditAction memory_action = MemoryAuditAction::kTerminate;
  std::vector<MemoryOveruse> overuses;
};

const char* unavailable_reason_name(ledger::GpuUnavailableReason reason);  // "lost", "xid", ...
std::string node_checks_json(const NodeChecks& checks);
bool write_node_checks(const std::string& run_dir, const NodeChecks& checks, std::string* error);
bool write_xid_fence(const std::string& run_dir, const GpuHealth& gpu, const XidFence& fence, std::string* error);

}  // namespace fracgpu::controller
