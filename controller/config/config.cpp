#include "config/config.h"

#include <grp.h>
#include <pwd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "config/api_tenant.h"
#include "config/config_file.h"
#include "config/tenant_rules.h"
#include "fracgpu/ledger_layout.h"
#include "daemon/metrics.h"

namespace fracgpu::controller {
namespace {

std::string_view type_name(toml::node_type t) {
  switch (t) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    case toml::node_type::none: break;
  }
  return "nothing";
}

int line_of(const toml::node& n) { return static_cast<int>(n.source().begin.line); }

// An integer or a float, as a double; nullopt for any other type.
std::optional<double> number_of(const toml::node& n) {
  if (const auto* i = n.as_integer()) return static_cast<double>(i->get());
  if (const auto* f = n.as_floating_point()) return f->get();
  return std::nullopt;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The most '.' one line may hold outside strings and comments. toml++ builds
// (and frees) the tables of a dotted key or a table header recursively, one
// level per component, and no limit of its own stops it: a key of 50,000
// components overflowed the 8 MiB stack of fracgpud --check. Arrays and
// inline tables it already stops at 256 levels. A real config has a dot or
// two per line (a fraction, a dotted key); a key can only nest as deep as
// the dots on its line, so 128 keeps any nesting a few hundred levels deep.
constexpr size_t kMaxDotsPerLine = 128;

// The first line (1-based) holding more than kMaxDotsPerLine '.' outside
// strings and comments, or 0. Multi-line strings are followed across lines.
int line_with_too_many_dots(std::string_view text) {
  enum class In { kCode, kComment, kBasic, kLiteral, kMultiBasic, kMultiLiteral } in = In::kCode;
  constexpr std::string_view kMultiBasicQuote = R"(""")";
  constexpr std::string_view kMultiLiteralQuote = R"(''')";
  size_t dots = 0;
  int line = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const std::string_view rest = text.substr(i);
    const auto opens = [&](std::string_view quote) {
      if (!rest.starts_with(quote)) return false;
      i += quote.size() - 1;
      return true;
    };
    if (c == '\n') {
      ++line;
      dots = 0;
      if (in == In::kComment || in == In::kBasic || in == In::kLiteral) in = In::kCode;  // they end with the line
      continue;
    }
    switch (in) {
      case In::kCode:
        if (c == '#') in = In::kComment;
        else if (opens(kMultiBasicQuote)) in = In::kMultiBasic;
        else if (opens(kMultiLiteralQuote)) in = In::kMultiLiteral;
        else if (c == '"') in = In::kBasic;
        else if (c == '\'') in = In::kLiteral;
        else if (c == '.' && ++dots > kMaxDotsPerLine) return line;
        break;
      case In::kBasic:
        if (c == '\\' && i + 1 < text.size() && text[i + 1] != '\n') ++i;  // an escaped quote does not end it
        else if (c == '"') in = In::kCode;
        break;
      case In::kMultiBasic:
        if (c == '\\' && i + 1 < text.size() && text[i + 1] != '\n') ++i;
        else if (opens(kMultiBasicQuote)) in = In::kCode;
        break;
      case In::kLiteral:
        if (c == '\'') in = In::kCode;
        break;
      case In::kMultiLiteral:
        if (opens(kMultiLiteralQuote)) in = In::kCode;
        break;
      case In::kComment:
        break;
    }
  }
  return 0;
}

// The units a duration may carry, for error messages.
constexpr std::string_view kDurationUnitList = "us, ms, s";

// Parses "<number>[ ]<unit>" with unit us, ms or s ("20ms", "2500us", "0.05s").
// The unit is required: a bare number would not say what it counts. The number
// may have a decimal part; the result is rounded down to whole microseconds,
// exactly (no float). Zero is accepted (callers check the range). On failure
// returns nullopt and sets *why to a phrase that completes `time_slice "x" ...`.
std::optional<std::chrono::microseconds> parse_duration(std::string_view text, std::string* why) {
  auto fail = [&](std::string reason) -> std::optional<std::chrono::microseconds> {
    *why = std::move(reason);
    return std::nullopt;
  };
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  const std::string example = fmt::format("write a number and a unit, e.g. \"20ms\"; units: {}", kDurationUnitList);
  std::string_view s = text;
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  if (!s.empty() && s.front() == '-') return fail("is negative (durations must be greater than zero)");
  if (s.empty() || !digit(s.front())) return fail(fmt::format("is not a duration ({})", example));
  constexpr uint64_t kMaxWhole = 1'000'000'000'000ull;  // far above any range; keeps whole * 10^6 in 64 bits
  size_t i = 0;
  uint64_t whole = 0;
  for (; i < s.size() && digit(s[i]); ++i) {
    whole = whole * 10 + static_cast<uint64_t>(s[i] - '0');
    if (whole > kMaxWhole) return fail("is too long");
  }
  // Six fraction digits are all that can matter: a second is 10^6 us.
  uint64_t frac = 0;
  uint64_t frac_scale = 1;
  if (i < s.size() && s[i] == '.') {
    ++i;
    if (i >= s.size() || !digit(s[i])) return fail("is not a duration (a digit must follow the decimal point)");
    for (; i < s.size() && digit(s[i]); ++i) {
      if (frac_scale < 1'000'000) {
        frac = frac * 10 + static_cast<uint64_t>(s[i] - '0');
        frac_scale *= 10;
      }
    }
  }
  std::string_view unit = s.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  uint64_t us_per_unit = 0;
  if (unit == "us") us_per_unit = 1;
  else if (unit == "ms") us_per_unit = 1'000;
  else if (unit == "s") us_per_unit = 1'000'000;
  else if (unit.empty()) return fail(fmt::format("has no unit ({})", example));
  else return fail(fmt::format("has an unknown unit \"{}\" (use {})", unit, kDurationUnitList));
  const uint64_t us = whole * us_per_unit + frac * us_per_unit / frac_scale;
  return std::chrono::microseconds(static_cast<int64_t>(us));
}

// "20ms", "2500us", "1s": the largest unit that names the value exactly.
std::string format_duration(std::chrono::microseconds d) {
  const int64_t us = d.count();
  if (us != 0 && us % 1'000'000 == 0) return fmt::format("{}s", us / 1'000'000);
  if (us % 1'000 == 0) return fmt::format("{}ms", us / 1'000);
  return fmt::format("{}us", us);
}

// A reference to a GPU from a tenant (`devices` entry or `memory` key), as written.
struct GpuRef {
  std::optional<int64_t> index;
  std::optional<GpuUuid> uuid;
  std::string text;  // as written, for messages: `0` or `GPU-...`
};

// A [[gpu]] table while it is being checked.
struct GpuDraft {
  ManagedGpu gpu;
  bool valid = false;     // resolved against the node, every key without error
  bool resolved = false;  // names a node GPU not configured before (other keys may be bad)
  std::optional<int64_t> index;
  std::optional<GpuUuid> uuid;
};

struct MemoryEntry {
  GpuRef ref;
  uint64_t bytes = 0;
  int line = 0;
};

