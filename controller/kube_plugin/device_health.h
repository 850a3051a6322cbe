// Each GPU's health as the kubelet's DRA health stream reports it
// (dra-health v1alpha1 NodeWatchResources, KEP-4680): one entry per device
// "gpu-<index>" of the node's pool. The slice loop writes it from the same
// control API NODE reply it publishes the slice from (no second poller); each
// open stream waits here for the next change.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fracgpu::kube_plugin {

enum class DeviceHealthState { kUnknown, kHealthy, kUnhealthy };

struct DeviceHealthEntry {
  std::string device;  // "gpu-<index>"
  DeviceHealthState state = DeviceHealthState::kUnknown;
  // When the plugin first saw this state (Unix seconds): the kubelet's
  // last_updated_time, which must not move while nothing changes.
  int64_t since_unix = 0;
  // While Unhealthy: the fence's class, as the slice's taint value
  // ("gpu-lost", "ecc-errors", ...; kube::fence_taint_value); else "".
  std::string reason;
};

struct DeviceHealthSnapshot {
  uint64_t version = 0;  // 0: nothing known yet
  bool closed = false;   // the plugin is stopping: streams end
  std::vector<DeviceHealthEntry> devices;  // ordered by GPU index
};

class DeviceHealthBoard {
 public:
  // From the daemon's NODE object: a fenced GPU is Unhealthy, any other
  // Healthy; a GPU no longer listed is dropped. Malformed entries are skipped
  // (the slice logs them). The version moves only when something changed.
  void update_from_node(const nlohmann::json& node, int64_t now_unix);
  // The daemon did not answer: what we knew can no longer be vouched for.
  void mark_unknown(int64_t now_unix);
  // The board once its version is above `seen`, or once closed, or after
  // `timeout` (then as it is, possibly unchanged).
  DeviceHealthSnapshot wait_newer_than(uint64_t seen, std::chrono::milliseconds timeout) const;
  DeviceHealthSnapshot snapshot() const;
  // Wakes every waiter for good (shutdown).
  void close();

 private:
  DeviceHealthSnapshot snapshot_locked() const;
  void set_locked(int64_t index, DeviceHealthState state, int64_t now_unix, bool* changed,
                  const std::string& reason = "");

  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::map<int64_t, DeviceHealthEntry> by_index_;
  uint64_t version_ = 0;
  bool closed_ = false;
};

}  // namespace fracgpu::kube_plugin
