// The run dir as the node side opens it (docs/architecture.md, "Who may write
// what"): every file and directory in it is reached by name from an open
// directory (shm/safe_file.h), never through a link, never a FIFO or device,
// and must belong to the daemon's user.
//
//   <run_dir>/                 the daemon's, 0755: refused if its group or others may write it
//     .tmp/                    0700: where the daemon makes files before renaming them into place
//     tenants/<name>/          0755, the daemon's; mounted read-only into the tenant's containers
//     gpus/<uuid>/, fences/    the daemon's
//     fracgpud.pid, placement.json, health.json
//
// The daemon checks the run dir at start; the CLI and the metrics child take
// its owner to be the daemon's user (the daemon runs on no other run dir).
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>

namespace fracgpu::controller {

// The run dir's names (docs/architecture.md, "Who may write what").
inline constexpr const char* kPidFileName = "fracgpud.pid";
inline constexpr const char* kTenantsDirName = "tenants";
// <tenant dir>/gputime-<entry>: the hard link to the arbiter of the GPU in
// that entry of the tenant's policy.
inline constexpr const char* kGpuTimeLinkPrefix = "gputime-";
// What fracgpud last found, written after every health probe and audit
// (whole or not at all: write_run_file) for `fracgpu status` and anything
// else that wants it. Schema: docs/configuration.md.
inline constexpr const char* kHealthFileName = "health.json";
inline constexpr const char* kPrivateDirName = ".tmp";
// The most the node side reads of a JSON file of the run dir.
inline constexpr size_t kMaxRunFileBytes = 16u << 20;

// A file descriptor, closed when dropped. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = other.release();
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// The daemon's run dir: created (0755) if missing; refused if another user
// owns it or its group or others may write it. tenants/ and the private .tmp/
// are created and opened in it the same way (.tmp/ mode 0700, tenants/ 0755,
// a mode found different is set); `notes` gets a line for each mode set.
struct DaemonRunDir {
  std::string path;
  UniqueFd root;
  UniqueFd tenants;
  UniqueFd private_dir;
};
std::optional<DaemonRunDir> open_daemon_run_dir(const std::string& path, std::string* error, std::string* notes);

// `mkdir -p path`: the parts it makes get `mode`, the parts there stay as
// they are. false with *error if a part cannot be made or the path is not a
// directory in the end.
bool make_path(const std::string& path, mode_t mode, std::string* error);

// For readers (the CLI, the metrics child): the run dir opened as given, and
// its owner, whom every file and directory in it must belong to.
struct RunDirView {
  UniqueFd root;
  uid_t owner = 0;
};
std::optional<RunDirView> open_run_dir_view(const std::string& path, std::string* error);

// Opens (creating it 0755 if missing) the subdirectory `name` of an open
// directory, the daemon's own; refused otherwise (*error names it and why).
UniqueFd make_daemon_dir(int parent, const std::string& shown_parent, const char* name, std::string* error);

// The content of the regular file `name` in `dirfd`, owned by `owner`, at
// most `max_bytes` long. nullopt with *error (and *missing if there is
// nothing by that name) otherwise.
std::optional<std::string> read_file_at(int dirfd, const std::string& shown_dir, const char* name, uid_t owner,
                                        size_t max_bytes, std::string* error, bool* missing = nullptr);

// How write_run_file leaves the file. kAtomic: readers see the old file or
// the new one, never half of one, and a process killed at any point leaves
// one of them; a crash of the machine may lose the change. kDurable: also
// fsync()ed before it is renamed, and its directory after, so that once the
// call returns the new content survives a crash of the machine too (for
// state that a restart must not forget; the cost is paid by each write).
enum class RunFileWrite { kAtomic, kDurable };

// Replaces <run_dir>/<subdir>/<name> (subdir empty: in the run dir itself)
// with `text`, whole or not at all: written to a new file in the private
// .tmp/ with its space reserved first, then renamed over the old one. Any
// failure (a full file system, say) keeps the old file and says why.
bool write_run_file(const std::string& run_dir, std::string_view subdir, const std::string& name,
                    std::string_view text, std::string* error, RunFileWrite how = RunFileWrite::kAtomic);

// Removes the tenant directory `name` in `tenants_dir` (shown as
// `shown_parent`) and what it holds: the daemon's own files and links, never
// followed. Refused (*error says why, nothing more removed) if the directory
// is not the daemon's, or holds a directory.
bool remove_tenant_dir(int tenants_dir, const std::string& shown_parent, const std::string& name, std::string* error);

// Publishes a hard link to `src_name` in `src_dir` as `dst_name` in
// `dst_dir`, replacing whatever has that name (a link planted there is
// replaced, never followed): linked first under a random name in the private
// directory `private_dir`, then renamed into place.
bool link_replacing(int src_dir, const char* src_name, int dst_dir, const char* dst_name, int private_dir,
                    std::string* error);

}  // namespace fracgpu::controller
