#include "cli/tenant_command.h"

#include <cmath>
#include <cstdlib>
#include <optional>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/text_escape.h"
#include "common/units.h"
#include "control/client.h"
#include "control/protocol.h"
#include "state/status.h"

namespace fracgpu::controller {
namespace {

using nlohmann::json;
namespace proto = fracgpu::control;

std::optional<double> parse_number(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

// "GPU-...[:share=0.5][:memory=20GiB][:limit=1.0]" -> one entry of SPEC's
// gpus. The share defaults to the whole GPU. Values are the daemon's to
// judge; only their syntax is checked here.
std::optional<json> parse_gpu_option(const std::string& option, std::string* error) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t colon; (colon = option.find(':', start)) != std::string::npos; start = colon + 1)
    parts.push_back(option.substr(start, colon - start));
  parts.push_back(option.substr(start));
  json gpu = {{"uuid", parts[0]}, {"share", 1.0}};
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    const size_t eq = part.find('=');
    const std::string key = part.substr(0, eq);
    const std::string value = eq == std::string::npos ? std::string() : part.substr(eq + 1);
    if (eq == std::string::npos || (key != "share" && key != "memory" && key != "limit")) {
      *error = fmt::format("--gpu {}: \"{}\" is not share=..., memory=... or limit=...", escape_terminal(option),
                           escape_terminal(part));
      return std::nullopt;
    }
    if (key == "memory") {
      std::string why;
      const std::optional<uint64_t> bytes = parse_size(value, &why);
      if (!bytes) {
        *error = fmt::format("--gpu {}: memory \"{}\" {}", escape_terminal(option), escape_terminal(value), why);
        return std::nullopt;
      }
      gpu["memory"] = *bytes;
      continue;
    }
    const std::optional<double> number = parse_number(value);
    if (!number) {
      *error = fmt::format("--gpu {}: {} \"{}\" is not a number", escape_terminal(option), key, escape_terminal(value));
      return std::nullopt;
    }
    gpu[key] = *number;
  }
  return gpu;
}

std::string fraction_text(const json& value) {
  if (!value.is_number()) return "-";
  return format_gpus(static_cast<uint64_t>(std::llround(value.get<double>() * kPpmPerGpu)));
}

std::string text_of(const json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// One row per GPU of each tenant; the tenant's columns on its first row.
std::string tenants_table(const json& tenants) {
  std::vector<std::vector<std::string>> rows{
      {"TENANT", "SOURCE", "STATE", "PRIORITY", "PROCS", "GPU", "INDEX", "SHARE", "LIMIT", "MEMORY", "ANNOTATIONS"}};
  for (const json& t : tenants) {
    if (!t.is_object()) continue;
    std::string notes;
    if (const auto a = t.find("annotations"); a != t.end() && a->is_object())
      for (const auto& [k, v] : a->items())
        notes += fmt::format("{}{}={}", notes.empty() ? "" : " ", k, v.is_string() ? v.get<std::string>() : v.dump());
    // A daemon from before priorities sends none: its tenants are all normal.
    const std::string priority = text_of(t, "priority");
    const std::vector<std::string> tenant_cells{text_of(t, "name"), text_of(t, "source"), text_of(t, "state"),
                                                priority.empty() ? "normal" : priority,
                                                t.contains("processes") ? t["processes"].dump() : "-"};
    const json gpus = t.value("gpus", json::array());
    for (size_t i = 0; i < std::max<size_t>(gpus.size(), 1); ++i) {
      std::vector<std::string> row = i == 0 ? tenant_cells : std::vector<std::string>(tenant_cells.size(), "");
      if (i < gpus.size() && gpus[i].is_object()) {
        const json& g = gpus[i];
        const json memory = g.value("memory", json());
        row.insert(row.end(), {text_of(g, "uuid"), g.contains("index") ? g["index"].dump() : "-",
                               fraction_text(g.value("share", json())), fraction_text(g.value("limit", json())),
                               memory.is_number_unsigned() ? format_size(memory.get<uint64_t>()) : "unlimited"});
      } else {
        row.insert(row.end(), {"-", "-", "-", "-", "-"});
      }
      row.push_back(i == 0 ? (notes.empty() ? "-" : notes) : "");
      rows.push_back(std::move(row));
    }
  }
  return rows.size() == 1 ? "no tenant\n" : render_table(rows);
}

int exit_code_of(const control::Reply& reply) {
  if (reply.ok) return kTenantOk;
  if (reply.code == proto::code::kUnreachable || reply.code == proto::code::kBusy) return kTenantUnreachable;
  if (reply.code == proto::code::kDenied) return kTenantDenied;
  if (reply.code == proto::code::kNotFound) return kTenantNotFound;
  if (reply.code == proto::code::kInternal) return kStatusInternal;
  return kTenantRefused;
}

void print_failure(const control::Reply& reply) {
  std::string hint;
  // The daemon names request fields; the command line calls them options.
  if (reply.field.rfind("gpus[", 0) == 0) {
    const size_t index = std::strtoul(reply.field.c_str() + 5, nullptr, 10);
    hint = fmt::format(" (gpus[{}] is --gpu number {})", index, index + 1);
  }
  if (reply.code == proto::code::kUnreachable)
    fmt::print(stderr, "fracgpu: cannot reach fracgpud: {} (is it running? see --run-dir)\n",
               escape_terminal(reply.error));
  else
    fmt::print(stderr, "fracgpu: {}{} [{}]\n", escape_terminal(reply.error), hint, escape_terminal(reply.code));
}

}  // namespace

