// This node's ResourceSlice (resource.k8s.io/v1) for the DRA driver
// gpu.fracgpu.io: what it holds, and publishing it through the API server.
//
// One pool per node (named after the node), one slice in it, one device per
// managed GPU. A GPU the daemon's health probe fenced is either left out or
// (SliceOptions::taint_fenced) kept with the taint
// gpu.fracgpu.io/unhealthy=<reason>:NoSchedule, so the scheduler allocates
// it to no new claim (resource/v1 DeviceTaint; the API server keeps device
// taints only with its feature gate DRADeviceTaints: alpha, off, in 1.33 to
// 1.35; beta, on, in 1.36; GA from 1.37). Each device allows multiple allocations and carries
// two consumable capacities the kube-scheduler books claims against:
//   memory  bytes the GPU has less what config tenants hold, with a
//           requestPolicy {default, validRange {min 256Mi, step 256Mi}}
//           (the API requires a default wherever a validRange is set; the
//           default, the largest reachable amount, is what a claim that names
//           no memory gets: the whole free GPU memory, as for a device
//           without a policy);
//   share   the GPU's time less what config tenants hold, in thousandths
//           ("1", "750m"); no requestPolicy by default: see SliceOptions.
// The rules these follow are resource/v1's validation (names are DNS labels,
// at most 32 attributes and capacities a device, 128 devices a slice,
// attribute strings <= 64 bytes, versions semver, validRange min + step <=
// value, default reachable from min in steps); tests check them.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

#include "kube/api_client.h"

namespace fracgpu::kube {

inline constexpr const char* kDriverName = "gpu.fracgpu.io";
inline constexpr const char* kResourceApi = "/apis/resource.k8s.io/v1";
// resource/v1: ResourceSliceMaxDevices, ResourceSliceMaxAttributesAndCapacitiesPerDevice.
inline constexpr size_t kMaxDevicesPerSlice = 128;
inline constexpr size_t kMaxAttributesAndCapacities = 32;
inline constexpr size_t kMaxAttributeStringBytes = 64;
// resource/v1: ResourceSliceMaxDevicesWithTaintsOrConsumesCounters, DeviceTaintsMaxLength.
inline constexpr size_t kMaxDevicesPerSliceWithTaints = 64;
inline constexpr size_t kMaxTaintsPerDevice = 16;
inline constexpr const char* kUnhealthyTaintKey = "gpu.fracgpu.io/unhealthy";
inline constexpr const char* kNoScheduleEffect = "NoSchedule";

struct SliceOptions {
  // memory's requestPolicy: validRange min and step, in bytes.
  uint64_t memory_step = 256ull << 20;
  // share's requestPolicy. Without DRAFractionalCapacityRange (absent before
  // Kubernetes 1.36, beta from 1.37) the scheduler rounds a validRange's
  // quantities up to whole units, so a step of 1m would make every request
  // for "500m" consume "1", the whole GPU. So by default share has no policy:
  // the scheduler books exactly what is asked (a claim naming no share gets
  // the whole free share). true: validRange {min 1m, max <value>, step 1m}
  // and default <value>, for clusters where that gate is on.
  bool share_valid_range = false;
  // A fenced GPU: true, in the slice with the kUnhealthyTaintKey NoSchedule
  // taint; false, left out.
  bool taint_fenced = false;
  // While the node's Node object does not exist, it is asked for again
  // after 1 s, then twice as long each time, up to this (the plugin: its
  // --slice-interval).
  std::chrono::milliseconds node_retry_max{30'000};
};

// The taint value for the daemon's fence_reason: a short class of fault
// ("gpu-lost", "ecc-errors", "xid", "sensors-unreadable", else "unhealthy"),
// always a valid label value; the full reason is in the daemon's log and
// `fracgpu status`.
std::string fence_taint_value(const std::string& fence_reason);

// "<node>-gpu.fracgpu.io", lower case; a node name too long for a DNS-1123
// subdomain (253) is cut and a hash of the whole name added, so two long
// names never share a slice.
std::string slice_name(const std::string& node_name);
// "gpu-<index>": a DNS label.
std::string device_name(int64_t gpu_index);

// The ResourceSlice JSON for this node from the control API's NODE object
// (the control API's "node" reply); fenced GPUs tainted or left out (see
// SliceOptions::taint_fenced), GPUs with too little free (memory below min + step, no share left) or a
// malformed entry: each reason is appended to *left_out when given.
nlohmann::json build_resource_slice(const std::string& node_name, const nlohmann::json& node,
                                    int64_t pool_generation, const SliceOptions& options = {},
                                    std::vector<std::string>* left_out = nullptr);

// Keeps the node's slice in the API server equal to what the NODE object says.
// Thread-safe (one mutex).
//
// The slice's controlling owner is the node's Node object, named by its uid
// (GET /api/v1/nodes/<node>). A Node deleted and created again (`kubectl
// delete node`, then the kubelet registering anew) has a new uid, and the
// garbage collector deletes at once every slice naming the old one. So the
// Node is read again at each periodic publish and whenever our slice turned
// out to be gone (absent from the list, or a 404 on our update), and the
// slice is written under the uid the Node has now. While the Node does not
// exist nothing is written (the collector would delete it, and a slice with
// no owner would outlive the node); it is asked for again with backoff
// (SliceOptions::node_retry_max), said once in the log.
class SlicePublisher {
 public:
  SlicePublisher(ApiClient& api, std::string node_name, std::shared_ptr<spdlog::logger> log,
                 SliceOptions options = {});

