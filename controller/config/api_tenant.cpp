#include "config/api_tenant.h"

#include <algorithm>
#include <initializer_list>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/text_escape.h"
#include "config/tenant_rules.h"
#include "control/protocol.h"

namespace fracgpu::controller {
namespace {

using nlohmann::json;
namespace proto = fracgpu::control;

bool fail(SpecError* error, std::string field, std::string reason, const char* code = proto::code::kInvalid) {
  error->code = code;
  error->message = field.empty() ? std::move(reason) : fmt::format("{}: {}", field, reason);
  error->field = std::move(field);
  return false;
}

// A value as the client sent it, for messages: JSON text, at most 64
// bytes of it, control characters and non-ASCII escaped.
std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', true, json::error_handler_t::replace);
  if (text.size() > 64) text = text.substr(0, 61) + "...";
  return escape_terminal(text);
}

std::string_view json_type(const json& value) {
  if (value.is_string()) return "a string";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number()) return "a number";
  if (value.is_array()) return "an array";
  if (value.is_object()) return "an object";
  return "null";
}

bool wrong_type(SpecError* error, const std::string& field, const json& value, std::string_view expected) {
  return fail(error, field, fmt::format("must be {}, not {}", expected, json_type(value)));
}

// Unknown keys are refused, as in the config: a misspelt "memmory" must
// not silently become the default quota.
bool known_keys(const json& object, std::initializer_list<std::string_view> allowed, const std::string& prefix,
                SpecError* error) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
    std::string list;
    for (std::string_view k : allowed) list += fmt::format("{}{}", list.empty() ? "" : ", ", k);
    return fail(error, prefix + escape_terminal(key), fmt::format("unknown key (known keys: {})", list));
  }
  return true;
}

