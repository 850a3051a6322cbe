// The client side of fracgpud's control API (protocol.h): one request, one
// reply. Links nlohmann_json only, so any program (the CLI, the kubelet
// plugin) can speak to the daemon without linking the daemon.
#pragma once

#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

namespace fracgpu::control {

struct Reply {
  bool ok = false;
  std::string code;   // empty when ok; a protocol.h code otherwise
  std::string field;  // the field at fault, when one is ("gpus[0].share")
  std::string error;  // the reason, starting with the field when there is one
  nlohmann::json body;  // the whole reply object (empty object on transport failure)
};

// <run_dir>/control.sock.
std::string socket_path_in(const std::string& run_dir);

// Connects to `socket_path`, sends `request` (a JSON object) and waits for
// the reply, all within `timeout`. Never throws. A daemon with no
// connection free for this user answers `busy` before reading the request,
// with "retry_after_ms": then it is asked again after that long (and at
// least 10 ms, 20 ms, ... up to 200 ms, growing with each refusal), until
// `timeout`; a busy reply whose retry-after ends past `timeout` is returned
// at once. Only the last answer is returned. A failure to connect, send
// or read a whole JSON object in time (or a reply that is not one) gives
// ok=false with code "unreachable" and the reason in `error`.
Reply call(const std::string& socket_path, const nlohmann::json& request, std::chrono::milliseconds timeout);

}  // namespace fracgpu::control
