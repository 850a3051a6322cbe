#include "state/live_view.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

#include <fmt/format.h>

#include "common/text_escape.h"
#include "common/units.h"
#include "config/config.h"

namespace fracgpu::controller {

std::optional<double> parse_interval_seconds(std::string_view text, std::string* why) {
  const std::string s(text);
  char* end = nullptr;
  // Digits and one point only: no sign, exponent, "inf" or "nan", which
  // strtod would take.
  const bool plain = !s.empty() && s.find_first_not_of("0123456789.") == std::string::npos &&
                     std::count(s.begin(), s.end(), '.') <= 1 && s != ".";
  const double value = plain ? std::strtod(s.c_str(), &end) : 0;
  if (!plain || end != s.c_str() + s.size() || !std::isfinite(value) || value < kLiveMinIntervalS ||
      value > kLiveMaxIntervalS) {
    *why = fmt::format("\"{}\" is not a number of seconds from {} to {} (e.g. 1 or 0.5)", escape_terminal(s),
                       kLiveMinIntervalS, kLiveMaxIntervalS);
    return std::nullopt;
  }
  return value;
}

std::optional<LiveOrder> parse_live_order(std::string_view text) {
  if (text == "gpu") return LiveOrder::kGpuTime;
  if (text == "memory") return LiveOrder::kMemory;
  if (text == "name") return LiveOrder::kName;
  return std::nullopt;
}

std::string_view live_order_description(LiveOrder order) {
  switch (order) {
    case LiveOrder::kGpu: return "by GPU, then tenant";
    case LiveOrder::kGpuTime: return "by GPU time over the last second";
    case LiveOrder::kMemory: return "by memory used";
    case LiveOrder::kName: return "by tenant name";
  }
  return "";
}

void GpuTimeReadings::record(const StatusReport& report, uint64_t now_ns) {
  std::set<std::pair<std::string, std::string>> seen;
  for (const TenantStatus& t : report.tenants)
    for (const GpuEntryStatus& g : t.gpus) {
      if (!g.gpu_time) continue;
      const GpuTimeStatus& time = *g.gpu_time;
      auto key = std::make_pair(t.name, g.uuid);
      seen.insert(key);
      Series& series = series_[key];
      const Reading reading{now_ns, time.measured ? time.measured_ns : time.used_ns, time.throttled_ns};
      if (!series.readings.empty()) {
        const Reading& last = series.readings.back();
        if (series.measured != time.measured || reading.used_ns < last.used_ns ||
            reading.throttled_ns < last.throttled_ns || now_ns <= last.at_ns)
          series.readings.clear();
      }
      series.measured = time.measured;
      series.readings.push_back(reading);
      // Keep what the long window may use: readings up to twice its age.
      while (series.readings.size() > 2 && now_ns - series.readings[1].at_ns >= 2 * kLiveLongWindowNs)
        series.readings.pop_front();
    }
  std::erase_if(series_, [&](const auto& entry) { return !seen.contains(entry.first); });
}

std::optional<WindowShare> GpuTimeReadings::share(const std::string& tenant, const std::string& uuid,
                                                  uint64_t window_ns, uint64_t Reading::*counter) const {
  const auto it = series_.find({tenant, uuid});
  if (it == series_.end() || it->second.readings.size() < 2) return std::nullopt;
  const std::deque<Reading>& readings = it->second.readings;
  const Reading& latest = readings.back();
  // The earlier reading whose age is closest to the window (the oldest,
  // while none is that old yet).
  const Reading* base = &readings.front();
  uint64_t best = UINT64_MAX;
  for (size_t i = 0; i + 1 < readings.size(); ++i) {
    const uint64_t age = latest.at_ns - readings[i].at_ns;
    const uint64_t off = age > window_ns ? age - window_ns : window_ns - age;
    if (off < best) {
      best = off;
      base = &readings[i];
    }
  }
  WindowShare out;
  out.span_ns = latest.at_ns - base->at_ns;
  const uint64_t delta = latest.*counter - base->*counter;
  out.ppm = static_cast<uint32_t>(
      std::min<unsigned __int128>(static_cast<unsigned __int128>(delta) * 1'000'000 / out.span_ns, 1'000'000));
  return out;
}

std::optional<WindowShare> GpuTimeReadings::used(const std::string& tenant, const std::string& uuid,
                                                 uint64_t window_ns) const {
  return share(tenant, uuid, window_ns, &Reading::used_ns);
}

std::optional<WindowShare> GpuTimeReadings::throttled(const std::string& tenant, const std::string& uuid,
                                                      uint64_t window_ns) const {
  return share(tenant, uuid, window_ns, &Reading::throttled_ns);
}

namespace {

// A window's span is off by more than a tenth: the cell gets a "*".
bool off_window(const WindowShare& s, uint64_t window_ns) {
  const uint64_t tenth = window_ns / 10;
  return s.span_ns + tenth < window_ns || s.span_ns > window_ns + tenth;
}

struct GpuHealthView {
  std::map<std::string, int64_t> index;  // driver ordinal by UUID, from health.json
  std::map<std::string, std::string> health;  // "ok", "UNHEALTHY (xid)" by UUID
};

GpuHealthView gpu_health_view(const std::optional<nlohmann::json>& h) {
  GpuHealthView view;
  if (!h || !h->value("nvml", false)) return view;
  for (const auto& g : h->value("gpus", nlohmann::json::array())) {
    if (!g.is_object()) continue;
    const std::string uuid = g.value("uuid", std::string());
    if (uuid.empty()) continue;
    view.index[uuid] = g.value("index", int64_t{-1});
    view.health[uuid] =
        g.value("healthy", true) ? "ok" : fmt::format("UNHEALTHY ({})", g.value("reason", std::string("?")));
  }
  return view;
}

}  // namespace

std::vector<std::string> live_view_lines(const std::optional<StatusReport>& report, const std::string& error,
                                         const GpuTimeReadings& readings, const LiveFrameInfo& info) {
  std::vector<std::string> lines;
  lines.push_back(fmt::format("{} on {}  {}  every {} s, {}", info.title, escape_terminal(info.node), info.clock,
                              info.interval_s, live_order_description(info.order)));
  if (!report) {
    lines.push_back(fmt::format("cannot read the run dir: {}", escape_terminal(error)));
    lines.push_back(fmt::format("trying again every {} s (Ctrl-C quits)", info.interval_s));
    return lines;
  }
  lines.push_back(fmt::format("daemon: {}  run dir: {}", daemon_summary(report->daemon),
                              escape_terminal(report->run_dir)));
  if (!report->daemon.alive)
    lines.push_back(
        "fracgpud is not running: its counters stand still (GPU-time shares fall to 0%), the rest is as it left it");
  lines.emplace_back();

  std::vector<GpuRow> rows = gpu_rows(*report);
  const auto used = [&](const GpuRow& r, uint64_t window) -> std::optional<WindowShare> {
    if (r.gpu == nullptr) return std::nullopt;
    return readings.used(r.tenant->name, r.gpu->uuid, window);
  };
  // Missing figures sort last.
  const auto ppm_key = [](const std::optional<WindowShare>& s) { return s ? int64_t{s->ppm} : int64_t{-1}; };
  switch (info.order) {
    case LiveOrder::kGpu: break;
    case LiveOrder::kGpuTime:
      std::stable_sort(rows.begin(), rows.end(), [&](const GpuRow& a, const GpuRow& b) {
        const auto ka = std::make_pair(ppm_key(used(a, kLiveShortWindowNs)), ppm_key(used(a, kLiveLongWindowNs)));
        const auto kb = std::make_pair(ppm_key(used(b, kLiveShortWindowNs)), ppm_key(used(b, kLiveLongWindowNs)));
        return ka > kb;
      });
      break;
    case LiveOrder::kMemory:
      std::stable_sort(rows.begin(), rows.end(), [](const GpuRow& a, const GpuRow& b) {
        const auto bytes = [](const GpuRow& r) { return r.gpu ? int64_t(r.gpu->memory_used) : int64_t{-1}; };
        return bytes(a) > bytes(b);
      });
      break;
    case LiveOrder::kName:
      std::stable_sort(rows.begin(), rows.end(),
                       [](const GpuRow& a, const GpuRow& b) { return a.tenant->name < b.tenant->name; });
      break;
  }

  const GpuHealthView health = gpu_health_view(report->gpu_health);
  const auto gpu_name = [&](const std::string& uuid) {
    const auto it = health.index.find(uuid);
    return it != health.index.end() && it->second >= 0 ? std::to_string(it->second) : uuid.substr(0, 12);
  };
  bool starred = false;
  const auto window_cell = [&](const std::optional<WindowShare>& s, uint64_t window) -> std::string {
    if (!s) return "-";
    const bool off = off_window(*s, window);
    starred = starred || off;
    return format_ppm_percent(s->ppm) + (off ? "*" : "");
  };
  std::vector<std::vector<std::string>> table{
      {"GPU", "TENANT", "SHARE", "LIMIT", "1S", "10S", "MEMORY", "THROTTLED", "PRIORITY", "HEALTH"}};
  for (size_t i = 0; i < rows.size(); ++i) {
    const GpuRow& r = rows[i];
    std::string tenant = r.tenant->name;
    if (r.tenant->state != "active") tenant += " (" + r.tenant->state + ")";
    if (r.gpu == nullptr) {
      table.push_back({"none", tenant, "-", "-", "-", "-", "-", "-", "-", "-"});
      continue;
    }
    const GpuEntryStatus& g = *r.gpu;
    if (g.state != "granted") tenant += " (" + g.state + ")";
    const std::optional<GpuTimeStatus>& time = g.gpu_time;
    std::string cell_health = health.health.contains(g.uuid) ? health.health.at(g.uuid) : "-";
    // The tenant's own policy mark is what refuses its new processes.
    if (g.unavailable == "bypass")
      cell_health = "DENIED (bypass)";
    else if (!g.unavailable.empty())
      cell_health = fmt::format("UNHEALTHY ({})", g.unavailable);
    const bool same_gpu = i > 0 && rows[i - 1].gpu != nullptr && rows[i - 1].gpu->uuid == g.uuid;
    table.push_back({same_gpu ? "" : gpu_name(g.uuid), tenant, format_share(g.share_ppm), format_share(g.limit_ppm),
                     window_cell(used(r, kLiveShortWindowNs), kLiveShortWindowNs),
                     window_cell(used(r, kLiveLongWindowNs), kLiveLongWindowNs),
                     fmt::format("{} / {}", format_size(g.memory_used),
                                 g.memory_quota ? format_size(*g.memory_quota) : "unlimited"),
                     window_cell(time ? readings.throttled(r.tenant->name, g.uuid, kLiveLongWindowNs) : std::nullopt,
                                 kLiveLongWindowNs),
                     time ? time->priority : "-", cell_health});
  }
  if (rows.empty()) {
    lines.push_back("no tenant");
  } else {
    std::string text = render_table(std::move(table));
    size_t start = 0;
    for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1)
      lines.push_back(text.substr(start, end - start));
  }
  lines.emplace_back();
  lines.push_back(
      "1S, 10S: GPU time used over the last 1 s, 10 s; THROTTLED: of the last 10 s, time waiting for the GPU");
  if (starred)
    lines.push_back(
        "*: not over the column's whole window: fracgpu has not been reading that long (or a reading was late)");
  size_t unreadable = 0;
  for (const TenantStatus& t : report->tenants) unreadable += t.error.empty() ? 0 : 1;
  if (unreadable > 0)
    lines.push_back(fmt::format("{} tenant ledger{} cannot be read: `fracgpu status` says why", unreadable,
                                unreadable == 1 ? "" : "s"));
  return lines;
}

}  // namespace fracgpu::controller