bool printable_ascii(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

std::optional<double> number(const json& value) {
  if (!value.is_number()) return std::nullopt;
  return value.get<double>();
}

bool parse_gpu(const json& entry, size_t i, ApiGrant* out, bool* memory_given, SpecError* error) {
  const std::string at = fmt::format("gpus[{}]", i);
  if (!entry.is_object()) return wrong_type(error, at, entry, "an object");
  if (!known_keys(entry, {"uuid", "share", "memory", "limit"}, at + ".", error)) return false;

  const auto uuid = entry.find("uuid");
  if (uuid == entry.end()) return fail(error, at + ".uuid", "missing (the GPU's UUID, \"GPU-...\")");
  if (!uuid->is_string()) return wrong_type(error, at + ".uuid", *uuid, "a GPU UUID string");
  const auto parsed = parse_gpu_uuid(uuid->get<std::string>());
  if (!parsed)
    return fail(error, at + ".uuid",
                fmt::format("{} is not a GPU UUID (\"GPU-\" and 8-4-4-4-12 hex digits)", shown(*uuid)));
  out->uuid = *parsed;

  const auto share = entry.find("share");
  if (share == entry.end()) return fail(error, at + ".share", "missing (the fraction of the GPU's time, (0, 1])");
  const std::optional<double> share_value = number(*share);
  if (!share_value) return wrong_type(error, at + ".share", *share, "a fraction of one GPU such as 0.5");
  if (const auto problem = fraction_problem(*share_value))
    return fail(error, at + ".share", fmt::format("{} {}", shown(*share), *problem));
  out->share_ppm = fraction_ppm(*share_value);

  out->limit_ppm = out->share_ppm;  // a hard cap unless asked otherwise
  if (const auto limit = entry.find("limit"); limit != entry.end()) {
    const std::optional<double> limit_value = number(*limit);
    if (!limit_value) return wrong_type(error, at + ".limit", *limit, "a fraction of one GPU such as 1.0");
    if (const auto problem = fraction_problem(*limit_value))
      return fail(error, at + ".limit", fmt::format("{} {}", shown(*limit), *problem));
    const uint32_t limit_ppm = fraction_ppm(*limit_value);
    // The whole GPU is never capped (as a whole GPU of a [[tenant]]): its limit is ignored.
    if (out->share_ppm < kPpmPerGpu)
      if (const auto problem = limit_problem(limit_ppm, out->share_ppm, format_gpu_uuid(out->uuid)))
        return fail(error, at + ".limit", fmt::format("{} {}", shown(*limit), *problem));
    out->limit_ppm = limit_ppm;
  }
  if (out->share_ppm == kPpmPerGpu) out->limit_ppm = kPpmPerGpu;

  *memory_given = false;
  out->memory = 0;
  if (const auto memory = entry.find("memory"); memory != entry.end()) {
    if (!memory->is_number_unsigned() || memory->get<uint64_t>() == 0)
      return fail(error, at + ".memory",
                  fmt::format("{} must be a number of bytes greater than zero (an integer)", shown(*memory)));
    out->memory = memory->get<uint64_t>();
    *memory_given = true;
  }
  return true;
}

bool parse_annotations(const json& annotations, Annotations* out, SpecError* error) {
  if (!annotations.is_object()) return wrong_type(error, "annotations", annotations, "an object of strings");
  if (annotations.size() > proto::kMaxAnnotations)
    return fail(error, "annotations",
                fmt::format("{} entries, above the {} allowed", annotations.size(), proto::kMaxAnnotations));
  for (const auto& [key, value] : annotations.items()) {
    if (key.empty() || key.size() > proto::kMaxAnnotationKeyBytes || !printable_ascii(key))
      return fail(error, "annotations",
                  fmt::format("key \"{}\" must be 1 to {} printable ASCII characters", escape_terminal(key),
                              proto::kMaxAnnotationKeyBytes));
    const std::string field = "annotations." + key;
    if (!value.is_string()) return wrong_type(error, field, value, "a string");
    const std::string& text = value.get_ref<const std::string&>();
    if (text.size() > proto::kMaxAnnotationValueBytes || !printable_ascii(text))
      return fail(error, field,
                  fmt::format("the value must be at most {} printable ASCII characters", proto::kMaxAnnotationValueBytes));
    out->emplace(key, text);
  }
  return true;
}

std::string share_text(uint32_t ppm) { return format_gpus(ppm); }

}  // namespace

std::optional<ApiTenant> parse_api_spec(const json& spec, SpecError* error) {
  if (!spec.is_object()) {
    wrong_type(error, "tenant", spec, "an object (the tenant's spec)");
    return std::nullopt;
  }
  if (!known_keys(spec, {"name", "gpus", "count_managed", "annotations", "priority"}, "", error)) return std::nullopt;
  ApiTenant tenant;
  const auto name = spec.find("name");
  if (name == spec.end()) {
    fail(error, "name", "missing (the tenant's name)");
    return std::nullopt;
  }
  if (!name->is_string()) {
    wrong_type(error, "name", *name, "a string");
    return std::nullopt;
  }
  if (!valid_tenant_name(name->get<std::string>())) {
    fail(error, "name", fmt::format("{} {}", shown(*name), kTenantNameRule));
    return std::nullopt;
  }
  tenant.name = name->get<std::string>();

  const auto gpus = spec.find("gpus");
  if (gpus == spec.end()) {
    fail(error, "gpus", "missing (1 to 16 GPUs, each {\"uuid\": ..., \"share\": ...})");
    return std::nullopt;
  }
  if (!gpus->is_array()) {
    wrong_type(error, "gpus", *gpus, "an array");
    return std::nullopt;
  }
  if (gpus->size() < proto::kMinSpecGpus || gpus->size() > proto::kMaxSpecGpus) {
    fail(error, "gpus", fmt::format("{} GPUs: a tenant holds 1 to {}", gpus->size(), proto::kMaxSpecGpus));
    return std::nullopt;
  }
  for (size_t i = 0; i < gpus->size(); ++i) {
    ApiGrant grant;
    bool memory_given = false;
    if (!parse_gpu((*gpus)[i], i, &grant, &memory_given, error)) return std::nullopt;
    for (size_t j = 0; j < tenant.gpus.size(); ++j) {
      if (tenant.gpus[j].uuid != grant.uuid) continue;
      fail(error, fmt::format("gpus[{}].uuid", i),
           fmt::format("{} is named twice (also gpus[{}]): one entry per GPU", format_gpu_uuid(grant.uuid), j));
      return std::nullopt;
    }
    tenant.gpus.push_back(grant);
  }

  if (const auto managed = spec.find("count_managed"); managed != spec.end()) {
    if (!managed->is_boolean()) {
      wrong_type(error, "count_managed", *managed, "true or false");
      return std::nullopt;
    }
    tenant.count_managed = managed->get<bool>();
  }
  if (const auto annotations = spec.find("annotations"); annotations != spec.end())
    if (!parse_annotations(*annotations, &tenant.annotations, error)) return std::nullopt;
  // Absent: normal, so a file written before priorities existed reads as it meant.
  if (const auto priority = spec.find("priority"); priority != spec.end()) {
    const auto parsed = priority->is_string() ? parse_priority(priority->get<std::string>()) : std::nullopt;
    if (!parsed) {
      fail(error, "priority", fmt::format("{} is not a priority (use {})", shown(*priority), kPriorityList));
      return std::nullopt;
    }
    tenant.priority = *parsed;
  }
  return tenant;
}