  // Reads the node's slices, then creates or updates ours when its devices
  // or its owner differ (pool generation bumped, a 409 conflict re-read and
  // retried) and deletes other slices of this node and driver. Unchanged: no
  // write. `periodic`: the caller's periodic publish; the Node is read again
  // first. false on failure (logged) and while the Node does not exist; the
  // next call starts over from the server (during a backoff for the absent
  // Node, it returns false without asking the server anything).
  bool publish(const nlohmann::json& node, bool periodic = false);
  // Deletes this node's slices of this driver (uninstall); absent is success.
  bool remove();

  // Whether fenced GPUs are published tainted: the options ask for it and
  // the API server has not dropped a taint we wrote (then, for the rest of
  // this run, fenced GPUs are left out instead).
  bool taints_in_use() const;

  // The pool generation last written or found current (0 before any).
  int64_t generation() const;
  // Device name -> GPU UUID of the slice last published (empty before).
  std::map<std::string, std::string> device_uuids() const;

 private:
  struct Existing;
  bool list_node_slices(std::vector<nlohmann::json>* slices);
  // *taints_dropped: the server's copy lacks taints we wrote.
  bool write_slice(const nlohmann::json& devices, Existing* current, bool* taints_dropped);
  // GET /api/v1/nodes/<node> (RBAC get on nodes): its uid now, once per
  // publish. false: the Node does not exist (404), or did not at the last
  // answer and has not been seen since; the next read waits for the backoff.
  // An unreadable answer keeps the uid known before (none: the slice goes
  // without an owner, warned once).
  bool read_node();
  nlohmann::json owner_references() const;  // [] while the uid is unknown

  ApiClient& api_;
  std::string node_name_;
  std::string slice_name_;
  std::shared_ptr<spdlog::logger> log_;
  SliceOptions options_;
  mutable std::mutex mutex_;
  // What we last wrote and the resourceVersion the server gave it: while the
  // server still shows that version, our object is as we wrote it (the server
  // rewrites quantities in its own form, so its copy is compared by value).
  nlohmann::json last_devices_;
  std::string last_resource_version_;
  int64_t generation_ = 0;
  std::vector<std::string> last_left_out_;
  std::vector<std::string> last_tainted_;
  bool taints_dropped_ = false;
  std::string node_uid_;
  bool node_uid_warned_ = false;
  bool node_read_ = false;    // during one publish: the Node was read in it
  bool node_absent_ = false;  // the last answer about the Node was 404
  std::chrono::milliseconds node_retry_delay_{0};
  std::chrono::steady_clock::time_point node_retry_at_{};
};

}  // namespace fracgpu::kube
