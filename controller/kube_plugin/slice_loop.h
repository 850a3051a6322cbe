// Keeps the node's ResourceSlice current: asks fracgpud for NODE every
// poll period (a local socket: cheap) and publishes (kube::SlicePublisher)
// when the daemon's NODE generation moved, when the plugin prepared or
// unprepared something, after a failed publish, and every --slice-interval
// in any case (a slice deleted by someone else comes back; the node's Node
// is read again then, so that a Node deleted and created again, with a new
// uid, owns the slice: see kube::SlicePublisher). A fenced GPU
// is tainted in the slice on the next poll (or leaves it, where the API
// server drops taints), and is clean again when the fence clears. The same
// NODE reply feeds the kubelet's health stream (DeviceHealthBoard): fenced
// GPUs Unhealthy, the others Healthy, all Unknown while the daemon does not answer.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <spdlog/logger.h>

#include "kube/resource_slice.h"
#include "kube_plugin/device_health.h"

namespace fracgpu::kube_plugin {

struct SliceLoopOptions {
  std::string run_dir;
  std::chrono::milliseconds interval{30'000};
  std::chrono::milliseconds poll{1'000};
  std::chrono::milliseconds control_timeout{10'000};
};

class SliceLoop {
 public:
  // `changes` is read each poll: a new value means republish. `health`
  // (optional) is updated from every poll.
  SliceLoop(kube::SlicePublisher& publisher, SliceLoopOptions options, std::function<uint64_t()> changes,
            std::shared_ptr<spdlog::logger> log, DeviceHealthBoard* health = nullptr);
  ~SliceLoop();
  void start();
  void stop();

 private:
  void run();

  kube::SlicePublisher& publisher_;
  SliceLoopOptions options_;
  std::function<uint64_t()> changes_;
  std::shared_ptr<spdlog::logger> log_;
  DeviceHealthBoard* health_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fracgpu::kube_plugin