bool resolve_api_tenant(ApiTenant* tenant, const NodeConfig& config, SpecError* error) {
  for (size_t i = 0; i < tenant->gpus.size(); ++i) {
    ApiGrant& grant = tenant->gpus[i];
    const ManagedGpu* gpu = config.find_gpu(grant.uuid);
    if (gpu == nullptr) {
      std::string managed;
      for (const ManagedGpu& g : config.gpus) managed += fmt::format("{}{}", managed.empty() ? "" : ", ", g.uuid);
      return fail(error, fmt::format("gpus[{}].uuid", i),
                  fmt::format("{} is not a GPU this fracgpud manages (managed: {})", format_gpu_uuid(grant.uuid),
                              managed.empty() ? "none" : managed));
    }
    const bool defaulted = grant.memory == 0;
    if (defaulted) grant.memory = fraction_quota(grant.share_ppm, gpu->memory_bytes);
    if (const auto problem = memory_quota_problem(grant.memory, *gpu))
      return fail(error, fmt::format("gpus[{}].memory", i),
                  defaulted ? fmt::format("{} (the default: share x the GPU's memory)", *problem) : *problem);
  }
  return true;
}

Tenant tenant_of(const ApiTenant& api, const NodeConfig& config) {
  Tenant tenant;
  tenant.name = api.name;
  tenant.count_managed = api.count_managed;
  tenant.placement = PlacementReason::kApi;
  tenant.source = TenantSource::kApi;
  tenant.draining = api.draining;
  tenant.annotations = api.annotations;
  tenant.priority = api.priority;
  for (const ApiGrant& grant : api.gpus) {
    for (size_t g = 0; g < config.gpus.size(); ++g) {
      if (config.gpus[g].uuid_bytes != grant.uuid) continue;
      tenant.grants.push_back({g, grant.share_ppm, grant.limit_ppm, grant.memory});
      tenant.gpus_ppm += grant.share_ppm;
    }
  }
  return tenant;
}

