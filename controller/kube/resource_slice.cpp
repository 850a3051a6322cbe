#include "kube/resource_slice.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/text_escape.h"
#include "kube/quantity.h"

namespace fracgpu::kube {
namespace {

using nlohmann::json;
using controller::escape_terminal;

constexpr std::string_view kSliceNameSuffix = "-gpu.fracgpu.io";
constexpr size_t kDnsSubdomainMax = 253;
constexpr int kMaxConflictRetries = 5;
constexpr int64_t kSharePpm = 1'000'000;

std::string slices_path() { return std::string(kResourceApi) + "/resourceslices"; }
std::string slice_path(const std::string& name) { return slices_path() + "/" + name; }

uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// Each dot-separated label made of [a-z0-9-], starting and ending with a letter or digit.
std::string as_dns_subdomain(std::string_view text) {
  std::string out;
  std::string label;
  auto flush = [&] {
    while (!label.empty() && label.back() == '-') label.pop_back();
    size_t start = label.find_first_not_of('-');
    if (start != std::string::npos) {
      if (!out.empty()) out.push_back('.');
      out += label.substr(start);
    }
    label.clear();
  };
  for (char raw : text) {
    char c = static_cast<char>(std::tolower(static_cast<unsigned char>(raw)));
    if (c == '.') {
      flush();
    } else {
      label.push_back((std::isalnum(static_cast<unsigned char>(c)) && static_cast<unsigned char>(c) < 0x80) ? c : '-');
    }
  }
  flush();
  return out;
}

// Printable ASCII only, at most `max_bytes`: attribute strings are shown by
// kubectl and matched by CEL; the API allows 64 bytes.
std::string attribute_string(std::string_view text, size_t max_bytes = kMaxAttributeStringBytes) {
  std::string out;
  for (unsigned char c : text) {
    if (out.size() >= max_bytes) break;
    out.push_back(c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?');
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// "9.0" -> "9.0.0": semver as version attributes require (numbers without
// leading zeros). nullopt for anything else.
std::optional<std::string> semver_of_major_minor(std::string_view text) {
  size_t dot = text.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot + 1 >= text.size()) return std::nullopt;
  std::string_view major = text.substr(0, dot), minor = text.substr(dot + 1);
  for (auto part : {major, minor}) {
    if (part.size() > 6) return std::nullopt;
    for (char c : part)
      if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  return fmt::format("{}.{}.0", std::stoi(std::string(major)), std::stoi(std::string(minor)));
}

// "256Mi" rather than "268435456": how people write the step.
std::string binary_quantity(uint64_t bytes) {
  static constexpr std::pair<int, const char*> kUnits[] = {{40, "Ti"}, {30, "Gi"}, {20, "Mi"}, {10, "Ki"}};
  for (auto [shift, suffix] : kUnits) {
    uint64_t unit = 1ull << shift;
    if (bytes != 0 && bytes % unit == 0) return fmt::format("{}{}", bytes / unit, suffix);
  }
  return bytes_quantity(bytes);
}

template <typename T>
std::optional<T> number_field(const json& object, const char* key, T fallback) {
  if (!object.contains(key) || object[key].is_null()) return fallback;
  const json& v = object[key];
  if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) return std::nullopt;
    double d = v.get<double>();
    return std::isfinite(d) ? std::optional<double>(d) : std::nullopt;
  } else {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<T>::max())) return std::nullopt;
      return static_cast<T>(u);
    }
    if (!v.is_number_integer()) return std::nullopt;
    int64_t i = v.get<int64_t>();
    if (i < 0 && std::is_unsigned_v<T>) return std::nullopt;
    return static_cast<T>(i);
  }
}

std::string string_field(const json& object, const char* key) {
  if (!object.contains(key) || !object[key].is_string()) return "";
  return object[key].get<std::string>();
}

