#include "kube_plugin/device_health.h"

#include <set>

#include "kube/resource_slice.h"

namespace fracgpu::kube_plugin {

using nlohmann::json;

void DeviceHealthBoard::set_locked(int64_t index, DeviceHealthState state, int64_t now_unix, bool* changed,
                                   const std::string& reason) {
  auto [it, added] = by_index_.try_emplace(index);
  DeviceHealthEntry& entry = it->second;
  if (!added && entry.state == state) {
    // Another fault class while still fenced: a change, the state's time kept.
    if (entry.reason != reason) {
      entry.reason = reason;
      *changed = true;
    }
    return;
  }
  entry.device = kube::device_name(index);
  entry.state = state;
  entry.since_unix = now_unix;
  entry.reason = reason;
  *changed = true;
}

void DeviceHealthBoard::update_from_node(const json& node, int64_t now_unix) {
  if (!node.is_object() || !node.contains("gpus") || !node["gpus"].is_array()) return;
  std::lock_guard lock(mutex_);
  bool changed = false;
  std::set<int64_t> listed;
  for (const json& gpu : node["gpus"]) {
    if (!gpu.is_object() || !gpu.contains("index") || !gpu["index"].is_number_integer()) continue;
    const int64_t index = gpu["index"].get<int64_t>();
    if (index < 0 || !listed.insert(index).second) continue;
    const bool fenced = gpu.contains("fenced") && gpu["fenced"].is_boolean() && gpu["fenced"].get<bool>();
    const std::string reason =
        fenced ? kube::fence_taint_value(gpu.contains("fence_reason") && gpu["fence_reason"].is_string()
                                             ? gpu["fence_reason"].get<std::string>()
                                             : std::string())
               : std::string();
    set_locked(index, fenced ? DeviceHealthState::kUnhealthy : DeviceHealthState::kHealthy, now_unix, &changed,
               reason);
  }
  for (auto it = by_index_.begin(); it != by_index_.end();) {
    if (listed.count(it->first)) {
      ++it;
      continue;
    }
    it = by_index_.erase(it);
    changed = true;
  }
  // The first answer counts as a change even for a node without GPUs: the
  // streams waiting for "anything known" send their first (complete) list.
  if (changed || version_ == 0) {
    ++version_;
    changed_.notify_all();
  }
}

void DeviceHealthBoard::mark_unknown(int64_t now_unix) {
  std::lock_guard lock(mutex_);
  bool changed = false;
  for (auto& [index, entry] : by_index_) set_locked(index, DeviceHealthState::kUnknown, now_unix, &changed);
  if (changed) {
    ++version_;
    changed_.notify_all();
  }
}

DeviceHealthSnapshot DeviceHealthBoard::snapshot_locked() const {
  DeviceHealthSnapshot out;
  out.version = version_;
  out.closed = closed_;
  for (const auto& [index, entry] : by_index_) out.devices.push_back(entry);
  return out;
}

DeviceHealthSnapshot DeviceHealthBoard::snapshot() const {
  std::lock_guard lock(mutex_);
  return snapshot_locked();
}

DeviceHealthSnapshot DeviceHealthBoard::wait_newer_than(uint64_t seen, std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return closed_ || version_ > seen; });
  return snapshot_locked();
}

void DeviceHealthBoard::close() {
  std::lock_guard lock(mutex_);
  closed_ = true;
  changed_.notify_all();
}

}  // namespace fracgpu::kube_plugin