std::string spec_difference(const ApiTenant& asked, const ApiTenant& existing) {
  std::vector<std::string> differences;
  const auto find = [](const ApiTenant& t, const GpuUuid& uuid) -> const ApiGrant* {
    for (const ApiGrant& g : t.gpus)
      if (g.uuid == uuid) return &g;
    return nullptr;
  };
  for (const ApiGrant& a : asked.gpus) {
    const std::string uuid = format_gpu_uuid(a.uuid);
    const ApiGrant* e = find(existing, a.uuid);
    if (e == nullptr) {
      differences.push_back(fmt::format("{} asked, not held", uuid));
      continue;
    }
    std::vector<std::string> values;
    if (a.share_ppm != e->share_ppm)
      values.push_back(fmt::format("share {} asked ({} held)", share_text(a.share_ppm), share_text(e->share_ppm)));
    if (a.limit_ppm != e->limit_ppm)
      values.push_back(fmt::format("limit {} asked ({} held)", share_text(a.limit_ppm), share_text(e->limit_ppm)));
    if (a.memory != e->memory)
      values.push_back(fmt::format("memory {} asked ({} held)", format_size(a.memory), format_size(e->memory)));
    if (!values.empty()) differences.push_back(fmt::format("{}: {}", uuid, fmt::join(values, ", ")));
  }
  for (const ApiGrant& e : existing.gpus)
    if (find(asked, e.uuid) == nullptr) differences.push_back(fmt::format("{} held, not asked", format_gpu_uuid(e.uuid)));
  if (asked.count_managed != existing.count_managed)
    differences.push_back(fmt::format("count_managed {} asked, {} held", asked.count_managed, existing.count_managed));
  if (asked.annotations != existing.annotations) differences.push_back("annotations differ");
  if (asked.priority != existing.priority)
    differences.push_back(fmt::format("priority {} asked, {} held", priority_name(asked.priority),
                                      priority_name(existing.priority)));
  std::string text;
  for (const std::string& d : differences) text += fmt::format("{}{}", text.empty() ? "" : "; ", d);
  return text;
}

json spec_json(const ApiTenant& tenant) {
  json gpus = json::array();
  for (const ApiGrant& g : tenant.gpus)
    gpus.push_back({{"uuid", format_gpu_uuid(g.uuid)},
                    {"share", static_cast<double>(g.share_ppm) / kPpmPerGpu},
                    {"memory", g.memory},
                    {"limit", static_cast<double>(g.limit_ppm) / kPpmPerGpu}});
  json annotations = json::object();
  for (const auto& [k, v] : tenant.annotations) annotations[k] = v;
  return {{"name", tenant.name},
          {"gpus", std::move(gpus)},
          {"count_managed", tenant.count_managed},
          {"annotations", std::move(annotations)},
          {"priority", priority_name(tenant.priority)}};
}

uint32_t GpuBook::free_ppm() const {
  const uint64_t held = uint64_t{config_ppm} + api_ppm;
  return held >= kPpmPerGpu ? 0 : static_cast<uint32_t>(kPpmPerGpu - held);
}

uint64_t GpuBook::free_memory(uint64_t gpu_memory) const {
  // Saturating: an unlimited quota books UINT64_MAX.
  uint64_t held = config_memory;
  for (const uint64_t more : {api_memory, shrunk_memory}) held = more > UINT64_MAX - held ? UINT64_MAX : held + more;
  return held >= gpu_memory ? 0 : gpu_memory - held;
}

std::vector<GpuBook> book_of(const NodeConfig& config, std::string_view except) {
  std::vector<GpuBook> book(config.gpus.size());
  for (const Tenant& tenant : config.tenants) {
    if (tenant.name == except) continue;
    const bool api = tenant.source == TenantSource::kApi;
    for (const Grant& grant : tenant.grants) {
      GpuBook& b = book[grant.gpu];
      (api ? b.api_ppm : b.config_ppm) += grant.share_ppm;
      b.tenants += 1;
      uint64_t& memory = api ? b.api_memory : b.config_memory;
      // An unlimited quota holds the whole GPU.
      memory = grant.memory_quota > UINT64_MAX - memory ? UINT64_MAX : memory + grant.memory_quota;
    }
  }
  return book;
}

