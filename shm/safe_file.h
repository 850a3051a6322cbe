// Opening and creating files in directories another party may have written.
//
// A tenant's directory is reachable from its containers, and whatever a
// tenant can write is attacker input to the root daemon, the CLI and the
// metrics child: a symbolic link planted under a name the daemon opens would
// make it write through the link into any host file; a FIFO would block an
// open for ever; a device would be read. So every file the node side opens
// in the run dir, and the interposer in its tenant directory, is opened here:
//
//  - from a directory descriptor, one name at a time, never by a path that
//    could be walked through a planted link (openat, never open);
//  - with O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, after an fstatat that refuses
//    anything but the expected kind of file without opening it, and an fstat
//    after the open that checks the same again on what was really opened:
//    a regular file (or directory), the expected owner, the exact size;
//  - new files are never made with O_CREAT | O_TRUNC on a name: they are
//    made nameless (O_TMPFILE), sized with fallocate so that no later write
//    through a mapping can fault for lack of space, filled, and only then
//    linked in (linkat fails if the name exists: nothing is ever replaced or
//    written through). Where the file system has no O_TMPFILE, the file is
//    made under an unpredictable name with O_CREAT | O_EXCL in a private
//    directory (set_private_dir), then linked in the same way.
//
// Like the ledger: no allocation, no exceptions, no logging; errors come back
// as a status and a one-line message naming the file and the reason, in a
// caller's buffer. The interposer uses this too.
#pragma once

#include <cstddef>
#include <cstdint>

#include <sys/types.h>

namespace fracgpu::shm {

// Owner checks: kAnyOwner skips the check.
inline constexpr uid_t kAnyOwner = static_cast<uid_t>(-1);

enum class FileStatus : int {
  kOk = 0,
  kMissing,       // nothing by that name (or the directory is missing)
  kWrongType,     // a symbolic link, FIFO, device, socket, ... where a file or directory was expected: never opened
  kWrongOwner,    // owned by another user than expected
  kWrongSize,     // not the exact expected size
  kOpenToOthers,  // a directory its group or others may write
  kExists,        // create: the name is taken (by anything: it is left alone)
  kSystem,        // any other error; *sys_errno says which
};

struct Opened {
  int fd = -1;
  FileStatus status = FileStatus::kOk;
  int sys_errno = 0;  // the system error behind kSystem (and kMissing)
  bool ok() const { return status == FileStatus::kOk; }
};

// printf into a caller's error buffer (either may be null/0: then nothing).
void set_error(char* err, size_t err_len, const char* fmt, ...) __attribute__((format(printf, 3, 4)));

// "a symbolic link", "a FIFO", "a directory", ...: what a mode's file type is.
const char* file_type_name(mode_t mode);

// Opens the regular file `name` in `dirfd` (access: O_RDONLY or O_RDWR),
// refusing anything else; checks its owner (unless kAnyOwner) and, with
// size >= 0, its exact size. `shown_dir` names the directory in messages.
Opened open_file_at(int dirfd, const char* name, int access, uid_t owner, int64_t size, const char* shown_dir,
                    char* err, size_t err_len);

// Opens the directory `name` in `dirfd` (no link followed), checks its owner
// and, if `private_only`, that neither its group nor others may write it.
Opened open_dir_at(int dirfd, const char* name, uid_t owner, bool private_only, const char* shown_dir, char* err,
                   size_t err_len);

// Opens a directory by a path the operator configured (the run dir, a tenant
// directory named by the environment): links in the path are followed, as
// the operator may have meant them (/var/run is often one). Same checks.
Opened open_dir_path(const char* path, uid_t owner, bool private_only, char* err, size_t err_len);

// mkdirat(mode) unless it exists, then open_dir_at with `owner`. A directory
// that exists with other permission bits than `mode` gets `mode` (it is
// checked to be the owner's first); *mode_fixed (if given) says so.
Opened make_dir_at(int dirfd, const char* name, mode_t mode, uid_t owner, const char* shown_dir, bool* mode_fixed,
                   char* err, size_t err_len);

// Fills a new file's mapping before it is published (null: left zero).
using FillFn = void (*)(void* map, const void* arg);

// Creates the regular file `name` in `dirfd`, complete: nameless first, mode
// `mode` (whatever the umask), `bytes` long with its blocks reserved, filled
// by `fill`, then linked in. kExists if the name was taken meanwhile (by
// anything at all); nothing by that name is ever replaced or written to.
FileStatus create_file_at(int dirfd, const char* name, mode_t mode, uint64_t bytes, FillFn fill, const void* fill_arg,
                          const char* shown_dir, int* sys_errno, char* err, size_t err_len);

// Where create_file_at makes its files when the file system has no O_TMPFILE
// (the daemon's <run_dir>/.tmp, mode 0700: no tenant can see or plant names
// there). Without one, such a file system is refused. The descriptor stays
// the caller's; -1 forgets it.
void set_private_dir(int dirfd);
int private_dir();

// Tests only: take the fallback path as if O_TMPFILE were not supported.
void force_no_tmpfile_for_testing(bool on);

// "<prefix><16 random hex digits>" into out (at least prefix + 17 bytes).
// False if the kernel gives no randomness.
bool random_name(const char* prefix, char* out, size_t out_len);

// Reserves the blocks of [0, bytes) of an open file (and extends it to
// `bytes`), so that writes through a mapping of it can never fault for lack
// of space. 0, or the errno; EOPNOTSUPP where the file system cannot.
int reserve_blocks(int fd, uint64_t bytes);

}  // namespace fracgpu::shm
