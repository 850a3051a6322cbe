// Reading the node config file, refusing anything that is not a plain file of
// reasonable size. fracgpud --check and every start and reload read a path an
// operator (or a config-management tool) named: a FIFO there would block the
// daemon forever, /dev/zero or a runaway generated file would grow it without
// bound, and a read error must not pass for an empty config. So the file is
// opened without blocking, must be a regular file (after following symlinks),
// and is read with a bound, never trusting st_size alone (/proc files report 0).
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace fracgpu::controller {

// The largest config file fracgpud reads (docs/configuration.md). A node
// config with hundreds of tenants is a few tens of KiB.
inline constexpr size_t kMaxConfigBytes = 1u << 20;

// The file's content, or nullopt and *why: a phrase naming the reason
// ("it is a FIFO (named pipe), not a regular file", "cannot open: ...").
std::optional<std::string> read_config_file(const std::string& path, std::string* why,
                                            size_t max_bytes = kMaxConfigBytes);

}  // namespace fracgpu::controller