std::optional<std::string> capacity_problem(const ApiTenant& tenant, const NodeConfig& config,
                                            const std::vector<GpuBook>& book) {
  for (const ApiGrant& grant : tenant.gpus) {
    for (size_t g = 0; g < config.gpus.size(); ++g) {
      const ManagedGpu& gpu = config.gpus[g];
      if (gpu.uuid_bytes != grant.uuid) continue;
      const GpuBook& b = book[g];
      if (b.tenants >= kMaxTenantsPerGpu)
        return fmt::format("{}: it has {} tenants already, the most one GPU's time is shared among", gpu.uuid,
                           b.tenants);
      if (grant.share_ppm > b.free_ppm())
        return fmt::format("{}: share {} asked, {} free (config tenants {}, API tenants {})", gpu.uuid,
                           share_text(grant.share_ppm), share_text(b.free_ppm()), share_text(b.config_ppm),
                           share_text(b.api_ppm));
      if (!config.daemon.allow_overcommit && grant.memory > b.free_memory(gpu.memory_bytes))
        return fmt::format("{}: memory {} asked, {} free of its {} (config tenants {}, API tenants {}{})", gpu.uuid,
                           format_size(grant.memory), format_size(b.free_memory(gpu.memory_bytes)),
                           format_size(gpu.memory_bytes), format_size(b.config_memory), format_size(b.api_memory),
                           b.shrunk_memory == 0 ? std::string()
                                                : ", still held past shrunk quotas " + format_size(b.shrunk_memory));
    }
  }
  return std::nullopt;
}

std::string api_tenants_file_text(const ApiTenants& tenants) {
  json list = json::array();
  for (const auto& [name, tenant] : tenants) {
    json entry = spec_json(tenant);
    entry["state"] = tenant.draining ? proto::kStateDraining : proto::kStateActive;
    list.push_back(std::move(entry));
  }
  return json{{"version", 1}, {"tenants", std::move(list)}}.dump(2) + "\n";
}

std::optional<ApiTenants> parse_api_tenants_file(std::string_view text, std::string* error) {
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("version") || !doc.contains("tenants") || !doc["tenants"].is_array()) {
    *error = "not a file of API tenants ({\"version\": 1, \"tenants\": [...]})";
    return std::nullopt;
  }
  if (doc["version"] != 1) {
    *error = fmt::format("version {} is not one this fracgpud reads (1)", shown(doc["version"]));
    return std::nullopt;
  }
  ApiTenants tenants;
  const json& list = doc["tenants"];
  for (size_t i = 0; i < list.size(); ++i) {
    json spec = list[i];
    std::string state = proto::kStateActive;
    if (spec.is_object() && spec.contains("state")) {
      state = spec["state"].is_string() ? spec["state"].get<std::string>() : std::string();
      spec.erase("state");
    }
    SpecError why;
    std::optional<ApiTenant> tenant = parse_api_spec(spec, &why);
    if (!tenant) {
      *error = fmt::format("tenants[{}]: {}", i, why.message);
      return std::nullopt;
    }
    if (state != proto::kStateActive && state != proto::kStateDraining) {
      *error = fmt::format("tenants[{}] (\"{}\"): state must be \"active\" or \"draining\"", i, tenant->name);
      return std::nullopt;
    }
    tenant->draining = state == proto::kStateDraining;
    for (size_t g = 0; g < tenant->gpus.size(); ++g) {
      if (tenant->gpus[g].memory != 0) continue;
      *error = fmt::format("tenants[{}] (\"{}\"): gpus[{}].memory is missing", i, tenant->name, g);
      return std::nullopt;
    }
    const std::string name = tenant->name;
    if (!tenants.emplace(name, std::move(*tenant)).second) {
      *error = fmt::format("tenants[{}]: tenant \"{}\" is listed twice", i, name);
      return std::nullopt;
    }
  }
  return tenants;
}

}  // namespace fracgpu::controller
