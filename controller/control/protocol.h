// fracgpud's control API: the names and limits both ends agree on.
// The whole contract (requests, replies, semantics) is in
// docs/configuration.md, "The control API"; this header is its vocabulary,
// shared by the daemon's server, its client (client.h) and every program
// that speaks it (the CLI, the kubelet plugin).
//
// Transport: a SOCK_STREAM Unix socket <run_dir>/control.sock. The client
// writes one JSON object and '\n'; the daemon answers one JSON object and
// '\n'. A connection may carry several requests in sequence.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace fracgpu::control {

// <run_dir>/kSocketName.
inline constexpr const char* kSocketName = "control.sock";

// Framing. A request is at most kMaxRequestBytes including its newline; a
// client that sends more without a newline is dropped, and so is one that
// has not sent a whole request kRequestTimeout after it connected or after
// its last reply (however many bytes it trickled meanwhile).
inline constexpr size_t kMaxRequestBytes = 64u << 10;
inline constexpr std::chrono::milliseconds kRequestTimeout{5000};
// The most a client reads of one reply (a list of every tenant on a node is
// far below it; a peer sending more is not the daemon).
inline constexpr size_t kMaxReplyBytes = 16u << 20;

// Requests: {"op": OP, ...}.
namespace op {
inline constexpr const char* kCreate = "create";  // {"tenant": SPEC}
inline constexpr const char* kResize = "resize";  // {"tenant": SPEC}
inline constexpr const char* kDelete = "delete";  // {"name": NAME}
inline constexpr const char* kGet = "get";        // {"name": NAME}
inline constexpr const char* kList = "list";      // {}
inline constexpr const char* kNode = "node";      // {}
}  // namespace op

// Failure codes: {"ok": false, "code": CODE, "field": ..., "error": ...}.
namespace code {
inline constexpr const char* kInvalid = "invalid";         // bad request or spec; field + reason
inline constexpr const char* kExists = "exists";           // create: same name, different spec
inline constexpr const char* kConflict = "conflict";       // a config tenant's name, or the tenant is draining
inline constexpr const char* kNoCapacity = "no_capacity";  // not enough unallocated share or memory
inline constexpr const char* kNotFound = "not_found";      // get/resize of an absent tenant
inline constexpr const char* kUnavailable = "unavailable"; // create on a GPU fenced by the health probe
inline constexpr const char* kDenied = "denied";           // peer not allowed on the socket
// Every connection its user may have is taken: sent as the connection is
// closed, before any request of it was read, so asking again is safe
// (call() does, until its timeout). "retry_after_ms" says when: a user
// that connects again sooner is refused again at once.
inline constexpr const char* kBusy = "busy";
inline constexpr const char* kInternal = "internal";       // anything else (the daemon logs it)
// Never sent by the daemon: the client's own verdict when it could not
// connect, send, or read a whole well-formed reply in time.
inline constexpr const char* kUnreachable = "unreachable";
}  // namespace code

// delete's "state".
namespace delete_state {
inline constexpr const char* kDeleted = "deleted";
inline constexpr const char* kDraining = "draining";
inline constexpr const char* kAbsent = "absent";
}  // namespace delete_state

// A tenant's "source" and "state" in STATE.
inline constexpr const char* kSourceApi = "api";
inline constexpr const char* kSourceConfig = "config";
inline constexpr const char* kStateActive = "active";
inline constexpr const char* kStateDraining = "draining";
// Kept (api-tenants.json) but not placed: its GPU is gone from the config, it
// no longer fits, or a [[tenant]] took its name. "unplaced_reason" says which;
// a resize that fits, or a delete, repairs it.
inline constexpr const char* kStateUnplaced = "unplaced";

// SPEC limits.
inline constexpr size_t kMinSpecGpus = 1;
inline constexpr size_t kMaxSpecGpus = 16;
inline constexpr size_t kMaxAnnotations = 16;
inline constexpr size_t kMaxAnnotationKeyBytes = 63;
inline constexpr size_t kMaxAnnotationValueBytes = 256;
// A share is kept to this precision (the book adds shares; 1e-6 keeps the
// sum of 16 of them exact enough to compare with 1).
inline constexpr double kSharePrecision = 1e-6;
// A default memory quota (share x the GPU's memory) is rounded down to this.
inline constexpr uint64_t kDefaultMemoryAlignment = 2u << 20;

}  // namespace fracgpu::control
