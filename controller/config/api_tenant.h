// Tenants of the control API (docs/configuration.md, "The control API"): a
// request's SPEC checked and resolved against the node config, one book of
// capacity for config and API tenants, and the file they persist in.
//
// A SPEC is checked with the rules of a [[tenant]] (tenant_rules.h); what a
// config expresses differently (a share per GPU rather than `gpus` split by
// placement, annotations) has its own checks here. Errors name the field
// ("gpus[0].share") and the reason.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"

namespace fracgpu::controller {

// A refused request: a control/protocol.h code, the field at fault (empty
// when none is alone at fault) and a message that starts with the field.
struct SpecError {
  std::string code;
  std::string field;
  std::string message;
};

// The SPEC's own rules, independent of the node: keys and types, the name,
// 1 to 16 GPUs (each once) with a share in (0, 1] and a limit in
// [share, 1] (1 when the share is), an optional memory quota in bytes,
// count_managed, annotations, priority ("latency", "normal" or "batch";
// absent: normal). A GPU whose memory is not given has
// ApiGrant::memory 0 until resolve_api_tenant() fills it.
std::optional<ApiTenant> parse_api_spec(const nlohmann::json& spec, SpecError* error);

// Against the config: every GPU one fracgpud manages (set to the config's
// spelling), memory defaulted to share x the GPU's memory (rounded down to
// 2 MiB), and every quota within its GPU and above a context
// (tenant_rules.h). Capacity is not checked here (capacity_problem).
bool resolve_api_tenant(ApiTenant* tenant, const NodeConfig& config, SpecError* error);

// The tenant as the daemon applies it. `tenant` must resolve against `config`.
Tenant tenant_of(const ApiTenant& tenant, const NodeConfig& config);

// What differs between two specs of the same name, for the "exists" error
// ("gpus[0].share 0.5 here, 0.25 there"); empty if they are the same.
std::string spec_difference(const ApiTenant& asked, const ApiTenant& existing);

// The SPEC of a tenant, every value explicit (as persisted and as a create
// of the same spec would send it).
nlohmann::json spec_json(const ApiTenant& tenant);

// ---- One book: what config and API tenants hold of each GPU ----

struct GpuBook {
  uint32_t config_ppm = 0;
  uint32_t api_ppm = 0;  // draining tenants included: they keep their capacity
  uint32_t tenants = 0;  // tenants with a grant on it, config and API (draining included)
  uint64_t config_memory = 0;
  uint64_t api_memory = 0;
  // Memory still held past a shrink, beyond the shrunk tenants' new quotas
  // (the daemon adds it: Daemon::capacity_book): booked until it is freed.
  uint64_t shrunk_memory = 0;

  uint32_t free_ppm() const;
  uint64_t free_memory(uint64_t gpu_memory) const;  // 0 when overcommitted
};

// Per GPU of config.gpus (same order), leaving out the tenant named `except`.
std::vector<GpuBook> book_of(const NodeConfig& config, std::string_view except = {});

// Why `tenant` (resolved) does not fit beside `book`: on each GPU the
// shares of all tenants stay at or below 1, and memory quotas within the
// GPU's memory unless allow_overcommit. ("GPU-...: share 0.5 asked, 0.25
// free (config tenants 0.5, API tenants 0.25)"); nullopt when it fits.
std::optional<std::string> capacity_problem(const ApiTenant& tenant, const NodeConfig& config,
                                            const std::vector<GpuBook>& book);

// ---- <run_dir>/api-tenants.json ----

inline constexpr const char* kApiTenantsFileName = "api-tenants.json";

// {"version": 1, "tenants": [SPEC + "state": "active"|"draining", ...]}, by name.
std::string api_tenants_file_text(const ApiTenants& tenants);
// Every entry checked as a request is (parse_api_spec), memory required;
// nullopt with *error naming the entry and the reason otherwise.
std::optional<ApiTenants> parse_api_tenants_file(std::string_view text, std::string* error);

}  // namespace fracgpu::controller
