// The plugin's claim records, <run-dir>/kube/claims/<uid>.json: what the
// plugin made on this node for each claim it prepared. A record is written
// before the tenant is created and removed after the tenant and the CDI spec
// are gone, so a plugin killed at any point finds, at the next prepare or
// unprepare of that claim, what it may have left behind, and neither leaks
// nor duplicates a tenant. Unprepare works from the record alone (not from
// memory, not from the API server).
//
// Record: {"version": 1, "plan": plan_to_json(...), "tenant": "dra-<uid>",
//          "cdi_spec": "gpu.fracgpu.io-claim_<uid>.json"}.
// Only the plugin writes this directory (root, not shared with tenants).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kube_plugin/claim_plan.h"

namespace fracgpu::kube_plugin {

struct ClaimRecord {
  ClaimPlan plan;
  std::string tenant;    // always tenant_name(plan.claim.uid)
  std::string cdi_spec;  // always cdi_spec_file_name(plan.claim.uid)
};

class ClaimStore {
 public:
  // Records under <run_dir>/kube/claims (made on first write).
  explicit ClaimStore(const std::string& run_dir);

  const std::string& dir() const { return dir_; }

  // Durable before it returns (atomic_file.h). false with *error.
  bool put(const ClaimPlan& plan, std::string* error);
  // The record of `uid`: nullopt and *error empty when there is none; nullopt
  // and *error set when the file is unreadable or malformed (or names
  // another uid or tenant: a record is believed only for its own claim).
  std::optional<ClaimRecord> get(const std::string& uid, std::string* error) const;
  bool remove(const std::string& uid, std::string* error);
  // The uids with a record, sorted.
  std::vector<std::string> list() const;

 private:
  std::string dir_;
};

}  // namespace fracgpu::kube_plugin