// One device for one GPU entry of the NODE object; nullopt with *why if the
// GPU cannot be offered.
std::optional<json> device_for_gpu(const json& gpu, const json& node, const SliceOptions& options, std::string* why) {
  if (!gpu.is_object()) {
    *why = "not an object";
    return std::nullopt;
  }
  const std::string uuid = string_field(gpu, "uuid");
  auto index = number_field<int64_t>(gpu, "index", -1);
  auto memory = number_field<uint64_t>(gpu, "memory", 0);
  auto config_memory = number_field<uint64_t>(gpu, "config_memory", 0);
  auto config_share = number_field<double>(gpu, "config_share", 0.0);
  if (uuid.empty() || uuid.size() > kMaxAttributeStringBytes || attribute_string(uuid) != uuid) {
    *why = "uuid missing or not printable";
    return std::nullopt;
  }
  if (!index || *index < 0 || *index > 99999) {
    *why = "index missing or out of range";
    return std::nullopt;
  }
  if (!memory || *memory == 0 || !config_memory || !config_share || *config_share < 0 || *config_share > 1) {
    *why = "memory, config_memory or config_share missing or out of range";
    return std::nullopt;
  }
  const bool fenced = gpu.contains("fenced") && gpu["fenced"].is_boolean() && gpu["fenced"].get<bool>();
  if (fenced && !options.taint_fenced) {
    std::string reason = string_field(gpu, "fence_reason");
    *why = "fenced by the health probe" + (reason.empty() ? "" : ": " + escape_terminal(reason));
    return std::nullopt;
  }

  // What the scheduler may hand out: config tenants are outside its books.
  // With overcommit, config quotas do not reduce what an API tenant may get.
  bool overcommit = node.contains("allow_overcommit") && node["allow_overcommit"].is_boolean() &&
                    node["allow_overcommit"].get<bool>();
  uint64_t free_memory = overcommit ? *memory : (*memory > *config_memory ? *memory - *config_memory : 0);
  int64_t config_ppm = std::llround(*config_share * kSharePpm);
  int64_t free_milli = std::max<int64_t>(0, kSharePpm - config_ppm) / 1000;  // rounded down

  const uint64_t step = options.memory_step;
  // The API requires min + step <= value.
  if (step == 0 || free_memory < 2 * step) {
    *why = fmt::format("free memory {} B is below {} B (requestPolicy min + step)", free_memory, 2 * step);
    return std::nullopt;
  }
  if (free_milli < (options.share_valid_range ? 2 : 1)) {
    *why = "no share left beside config tenants";
    return std::nullopt;
  }

  json attributes = json::object();
  attributes["uuid"] = {{"string", uuid}};
  attributes["index"] = {{"int", *index}};
  attributes["memory"] = {{"int", static_cast<int64_t>(std::min<uint64_t>(*memory, INT64_MAX))}};
  if (std::string name = attribute_string(string_field(gpu, "name")); !name.empty())
    attributes["productName"] = {{"string", name}};
  if (auto cc = semver_of_major_minor(string_field(gpu, "compute_capability")))
    attributes["computeCapability"] = {{"version", *cc}};
  if (std::string driver = attribute_string(string_field(node, "driver_version")); !driver.empty())
    attributes["driverVersion"] = {{"string", driver}};
  // cuDriverGetVersion: 1000 * major + 10 * minor.
  if (auto cuda = number_field<int64_t>(node, "cuda_driver_version", 0); cuda && *cuda > 0 && *cuda < 10'000'000)
    attributes["cudaDriverVersion"] = {{"version", fmt::format("{}.{}.0", *cuda / 1000, (*cuda % 1000) / 10)}};

  // The largest amount reachable from min in steps: the API wants the default
  // inside the range and on a step.
  uint64_t memory_default = step + (free_memory - step) / step * step;
  json memory_capacity = {{"value", bytes_quantity(free_memory)},
                          {"requestPolicy",
                           {{"default", bytes_quantity(memory_default)},
                            {"validRange", {{"min", binary_quantity(step)}, {"step", binary_quantity(step)}}}}}};
  json share_capacity = {{"value", milli_quantity(free_milli)}};
  if (options.share_valid_range) {
    share_capacity["requestPolicy"] = {
        {"default", milli_quantity(free_milli)},
        {"validRange", {{"min", "1m"}, {"max", milli_quantity(free_milli)}, {"step", "1m"}}}};
  }
  json device = {{"name", device_name(*index)},
                 {"allowMultipleAllocations", true},
                 {"attributes", std::move(attributes)},
                 {"capacity", {{"memory", std::move(memory_capacity)}, {"share", std::move(share_capacity)}}}};
  // NoSchedule: no new claim gets the GPU; claims already allocated keep it
  // (their pods are not evicted: the daemon already refuses their new
  // processes there, and the kubelet's health stream shows them Unhealthy).
  // timeAdded is left to the API server, and carried over from its copy by
  // SlicePublisher.
  if (fenced)
    device["taints"] = json::array(
        {{{"key", kUnhealthyTaintKey}, {"value", fence_taint_value(string_field(gpu, "fence_reason"))},
          {"effect", kNoScheduleEffect}}});
  return device;
}