struct TenantDraft {
  Tenant tenant;
  bool valid = true;  // every field of its own parsed cleanly
  std::vector<GpuRef> devices;
  bool has_devices = false;
  int devices_line = 0;
  std::vector<MemoryEntry> memory;
  int gpus_line = 0;                       // where `gpus` is, for placement errors
  std::optional<uint32_t> limit_ppm;       // `limit`; not given: the share
  int limit_line = 0;
  std::map<size_t, int> memory_line;       // GPU -> line of its explicit quota
};

class Parser {
 public:
  Parser(std::string_view source, const std::vector<DiscoveredGpu>& node, const PriorPlacement* prior,
         const ApiTenants* api)
      : source_(source), node_(node), prior_(prior), api_(api) {}

  ConfigResult run(std::string_view text) {
    if (const int line = line_with_too_many_dots(text); line != 0) {
      error(line, fmt::format("more than {} '.' outside strings on one line: keys or table headers nested this deep "
                              "are refused",
                              kMaxDotsPerLine));
      return finish();
    }
    toml::table root;
    try {
      root = toml::parse(text, std::string_view(source_));
    } catch (const toml::parse_error& e) {
      error(static_cast<int>(e.source().begin.line), fmt::format("TOML syntax error: {}", e.description()));
      return finish();
    }
    config_.source = source_;
    check_keys(root, {"daemon", "gpu", "tenant"}, "");
    if (const toml::node* daemon = root.get("daemon")) parse_daemon(*daemon);
    const auto gpus = tables_of(root, "gpu");
    const auto tenants = tables_of(root, "tenant");
    const toml::array* gpu_array = root["gpu"].as_array();
    if (gpus.empty() && (!root.contains("gpu") || (gpu_array != nullptr && gpu_array->empty())))
      error(1, "no [[gpu]] table: list the GPUs fracgpu manages (see docs/configuration.md)");
    for (const toml::table* t : gpus) parse_gpu(*t);
    reserve_api_tenants();
    for (const toml::table* t : tenants) parse_tenant(*t);
    place_fractions();
    apply_limits();
    apply_explicit_memory();
    check_memory_totals();
    // Grants index the drafts; a failed draft has its error, so the config
    // is only used when every draft is valid.
    for (const GpuDraft& d : gpus_) config_.gpus.push_back(d.gpu);
    for (const TenantDraft& draft : tenants_)
      if (draft.valid) config_.tenants.push_back(draft.tenant);
    if (api_ != nullptr && errors_.empty())
      for (const auto& [name, tenant] : *api_) config_.tenants.push_back(tenant_of(tenant, config_));
    return finish();
  }

 private:
  // ---- Reporting ----

  void error(int line, std::string message) { errors_.push_back({source_, line, std::move(message)}); }

  // `where: message`, or just the message for top-level keys.
  void error_in(std::string_view where, int line, std::string_view message) {
    error(line, where.empty() ? std::string(message) : fmt::format("{}: {}", where, message));
  }

  void wrong_type(std::string_view where, std::string_view key, const toml::node& n, std::string_view expected) {
    error_in(where, line_of(n), fmt::format("{} must be {}, not {}", key, expected, type_name(n.type())));
  }

  ConfigResult finish() {
    ConfigResult result;
    std::stable_sort(errors_.begin(), errors_.end(),
                     [](const ConfigError& a, const ConfigError& b) { return a.line < b.line; });
    result.errors = std::move(errors_);
    if (result.errors.empty()) result.config = std::move(config_);
    return result;
  }

  // ---- Schema helpers ----

