// fracgpu-kubelet-plugin: the DRA driver gpu.fracgpu.io on one node
// (docs/kubernetes.md). Publishes the node's ResourceSlice, registers with
// the kubelet and serves NodePrepareResources / NodeUnprepareResources and
// the devices' health stream (NodeWatchResources),
// until SIGTERM or SIGINT. With --uninstall: deletes the node's slices and exits.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "kube/api_client.h"
#include "kube/resource_slice.h"
#include "kube_plugin/claim_status.h"
#include "kube_plugin/driver.h"
#include "kube_plugin/grpc_servers.h"
#include "kube_plugin/slice_loop.h"

using namespace fracgpu;

int main(int argc, char** argv) {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);  // threads started below inherit it
  signal(SIGPIPE, SIG_IGN);

  kube_plugin::DriverOptions driver_options;
  std::string plugin_dir = "/var/lib/kubelet/plugins/gpu.fracgpu.io";
  std::string registry_dir = "/var/lib/kubelet/plugins_registry";
  std::string kubeconfig;
  std::string log_level = "info";
  double slice_interval_s = 30;
  bool share_valid_range = false;
  bool uninstall = false;

  CLI::App app{"fracgpu-kubelet-plugin: the DRA kubelet plugin of the driver gpu.fracgpu.io"};
  app.add_option("--node-name", driver_options.node_name, "this node's name (the slice's pool)")->required();
  app.add_option("--run-dir", driver_options.run_dir, "fracgpud's run dir (control.sock; claim records in kube/)")
      ->capture_default_str();
  app.add_option("--plugin-dir", plugin_dir, "where the DRA socket dra.sock is made")->capture_default_str();
  app.add_option("--registry-dir", registry_dir, "the kubelet's plugin registry (gpu.fracgpu.io-reg.sock)")
      ->capture_default_str();
  app.add_option("--cdi-dir", driver_options.cdi_dir, "where CDI specs are written")->capture_default_str();
  app.add_option("--library-host-path", driver_options.cdi.library_host_path, "libfracgpu.so on the host")
      ->capture_default_str();
  app.add_option("--library-container-path", driver_options.cdi.library_container_path,
                 "where containers get it (their LD_PRELOAD)")
      ->capture_default_str();
  app.add_option("--device-nodes", driver_options.cdi.device_nodes,
                 "nvidia-cdi: NVIDIA's CDI spec brings the GPUs (nvidia.com/gpu=UUID); host: /dev/nvidia* in our spec")
      ->check(CLI::IsMember({kube_plugin::kDeviceNodesNvidiaCdi, kube_plugin::kDeviceNodesHost}))
      ->capture_default_str();
  app.add_option("--slice-interval", slice_interval_s, "seconds between publishes when nothing changed")
      ->check(CLI::Range(0.05, 86400.0))
      ->capture_default_str();
  app.add_flag("--share-valid-range", share_valid_range,
               "publish share with a requestPolicy (validRange 1m steps); only where DRAFractionalCapacityRange is on");
  app.add_option("--kubeconfig", kubeconfig, "a kubeconfig instead of the pod's service account");
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")->capture_default_str();
  app.add_flag("--uninstall", uninstall, "delete this node's ResourceSlices of gpu.fracgpu.io and exit");
  CLI11_PARSE(app, argc, argv);

  auto log = spdlog::stderr_color_mt("kubelet-plugin");
  log->set_level(spdlog::level::from_str(log_level));
  log->flush_on(spdlog::level::info);
  spdlog::set_default_logger(log);
  if (const char* crash = std::getenv(kube_plugin::kCrashEnv); crash && *crash) {
    driver_options.crash_point = crash;
    if (std::find(std::begin(kube_plugin::kCrashPoints), std::end(kube_plugin::kCrashPoints),
                  driver_options.crash_point) == std::end(kube_plugin::kCrashPoints)) {
      log->error("{}={}: not a crash point (after-record, after-tenant, after-cdi)", kube_plugin::kCrashEnv, crash);
      return 64;
    }
    log->warn("test hook: {}={}", kube_plugin::kCrashEnv, crash);
  }

  std::string error;
  auto api =
      kubeconfig.empty() ? kube::ApiClient::in_cluster(&error) : kube::ApiClient::from_kubeconfig(kubeconfig, &error);
  if (!api) {
    log->error("the API server: {}", error);
    return 1;
  }
  api->set_logger(log);
  if (const std::string warning = api->transport_warning(); !warning.empty()) log->warn("{}", warning);
  // The kubelet gives a prepare 45 s: an API call (with its retries) must end well within it.
  kube::RetryPolicy retries;
  retries.total_timeout = std::chrono::seconds(30);
  api->set_retry_policy(retries);
  kube::SliceOptions slice_options;
  slice_options.share_valid_range = share_valid_range;
  // A fenced GPU stays in the slice with a NoSchedule taint; the publisher
  // falls back to leaving it out where the API server drops taints.
  slice_options.taint_fenced = true;
  const auto interval = std::chrono::milliseconds(std::llround(slice_interval_s * 1000));
  // A deleted Node is asked for again at least as often as the slice is published.
  slice_options.node_retry_max = interval;
  kube::SlicePublisher publisher(*api, driver_options.node_name, log, slice_options);
  if (uninstall) {
    const bool ok = publisher.remove();
    log->info("uninstall: this node's slices {}", ok ? "deleted" : "NOT all deleted (see above)");
    return ok ? 0 : 1;
  }

  kube_plugin::DeviceHealthBoard health;
  kube_plugin::ClaimStatusReporter claim_status(api.get(), &health, log);
  kube_plugin::Driver driver(driver_options, api.get(), log, &claim_status);
  driver.report_recorded();
  claim_status.start();
  kube_plugin::PluginServers servers(driver, health, driver_options.node_name, plugin_dir, registry_dir, log);
  if (!servers.start(&error)) {
    log->error("{}", error);
    return 1;
  }
  kube_plugin::SliceLoop slices(
      publisher,
      {driver_options.run_dir, interval, std::min(interval, std::chrono::milliseconds(1000)),
       driver_options.control_timeout},
      // A prepare or unprepare that changed something, or the kubelet
      // registering the plugin (a kubelet starting deletes the node's slices).
      [&driver, &servers] { return driver.changes() + servers.registrations(); }, log, &health);
  slices.start();

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  log->info("signal {}: stopping (prepared claims stay, in their records)", signal_number);
  slices.stop();
  servers.stop();
  claim_status.stop();
  log->info("stopped");
  return 0;
}