bool has_taints(const json& device) {
  return device.is_object() && device.contains("taints") && device["taints"].is_array() && !device["taints"].empty();
}

// timeAdded of the server's copy of the same taint (key, value, effect) on the
// same device, so that an unchanged taint is written back unchanged.
void carry_taint_times(json& devices, const json& server_devices) {
  if (!server_devices.is_array()) return;
  for (json& device : devices) {
    if (!has_taints(device)) continue;
    for (const json& theirs : server_devices) {
      if (!has_taints(theirs) || theirs.value("name", std::string()) != device["name"]) continue;
      for (json& taint : device["taints"])
        for (const json& their_taint : theirs["taints"])
          if (their_taint.is_object() && their_taint.contains("timeAdded") &&
              their_taint.value("key", std::string()) == taint["key"] &&
              their_taint.value("value", std::string()) == taint["value"] &&
              their_taint.value("effect", std::string()) == taint["effect"])
            taint["timeAdded"] = their_taint["timeAdded"];
    }
  }
}

// Whether a device we wrote with taints came back without them: the API
// server dropped the field (DRADeviceTaints off), as it drops any field of a
// disabled feature.
bool taints_dropped_by_server(const json& written_devices, const json& stored) {
  if (!stored.is_object() || !stored.contains("spec") || !stored["spec"].is_object() ||
      !stored["spec"].contains("devices") || !stored["spec"]["devices"].is_array())
    return false;
  for (const json& ours : written_devices) {
    if (!has_taints(ours)) continue;
    for (const json& theirs : stored["spec"]["devices"])
      if (theirs.is_object() && theirs.value("name", std::string()) == ours["name"] && !has_taints(theirs)) return true;
  }
  return false;
}

// Devices in a form where the server's rewriting of quantities ("1000m" as
// "1", a byte count as "80Gi") does not count as a change.
json normalized_devices(const json& devices) {
  if (!devices.is_array()) return json::array();
  json out = devices;
  auto normalize = [](json& q) {
    if (!q.is_string()) return;
    if (auto parsed = Quantity::parse(q.get<std::string>())) q = parsed->decimal();
  };
  for (json& device : out) {
    if (!device.is_object() || !device.contains("capacity") || !device["capacity"].is_object()) continue;
    for (auto& [name, capacity] : device["capacity"].items()) {
      if (!capacity.is_object()) continue;
      if (capacity.contains("value")) normalize(capacity["value"]);
      if (!capacity.contains("requestPolicy") || !capacity["requestPolicy"].is_object()) continue;
      json& policy = capacity["requestPolicy"];
      if (policy.contains("default")) normalize(policy["default"]);
      if (policy.contains("validRange") && policy["validRange"].is_object())
        for (auto& [key, bound] : policy["validRange"].items()) normalize(bound);
      if (policy.contains("validValues") && policy["validValues"].is_array())
        for (json& v : policy["validValues"]) normalize(v);
    }
  }
  std::sort(out.begin(), out.end(), [](const json& a, const json& b) {
    return a.value("name", std::string()) < b.value("name", std::string());
  });
  return out;
}