  void check_keys(const toml::table& t, std::initializer_list<std::string_view> allowed, std::string_view where) {
    for (auto&& [key, value] : t) {
      const std::string_view k = key.str();
      if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) continue;
      std::string hint;
      for (std::string_view candidate : allowed)
        if (edit_distance(k, candidate) <= 2) hint = fmt::format(" (did you mean \"{}\"?)", candidate);
      if (hint.empty()) {
        std::string list;
        for (std::string_view candidate : allowed) list += fmt::format("{}{}", list.empty() ? "" : ", ", candidate);
        hint = fmt::format(" (known keys: {})", list);
      }
      error_in(where, static_cast<int>(key.source().begin.line), fmt::format("unknown key \"{}\"{}", k, hint));
    }
  }

  std::vector<const toml::table*> tables_of(const toml::table& root, std::string_view key) {
    std::vector<const toml::table*> out;
    const toml::node* n = root.get(key);
    if (n == nullptr) return out;
    const std::string expected = fmt::format("an array of tables ([[{}]])", key);
    const toml::array* arr = n->as_array();
    if (arr == nullptr) {
      wrong_type("", key, *n, expected);
      return out;
    }
    for (const toml::node& element : *arr) {
      if (const toml::table* t = element.as_table())
        out.push_back(t);
      else
        wrong_type("", key, element, expected);
    }
    return out;
  }

  // The value of `key` if present and of type T; a wrong type is reported
  // as "<key> must be <expected>, not <actual>".
  template <typename T>
  std::optional<T> get(const toml::table& t, std::string_view key, std::string_view where, std::string_view expected) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return std::nullopt;
    if (const auto* v = n->as<T>()) return v->get();
    wrong_type(where, key, *n, expected);
    return std::nullopt;
  }
  std::optional<std::string> get_string(const toml::table& t, std::string_view key, std::string_view where) {
    return get<std::string>(t, key, where, "a string");
  }
  std::optional<bool> get_bool(const toml::table& t, std::string_view key, std::string_view where) {
    return get<bool>(t, key, where, "true or false");
  }

  // A size: a string with a unit, or an integer number of bytes. Messages
  // read `<what> <value><suffix> <reason>`. Zero is refused unless allowed.
  std::optional<uint64_t> get_size(const toml::node& n, std::string_view what, std::string_view where,
                                   bool allow_zero, std::string_view suffix = {}) {
    std::optional<uint64_t> bytes;
    std::string shown;
    if (const auto* i = n.as_integer()) {
      shown = std::to_string(i->get());
      if (i->get() < 0) {
        error_in(where, line_of(n), fmt::format("{} {}{} is negative (sizes must be greater than zero)", what, shown, suffix));
        return std::nullopt;
      }
      bytes = static_cast<uint64_t>(i->get());
    } else if (const auto* s = n.as_string()) {
      shown = fmt::format("\"{}\"", s->get());
      std::string why;
      bytes = parse_size(s->get(), &why);
      if (!bytes) {
        error_in(where, line_of(n), fmt::format("{} {}{} {}", what, shown, suffix, why));
        return std::nullopt;
      }
    } else {
      wrong_type(where, what, n, "a size such as \"16GiB\" or an integer number of bytes");
      return std::nullopt;
    }
    if (*bytes == 0 && !allow_zero) {
      error_in(where, line_of(n), fmt::format("{} {}{} must be greater than zero", what, shown, suffix));
      return std::nullopt;
    }
    return bytes;
  }

  // A duration string ("20ms") within [min, max]. Messages read
  // `<key> "<value>" <reason>`, at the value's line.
  std::optional<std::chrono::microseconds> get_duration(const toml::table& t, std::string_view key,
                                                        std::string_view where, std::chrono::microseconds min,
                                                        std::chrono::microseconds max) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return std::nullopt;
    const auto* s = n->as_string();
    if (s == nullptr) {
      wrong_type(where, key, *n, "a duration such as \"20ms\"");
      return std::nullopt;
    }
    std::string why;
    const auto d = parse_duration(s->get(), &why);
    if (!d) {
      error_in(where, line_of(*n), fmt::format("{} \"{}\" {}", key, s->get(), why));
      return std::nullopt;
    }
    if (*d < min || *d > max) {
      error_in(where, line_of(*n), fmt::format("{} \"{}\" is out of range ({}..{})", key, s->get(),
                                               format_duration(min), format_duration(max)));
      return std::nullopt;
    }
    return d;
  }

  // A tenant's reference to a GPU: an integer index, or a string holding an
  // index or a UUID (memory keys are always strings).
  std::optional<GpuRef> parse_gpu_ref(const toml::node* n, std::string_view text, std::string_view what,
                                      std::string_view where, int line) {
    GpuRef ref;
    if (n != nullptr && n->is_integer()) {
      ref.index = n->as_integer()->get();
      ref.text = std::to_string(*ref.index);
      return ref;
    }
    if (n != nullptr && !n->is_string()) {
      wrong_type(where, what, *n, "a GPU index or a UUID string");
      return std::nullopt;
    }
    if (n != nullptr) text = n->as_string()->get();
    ref.text = text;
    if (!text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
        text.size() < 10) {
      ref.index = std::stoll(std::string(text));
      return ref;
    }
    if (auto uuid = parse_gpu_uuid(text)) {
      ref.uuid = uuid;
      return ref;
    }
    error_in(where, line, fmt::format("{} \"{}\" is neither a GPU index nor a GPU UUID (\"GPU-\" and 8-4-4-4-12 hex "
                                      "digits)",
                                      what, text));
    return std::nullopt;
  }

  // ---- [daemon] ----

  // The memory audit's keys (memory_audit.h): [daemon] memory_*.
  void parse_memory_audit(const toml::table& t, std::string_view where, MemoryAuditSettings& m) {
    if (auto every = get_duration(t, "memory_audit_interval", where, kMinCheckInterval, kMaxCheckInterval))
      m.interval = *every;
    if (auto grace = get_duration(t, "memory_grace", where, std::chrono::microseconds{0}, kMaxMemoryGrace))
      m.grace = *grace;
    if (const toml::node* n = t.get("memory_tolerance"))
      if (auto bytes = get_size(*n, "memory_tolerance", where, /*allow_zero=*/true)) m.tolerance = *bytes;
    if (auto action = get_string(t, "memory_audit_action", where)) {
      if (auto parsed = parse_memory_audit_action(*action))
        m.action = *parsed;
      else
        error_in(where, line_of(*t.get("memory_audit_action")),
                 fmt::format("memory_audit_action \"{}\" is not a memory audit action (use {})", *action,
                             kMemoryAuditActionList));
    }
    if (const toml::node* n = t.get("unowned_memory_allowance"))
      if (auto bytes = get_size(*n, "unowned_memory_allowance", where, /*allow_zero=*/true))
        m.unowned_allowance = *bytes;
    if (const toml::node* n = t.get("node_agent_cgroups")) parse_node_agent_cgroups(*n, where, m);
  }

  // `node_agent_cgroups`: absolute cgroup paths, each naming one subtree.
  void parse_node_agent_cgroups(const toml::node& n, std::string_view where, MemoryAuditSettings& m) {
    const toml::array* list = n.as_array();
    if (list == nullptr) {
      wrong_type(where, "node_agent_cgroups", n, "an array of cgroup paths such as [\"/system.slice/dcgm.service\"]");
      return;
    }
    std::vector<std::string> paths;
    for (const toml::node& element : *list) {
      const auto* text = element.as_string();
      if (text == nullptr) {
        wrong_type(where, "node_agent_cgroups", element, "a cgroup path string");
        continue;
      }
      if (std::string why = node_agent_cgroup_problem(text->get()); !why.empty()) {
        error_in(where, line_of(element), fmt::format("node_agent_cgroups \"{}\" {}", text->get(), why));
        continue;
      }
      paths.push_back(text->get());
    }
    m.node_agent_cgroups = std::move(paths);
  }

  // Why `path` cannot name a node agent's cgroup; empty if it can. Matched
  // by whole components (cgroup_within), so it must be written as
  // /proc/<pid>/cgroup shows it: one form only.
  static std::string node_agent_cgroup_problem(std::string_view path) {
    if (path.empty() || path.front() != '/') return "must be an absolute cgroup path (as /proc/<pid>/cgroup shows it)";
    if (path == "/") return "is the root cgroup: it would exempt every process, tenants' escaped ones included";
    if (path.back() == '/') return "must not end in \"/\"";
    if (std::any_of(path.begin(), path.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }))
      return "holds a control character";
    for (size_t start = 1; start <= path.size();) {
      size_t end = path.find('/', start);
      if (end == std::string_view::npos) end = path.size();
      const std::string_view part = path.substr(start, end - start);
      if (part.empty() || part == "." || part == "..")
        return "must not hold an empty, \".\" or \"..\" component (write the path as /proc/<pid>/cgroup shows it)";
      start = end + 1;
    }
    return {};
  }

  void parse_daemon(const toml::node& n) {
    const toml::table* t = n.as_table();
    if (t == nullptr) {
      wrong_type("", "daemon", n, "a table ([daemon])");
      return;
    }
    constexpr std::string_view where = "[daemon]";
    check_keys(*t, {"run_dir", "log_level", "reap_interval_ms", "allow_overcommit", "time_slice", "gpu_time_charging", "side_by_side", "placement",
                    "metrics_address", "health_interval", "audit_interval", "audit_action", "liveness_timeout",
                    "memory_audit_interval", "memory_grace", "memory_tolerance", "memory_audit_action",
                    "unowned_memory_allowance", "node_agent_cgroups",
                    "control_group"},
               where);
    DaemonSettings& d = config_.daemon;
    if (auto dir = get_string(*t, "run_dir", where)) {
      if (dir->empty() || dir->front() != '/')
        error_in(where, line_of(*t->get("run_dir")), fmt::format("run_dir \"{}\" must be an absolute path", *dir));
      else
        d.run_dir = *dir;
      d.run_dir_line = line_of(*t->get("run_dir"));
    }
    if (auto level = get_string(*t, "log_level", where)) {
      if (auto parsed = parse_log_level(*level))
        d.log_level = *parsed;
      else
        error_in(where, line_of(*t->get("log_level")),
                 fmt::format("log_level \"{}\" is not a log level (use {})", *level, kLogLevelList));
    }
    if (auto ms = get<int64_t>(*t, "reap_interval_ms", where, "an integer")) {
      const int line = line_of(*t->get("reap_interval_ms"));
      if (*ms <= 0)
        error_in(where, line, fmt::format("reap_interval_ms {} must be greater than zero", *ms));
      else if (*ms < kMinReapIntervalMs || *ms > kMaxReapIntervalMs)
        error_in(where, line,
                 fmt::format("reap_interval_ms {} is out of range ({}..{})", *ms, kMinReapIntervalMs, kMaxReapIntervalMs));
      else
        d.reap_interval = std::chrono::milliseconds(*ms);
    }
    if (auto overcommit = get_bool(*t, "allow_overcommit", where)) d.allow_overcommit = *overcommit;
    if (auto slice = get_duration(*t, "time_slice", where, kMinTimeSlice, kMaxTimeSlice)) d.time_slice = *slice;
    if (auto charging = get_string(*t, "gpu_time_charging", where)) {
      if (*charging == "held" || *charging == "measured")
        d.gpu_time_measured = *charging == "measured";
      else
        error_in(where, line_of(*t->get("gpu_time_charging")),
                 fmt::format("gpu_time_charging \"{}\" is not a way of charging GPU time (use held, measured)", *charging));
    }
    if (auto side = get_bool(*t, "side_by_side", where)) d.side_by_side = *side;
    if (auto policy = get_string(*t, "placement", where)) {
      if (auto parsed = parse_placement_policy(*policy))
        d.placement = *parsed;
      else
        error_in(where, line_of(*t->get("placement")),
                 fmt::format("placement \"{}\" is not a placement policy (use {})", *policy, kPlacementPolicyList));
    }
    if (auto every = get_duration(*t, "health_interval", where, kMinCheckInterval, kMaxCheckInterval))
      d.health_interval = *every;
    if (auto every = get_duration(*t, "audit_interval", where, kMinCheckInterval, kMaxCheckInterval))
      d.audit_interval = *every;
    if (auto bound = get_duration(*t, "liveness_timeout", where, kMinLivenessTimeout, kMaxLivenessTimeout)) {
      // A few ticks at least: one slow tick must not fail the liveness probe.
      if (*bound < 3 * std::chrono::duration_cast<std::chrono::microseconds>(d.reap_interval))
        error_in(where, line_of(*t->get("liveness_timeout")),
                 fmt::format("liveness_timeout \"{}\" must be at least 3 times reap_interval_ms ({} ms)",
                             format_duration(*bound), d.reap_interval.count()));
      else
        d.liveness_timeout = *bound;
    }
    if (auto action = get_string(*t, "audit_action", where)) {
      if (auto parsed = parse_audit_action(*action))
        d.audit_action = *parsed;
      else
        error_in(where, line_of(*t->get("audit_action")),
                 fmt::format("audit_action \"{}\" is not an audit action (use {})", *action, kAuditActionList));
    }
    parse_memory_audit(*t, where, d.memory_audit);
    if (auto group = get_string(*t, "control_group", where)) {
      std::string why;
      if (!group->empty() && !resolve_control_group(*group, &d, &why))
        error_in(where, line_of(*t->get("control_group")), fmt::format("control_group \"{}\" {}", *group, why));
    }
    if (auto address = get_string(*t, "metrics_address", where)) {
      std::string why;
      if (*address == "" || *address == "off")
        d.metrics_address.clear();
      else if (!parse_host_port(*address, &why))
        error_in(where, line_of(*t->get("metrics_address")), fmt::format("metrics_address \"{}\" {}", *address, why));
      else
        d.metrics_address = *address;
    }
  }

  // ---- [[gpu]] ----

  std::string known_gpus() const {
    if (node_.empty()) return "no GPU was found on this node";
    std::string list;
    for (const DiscoveredGpu& g : node_) list += fmt::format("{}{} ({})", list.empty() ? "" : ", ", g.index, g.uuid);
    return "GPUs on this node: " + list;
  }

  void parse_gpu(const toml::table& t) {
    GpuDraft draft;
    draft.gpu.line = line_of(t);
    bool ok = true;
    draft.index = get<int64_t>(t, "index", "[[gpu]]", "an integer");
    if (!draft.index && t.contains("index")) ok = false;
    if (auto text = get_string(t, "uuid", "[[gpu]]")) {
      draft.uuid = parse_gpu_uuid(*text);
      if (!draft.uuid) {
        error_in("[[gpu]]", line_of(*t.get("uuid")),
                 fmt::format("uuid \"{}\" is not a GPU UUID (\"GPU-\" and 8-4-4-4-12 hex digits)", *text));
        ok = false;
      }
    } else if (t.contains("uuid")) {
      ok = false;
    }
    const std::string where = draft.index  ? fmt::format("[[gpu]] index {}", *draft.index)
                              : draft.uuid ? fmt::format("[[gpu]] uuid \"{}\"", format_gpu_uuid(*draft.uuid))
                                           : std::string("[[gpu]]");
    check_keys(t, {"index", "uuid", "context_memory", "memory"}, where);
    if (ok && !draft.index && !draft.uuid) {
      error_in(where, draft.gpu.line, "missing required key: index or uuid");
      ok = false;
    }

    // Find it on the node; with both keys given they must name the same GPU.
    const DiscoveredGpu* found = nullptr;
    if (ok && draft.index) {
      for (const DiscoveredGpu& g : node_)
        if (g.index == *draft.index) found = &g;
      if (found == nullptr) {
        error_in(where, line_of(*t.get("index")),
                 fmt::format("GPU index {} is not present on this node ({})", *draft.index, known_gpus()));
        ok = false;
      }
    }
    if (ok && draft.uuid) {
      const std::string uuid = format_gpu_uuid(*draft.uuid);
      const DiscoveredGpu* by_uuid = nullptr;
      for (const DiscoveredGpu& g : node_)
        if (parse_gpu_uuid(g.uuid) == draft.uuid) by_uuid = &g;
      if (by_uuid == nullptr) {
        error_in(where, line_of(*t.get("uuid")),
                 fmt::format("GPU {} is not present on this node ({})", uuid, known_gpus()));
        ok = false;
      } else if (found != nullptr && found != by_uuid) {
        error_in(where, line_of(*t.get("uuid")),
                 fmt::format("index {} and uuid {} name different GPUs (index {} is {})", *draft.index, uuid,
                             *draft.index, found->uuid));
        ok = false;
      }
      found = by_uuid;
    }
    if (ok) {
      for (const GpuDraft& other : gpus_) {
        if (other.resolved && other.gpu.index == found->index) {
          error_in(where, draft.gpu.line,
                   fmt::format("GPU {} ({}) is already configured at line {}", found->index, found->uuid,
                               other.gpu.line));
          ok = false;
        }
      }
    }
    if (found != nullptr) {
      draft.resolved = ok;  // a duplicate must not shadow the first one
      draft.gpu.index = found->index;
      draft.gpu.uuid = found->uuid;
      draft.gpu.uuid_bytes = parse_gpu_uuid(found->uuid).value_or(GpuUuid{});
      draft.gpu.name = found->name;
      draft.gpu.memory_bytes = found->memory_bytes;
    }

    if (const toml::node* n = t.get("memory")) {
      auto bytes = get_size(*n, "memory", where, false);
      if (!bytes) {
        ok = false;
      } else if (found != nullptr && *bytes > found->memory_bytes) {
        error_in(where, line_of(*n),
                 fmt::format("memory {} is above the {} the GPU has (the override may only lower it)",
                             format_size(*bytes), format_size(found->memory_bytes)));
        ok = false;
      } else {
        draft.gpu.memory_bytes = *bytes;
      }
    }
    if (const toml::node* n = t.get("context_memory")) {
      auto bytes = get_size(*n, "context_memory", where, true);
      if (!bytes) {
        ok = false;
      } else if (ok && *bytes >= draft.gpu.memory_bytes) {
        error_in(where, line_of(*n),
                 fmt::format("context_memory {} is not below the GPU's memory ({})", format_size(*bytes),
                             format_size(draft.gpu.memory_bytes)));
        ok = false;
      } else {
        draft.gpu.context_memory = *bytes;
      }
    } else if (const toml::node* m = t.get("memory"); ok && m != nullptr &&
                                                        draft.gpu.context_memory >= draft.gpu.memory_bytes) {
      // The default context_memory, under a memory override that lowered
      // the GPU below it: said here, once, not by every tenant on the GPU.
      error_in(where, line_of(*m),
               fmt::format("memory {} is not above the context_memory of {} (the default; set context_memory lower)",
                           format_size(draft.gpu.memory_bytes), format_size(draft.gpu.context_memory)));
      ok = false;
    }
    draft.valid = ok;
    gpus_.push_back(std::move(draft));
  }

  // Index into gpus_ of the [[gpu]] a reference names; nullopt (with an error
  // unless the [[gpu]] itself already failed) when it names none.
  std::optional<size_t> resolve(const GpuRef& ref, std::string_view where, std::string_view what, int line) {
    for (size_t i = 0; i < gpus_.size(); ++i) {
      const GpuDraft& d = gpus_[i];
      const bool match = (ref.index && ((d.valid && d.gpu.index == *ref.index) || (d.index && *d.index == *ref.index))) ||
                         (ref.uuid && ((d.valid && d.gpu.uuid_bytes == *ref.uuid) || (d.uuid && *d.uuid == *ref.uuid)));
      if (!match) continue;
      if (!d.valid) return std::nullopt;  // that [[gpu]] has its own error already
      return i;
    }
    std::string list;
    for (const GpuDraft& d : gpus_)
      if (d.valid) list += fmt::format("{}{}", list.empty() ? "" : ", ", d.gpu.index);
    error_in(where, line,
             fmt::format("{} {} is not a configured [[gpu]] (configured: {})", what, ref.text,
                         list.empty() ? "none" : list));
    return std::nullopt;
  }

  // ---- [[tenant]] ----

  void parse_tenant(const toml::table& t) {
    TenantDraft draft;
    Tenant& tenant = draft.tenant;
    tenant.line = line_of(t);
    std::string where = "[[tenant]]";
    if (auto name = get_string(t, "name", where)) {
      if (!valid_tenant_name(*name)) {
        error_in(where, line_of(*t.get("name")), fmt::format("name \"{}\" {}", *name, kTenantNameRule));
        draft.valid = false;
      } else {
        tenant.name = *name;
        where = fmt::format("tenant \"{}\"", *name);
        if (api_ != nullptr && api_->contains(*name)) {
          error_in(where, line_of(*t.get("name")),
                   fmt::format("the name belongs to a tenant created through the control API: choose another, or "
                               "delete that tenant first (fracgpu tenant delete {})",
                               *name));
          draft.valid = false;
        }
        for (const TenantDraft& other : tenants_) {
          if (other.tenant.name == *name) {
            error_in(where, line_of(*t.get("name")),
                     fmt::format("duplicate tenant name (first defined at line {})", other.tenant.line));
            draft.valid = false;
          }
        }
      }
    } else {
      if (!t.contains("name")) error_in(where, tenant.line, "missing required key \"name\"");
      draft.valid = false;
    }
    check_keys(t, {"name", "gpus", "devices", "count_managed", "memory", "limit", "priority"}, where);

    if (const toml::node* n = t.get("gpus")) {
      draft.gpus_line = line_of(*n);
      const std::optional<double> value = number_of(*n);
      if (!value) {
        wrong_type(where, "gpus", *n, "a number of GPUs such as 0.5 or 2");
        draft.valid = false;
      } else if (!std::isfinite(*value) || *value <= 0) {
        error_in(where, line_of(*n), fmt::format("gpus = {} must be greater than zero", *value));
        draft.valid = false;
      } else if (*value > static_cast<double>(ledger::kMaxGpus)) {
        error_in(where, line_of(*n), fmt::format("gpus = {} is above the {} GPUs a tenant may hold", *value,
                                                 ledger::kMaxGpus));
        draft.valid = false;
      } else {
        tenant.gpus_ppm = static_cast<uint64_t>(std::llround(*value * kPpmPerGpu));
        if (tenant.gpus_ppm == 0) {
          error_in(where, line_of(*n), fmt::format("gpus = {} is below the smallest share (0.000001)", *value));
          draft.valid = false;
        }
      }
    }
    if (const toml::node* n = t.get("limit")) {
      draft.limit_line = line_of(*n);
      const std::optional<double> value = number_of(*n);
      if (!value) {
        wrong_type(where, "limit", *n, "a fraction of one GPU such as 0.5 or 1.0");
        draft.valid = false;
      } else if (const auto problem = fraction_problem(*value)) {
        error_in(where, draft.limit_line, fmt::format("limit = {} {}", *value, *problem));
        draft.valid = false;
      } else if (!t.contains("gpus")) {
        error_in(where, draft.limit_line,
                 "limit needs gpus: a tenant with only memory quotas has no share of GPU time to cap (it may use "
                 "whatever time nobody with a share wants)");
        draft.valid = false;
      } else {
        draft.limit_ppm = fraction_ppm(*value);
      }
    }
    if (auto managed = get_bool(t, "count_managed", where)) tenant.count_managed = *managed;
    else if (t.contains("count_managed")) draft.valid = false;
    if (auto priority = get_string(t, "priority", where)) {
      if (auto parsed = parse_priority(*priority)) {
        tenant.priority = *parsed;
      } else {
        error_in(where, line_of(*t.get("priority")),
                 fmt::format("priority \"{}\" is not a priority (use {})", *priority, kPriorityList));
        draft.valid = false;
      }
    } else if (t.contains("priority")) {
      draft.valid = false;
    }

    if (const toml::node* n = t.get("devices")) {
      draft.has_devices = true;
      draft.devices_line = line_of(*n);
      if (const toml::array* arr = n->as_array()) {
        for (const toml::node& element : *arr) {
          if (auto ref = parse_gpu_ref(&element, {}, "devices entry", where, line_of(element)))
            draft.devices.push_back(*ref);
          else
            draft.valid = false;
        }
        if (arr->empty()) {
          error_in(where, draft.devices_line, "devices is empty (leave it out to let fracgpu place the tenant)");
          draft.valid = false;
        }
      } else {
        wrong_type(where, "devices", *n, "an array of GPU indices or UUIDs");
        draft.valid = false;
      }
      if (!t.contains("gpus")) {
        error_in(where, draft.devices_line,
                 "devices needs gpus (a tenant with only memory quotas names its GPUs in the memory table)");
        draft.valid = false;
      }
    }

    if (const toml::node* n = t.get("memory")) {
      if (const toml::table* mem = n->as_table()) {
        for (auto&& [key, value] : *mem) {
          const int line = static_cast<int>(key.source().begin.line);
          auto ref = parse_gpu_ref(nullptr, key.str(), "memory key", where, line);
          if (!ref) {
            draft.valid = false;
            continue;
          }
          auto bytes = get_size(value, "memory", where, false, fmt::format(" for GPU {}", ref->text));
          if (!bytes) {
            draft.valid = false;
            continue;
          }
          draft.memory.push_back({*ref, *bytes, line_of(value)});
        }
      } else {
        wrong_type(where, "memory", *n, "a table of per-GPU quotas ([tenant.memory] with \"0\" = \"12GiB\")");
        draft.valid = false;
      }
    }
    if (!t.contains("gpus") && !t.contains("memory")) {
      error_in(where, tenant.line, "missing required key: gpus or memory (or both)");
      draft.valid = false;
    }
    tenants_.push_back(std::move(draft));
  }

  // ---- Placement ----

  std::string free_list() const {
    std::string list;
    for (size_t i = 0; i < gpus_.size(); ++i)
      if (gpus_[i].valid)
        list += fmt::format("{}GPU {}: {}", list.empty() ? "" : ", ", gpus_[i].gpu.index, format_gpus(free_[i]));
    std::string held;
    for (size_t i = 0; i < gpus_.size(); ++i) held += api_share_note(i);
    return list + held;
  }

  // "; API tenants hold 0.5 of GPU 0 (\"dra-1\" 0.5)", or "" when they hold none of it.
  std::string api_share_note(size_t gpu) const {
    if (api_ppm_.empty() || api_ppm_[gpu] == 0) return "";
    return fmt::format("; API tenants hold {} of GPU {} ({})", format_gpus(api_ppm_[gpu]), gpus_[gpu].gpu.index,
                       api_share_holders_[gpu]);
  }

  // ---- Tenants of the control API ----

  // Their GPUs, shares and quotas are taken before any [[tenant]] is placed:
  // a running API tenant is never moved or shrunk by the config. What no
  // longer fits them is an error naming them (line 0: no line of the file
  // is at fault, the config as a whole is).
  void reserve_api_tenants() {
    api_ppm_.assign(gpus_.size(), 0);
    api_memory_.assign(gpus_.size(), 0);
    api_tenants_.assign(gpus_.size(), 0);
    api_share_holders_.assign(gpus_.size(), "");
    api_memory_holders_.assign(gpus_.size(), "");
    if (api_ == nullptr) return;
    for (const auto& [name, tenant] : *api_) {
      const std::string where = fmt::format("API tenant \"{}\"", name);
      for (const ApiGrant& grant : tenant.gpus) {
        const std::string uuid = format_gpu_uuid(grant.uuid);
        size_t g = 0;
        while (g < gpus_.size() && !(gpus_[g].gpu.uuid_bytes == grant.uuid || gpus_[g].uuid == grant.uuid)) ++g;
        if (g == gpus_.size()) {
          error_in(where, 0,
                   fmt::format("holds {}, which is not a configured [[gpu]] any more: configure it again, or delete "
                               "the tenant first (fracgpu tenant delete {})",
                               uuid, name));
          continue;
        }
        if (!gpus_[g].valid) continue;  // that [[gpu]] has its own error
        const ManagedGpu& gpu = gpus_[g].gpu;
        if (const auto problem = memory_quota_problem(grant.memory, gpu)) error_in(where, 0, *problem);
        api_ppm_[g] += grant.share_ppm;
        api_memory_[g] += grant.memory;
        api_tenants_[g] += 1;
        api_share_holders_[g] += fmt::format("{}\"{}\" {}", api_share_holders_[g].empty() ? "" : ", ", name,
                                             format_gpus(grant.share_ppm));
        api_memory_holders_[g] += fmt::format("{}API tenant \"{}\" {}", api_memory_holders_[g].empty() ? "" : ", ",
                                              name, format_size(grant.memory));
      }
    }
    for (size_t g = 0; g < gpus_.size(); ++g) {
      const ManagedGpu& gpu = gpus_[g].gpu;
      if (api_ppm_[g] > kPpmPerGpu)
        error(0, fmt::format("API tenants hold {} of GPU {} ({}), more than the whole GPU", format_gpus(api_ppm_[g]),
                             gpu.index, api_share_holders_[g]));
      if (!config_.daemon.allow_overcommit && api_memory_[g] > gpu.memory_bytes)
        error(0, fmt::format("memory quotas of API tenants on GPU {} add up to {}, above its {} ({}); set "
                             "allow_overcommit = true in [daemon] or delete some of them",
                             gpu.index, format_size(api_memory_[g]), format_size(gpu.memory_bytes),
                             api_memory_holders_[g]));
    }
  }

  // The cap defaults to the share (a hard cap); whole GPUs are never capped.
  Grant fraction_grant(size_t gpu, uint32_t ppm) const {
    return {gpu, ppm, ppm, fraction_quota(ppm, gpus_[gpu].gpu.memory_bytes)};
  }

  void grant(Tenant& tenant, size_t gpu, uint32_t ppm) {
    free_[gpu] -= ppm;
    tenant.grants.push_back(fraction_grant(gpu, ppm));
  }

  // Tenants that name their devices are placed first (in config order), so a
  // tenant listed earlier but placed automatically can never take the GPU
  // another tenant explicitly asked for. The rest: placement.h.
  void place_fractions() {
    free_.assign(gpus_.size(), kPpmPerGpu);
    for (size_t g = 0; g < gpus_.size(); ++g) free_[g] -= std::min(api_ppm_[g], kPpmPerGpu);
    size_t configured = 0;
    for (const GpuDraft& d : gpus_) configured += d.valid ? 1 : 0;
    for (TenantDraft& draft : tenants_) {
      if (!draft.valid || draft.tenant.gpus_ppm == 0 || !draft.has_devices) continue;
      const std::string where = fmt::format("tenant \"{}\"", draft.tenant.name);
      draft.tenant.placement = PlacementReason::kPinned;
      if (place_pinned(draft, pieces_of(draft.tenant.gpus_ppm), where, format_gpus(draft.tenant.gpus_ppm))) continue;
      draft.valid = false;
      draft.tenant.grants.clear();
    }
    // With a broken [[gpu]] the capacity is unknown: placing automatic
    // tenants would only add misleading errors to the one that matters.
    const bool capacity_known = configured == gpus_.size();
    std::vector<TenantDraft*> automatic;
    std::vector<PlacementAsk> asks;
    for (TenantDraft& draft : tenants_) {
      if (!draft.valid || draft.tenant.gpus_ppm == 0 || draft.has_devices) continue;
      const size_t needed = pieces_of(draft.tenant.gpus_ppm).size();
      if (!capacity_known || needed > configured) {
        if (capacity_known)
          error_in(fmt::format("tenant \"{}\"", draft.tenant.name), line_of_gpus(draft),
                   fmt::format("gpus = {} needs {} GPUs but only {} are configured", format_gpus(draft.tenant.gpus_ppm),
                               needed, configured));
        draft.valid = false;
        continue;
      }
      automatic.push_back(&draft);
      asks.push_back({draft.tenant.name, draft.tenant.gpus_ppm});
    }
    std::vector<PlacementGpu> capacity;
    for (size_t g = 0; g < gpus_.size(); ++g) capacity.push_back({gpus_[g].gpu.uuid_bytes, gpus_[g].valid, free_[g]});
    const std::vector<PlacementResult> results = place_automatic(config_.daemon.placement, capacity, asks, prior_);
    for (size_t g = 0; g < gpus_.size(); ++g) free_[g] = capacity[g].free_ppm;
    for (size_t i = 0; i < automatic.size(); ++i) {
      TenantDraft& draft = *automatic[i];
      const PlacementResult& r = results[i];
      if (!r.placed) {
        error_in(fmt::format("tenant \"{}\"", draft.tenant.name), line_of_gpus(draft),
                 fmt::format("cannot place gpus = {}: no other configured GPU has {} unallocated (unallocated: {})",
                             format_gpus(draft.tenant.gpus_ppm), format_gpus(r.failed_piece), free_list()));
        draft.valid = false;
        continue;
      }
      draft.tenant.placement = r.reason;
      // Capacity is already taken by place_automatic: only the grants remain.
      for (const auto& [g, ppm] : r.grants) draft.tenant.grants.push_back(fraction_grant(g, ppm));
    }
  }

  bool place_pinned(TenantDraft& draft, const std::vector<uint32_t>& pieces, const std::string& where,
                    const std::string& asked) {
    Tenant& tenant = draft.tenant;
    if (draft.devices.size() != pieces.size()) {
      error_in(where, draft.devices_line,
               fmt::format("devices lists {} GPU(s) but gpus = {} is placed on {} (one per whole GPU, one for the "
                           "remaining fraction)",
                           draft.devices.size(), asked, pieces.size()));
      return false;
    }
    std::vector<size_t> targets;
    for (const GpuRef& ref : draft.devices) {
      auto gpu = resolve(ref, where, "devices entry", draft.devices_line);
      if (!gpu) return false;
      if (std::find(targets.begin(), targets.end(), *gpu) != targets.end()) {
        error_in(where, draft.devices_line, fmt::format("devices names GPU {} twice", gpus_[*gpu].gpu.index));
        return false;
      }
      targets.push_back(*gpu);
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (free_[targets[i]] < pieces[i]) {
        // The pieces granted before go back: a tenant that is not placed
        // holds nothing, and the errors of the tenants after it name causes.
        for (size_t j = 0; j < i; ++j) free_[targets[j]] += pieces[j];
        error_in(where, draft.devices_line,
                 fmt::format("cannot place {} of GPU {}: only {} of it is unallocated (sum of fractions on a GPU "
                             "cannot exceed 1.0){}",
                             format_gpus(pieces[i]), gpus_[targets[i]].gpu.index, format_gpus(free_[targets[i]]),
                             api_share_note(targets[i])));
        return false;
      }
      grant(tenant, targets[i], pieces[i]);
    }
    return true;
  }

  static int line_of_gpus(const TenantDraft& draft) { return draft.gpus_line != 0 ? draft.gpus_line : draft.tenant.line; }

  // ---- GPU-time limits ----

  // `limit` caps the fractional piece of a tenant's `gpus`; whole GPUs are
  // the tenant's alone and never capped. It may not undercut the share.
  void apply_limits() {
    for (TenantDraft& draft : tenants_) {
      if (!draft.valid || !draft.limit_ppm) continue;
      for (Grant& g : draft.tenant.grants) {
        if (g.share_ppm >= kPpmPerGpu) continue;
        if (const auto problem =
                limit_problem(*draft.limit_ppm, g.share_ppm, fmt::format("GPU {}", gpus_[g.gpu].gpu.index))) {
          error_in(fmt::format("tenant \"{}\"", draft.tenant.name), draft.limit_line,
                   fmt::format("limit = {} {}", format_gpus(*draft.limit_ppm), *problem));
          draft.valid = false;
          break;
        }
        g.limit_ppm = *draft.limit_ppm;
      }
    }
  }

  // ---- Explicit memory quotas ----

  void apply_explicit_memory() {
    for (TenantDraft& draft : tenants_) {
      if (!draft.valid) continue;
      Tenant& tenant = draft.tenant;
      const std::string where = fmt::format("tenant \"{}\"", tenant.name);
      std::set<size_t> seen;
      for (const MemoryEntry& entry : draft.memory) {
        auto gpu = resolve(entry.ref, where, "memory key", entry.line);
        if (!gpu) {
          draft.valid = false;
          continue;
        }
        const ManagedGpu& managed = gpus_[*gpu].gpu;
        draft.memory_line[*gpu] = entry.line;
        if (!seen.insert(*gpu).second) {
          error_in(where, entry.line, fmt::format("memory names GPU {} twice", managed.index));
          draft.valid = false;
          continue;
        }
        if (const auto problem = memory_quota_problem(entry.bytes, managed)) {
          error_in(where, entry.line, *problem);
          draft.valid = false;
          continue;
        }
        auto it = std::find_if(tenant.grants.begin(), tenant.grants.end(), [&](const Grant& g) { return g.gpu == *gpu; });
        if (it != tenant.grants.end()) {
          it->memory_quota = entry.bytes;  // overrides the fraction's share of memory
        } else if (tenant.gpus_ppm == 0) {
          tenant.grants.push_back({*gpu, 0, kPpmPerGpu, entry.bytes});
        } else {
          std::string placed;
          for (const Grant& g : tenant.grants)
            placed += fmt::format("{}{}", placed.empty() ? "" : ", ", gpus_[g.gpu].gpu.index);
          error_in(where, entry.line,
                   fmt::format("memory quota for GPU {}, but gpus placed the tenant on GPU {} (choose them with "
                               "devices = [...])",
                               managed.index, placed));
          draft.valid = false;
        }
      }
      if (draft.valid && tenant.grants.size() > ledger::kMaxGpus) {
        error_in(where, tenant.line,
                 fmt::format("is granted {} GPUs, above the {} a tenant may hold", tenant.grants.size(), ledger::kMaxGpus));
        draft.valid = false;
      }
      // Keep memory-only grants in config order of the GPUs, not key order.
      if (tenant.gpus_ppm == 0)
        std::sort(tenant.grants.begin(), tenant.grants.end(), [](const Grant& a, const Grant& b) { return a.gpu < b.gpu; });
    }
  }

  // Quotas on a GPU must fit in its memory unless overcommit is allowed. The
  // error goes to the tenant that tips a GPU over: that is where to edit.
  // Each quota must also hold at least one context.
  void check_memory_totals() {
    // API tenants' quotas are there first (reserve_api_tenants).
    std::vector<uint64_t> total = api_memory_;
    std::vector<std::string> holders = api_memory_holders_;
    std::vector<bool> reported(gpus_.size(), false);
    std::vector<uint32_t> count = api_tenants_;
    for (TenantDraft& draft : tenants_) {
      if (!draft.valid) continue;
      for (const Grant& g : draft.tenant.grants) {
        if (++count[g.gpu] == kMaxTenantsPerGpu + 1)
          error_in(fmt::format("tenant \"{}\"", draft.tenant.name), line_of_gpus(draft),
                   fmt::format("GPU {} would have more than {} tenants (API tenants included), the most one GPU's "
                               "time is shared among",
                               gpus_[g.gpu].gpu.index, kMaxTenantsPerGpu));
        total[g.gpu] += g.memory_quota;
        holders[g.gpu] += fmt::format("{}{} {}", holders[g.gpu].empty() ? "" : ", ", draft.tenant.name,
                                      format_size(g.memory_quota));
        const ManagedGpu& gpu = gpus_[g.gpu].gpu;
        const auto explicit_line = draft.memory_line.find(g.gpu);
        const int line = explicit_line != draft.memory_line.end() ? explicit_line->second : line_of_gpus(draft);
        // Fits the GPU and holds a context (tenant_rules.h).
        if (const auto problem = memory_quota_problem(g.memory_quota, gpu))
          error_in(fmt::format("tenant \"{}\"", draft.tenant.name), line, *problem);
        if (config_.daemon.allow_overcommit || reported[g.gpu] || total[g.gpu] <= gpu.memory_bytes) continue;
        reported[g.gpu] = true;
        error_in(fmt::format("tenant \"{}\"", draft.tenant.name), line,
                 fmt::format("memory quotas on GPU {} add up to {}, above its {} ({}); lower them or set "
                             "allow_overcommit = true in [daemon]",
                             gpu.index, format_size(total[g.gpu]), format_size(gpu.memory_bytes), holders[g.gpu]));
      }
    }
  }

  std::string source_;
  const std::vector<DiscoveredGpu>& node_;
  NodeConfig config_;
  std::vector<ConfigError> errors_;
  std::vector<GpuDraft> gpus_;
  std::vector<TenantDraft> tenants_;
  std::vector<uint32_t> free_;
  const PriorPlacement* prior_ = nullptr;
  const ApiTenants* api_ = nullptr;
  // Per [[gpu]]: what API tenants hold, and who ("\"dra-1\" 0.5, ...").
  std::vector<uint32_t> api_ppm_;
  std::vector<uint64_t> api_memory_;
  std::vector<uint32_t> api_tenants_;  // API tenants with a grant on each GPU
  std::vector<std::string> api_share_holders_;
  std::vector<std::string> api_memory_holders_;
};

}  // namespace

