// fracgpu: the operator's view of a node. `fracgpu status` reads every tenant
// ledger read-only; it never changes anything. Exit codes are in status.h.
#include <cstdio>
#include <exception>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "status.h"

namespace {

using namespace fracgpu::controller;

int status_command(const std::string& run_dir, bool json) {
  std::string error;
  const auto report = collect_status(run_dir, &error);
  if (!report) {
    fmt::print(stderr, "fracgpu: {}\n", error);
    return kStatusNoRunDir;
  }
  if (json)
    fmt::print("{}\n", status_to_json(*report).dump(2));
  else
    fmt::print("{}", status_to_text(*report));
  return report->all_ledgers_read() ? kStatusOk : kStatusBadLedger;
}

int run(int argc, char** argv) {
  CLI::App app{"fracgpu: inspect fractional GPU sharing on this node"};
  app.require_subcommand(1);
  CLI::App* status =
      app.add_subcommand("status", "Quotas, usage, GPU-time shares and processes of every tenant, per GPU");
  bool json = false;
  std::string run_dir = default_run_dir();
  status->add_flag("--json", json, "Print JSON (schema in docs/configuration.md)");
  status->add_option("--run-dir", run_dir, "fracgpud's run directory (default: $FRACGPU_RUN_DIR or /run/fracgpu)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kStatusUsage;
  }
  return status_command(run_dir, json);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "fracgpu: internal error: {}\n", e.what());
    return kStatusInternal;
  }
}