int64_t pool_generation_of(const json& slice) {
  const json* pool = nullptr;
  if (slice.contains("spec") && slice["spec"].is_object() && slice["spec"].contains("pool"))
    pool = &slice["spec"]["pool"];
  if (!pool || !pool->is_object() || !pool->contains("generation") || !(*pool)["generation"].is_number_integer())
    return 0;
  return (*pool)["generation"].get<int64_t>();
}

std::string metadata_string(const json& object, const char* key) {
  if (!object.contains("metadata") || !object["metadata"].is_object()) return "";
  return string_field(object["metadata"], key);
}

std::string spec_string(const json& object, const char* key) {
  if (!object.contains("spec") || !object["spec"].is_object()) return "";
  return string_field(object["spec"], key);
}

// The slice around `devices`: one pool per node, named after it, of one slice.
json slice_object(const std::string& node_name, int64_t pool_generation, json devices) {
  return json{{"apiVersion", "resource.k8s.io/v1"},
              {"kind", "ResourceSlice"},
              {"metadata",
               {{"name", slice_name(node_name)}, {"labels", {{"app.kubernetes.io/managed-by", "fracgpu"}}}}},
              {"spec",
               {{"driver", kDriverName},
                {"nodeName", node_name},
                {"pool", {{"name", node_name}, {"generation", pool_generation}, {"resourceSliceCount", 1}}},
                {"devices", std::move(devices)}}}};
}

}  // namespace

std::string slice_name(const std::string& node_name) {
  std::string clean = as_dns_subdomain(node_name);
  if (!clean.empty() && clean == node_name && clean.size() + kSliceNameSuffix.size() <= kDnsSubdomainMax)
    return clean + std::string(kSliceNameSuffix);
  // Cut, and told apart by a hash of the name as it was.
  std::string hash = fmt::format("{:08x}", static_cast<uint32_t>(fnv1a64(node_name) ^ (fnv1a64(node_name) >> 32)));
  size_t keep = kDnsSubdomainMax - kSliceNameSuffix.size() - hash.size() - 1;
  std::string prefix = clean.substr(0, std::min(keep, clean.size()));
  while (!prefix.empty() && (prefix.back() == '-' || prefix.back() == '.')) prefix.pop_back();
  return (prefix.empty() ? "" : prefix + "-") + hash + std::string(kSliceNameSuffix);
}

std::string device_name(int64_t gpu_index) { return fmt::format("gpu-{}", gpu_index); }

std::string fence_taint_value(const std::string& fence_reason) {
  std::string lower;
  for (unsigned char c : fence_reason) lower.push_back(static_cast<char>(std::tolower(c)));
  auto mentions = [&](std::string_view word) { return lower.find(word) != std::string::npos; };
  // The daemon's health probe words (controller/daemon/health.cpp): the most
  // specific first, as a sticky Xid fence may also mention a lost GPU.
  if (mentions("xid")) return "xid";
  if (mentions("ecc")) return "ecc-errors";
  if (mentions("lost") || mentions("cannot find")) return "gpu-lost";
  if (mentions("cannot be read")) return "sensors-unreadable";
  return "unhealthy";
}

