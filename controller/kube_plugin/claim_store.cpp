#include "kube_plugin/claim_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kube_plugin/atomic_file.h"
#include "kube_plugin/cdi_spec.h"
#include "state/run_dir.h"

namespace fracgpu::kube_plugin {

using nlohmann::json;

namespace {
constexpr int kRecordVersion = 1;
constexpr size_t kMaxRecordBytes = 64u << 10;
constexpr const char* kSuffix = ".json";
}  // namespace

ClaimStore::ClaimStore(const std::string& run_dir) : dir_(run_dir + "/kube/claims") {}

bool ClaimStore::put(const ClaimPlan& plan, std::string* error) {
  if (!valid_claim_uid(plan.claim.uid)) {
    *error = fmt::format("claim {}: uid \"{}\" cannot name a record", plan.claim.shown(), plan.claim.uid);
    return false;
  }
  if (!controller::make_path(dir_, 0700, error)) return false;
  const json record = {{"version", kRecordVersion},
                       {"plan", plan_to_json(plan)},
                       {"tenant", tenant_name(plan.claim.uid)},
                       {"cdi_spec", cdi_spec_file_name(plan.claim.uid)}};
  return write_file_atomic(dir_, plan.claim.uid + kSuffix, record.dump(2) + "\n", error);
}

std::optional<ClaimRecord> ClaimStore::get(const std::string& uid, std::string* error) const {
  error->clear();
  if (!valid_claim_uid(uid)) {
    *error = fmt::format("uid \"{}\" cannot name a record", uid);
    return std::nullopt;
  }
  const controller::UniqueFd dir(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir.valid()) {
    if (errno != ENOENT) *error = fmt::format("{}: cannot open: {}", dir_, std::strerror(errno));
    return std::nullopt;  // no directory: no record
  }
  // Our own regular file (no link followed), of a bounded size.
  bool missing = false;
  const std::string name = uid + kSuffix;
  auto text = controller::read_file_at(dir.get(), dir_, name.c_str(), geteuid(), kMaxRecordBytes, error, &missing);
  if (!text) {
    if (missing) error->clear();
    return std::nullopt;
  }
  const std::string path = dir_ + "/" + uid + kSuffix;
  const json record = json::parse(*text, nullptr, false);
  if (!record.is_object() || record.value("version", 0) != kRecordVersion || !record.contains("plan")) {
    *error = path + ": not a claim record of version 1";
    return std::nullopt;
  }
  std::string why;
  auto plan = plan_from_json(record["plan"], &why);
  if (!plan) {
    *error = path + ": " + why;
    return std::nullopt;
  }
  ClaimRecord out{std::move(*plan), record.value("tenant", ""), record.value("cdi_spec", "")};
  if (out.plan.claim.uid != uid || out.tenant != tenant_name(uid) || out.cdi_spec != cdi_spec_file_name(uid)) {
    *error = path + ": names another claim, tenant or spec than " + uid + "'s";
    return std::nullopt;
  }
  return out;
}

bool ClaimStore::remove(const std::string& uid, std::string* error) {
  if (!valid_claim_uid(uid)) {
    *error = fmt::format("uid \"{}\" cannot name a record", uid);
    return false;
  }
  return remove_file_durable(dir_, uid + kSuffix, error);
}

std::vector<std::string> ClaimStore::list() const {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir_.c_str());
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    const size_t n = std::char_traits<char>::length(kSuffix);
    if (name.size() > n && name.compare(name.size() - n, n, kSuffix) == 0) {
      name.resize(name.size() - n);
      if (valid_claim_uid(name)) out.push_back(name);
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace fracgpu::kube_plugin
