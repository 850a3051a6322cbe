// Strings a tenant controls (a process's command name, anything read from a
// usage file, a name in a process's environment) on their way to an
// operator: a terminal must never receive their control characters (an
// escape sequence can rewrite the screen, retitle the window, or worse), and
// a Prometheus scrape must stay parseable.
#pragma once

#include <string>
#include <string_view>

namespace fracgpu::controller {

// For terminals and logs: every byte outside printable ASCII (C0 controls,
// DEL, and all bytes >= 0x80, which include the C1 controls some terminals
// obey) and the backslash itself become \xNN, so the result is plain ASCII
// and reads back unambiguously.
std::string escape_terminal(std::string_view text);

// A Prometheus label value (text format 0.0.4): backslash, double quote and
// line feed escaped as the format defines; bytes that are not valid UTF-8,
// and other control characters (the format has no escape for them), become
// U+FFFD.
std::string escape_label_value(std::string_view text);

}  // namespace fracgpu::controller