bool resolve_control_group(const std::string& group, DaemonSettings* settings, std::string* why) {
  // getgrnam_r and getpwnam_r: the buffer grows while they say ERANGE.
  std::vector<char> buffer(4096);
  struct group entry {};
  struct group* found = nullptr;
  int rc;
  while ((rc = getgrnam_r(group.c_str(), &entry, buffer.data(), buffer.size(), &found)) == ERANGE &&
         buffer.size() < (1u << 24))
    buffer.resize(buffer.size() * 2);
  if (rc != 0 || found == nullptr) {
    *why = rc != 0 ? fmt::format("cannot be looked up: {}", strerror(rc))
                   : std::string("is not a group on this node (see getent group)");
    return false;
  }
  settings->control_group = group;
  settings->control_gid = entry.gr_gid;
  settings->control_members.clear();
  for (char** member = entry.gr_mem; member != nullptr && *member != nullptr; ++member) {
    std::vector<char> user_buffer(4096);
    struct passwd user {};
    struct passwd* user_found = nullptr;
    while (getpwnam_r(*member, &user, user_buffer.data(), user_buffer.size(), &user_found) == ERANGE &&
           user_buffer.size() < (1u << 24))
      user_buffer.resize(user_buffer.size() * 2);
    // A member the user database does not know can never connect as anyone.
    if (user_found != nullptr) settings->control_members.push_back(user.pw_uid);
  }
  return true;
}

