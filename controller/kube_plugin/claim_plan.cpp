#include "kube_plugin/claim_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>

#include <fmt/format.h>

#include "common/text_escape.h"
#include "config/config.h"
#include "kube/quantity.h"
#include "kube/resource_slice.h"

namespace fracgpu::kube_plugin {

using nlohmann::json;

namespace {

constexpr double kMicro = 1e6;

double round_micro(double v) { return std::round(v * kMicro) / kMicro; }

// The string member `key` of `j`, or "" when absent or not a string.
std::string str(const json& j, const char* key) {
  if (!j.is_object()) return {};
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// The part of a request name before "/" (a subrequest's parent).
std::string parent_request(const std::string& request) { return request.substr(0, request.find('/')); }

bool config_applies(const json& config, const std::string& request) {
  auto it = config.find("requests");
  if (it == config.end() || it->is_null()) return true;
  // Not a list of strings: json::type_error, the claim's error (plan_claim).
  const auto requests = it->get<std::vector<std::string>>();
  if (requests.empty()) return true;
  for (const std::string& r : requests)
    if (r == request || r == parent_request(request)) return true;
  return false;
}

// What the GpuConfigs applying to one request say, each field from the
// winning config that names it.
struct RequestConfig {
  std::string limit;     // the limit's text; "" when no config names one
  std::string priority;  // "latency", "normal" or "batch"; "" when no config names one
  int priority_rank = -1;  // the rank of the config it came from, to choose among a claim's requests
};

// The GpuConfigs of `request`'s results. false with *error on a malformed one.
bool request_config(const json& configs, const std::string& request, const std::string& who, RequestConfig* out,
                    std::string* error) {
  *out = RequestConfig();
  int limit_rank = -1;
  if (!configs.is_array()) return true;
  for (size_t i = 0; i < configs.size(); ++i) {
    const json& config = configs[i];
    const json* opaque = config.is_object() && config.contains("opaque") ? &config["opaque"] : nullptr;
    if (!opaque || str(*opaque, "driver") != kube::kDriverName || !config_applies(config, request)) continue;
    const std::string field = fmt::format("status.allocation.devices.config[{}].opaque.parameters", i);
    const json params = opaque->value("parameters", json());
    if (!params.is_object()) {
      *error = fmt::format("{}: {} is not an object", who, field);
      return false;
    }
    if (str(params, "apiVersion") != kConfigApiVersion || str(params, "kind") != kConfigKind) {
      *error = fmt::format("{}: {} is apiVersion \"{}\" kind \"{}\"; this driver reads apiVersion {} kind {}", who,
                           field, str(params, "apiVersion"), str(params, "kind"), kConfigApiVersion, kConfigKind);
      return false;
    }
    for (const auto& [key, value] : params.items()) {
      if (key != "apiVersion" && key != "kind" && key != "limit" && key != "priority") {
        *error = fmt::format("{}: {}.{} is not a GpuConfig field (fields: limit, priority)", who, field, key);
        return false;
      }
    }
    if (params.contains("limit") && !params["limit"].is_string()) {
      *error = fmt::format("{}: {}.limit must be a string (\"share\" or a fraction such as \"0.75\")", who, field);
      return false;
    }
    // Checked wherever it applies, winning or not: a misspelt priority is
    // a mistake to hear of, not one to lose to another config.
    if (params.contains("priority") && !(params["priority"].is_string() &&
                                         controller::parse_priority(params["priority"].get<std::string>()))) {
      *error = fmt::format("{}: {}.priority {} must be \"latency\", \"normal\" or \"batch\"", who, field,
                           controller::escape_terminal(params["priority"].dump()));
      return false;
    }
    // FromClaim beats FromClass; within a source the later wins.
    const int rank = (str(config, "source") == "FromClaim" ? 1 << 20 : 0) + static_cast<int>(i);
    if (rank > limit_rank && params.contains("limit")) {
      limit_rank = rank;
      out->limit = params["limit"].get<std::string>();
    }
    if (rank > out->priority_rank && params.contains("priority")) {
      out->priority_rank = rank;
      out->priority = params["priority"].get<std::string>();
    }
  }
  return true;
}

// The node's GPUs by device name.
std::map<std::string, const json*> gpus_by_device(const json& node) {
  std::map<std::string, const json*> out;
  if (!node.is_object() || !node.contains("gpus") || !node["gpus"].is_array()) return out;
  for (const json& gpu : node["gpus"])
    if (gpu.is_object() && gpu.contains("index") && gpu["index"].is_number_integer() && gpu.contains("uuid"))
      out[kube::device_name(gpu["index"].get<int64_t>())] = &gpu;
  return out;
}

}  // namespace

namespace {
std::optional<ClaimPlan> plan_claim_checked(const ClaimRef& ref, const json& claim, const std::string& node_name,
                                            const json& node, std::string* error);
}  // namespace

bool valid_claim_uid(const std::string& uid) {
  if (uid.empty() || uid.size() > 58) return false;
  for (char c : uid)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  return uid.front() != '-';
}

std::string tenant_name(const std::string& uid) { return kTenantPrefix + uid; }

std::optional<ClaimPlan> plan_claim(const ClaimRef& ref, const json& claim, const std::string& node_name,
                                    const json& node, std::string* error) {
  // The API server's object is input: a member of an unexpected type is an
  // error of this claim, never an exception out of the plugin.
  try {
    return plan_claim_checked(ref, claim, node_name, node, error);
  } catch (const json::exception& e) {
    *error = fmt::format("claim {}: malformed ResourceClaim ({})", ref.shown(), e.what());
    return std::nullopt;
  }
}

namespace {

std::optional<ClaimPlan> plan_claim_checked(const ClaimRef& ref, const json& claim, const std::string& node_name,
                                            const json& node, std::string* error) {
  const std::string who = "claim " + ref.shown();
  if (!claim.is_object() || !claim.contains("metadata") || !claim["metadata"].is_object()) {
    *error = who + ": the API server's answer is not a ResourceClaim";
    return std::nullopt;
  }
  const std::string uid = str(claim["metadata"], "uid");
  if (uid != ref.uid) {
    *error = fmt::format("{}: the API server has uid {}, the kubelet asked for {} (the claim was replaced)", who, uid,
                         ref.uid);
    return std::nullopt;
  }
  const json allocation = claim.value("status", json::object()).value("allocation", json());
  if (!allocation.is_object()) {
    *error = who + ": status.allocation is absent (the claim is not allocated)";
    return std::nullopt;
  }
  const json devices = allocation.value("devices", json::object());
  const json results = devices.is_object() ? devices.value("results", json::array()) : json::array();
  const json configs = devices.is_object() ? devices.value("config", json::array()) : json::array();
  const auto node_gpus = gpus_by_device(node);

  ClaimPlan plan;
  plan.claim = ref;
  std::map<int64_t, PlannedGpu> gpus;
  std::map<int64_t, std::string> limits;  // index -> the limit text of its (last) result
  int priority_rank = -1;                  // of the config plan.priority is from
  for (size_t i = 0; i < (results.is_array() ? results.size() : 0); ++i) {
    const json& result = results[i];
    if (str(result, "driver") != kube::kDriverName) continue;
    const std::string field = fmt::format("status.allocation.devices.results[{}]", i);
    if (str(result, "pool") != node_name) {
      *error =
          fmt::format("{}: {} is in pool \"{}\", not this node's ({})", who, field, str(result, "pool"), node_name);
      return std::nullopt;
    }
    // Admin access (monitoring a device others use) books no capacity in
    // the scheduler, and fracgpu has no tenant that holds none: a tenant made
    // from it would take a whole GPU's quota and share, and a process outside
    // any tenant is what the bypass audit stops. Refused, saying so.
    if (const auto admin = result.find("adminAccess"); admin != result.end() && admin->is_boolean() && admin->get<bool>()) {
      *error = fmt::format("{}: {} asks for admin access to {}, which fracgpu does not support (no tenant can hold a GPU "
                           "without booking part of it)",
                           who, field, str(result, "device"));
      return std::nullopt;
    }
    const std::string device = str(result, "device");
    auto found = node_gpus.find(device);
    if (found == node_gpus.end()) {
      *error = fmt::format("{}: {}.device \"{}\" is not a GPU of this node", who, field, device);
      return std::nullopt;
    }
    const json& gpu = *found->second;
    const int64_t index = gpu["index"].get<int64_t>();
    const std::string uuid = str(gpu, "uuid");
    const uint64_t gpu_memory = gpu.value("memory", uint64_t{0});

    uint64_t memory = gpu_memory;
    double share = 1.0;
    const json consumed = result.value("consumedCapacity", json::object());
    if (!consumed.is_object()) {
      *error = fmt::format("{}: {}.consumedCapacity is not an object", who, field);
      return std::nullopt;
    }
    for (const auto& [name, value] : consumed.items()) {
      if (name != "memory" && name != "share") continue;
      std::string why;
      auto q = value.is_string() ? kube::Quantity::parse(value.get<std::string>(), &why) : std::nullopt;
      if (!q) {
        *error = fmt::format("{}: {}.consumedCapacity.{} {} is not a quantity{}", who, field, name, value.dump(),
                             why.empty() ? "" : " (" + why + ")");
        return std::nullopt;
      }
      if (name == "memory") {
        if (q->value() <= 0 || static_cast<uint64_t>(q->value()) > gpu_memory) {
          *error =
              fmt::format("{}: {}: memory {} is not within the GPU's {} bytes", who, uuid, q->decimal(), gpu_memory);
          return std::nullopt;
        }
        memory = static_cast<uint64_t>(q->value());
      } else {
        // Down, not up: the scheduler booked billionths, fracgpud books
        // millionths, and three claims of 0.333333333 rounded up would book
        // more than the whole GPU, and the last be refused.
        const int64_t micro = q->micro_value_floor();
        if (micro <= 0 || micro > 1'000'000) {
          *error = fmt::format("{}: {}: share {} is not from a millionth (the finest share fracgpud books) to 1", who,
                               uuid, q->decimal());
          return std::nullopt;
        }
        share = static_cast<double>(micro) / kMicro;
      }
    }
    const std::string request = str(result, "request");
    RequestConfig config;
    if (!request_config(configs, request, who, &config, error)) return std::nullopt;
    const std::string& limit = config.limit;
    // One tenant per claim, so one priority: of the configs that name one
    // for any of its requests, the winning one (the same rank as a limit's).
    if (config.priority_rank > priority_rank) {
      priority_rank = config.priority_rank;
      plan.priority = config.priority;
    }

    auto [at, fresh] = gpus.try_emplace(index, PlannedGpu{uuid, index, 0, 0, std::nullopt});
    at->second.memory = std::min(gpu_memory, at->second.memory + memory);
    at->second.share = std::min(1.0, round_micro(at->second.share + share));
    if (!limit.empty()) limits[index] = limit;
    (void)fresh;
    plan.devices.push_back({request, str(result, "pool"), device, uuid, str(result, "shareID")});
  }
  if (plan.devices.empty()) {
    *error = fmt::format("{}: no device of driver {} is allocated to it on node {}", who, kube::kDriverName, node_name);
    return std::nullopt;
  }
  if (gpus.size() > 16) {
    *error = fmt::format("{}: {} GPUs; a tenant spans at most 16", who, gpus.size());
    return std::nullopt;
  }
  for (auto& [index, gpu] : gpus) {
    auto limit = limits.find(index);
    if (gpu.share < 1.0 && limit != limits.end() && limit->second != "share") {
      const std::string& text = limit->second;
      char* end = nullptr;
      // A plain decimal fraction only: strtod also takes hex floats
      // ("0x1p-1"), exponents, signs, "inf" and leading blanks.
      const bool decimal = !text.empty() && text.find_first_not_of("0123456789.") == std::string::npos &&
                           std::count(text.begin(), text.end(), '.') <= 1 && text != ".";
      const double value = decimal ? std::strtod(text.c_str(), &end) : -1;
      if (!decimal || *end != '\0' || !std::isfinite(value) || value < gpu.share - 1e-9 || value > 1.0) {
        *error = fmt::format("{}: {}: limit \"{}\" must be \"share\" or a fraction from the share ({}) to 1", who,
                             gpu.uuid, text, gpu.share);
        return std::nullopt;
      }
      gpu.limit = std::max(gpu.share, round_micro(value));
    }
    plan.gpus.push_back(gpu);
  }
  return plan;
}

}  // namespace

std::string kubelet_request_name(const std::string& request) { return parent_request(request); }

json tenant_spec(const ClaimPlan& plan) {
  json gpus = json::array();
  for (const PlannedGpu& gpu : plan.gpus) {
    json g = {{"uuid", gpu.uuid}, {"share", gpu.share}, {"memory", gpu.memory}};
    if (gpu.limit) g["limit"] = *gpu.limit;
    gpus.push_back(std::move(g));
  }
  json spec = {{"name", tenant_name(plan.claim.uid)},
               {"gpus", std::move(gpus)},
               {"annotations",
                {{"claim-namespace", plan.claim.ns}, {"claim-name", plan.claim.name}, {"claim-uid", plan.claim.uid}}}};
  // Normal is the daemon's default: left out, the spec is what it was before
  // priorities existed, for a claim prepared then and again after an upgrade.
  if (plan.priority != "normal") spec["priority"] = plan.priority;
  return spec;
}

json plan_to_json(const ClaimPlan& plan) {
  json gpus = json::array();
  for (const PlannedGpu& gpu : plan.gpus) {
    json g = {{"uuid", gpu.uuid}, {"index", gpu.index}, {"memory", gpu.memory}, {"share", gpu.share}};
    if (gpu.limit) g["limit"] = *gpu.limit;
    gpus.push_back(std::move(g));
  }
  json devices = json::array();
  for (const PreparedDevice& d : plan.devices)
    devices.push_back(
        {{"request", d.request}, {"pool", d.pool}, {"device", d.device}, {"uuid", d.uuid}, {"share_id", d.share_id}});
  return {{"namespace", plan.claim.ns},
          {"name", plan.claim.name},
          {"uid", plan.claim.uid},
          {"gpus", std::move(gpus)},
          {"devices", std::move(devices)},
          {"priority", plan.priority}};
}

std::optional<ClaimPlan> plan_from_json(const json& j, std::string* error) {
  try {
    ClaimPlan plan;
    plan.claim = {j.at("namespace").get<std::string>(), j.at("name").get<std::string>(),
                  j.at("uid").get<std::string>()};
    for (const json& g : j.at("gpus")) {
      PlannedGpu gpu{g.at("uuid").get<std::string>(), g.at("index").get<int64_t>(), g.at("memory").get<uint64_t>(),
                     g.at("share").get<double>(), std::nullopt};
      if (g.contains("limit")) gpu.limit = g["limit"].get<double>();
      plan.gpus.push_back(std::move(gpu));
    }
    for (const json& d : j.at("devices"))
      plan.devices.push_back({d.at("request").get<std::string>(), d.at("pool").get<std::string>(),
                              d.at("device").get<std::string>(), d.at("uuid").get<std::string>(),
                              d.value("share_id", std::string())});
    // A record from before priorities has none: its tenant is normal.
    plan.priority = j.value("priority", std::string("normal"));
    if (!valid_claim_uid(plan.claim.uid) || plan.gpus.empty() || plan.devices.empty() ||
        !controller::parse_priority(plan.priority)) {
      *error = "uid, gpus, devices or priority missing or malformed";
      return std::nullopt;
    }
    return plan;
  } catch (const json::exception& e) {
    *error = e.what();
    return std::nullopt;
  }
}

}  // namespace fracgpu::kube_plugin
