// fracgpu: the operator's view of a node. `fracgpu status` reads every tenant
// ledger read-only; it never changes anything. `fracgpu status --watch` and
// `fracgpu top` show it live (live_view_command.h). `fracgpu gpu clear`
// removes a GPU's Xid fence (health.h), the one thing an operator must undo
// by hand.
// `fracgpu tenant` speaks to fracgpud's control API (tenant_command.h).
// Exit codes are in status.h and tenant_command.h.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include <dirent.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli/live_view_command.h"
#include "cli/tenant_command.h"
#include "daemon/health.h"
#include "state/run_dir.h"
#include "safe_file.h"
#include "state/status.h"
#include "common/text_escape.h"
#include "common/uuid.h"

namespace {

using namespace fracgpu::controller;
namespace shm = fracgpu::shm;

int status_command(const std::string& run_dir, bool json) {
  std::string error;
  const auto report = collect_status(run_dir, &error);
  if (!report) {
    fmt::print(stderr, "fracgpu: {}\n", error);
    return kStatusNoRunDir;
  }
  if (json)
    // A process's name need not be UTF-8: invalid bytes are replaced, never
    // a reason to fail. ASCII only: C0 and C1 controls (C1 ones are valid
    // UTF-8, and terminals act on them) and all else come out as \uXXXX.
    fmt::print("{}\n", status_to_json(*report).dump(2, ' ', true, nlohmann::ordered_json::error_handler_t::replace));
  else
    fmt::print("{}", status_to_text(*report));
  return report->all_ledgers_read() ? kStatusOk : kStatusBadLedger;
}

// The fenced GPU `which` names: a UUID ("GPU-..."), or a driver ordinal
// looked up in the fences themselves (each records its GPU's index).
int clear_command(const std::string& run_dir, const std::string& which) {
  const std::string dir = run_dir + "/" + kFencesDirName;
  std::string uuid;
  std::string listed;  // the fences there are, for the error message
  int matches = 0;     // fences recording the index `which` (ordinals move: there may be several)
  std::string error;
  // "No fence" is said only after a listing that was read: a run dir or
  // fences directory that cannot be read is that, not the all-clear.
  const std::optional<RunDirView> view = open_run_dir_view(run_dir, &error);
  if (!view) {
    fmt::print(stderr, "fracgpu: {}\n", error);
    return kStatusNoRunDir;
  }
  {
    char err[512] = {};
    const shm::Opened fences =
        shm::open_dir_at(view->root.get(), kFencesDirName, view->owner, false, run_dir.c_str(), err, sizeof err);
    if (!fences.ok() && fences.status != shm::FileStatus::kMissing) {
      fmt::print(stderr, "fracgpu: {}\n", err);
      return kStatusNoRunDir;
    }
    DIR* listing = fences.ok() ? fdopendir(fences.fd) : nullptr;
    if (fences.ok() && listing == nullptr) ::close(fences.fd);
    while (const struct dirent* entry = listing != nullptr ? readdir(listing) : nullptr) {
      const std::string name = entry->d_name;
      if (!parse_gpu_uuid(name)) continue;  // a temporary file, or something foreign
      std::string ignored;
      const std::optional<std::string> text =
          read_file_at(dirfd(listing), dir, name.c_str(), view->owner, kMaxRunFileBytes, &ignored);
      const nlohmann::json j = text ? nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false)
                                    : nlohmann::json();
      const std::string index = j.is_object() && j.contains("index") ? j["index"].dump() : "?";
      listed += fmt::format("{}{} (GPU {})", listed.empty() ? "" : ", ", name, index);
      if (which == index) {
        uuid = name;
        ++matches;
      }
    }
    if (listing != nullptr) closedir(listing);
  }
  if (matches > 1) {
    fmt::print(stderr, "fracgpu: several fences record GPU index {} (fenced: {}); clear one by its UUID\n",
               escape_terminal(which), listed);
    return kStatusUsage;
  }
  const bool digits = !which.empty() && which.find_first_not_of("0123456789") == std::string::npos;
  if (!digits) {
    const auto parsed = parse_gpu_uuid(which);
    if (!parsed) {
      fmt::print(stderr, "fracgpu: \"{}\" is neither a GPU index nor a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)\n",
                 which);
      return kStatusUsage;
    }
    uuid = format_gpu_uuid(*parsed);
  }
  const std::string path = uuid.empty() ? std::string() : xid_fence_path(run_dir, uuid);
  if (uuid.empty() || ::unlink(path.c_str()) != 0) {
    if (!uuid.empty() && errno != ENOENT) {
      fmt::print(stderr, "fracgpu: cannot remove {}: {}\n", path, std::strerror(errno));
      return kStatusNoRunDir;
    }
    fmt::print(stderr, "fracgpu: GPU {} has no Xid fence in {} (fenced: {})\n", escape_terminal(which), dir,
               listed.empty() ? "none" : listed);
    return kStatusNoFence;
  }
  fmt::print("cleared the Xid fence of {}: fracgpud accepts new processes there again after its next health probe, "
             "unless the GPU is unhealthy for another reason\n",
             uuid);
  return kStatusOk;
}