std::optional<LogLevel> parse_log_level(std::string_view text) {
  if (text == "trace") return LogLevel::kTrace;
  if (text == "debug") return LogLevel::kDebug;
  if (text == "info") return LogLevel::kInfo;
  if (text == "warn") return LogLevel::kWarn;
  if (text == "error") return LogLevel::kError;
  return std::nullopt;
}

std::optional<Priority> parse_priority(std::string_view text) {
  if (text == "latency") return Priority::kLatency;
  if (text == "normal") return Priority::kNormal;
  if (text == "batch") return Priority::kBatch;
  return std::nullopt;
}

std::string_view priority_name(Priority priority) {
  switch (priority) {
    case Priority::kLatency: return "latency";
    case Priority::kBatch: return "batch";
    case Priority::kNormal: break;
  }
  return "normal";
}

Priority priority_of_stored(uint32_t value) {
  if (value == static_cast<uint32_t>(Priority::kLatency)) return Priority::kLatency;
  if (value == static_cast<uint32_t>(Priority::kBatch)) return Priority::kBatch;
  return Priority::kNormal;
}

const ManagedGpu* NodeConfig::find_gpu(const GpuUuid& uuid) const {
  for (const ManagedGpu& g : gpus)
    if (g.uuid_bytes == uuid) return &g;
  return nullptr;
}

const Tenant* NodeConfig::find_tenant(std::string_view name) const {
  for (const Tenant& t : tenants)
    if (t.name == name) return &t;
  return nullptr;
}

std::string ConfigError::to_string() const {
  // Line 0: about the file as a whole (it cannot be read), not a line of it.
  if (line <= 0) return fmt::format("{}: {}", file, message);
  return fmt::format("{}:{}: {}", file, line, message);
}

ConfigResult parse_config(std::string_view text, std::string_view source, const std::vector<DiscoveredGpu>& node,
                          const PriorPlacement* prior, const ApiTenants* api) {
  return Parser(source, node, prior, api).run(text);
}

ConfigResult load_config(const std::string& path, const std::vector<DiscoveredGpu>& node, const PriorPlacement* prior,
                         const ApiTenants* api) {
  std::string why;
  std::optional<std::string> text = read_config_file(path, &why);
  if (!text) {
    ConfigResult result;
    result.errors.push_back({path, 0, "cannot read the config file: " + why});
    return result;
  }
  return parse_config(*text, path, node, prior, api);
}

}  // namespace fracgpu::controller
