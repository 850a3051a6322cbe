// Files the plugin writes for others to read (claim records, CDI specs):
// whole or not at all, and durable before the call returns.
#pragma once

#include <string>
#include <string_view>

namespace fracgpu::kube_plugin {

// Replaces `dir`/`name` with `text`: written to a new file of its own in
// `dir` (O_CREAT | O_EXCL, never through a link), fsync()ed, renamed over
// `name`, then `dir` fsync()ed, so that after a crash the name holds the old
// content or the new one. Mode 0644. false with *error naming the file.
bool write_file_atomic(const std::string& dir, const std::string& name, std::string_view text, std::string* error);

// Removes `dir`/`name` and fsync()s `dir`. Absent is success.
bool remove_file_durable(const std::string& dir, const std::string& name, std::string* error);

// Reading them back, and making their directories, go through the run
// dir's own helpers (state/run_dir.h: read_file_at, make_path).

}  // namespace fracgpu::kube_plugin