CLI::App* add_tenant_commands(CLI::App& app, TenantOptions& options) {
  CLI::App* tenant = app.add_subcommand("tenant", "Tenants made at run time through fracgpud's control API");
  tenant->require_subcommand(1);
  const auto common = [&](CLI::App* sub) {
    sub->add_flag("--json", options.json, "Print the daemon's reply as JSON (docs/configuration.md)");
    sub->add_option("--run-dir", options.run_dir, "fracgpud's run directory (default: $FRACGPU_RUN_DIR or /run/fracgpu)");
    sub->add_option("--timeout", options.timeout_s, "Seconds to wait for the daemon (default 10)");
  };
  for (const char* verb : {"create", "resize"}) {
    CLI::App* sub = tenant->add_subcommand(
        verb, std::string(verb) == "create" ? "Create a tenant (nothing changes if it exists with the same spec)"
                                            : "Replace a tenant's whole spec with the one given (GPUs, shares, "
                                              "quotas, annotations, priority, --no-count-managed: what is left out "
                                              "takes its default)");
    sub->add_option("name", options.name, "Tenant name")->required();
    sub->add_option("--gpu", options.gpus,
                    "UUID[:share=0.5][:memory=20GiB][:limit=1.0], once per GPU (share defaults to the whole GPU, "
                    "memory to share x the GPU's memory, limit to the share)")
        ->required();
    sub->add_option("--annotation", options.annotations, "key=value, shown by get, list and status (repeatable)");
    sub->add_flag("--no-count-managed", options.no_count_managed, "Do not charge managed memory to the quota");
    sub->add_option("--priority", options.priority,
                    "latency, normal (the default) or batch: how urgently its work goes on its GPUs "
                    "(docs/sm-time.md#latency-tenants)")
        ->check(CLI::IsMember({"latency", "normal", "batch"}));
    common(sub);
  }
  CLI::App* del = tenant->add_subcommand("delete", "Delete a tenant (draining while its processes run)");
  del->add_option("name", options.name, "Tenant name")->required();
  common(del);
  CLI::App* get = tenant->add_subcommand("get", "One tenant");
  get->add_option("name", options.name, "Tenant name")->required();
  common(get);
  common(tenant->add_subcommand("list", "Every tenant, from the config and the control API"));
  return tenant;
}

int run_tenant_command(CLI::App& tenant, const TenantOptions& options) {
  const CLI::App* sub = tenant.get_subcommands().front();
  const std::string verb = sub->get_name();
  json request = {{"op", verb}};
  if (verb == "create" || verb == "resize") {
    json gpus = json::array();
    for (const std::string& option : options.gpus) {
      std::string error;
      std::optional<json> gpu = parse_gpu_option(option, &error);
      if (!gpu) {
        fmt::print(stderr, "fracgpu: {}\n", error);
        return kStatusUsage;
      }
      gpus.push_back(std::move(*gpu));
    }
    json annotations = json::object();
    for (const std::string& a : options.annotations) {
      const size_t eq = a.find('=');
      if (eq == std::string::npos || eq == 0) {
        fmt::print(stderr, "fracgpu: --annotation {}: write key=value\n", escape_terminal(a));
        return kStatusUsage;
      }
      annotations[a.substr(0, eq)] = a.substr(eq + 1);
    }
    request["tenant"] = {{"name", options.name},
                         {"gpus", std::move(gpus)},
                         {"count_managed", !options.no_count_managed},
                         {"annotations", std::move(annotations)}};
    // Only when asked for: a daemon from before priorities refuses the key.
    if (!options.priority.empty()) request["tenant"]["priority"] = options.priority;
  } else if (verb == "delete" || verb == "get") {
    request["name"] = options.name;
  }
  if (!(options.timeout_s > 0) || options.timeout_s > 3600) {
    fmt::print(stderr, "fracgpu: --timeout must be above 0 and at most 3600 seconds\n");
    return kStatusUsage;
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000));
  const control::Reply reply = control::call(control::socket_path_in(options.run_dir), request, timeout);
  if (options.json && reply.code != proto::code::kUnreachable) {
    // The daemon's text, not a tenant's: annotations are printable ASCII.
    fmt::print("{}\n", reply.body.dump(2, ' ', true, json::error_handler_t::replace));  // ASCII: no terminal controls
    return exit_code_of(reply);
  }
  if (!reply.ok) {
    print_failure(reply);
    return exit_code_of(reply);
  }
  const json& body = reply.body;
  const std::string name = escape_terminal(options.name);
  if (verb == "create" || verb == "resize") {
    const bool created = body.value("created", true);
    fmt::print("tenant \"{}\" {}\n", name,
               verb == "resize" ? "resized" : created ? "created" : "already exists with this spec: unchanged");
    fmt::print("{}", tenants_table(json::array({body.value("tenant", json::object())})));
  } else if (verb == "delete") {
    const std::string state = text_of(body, "state");
    if (state == proto::delete_state::kDeleted)
      fmt::print("tenant \"{}\" deleted\n", name);
    else if (state == proto::delete_state::kDraining)
      fmt::print("tenant \"{}\" is draining: its processes keep running within their quotas, new ones are refused; "
                 "fracgpud removes it when the last one exits\n",
                 name);
    else
      fmt::print("no tenant \"{}\": nothing to delete\n", name);
  } else if (verb == "get") {
    fmt::print("{}", tenants_table(json::array({body.value("tenant", json::object())})));
  } else {
    fmt::print("{}", tenants_table(body.value("tenants", json::array())));
  }
  return kTenantOk;
}

}  // namespace fracgpu::controller
