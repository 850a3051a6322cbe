// fracgpud: the node daemon. Owns policy: reads the node config and writes
// each tenant's quotas into its ledger; reclaims what dead processes held.
// Exit codes are in daemon.h; the flags are documented in docs/configuration.md.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "daemon/daemon.h"

namespace {

using namespace fracgpu::controller;

int run(int argc, char** argv) {
  // Before anything else, so a SIGTERM during start-up is queued, not fatal.
  block_daemon_signals();

  CLI::App app{"fracgpud: the fracgpu node daemon"};
  DaemonOptions options;
  bool check = false;
  std::string level;
  app.add_option("-c,--config", options.config_path, "Node config (TOML)")->required();
  app.add_flag("--check", check, "Validate the config against this node's GPUs and exit (0: valid, 1: invalid)");
  app.add_option("--log-level", level, "trace, debug, info, warn or error (overrides [daemon] log_level)");
  app.set_version_flag("--version", "fracgpud " FRACGPU_VERSION);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }
  if (!level.empty()) {
    options.log_level = parse_log_level(level);
    if (!options.log_level) {
      fmt::print(stderr, "fracgpud: --log-level {}: not a log level (use {})\n", level, kLogLevelList);
      return kExitUsage;
    }
  }
  // [[gpu]] index = N must mean what `nvidia-smi -L` calls GPU N, whatever
  // environment the service manager gave us: CUDA's default order is
  // "fastest first" and CUDA_VISIBLE_DEVICES renumbers, both unlike nvidia-smi.
  setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1);
  unsetenv("CUDA_VISIBLE_DEVICES");
  if (check) return check_config(options);
  // Each tenant costs the daemon a few descriptors per GPU (its ledger, its
  // usage file, the scheduler's copy): the soft limit's usual 1024 runs out
  // at a few hundred tenants. Take what the hard limit allows (the systemd
  // unit sets LimitNOFILE; docs/operations.md).
  if (struct rlimit nofile {}; getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    const rlim_t soft = nofile.rlim_cur;
    nofile.rlim_cur = nofile.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &nofile) != 0)
      fmt::print(stderr, "fracgpud: cannot raise the descriptor limit from {} to {}: it stays {}\n", soft,
                 nofile.rlim_max, soft);
  }

  Daemon daemon(options, make_daemon_logger());
  if (const int rc = daemon.start(); rc != kExitOk) return rc;
  return daemon.run();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    // Ledgers hold only atomics written in place: stopping here leaves them valid.
    fmt::print(stderr, "fracgpud: internal error: {}\n", e.what());
    return kExitInternal;
  }
}