// The seconds of --watch or --interval, checked; nullopt after printing why not.
std::optional<double> interval_option(const char* name, const std::string& text) {
  std::string why;
  const std::optional<double> seconds = parse_interval_seconds(text, &why);
  if (!seconds) fmt::print(stderr, "fracgpu: {}: {}\n", name, why);
  return seconds;
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
  std::string watch;  // empty: --watch without SECONDS
  CLI::Option* watch_option =
      status->add_option("--watch", watch,
                         "Redraw the per-GPU table every SECONDS (default 1), with GPU-time shares over the last 1 s "
                         "and 10 s, until Ctrl-C")
          ->expected(0, 1)
          ->type_name("[SECONDS]");
  unsigned count = 0;
  const auto add_count = [&](CLI::App* command) {
    return command->add_option("--count", count, "Stop after this many frames (default: until Ctrl-C)")
        ->check(CLI::Range(1u, 1'000'000'000u));
  };
  CLI::Option* status_count = add_count(status);
  CLI::App* top = app.add_subcommand(
      "top", "Live view of every tenant's GPU time, memory and health, sorted, until Ctrl-C (as status --watch)");
  std::string interval = "1";
  std::string sort = "gpu";
  top->add_option("-d,--interval", interval, "Seconds between frames (default 1)");
  top->add_option("--sort", sort,
                  "gpu: by GPU time over the last second (default); memory: by memory used; name: by tenant")
      ->check(CLI::IsMember({"gpu", "memory", "name"}));
  add_count(top);
  top->add_option("--run-dir", run_dir, "fracgpud's run directory (default: $FRACGPU_RUN_DIR or /run/fracgpu)");
  CLI::App* gpu = app.add_subcommand("gpu", "GPU actions");
  gpu->require_subcommand(1);
  CLI::App* clear = gpu->add_subcommand(
      "clear", "Clear a GPU's Xid fence (after a critical Xid, once the GPU was dealt with)");
  std::string which;
  clear->add_option("gpu", which, "GPU index (driver ordinal) or UUID")->required();
  clear->add_option("--run-dir", run_dir, "fracgpud's run directory (default: $FRACGPU_RUN_DIR or /run/fracgpu)");
  TenantOptions tenant_options;
  tenant_options.run_dir = run_dir;
  CLI::App* tenant = add_tenant_commands(app, tenant_options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kStatusUsage;
  }
  if (clear->parsed()) return clear_command(run_dir, which);
  if (tenant->parsed()) return run_tenant_command(*tenant, tenant_options);
  if (top->parsed()) {
    const std::optional<double> seconds = interval_option("--interval", interval);
    if (!seconds) return kStatusUsage;
    return run_live_view({run_dir, "fracgpu top", *seconds, parse_live_order(sort).value(), count});
  }
  if (watch_option->count() > 0) {
    if (json) {
      fmt::print(stderr, "fracgpu: --watch draws a table: it cannot be combined with --json\n");
      return kStatusUsage;
    }
    // `--watch` alone means 1 s.
    const std::optional<double> seconds = interval_option("--watch", watch.empty() ? "1" : watch);
    if (!seconds) return kStatusUsage;
    return run_live_view({run_dir, "fracgpu status --watch", *seconds, LiveOrder::kGpu, count});
  }
  if (status_count->count() > 0) {
    fmt::print(stderr, "fracgpu: --count counts the frames of --watch: it needs --watch\n");
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
