#include "kube_plugin/slice_loop.h"

#include <ctime>

#include "control/client.h"
#include "control/protocol.h"

namespace fracgpu::kube_plugin {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

SliceLoop::SliceLoop(kube::SlicePublisher& publisher, SliceLoopOptions options, std::function<uint64_t()> changes,
                     std::shared_ptr<spdlog::logger> log, DeviceHealthBoard* health)
    : publisher_(publisher),
      options_(std::move(options)),
      changes_(std::move(changes)),
      log_(std::move(log)),
      health_(health) {}

SliceLoop::~SliceLoop() { stop(); }

void SliceLoop::start() {
  thread_ = std::thread([this] { run(); });
}

void SliceLoop::stop() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SliceLoop::run() {
  bool published = false;
  json last_generation;
  uint64_t last_changes = 0;
  Clock::time_point last_publish{};
  std::string last_error;
  std::unique_lock lock(mutex_);
  while (!stop_) {
    lock.unlock();
    const control::Reply reply = control::call(control::socket_path_in(options_.run_dir), {{"op", control::op::kNode}},
                                               options_.control_timeout);
    if (!reply.ok) {
      // Without the daemon the slice stays as it was: what it offers is
      // still booked in the daemon's api-tenants.json.
      if (reply.error != last_error) log_->warn("slices: fracgpud's node: [{}] {}", reply.code, reply.error);
      last_error = reply.error;
      // The slice may keep offering the GPUs, but whether they are healthy
      // nobody can say while the daemon is away.
      if (health_) health_->mark_unknown(std::time(nullptr));
    } else {
      last_error.clear();
      const json node = reply.body.value("node", json());
      if (health_) health_->update_from_node(node, std::time(nullptr));
      const uint64_t changes = changes_();
      const json generation = node.value("generation", json());
      // The periodic publish also reads the Node again (a Node created
      // again has a new uid, under which the slice must be owned).
      const bool periodic = Clock::now() - last_publish >= options_.interval;
      if (!published || generation != last_generation || changes != last_changes || periodic) {
        published = publisher_.publish(node, periodic);  // failures logged there
        last_generation = generation;
        last_changes = changes;
        last_publish = Clock::now();
      }
    }
    lock.lock();
    wake_.wait_for(lock, options_.poll, [this] { return stop_; });
  }
}

}  // namespace fracgpu::kube_plugin