json build_resource_slice(const std::string& node_name, const json& node, int64_t pool_generation,
                          const SliceOptions& options, std::vector<std::string>* left_out) {
  auto leave_out = [&](std::string reason) {
    if (left_out) left_out->push_back(std::move(reason));
  };
  // Ordered by index, so the same node always gives the same JSON.
  std::vector<std::pair<int64_t, json>> devices;
  std::set<std::string> seen_uuids;
  std::set<int64_t> seen_indices;
  if (!node.is_object() || !node.contains("gpus") || !node["gpus"].is_array()) {
    leave_out("node: no \"gpus\" list");
  } else {
    const json& gpus = node["gpus"];
    for (size_t i = 0; i < gpus.size(); ++i) {
      const json& gpu = gpus[i];
      std::string label = gpu.is_object() && gpu.contains("uuid") && gpu["uuid"].is_string()
                              ? escape_terminal(gpu["uuid"].get<std::string>())
                              : fmt::format("gpus[{}]", i);
      std::string why;
      auto device = device_for_gpu(gpu, node, options, &why);
      if (!device) {
        leave_out(fmt::format("{}: {}", label, why));
        continue;
      }
      int64_t index = (*device)["attributes"]["index"]["int"].get<int64_t>();
      std::string uuid = (*device)["attributes"]["uuid"]["string"].get<std::string>();
      if (!seen_indices.insert(index).second || !seen_uuids.insert(uuid).second) {
        leave_out(fmt::format("{}: index {} or its UUID appears twice", label, index));
        continue;
      }
      devices.emplace_back(index, std::move(*device));
    }
  }
  std::sort(devices.begin(), devices.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  // A slice with a tainted device may hold fewer devices.
  const bool tainted = std::any_of(devices.begin(), devices.end(), [](const auto& d) { return has_taints(d.second); });
  const size_t max_devices = tainted ? kMaxDevicesPerSliceWithTaints : kMaxDevicesPerSlice;
  json device_list = json::array();
  for (auto& [index, device] : devices) {
    if (device_list.size() >= max_devices) {
      leave_out(fmt::format("{}: more than {} devices in one slice", device["name"].get<std::string>(), max_devices));
      continue;
    }
    device_list.push_back(std::move(device));
  }
  return slice_object(node_name, pool_generation, std::move(device_list));
}

// ---- SlicePublisher ----

struct SlicePublisher::Existing {
  bool present = false;
  std::string resource_version;
  int64_t generation = 0;
  json devices;
  json owner_references = json::array();
};

json SlicePublisher::owner_references() const {
  // The Node as the slice's controlling owner, as the upstream helper sets
  // it: the garbage collector deletes the slice when the node object goes.
  if (node_uid_.empty()) return json::array();
  return json::array(
      {{{"apiVersion", "v1"}, {"kind", "Node"}, {"name", node_name_}, {"uid", node_uid_}, {"controller", true}}});
}

bool SlicePublisher::read_node() {
  if (node_read_) return !node_absent_;
  if (node_absent_ && std::chrono::steady_clock::now() < node_retry_at_) return false;
  node_read_ = true;
  const std::string who = escape_terminal(node_name_);
  HttpResult result = api_.get("/api/v1/nodes/" + escape_query_value(node_name_));
  if (result.status == 404) {
    // Deleted, and not (yet) registered again by the kubelet. A slice written
    // now would be collected at once (its owner gone) or, without an owner,
    // outlive the node: nothing is written until the Node exists.
    const auto most = std::max(options_.node_retry_max, std::chrono::milliseconds(1));
    node_retry_delay_ = node_absent_ ? std::min(node_retry_delay_ * 2, most)
                                     : std::min<std::chrono::milliseconds>(std::chrono::seconds(1), most);
    node_retry_at_ = std::chrono::steady_clock::now() + node_retry_delay_;
    if (!node_absent_)
      log_->warn("node {}: the Node does not exist (deleted?): its ResourceSlice is not written until it exists "
                 "again; asking for it with backoff, at least every {} ms",
                 who, most.count());
    node_absent_ = true;
    return false;
  }
  const json object = result.ok() ? json::parse(result.body, nullptr, false) : json();
  const std::string uid = object.is_object() ? metadata_string(object, "uid") : std::string();
  if (!uid.empty() && metadata_string(object, "name") == node_name_) {
    if (node_absent_) log_->info("node {}: the Node exists again", who);
    node_absent_ = false;
    if (uid == node_uid_) return true;
    if (node_uid_.empty()) {
      log_->info("node {}: uid {}; its ResourceSlice is owned by it (deleted with the node)", who,
                 escape_terminal(uid));
    } else {
      // The garbage collector deletes every slice naming the old uid.
      log_->warn("node {}: uid {}, was {}: the Node was created again; its ResourceSlice is owned by the new one", who,
                 escape_terminal(uid), escape_terminal(node_uid_));
    }
    node_uid_ = uid;
    return true;
  }
  // No usable answer (a refusal, no answer, no uid in it).
  if (node_absent_) {
    // Still not seen again: wait as long once more before asking.
    node_retry_at_ = std::chrono::steady_clock::now() + node_retry_delay_;
    return false;
  }
  // The uid known before stays (the failure is logged by the client).
  if (node_uid_.empty() && !node_uid_warned_) {
    log_->warn("node {}: cannot read its uid ({}): the ResourceSlice is published without an owner, so it outlives a "
               "deleted node; RBAC must allow get on nodes (deploy/rbac.yaml). Asked again at each publish",
               who, result.ok() ? "no uid in the answer" : result.error);
    node_uid_warned_ = true;
  }
  return true;
}

SlicePublisher::SlicePublisher(ApiClient& api, std::string node_name, std::shared_ptr<spdlog::logger> log,
                               SliceOptions options)
    : api_(api),
      node_name_(std::move(node_name)),
      slice_name_(slice_name(node_name_)),
      log_(log ? std::move(log) : spdlog::default_logger()),
      options_(options) {}

int64_t SlicePublisher::generation() const {
  std::lock_guard lock(mutex_);
  return generation_;
}

std::map<std::string, std::string> SlicePublisher::device_uuids() const {
  std::lock_guard lock(mutex_);
  std::map<std::string, std::string> out;
  if (!last_devices_.is_array()) return out;
  for (const json& device : last_devices_) out[device["name"].get<std::string>()] = device["attributes"]["uuid"]["string"].get<std::string>();
  return out;
}

bool SlicePublisher::list_node_slices(std::vector<json>* slices) {
  std::string selector = fmt::format("spec.nodeName={},spec.driver={}", node_name_, kDriverName);
  HttpResult result = api_.get(slices_path() + "?fieldSelector=" + escape_query_value(selector));
  if (!result.ok()) {
    log_->error("ResourceSlices of node {}: cannot list them: {}", escape_terminal(node_name_), result.error);
    return false;
  }
  auto list = json::parse(result.body, nullptr, false);
  if (!list.is_object() || !list.contains("items") || !list["items"].is_array()) {
    log_->error("ResourceSlices of node {}: the list answer has no items", escape_terminal(node_name_));
    return false;
  }
  for (json& item : list["items"]) {
    if (!item.is_object()) continue;
    // A server that ignores the field selector must not make us delete another node's slices.
    if (spec_string(item, "nodeName") != node_name_ || spec_string(item, "driver") != kDriverName) continue;
    slices->push_back(std::move(item));
  }
  return true;
}

bool SlicePublisher::taints_in_use() const {
  std::lock_guard lock(mutex_);
  return options_.taint_fenced && !taints_dropped_;
}

bool SlicePublisher::write_slice(const json& devices, Existing* current, bool* taints_dropped) {
  *taints_dropped = false;
  for (int attempt = 0; attempt <= kMaxConflictRetries; ++attempt) {
    int64_t generation = std::max(generation_, current->generation) + 1;
    json slice = slice_object(node_name_, generation, devices);
    if (const json owners = owner_references(); !owners.empty()) slice["metadata"]["ownerReferences"] = owners;
    HttpResult result;
    if (current->present) {
      slice["metadata"]["resourceVersion"] = current->resource_version;
      result = api_.put(slice_path(slice_name_), slice);
    } else {
      result = api_.post(slices_path(), slice);
    }
    if (result.ok()) {
      auto written = json::parse(result.body, nullptr, false);
      last_resource_version_ = metadata_string(written, "resourceVersion");
      last_devices_ = devices;
      generation_ = generation;
      log_->info("ResourceSlice {}: {} (pool generation {}, {} devices)", slice_name_,
                 current->present ? "updated" : "created", generation, devices.size());
      current->present = true;
      current->resource_version = last_resource_version_;
      current->generation = generation;
      *taints_dropped = taints_dropped_by_server(devices, written);
      // Without DRAConsumableCapacity (a gate before Kubernetes 1.36) the
      // server drops the fields it does not know, and no pod could share a GPU.
      if (!devices.empty() && written.is_object() && written.contains("spec") &&
          written["spec"].contains("devices") && written["spec"]["devices"].is_array() &&
          !written["spec"]["devices"].empty() &&
          !written["spec"]["devices"][0].contains("allowMultipleAllocations"))
        log_->error("ResourceSlice {}: the API server dropped allowMultipleAllocations: enable the "
                    "DRAConsumableCapacity feature gate (Kubernetes 1.34 and 1.35)", slice_name_);
      return true;
    }
    if (result.status == 404 && current->present) {
      // Deleted since we listed it (the garbage collector, perhaps, the Node
      // having been created again): the Node read again, then created.
      log_->info("ResourceSlice {}: deleted meanwhile; creating it again", slice_name_);
      if (!read_node()) return false;
      *current = Existing{};
      continue;
    }
    if (result.status != 409) return false;  // logged by the client
    // Someone else wrote (or created) it since we read it: read it again.
    HttpResult fresh = api_.get(slice_path(slice_name_));
    if (fresh.status == 404) {
      *current = Existing{};
      continue;
    }
    if (!fresh.ok()) return false;
    auto object = json::parse(fresh.body, nullptr, false);
    current->present = true;
    current->resource_version = metadata_string(object, "resourceVersion");
    current->generation = pool_generation_of(object);
    current->devices = object.is_object() && object.contains("spec") && object["spec"].is_object() &&
                               object["spec"].contains("devices")
                           ? object["spec"]["devices"]
                           : json::array();
    const json owners = object.is_object() && object.contains("metadata") && object["metadata"].is_object()
                            ? object["metadata"].value("ownerReferences", json::array())
                            : json::array();
    if (normalized_devices(current->devices) == normalized_devices(devices) &&
        (node_uid_.empty() || owners == owner_references())) {
      generation_ = current->generation;
      last_resource_version_ = current->resource_version;
      last_devices_ = devices;
      return true;
    }
  }
  log_->error("ResourceSlice {}: still conflicting after {} attempts", slice_name_, kMaxConflictRetries + 1);
  return false;
}

bool SlicePublisher::publish(const json& node, bool periodic) {
  std::lock_guard lock(mutex_);
  node_read_ = false;
  try {
    // The Node is absent: nothing to do before its next read is due.
    if (node_absent_ && std::chrono::steady_clock::now() < node_retry_at_) return false;
    SliceOptions options = options_;
    options.taint_fenced = options_.taint_fenced && !taints_dropped_;
    std::vector<std::string> left_out;
    json desired = build_resource_slice(node_name_, node, 0, options, &left_out);
    if (left_out != last_left_out_) {
      for (const auto& reason : left_out) log_->warn("ResourceSlice {}: left out {}", slice_name_, reason);
      last_left_out_ = left_out;
    }
    json devices = desired["spec"]["devices"];
    std::vector<std::string> tainted;
    for (const json& device : devices)
      if (has_taints(device))
        tainted.push_back(fmt::format("{} ({}={})", device["name"].get<std::string>(), kUnhealthyTaintKey,
                                      device["taints"][0]["value"].get<std::string>()));
    if (tainted != last_tainted_) {
      for (const auto& what : tainted)
        log_->warn("ResourceSlice {}: tainted {}:{}: fenced by the health probe, no new claim gets it", slice_name_,
                   what, kNoScheduleEffect);
      last_tainted_ = tainted;
    }

    // The Node's uid: at each periodic publish (a Node created again has a
    // new one), while it is unknown, and while the Node is absent.
    if ((periodic || node_uid_.empty() || node_absent_) && !read_node()) return false;
    std::vector<json> slices;
    if (!list_node_slices(&slices)) return false;
    Existing ours;
    std::vector<std::string> stale;
    int64_t highest_generation = 0;
    for (const json& slice : slices) {
      std::string name = metadata_string(slice, "name");
      highest_generation = std::max(highest_generation, pool_generation_of(slice));
      bool same_pool = slice["spec"].contains("pool") && slice["spec"]["pool"].is_object() &&
                       string_field(slice["spec"]["pool"], "name") == node_name_;
      // Ours by name and shape; one with another pool (an older plugin's)
      // cannot be changed into ours (the pool name is immutable): replaced.
      if (name == slice_name_ && same_pool) {
        ours.present = true;
        ours.resource_version = metadata_string(slice, "resourceVersion");
        ours.generation = pool_generation_of(slice);
        ours.devices = slice["spec"].contains("devices") ? slice["spec"]["devices"] : json::array();
        if (slice["metadata"].contains("ownerReferences")) ours.owner_references = slice["metadata"]["ownerReferences"];
      } else {
        stale.push_back(name);
      }
    }
    // Ours is gone though it was there at our last publish: someone deleted
    // it, perhaps the garbage collector because the Node was created again.
    if (!ours.present && !last_resource_version_.empty() && !node_read_) {
      log_->info("ResourceSlice {}: gone from the API server; reading node {} again before creating it", slice_name_,
                 escape_terminal(node_name_));
      if (!read_node()) return false;
    }
    // The pool's generation must rise above every slice of it consumers may have seen.
    generation_ = std::max(generation_, highest_generation);
    carry_taint_times(devices, ours.devices);

    // Remove first what would block creating ours.
    bool ok = true;
    auto delete_stale = [&] {
      for (const auto& name : stale) {
        HttpResult result = api_.del(slice_path(name));
        if (result.ok() || result.status == 404) {
          log_->info("ResourceSlice {}: deleted (stale slice of node {})", escape_terminal(name), escape_terminal(node_name_));
        } else {
          ok = false;
        }
      }
    };
    if (std::find(stale.begin(), stale.end(), slice_name_) != stale.end()) delete_stale(), stale.clear();

    // Unchanged, and no other slice of the pool newer: consumers use only the
    // slices of a pool's highest generation.
    // A slice written before the node's uid was known gets its owner now.
    bool unchanged = ours.present && ours.generation >= highest_generation &&
                     (node_uid_.empty() || ours.owner_references == owner_references()) &&
                     ((ours.resource_version == last_resource_version_ && last_devices_ == devices) ||
                      normalized_devices(ours.devices) == normalized_devices(devices));
    if (unchanged) {
      generation_ = ours.generation;
      last_resource_version_ = ours.resource_version;
      last_devices_ = devices;
    } else {
      bool dropped = false;
      if (!write_slice(devices, &ours, &dropped)) return false;
      if (dropped) {
        // This API server does not keep device taints (DRADeviceTaints off):
        // a fenced GPU would look allocatable. Leave fenced GPUs out instead,
        // for the rest of this run, and rewrite the slice at once.
        taints_dropped_ = true;
        last_tainted_.clear();
        log_->error("ResourceSlice {}: the API server dropped the device taints (feature gate DRADeviceTaints off: "
                    "alpha, off by default, in Kubernetes 1.33 to 1.35): fenced GPUs are left out of the slice "
                    "instead, until the plugin restarts",
                    slice_name_);
        options.taint_fenced = false;
        left_out.clear();
        devices = build_resource_slice(node_name_, node, 0, options, &left_out)["spec"]["devices"];
        for (const auto& reason : left_out) log_->warn("ResourceSlice {}: left out {}", slice_name_, reason);
        last_left_out_ = left_out;
        if (!write_slice(devices, &ours, &dropped)) return false;
      }
    }
    delete_stale();
    return ok;
  } catch (const std::exception& e) {
    log_->error("ResourceSlice {}: internal error: {}", slice_name_, e.what());
    return false;
  }
}

bool SlicePublisher::remove() {
  std::lock_guard lock(mutex_);
  try {
    std::vector<json> slices;
    bool ok = list_node_slices(&slices);
    std::set<std::string> names;
    for (const json& slice : slices) names.insert(metadata_string(slice, "name"));
    // Ours by name even when the list failed: uninstall should do what it can.
    names.insert(slice_name_);
    for (const auto& name : names) {
      if (name.empty()) continue;
      HttpResult result = api_.del(slice_path(name));
      if (result.ok()) {
        log_->info("ResourceSlice {}: deleted", escape_terminal(name));
      } else if (result.status != 404) {
        ok = false;
      }
    }
    last_devices_ = json();
    last_resource_version_.clear();
    return ok;
  } catch (const std::exception& e) {
    log_->error("ResourceSlice {}: internal error: {}", slice_name_, e.what());
    return false;
  }
}

}  // namespace fracgpu::kube
