// `fracgpu tenant create|resize|delete|list|get`: the control API from the
// command line (docs/operations.md, "Tenants on demand"). Each subcommand is
// one request to fracgpud over <run_dir>/control.sock; --json prints the
// daemon's reply as it came.
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace fracgpu::controller {

// `fracgpu tenant` exit codes, besides kStatusUsage (64) and
// kStatusInternal (70) of status.h.
inline constexpr int kTenantOk = 0;
inline constexpr int kTenantUnreachable = 1;  // fracgpud could not be reached (not running? --run-dir? busy?)
inline constexpr int kTenantRefused = 4;      // refused: invalid, exists, conflict, no_capacity, unavailable
inline constexpr int kTenantNotFound = 5;     // get or resize of a tenant that does not exist
inline constexpr int kTenantDenied = 6;       // this user may not use the control API

struct TenantOptions {
  std::string run_dir;
  std::string name;
  std::vector<std::string> gpus;         // --gpu UUID[:share=S][:memory=M][:limit=L]
  std::vector<std::string> annotations;  // --annotation key=value
  bool no_count_managed = false;
  std::string priority;  // --priority latency|normal|batch; empty: not sent (the daemon's default, normal)
  bool json = false;
  double timeout_s = 10;
};

// Adds `tenant` and its subcommands to `app`; the chosen one runs from
// run_tenant_command once parsed. `options` must outlive the parse.
CLI::App* add_tenant_commands(CLI::App& app, TenantOptions& options);
// Runs whichever subcommand of `tenant` was parsed. Returns an exit code.
int run_tenant_command(CLI::App& tenant, const TenantOptions& options);

}  // namespace fracgpu::controller
