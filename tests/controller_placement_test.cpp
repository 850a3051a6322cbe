// Placement of `gpus` without `devices`: the bundle and spread policies, their
// determinism, keeping running tenants where they are (prior placement), and
// the [daemon] keys that choose the policy and the metrics address.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "config/config.h"
#include "daemon/metrics.h"
#include "config/placement.h"
#include "common/uuid.h"

using namespace fracgpu::controller;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint32_t kHalf = 500'000;
constexpr uint32_t kQuarter = 250'000;
constexpr uint32_t kWhole = 1'000'000;
const char* const kUuids[] = {"GPU-00000000-1111-2222-3333-444444444444", "GPU-aaaaaaaa-1111-2222-3333-444444444444",
                              "GPU-bbbbbbbb-1111-2222-3333-444444444444"};

GpuUuid uuid(size_t i) { return *parse_gpu_uuid(kUuids[i]); }

std::vector<PlacementGpu> gpus(size_t n) {
  std::vector<PlacementGpu> out;
  for (size_t i = 0; i < n; ++i) out.push_back({uuid(i), true, kWhole});
  return out;
}

size_t whole_gpus_free(const std::vector<PlacementGpu>& g) {
  size_t n = 0;
  for (const PlacementGpu& x : g) n += x.free_ppm == kWhole ? 1 : 0;
  return n;
}

// The GPU index of each tenant's single grant.
std::vector<size_t> single_gpus(const std::vector<PlacementResult>& results) {
  std::vector<size_t> out;
  for (const PlacementResult& r : results) {
    EXPECT_TRUE(r.placed);
    EXPECT_EQ(r.grants.size(), 1u);
    out.push_back(r.grants.empty() ? 99 : r.grants[0].first);
  }
  return out;
}

std::vector<DiscoveredGpu> node() {
  return {{0, kUuids[0], "Sim A", 80 * kGiB}, {1, kUuids[1], "Sim B", 80 * kGiB}, {2, kUuids[2], "Sim C", 80 * kGiB}};
}

const std::string kTwoGpus = "[[gpu]]\nindex = 0\n[[gpu]]\nindex = 1\n";

ConfigResult parse(const std::string& text, const PriorPlacement* prior = nullptr) {
  return parse_config(text, "test.toml", node(), prior);
}

std::string all_errors(const ConfigResult& r) {
  std::string out;
  for (const ConfigError& e : r.errors) out += e.to_string() + "\n";
  return out;
}

TEST(Placement, BundleKeepsAWholeGpuFreeWhereSpreadDoesNot) {
  const std::vector<PlacementAsk> asks{{"a", kHalf}, {"b", kQuarter}};
  auto bundle = gpus(2);
  EXPECT_EQ(single_gpus(place_automatic(PlacementPolicy::kBundle, bundle, asks, nullptr)), (std::vector<size_t>{0, 0}));
  EXPECT_EQ(whole_gpus_free(bundle), 1u);
  auto spread = gpus(2);
  EXPECT_EQ(single_gpus(place_automatic(PlacementPolicy::kSpread, spread, asks, nullptr)), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(whole_gpus_free(spread), 0u);
}

TEST(Placement, ThroughTheConfigAWholeGpuJobFitsOnlyUnderBundle) {
  const std::string tenants =
      "[[tenant]]\nname = \"a\"\ngpus = 0.5\n[[tenant]]\nname = \"b\"\ngpus = 0.25\n[[tenant]]\nname = \"big\"\ngpus = 1\n";
  const ConfigResult bundle = parse("[daemon]\nplacement = \"bundle\"\n" + kTwoGpus + tenants);
  ASSERT_TRUE(bundle.ok()) << all_errors(bundle);
  EXPECT_EQ(bundle.config->daemon.placement, PlacementPolicy::kBundle);
  EXPECT_EQ(bundle.config->tenants[0].grants[0].gpu, 0u);
  EXPECT_EQ(bundle.config->tenants[1].grants[0].gpu, 0u);
  EXPECT_EQ(bundle.config->tenants[2].grants[0].gpu, 1u);
  EXPECT_EQ(bundle.config->tenants[2].placement, PlacementReason::kPolicy);

  const ConfigResult spread = parse("[daemon]\nplacement = \"spread\"\n" + kTwoGpus + tenants);
  ASSERT_FALSE(spread.ok());
  ASSERT_EQ(spread.errors.size(), 1u) << all_errors(spread);
  EXPECT_EQ(spread.errors[0].line, 15);  // big's `gpus`
  EXPECT_NE(spread.errors[0].message.find("tenant \"big\": cannot place gpus = 1: no other configured GPU has 1 "
                                          "unallocated (unallocated: GPU 0: 0.5, GPU 1: 0.75)"),
            std::string::npos)
      << all_errors(spread);
}

TEST(Placement, BundleIsBestFitAndSpreadIsLeastLoaded) {
  // After a = 0.5 on GPU 0 and b = 0.75 on GPU 1 (the only one it fits),
  // GPU 0 has 0.5 free and GPU 1 has 0.25; a 0.2 goes to the fuller GPU 1
  // under bundle, to the emptier GPU 0 under spread.
  const std::vector<PlacementAsk> asks{{"a", kHalf}, {"b", 750'000}, {"c", 200'000}};
  auto bundle = gpus(2);
  EXPECT_EQ(single_gpus(place_automatic(PlacementPolicy::kBundle, bundle, asks, nullptr)),
            (std::vector<size_t>{0, 1, 1}));
  auto spread = gpus(2);
  EXPECT_EQ(single_gpus(place_automatic(PlacementPolicy::kSpread, spread, asks, nullptr)),
            (std::vector<size_t>{0, 1, 0}));
  // Three halves on three GPUs: spread gives each its own GPU, bundle packs two.
  const std::vector<PlacementAsk> halves{{"x", kHalf}, {"y", kHalf}, {"z", kHalf}};
  auto g3 = gpus(3);
  EXPECT_EQ(single_gpus(place_automatic(PlacementPolicy::kSpread, g3, halves, nullptr)), (std::vector<size_t>{0, 1, 2}));
  auto b3 = gpus(3);
  EXPECT_EQ(single_gpus(place_automatic(PlacementPolicy::kBundle, b3, halves, nullptr)), (std::vector<size_t>{0, 0, 1}));
  EXPECT_EQ(whole_gpus_free(b3), 1u);
}

TEST(Placement, MultiGpuAsksTakeDistinctGpusWholeOnesFirst) {
  for (PlacementPolicy policy : {PlacementPolicy::kBundle, PlacementPolicy::kSpread}) {
    auto g = gpus(3);
    g[2].free_ppm = kHalf;  // a pinned tenant holds half of GPU 2
    const auto r = place_automatic(policy, g, {{"big", 2'500'000}}, nullptr);
    ASSERT_TRUE(r[0].placed);
    ASSERT_EQ(r[0].grants.size(), 3u);
    EXPECT_EQ(r[0].grants[0], (std::pair<size_t, uint32_t>{0, kWhole}));
    EXPECT_EQ(r[0].grants[1], (std::pair<size_t, uint32_t>{1, kWhole}));
    EXPECT_EQ(r[0].grants[2], (std::pair<size_t, uint32_t>{2, kHalf}));
  }
}

TEST(Placement, AFailedTenantGivesBackItsPartialPieces) {
  auto g = gpus(2);
  g[1].free_ppm = kQuarter;
  // 1.5: the whole piece lands on GPU 0, then 0.5 fits nowhere else.
  const auto r = place_automatic(PlacementPolicy::kBundle, g, {{"big", 1'500'000}, {"small", kHalf}}, nullptr);
  EXPECT_FALSE(r[0].placed);
  EXPECT_EQ(r[0].failed_piece, kHalf);
  EXPECT_TRUE(r[0].grants.empty());
  ASSERT_TRUE(r[1].placed);
  EXPECT_EQ(r[1].grants[0].first, 0u);  // GPU 0 was given back
  EXPECT_EQ(g[0].free_ppm, kHalf);
  EXPECT_EQ(g[1].free_ppm, kQuarter);
}

TEST(Placement, IsDeterministic) {
  const std::vector<PlacementAsk> asks{{"a", 300'000}, {"b", 1'700'000}, {"c", 600'000}, {"d", 100'000},
                                       {"e", 400'000}};
  for (PlacementPolicy policy : {PlacementPolicy::kBundle, PlacementPolicy::kSpread}) {
    auto first = gpus(3);
    const auto expected = place_automatic(policy, first, asks, nullptr);
    for (int i = 0; i < 20; ++i) {
      auto again = gpus(3);
      const auto r = place_automatic(policy, again, asks, nullptr);
      ASSERT_EQ(r.size(), expected.size());
      for (size_t t = 0; t < r.size(); ++t) {
        EXPECT_EQ(r[t].placed, expected[t].placed);
        EXPECT_EQ(r[t].grants, expected[t].grants);
      }
    }
  }
}

TEST(Placement, RunningTenantsKeepTheirGpus) {
  // Under bundle, a = 0.5 would go to GPU 0; it runs on GPU 1 already.
  const PriorPlacement prior{{"a", {{uuid(1), kHalf}}}};
  auto g = gpus(2);
  // "new" is listed first but must not take a's place: kept tenants go first.
  const auto r = place_automatic(PlacementPolicy::kBundle, g, {{"new", kHalf}, {"a", kHalf}}, &prior);
  ASSERT_TRUE(r[1].placed);
  EXPECT_EQ(r[1].reason, PlacementReason::kKept);
  EXPECT_EQ(r[1].grants[0], (std::pair<size_t, uint32_t>{1, kHalf}));
  EXPECT_EQ(r[0].reason, PlacementReason::kPolicy);
  EXPECT_EQ(r[0].grants[0].first, 1u);  // bundle: next to a

  // A multi-GPU tenant keeps every piece, in any order of its GPUs.
  const PriorPlacement big{{"big", {{uuid(2), kHalf}, {uuid(0), kWhole}}}};
  auto g3 = gpus(3);
  const auto rb = place_automatic(PlacementPolicy::kBundle, g3, {{"big", 1'500'000}}, &big);
  EXPECT_EQ(rb[0].reason, PlacementReason::kKept);
  EXPECT_EQ(rb[0].grants, (std::vector<std::pair<size_t, uint32_t>>{{2, kHalf}, {0, kWhole}}));
}

TEST(Placement, PriorPlacementIsDroppedWhenTheConfigNoLongerAllowsIt) {
  const PriorPlacement prior{{"a", {{uuid(1), kHalf}}}};
  // `gpus` changed: placed afresh, preferring the GPU it runs on.
  auto g = gpus(2);
  auto r = place_automatic(PlacementPolicy::kBundle, g, {{"a", 750'000}}, &prior);
  EXPECT_EQ(r[0].reason, PlacementReason::kPolicy);
  EXPECT_EQ(r[0].grants[0].first, 1u);
  // Its GPU has no room left (a pinned tenant took it).
  g = gpus(2);
  g[1].free_ppm = kQuarter;
  r = place_automatic(PlacementPolicy::kBundle, g, {{"a", kHalf}}, &prior);
  EXPECT_EQ(r[0].reason, PlacementReason::kPolicy);
  EXPECT_EQ(r[0].grants[0].first, 0u);
  // Its GPU is no longer configured.
  const PriorPlacement gone{{"a", {{*parse_gpu_uuid("GPU-ffffffff-1111-2222-3333-444444444444"), kHalf}}}};
  g = gpus(2);
  r = place_automatic(PlacementPolicy::kBundle, g, {{"a", kHalf}}, &gone);
  EXPECT_EQ(r[0].reason, PlacementReason::kPolicy);
}

// The audit's case: bundle places x, y, z = 0.5 as GPU 0, 0, 1. Only z runs
// at the next start; x and y are idle but unchanged and must stay where
// their pods are pinned (without the record, x would move to GPU 1, next to z).
TEST(Placement, IdleUnchangedTenantsStayWhereTheyWere) {
  const std::vector<PlacementAsk> asks{{"x", kHalf}, {"y", kHalf}, {"z", kHalf}};
  auto first = gpus(2);
  const auto r1 = place_automatic(PlacementPolicy::kBundle, first, asks, nullptr);
  ASSERT_EQ(r1[0].grants[0].first, 0u);
  ASSERT_EQ(r1[1].grants[0].first, 0u);
  ASSERT_EQ(r1[2].grants[0].first, 1u);
  const PriorPlacement prior{{"z", {{uuid(1), kHalf, true}}},
                             {"x", {{uuid(0), kHalf, false}}},
                             {"y", {{uuid(0), kHalf, false}}}};
  auto g = gpus(2);
  const auto r = place_automatic(PlacementPolicy::kBundle, g, asks, &prior);
  EXPECT_EQ(r[0].grants[0].first, 0u);
  EXPECT_EQ(r[1].grants[0].first, 0u);
  EXPECT_EQ(r[2].grants[0].first, 1u);
  EXPECT_EQ(r[0].reason, PlacementReason::kUnchanged);
  EXPECT_EQ(r[2].reason, PlacementReason::kKept);

  // Keeping an idle tenant must not make the config unplaceable: x (idle,
  // GPU 0) blocks "whole"; placement is redone with x free to move.
  const PriorPlacement idle_x{{"x", {{uuid(0), kHalf, false}}}, {"z", {{uuid(1), kHalf, true}}}};
  g = gpus(2);
  const auto rw = place_automatic(PlacementPolicy::kBundle, g, {{"x", kHalf}, {"z", kHalf}, {"whole", kWhole}},
                                  &idle_x);
  ASSERT_TRUE(rw[0].placed && rw[1].placed && rw[2].placed);
  EXPECT_EQ(rw[0].grants[0].first, 1u);  // x moved next to z (idle: allowed)
  EXPECT_EQ(rw[1].reason, PlacementReason::kKept);
  EXPECT_EQ(rw[2].grants[0].first, 0u);
}

// A running tenant whose `gpus` changed is placed afresh, but on its current
// GPU when that has room (bundle alone would put 0.75 on the fuller GPU 1).
TEST(Placement, AResizedTenantPrefersItsCurrentGpu) {
  const PriorPlacement prior{{"a", {{uuid(0), kHalf, true}}}};
  auto g = gpus(2);
  g[1].free_ppm = 800'000;  // a pinned tenant holds 0.2 of GPU 1
  const auto r = place_automatic(PlacementPolicy::kBundle, g, {{"new", kQuarter}, {"a", 750'000}}, &prior);
  ASSERT_TRUE(r[1].placed);
  EXPECT_EQ(r[1].reason, PlacementReason::kPolicy);
  EXPECT_EQ(r[1].grants[0].first, 0u);
  // Placed before "new" (running tenants first), so "new" cannot take its room.
  EXPECT_EQ(r[0].grants[0].first, 0u);
  // Warned when it does move: its GPU had no room.
  const auto moved = running_tenants_moved(prior, {{"a", {"GPU-x"}}});
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_NE(moved[0].find("tenant \"a\" has running processes on " + format_gpu_uuid(uuid(0)) +
                          " but is now placed on GPU-x"),
            std::string::npos)
      << moved[0];
  EXPECT_TRUE(running_tenants_moved(prior, {{"a", {format_gpu_uuid(uuid(0))}}}).empty());
  const PriorPlacement idle{{"a", {{uuid(0), kHalf, false}}}};
  EXPECT_TRUE(running_tenants_moved(idle, {{"a", {"GPU-x"}}}).empty());  // idle: nothing stranded
}

TEST(Placement, RecordKeepsGrantsAcrossWriteAndRead) {
  char dir[] = "/tmp/fracgpu-place-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  PlacementRecord record;
  record.policy = "bundle";
  record.why = {{"x", "policy"}};
  record.grants = {{"x", {{format_gpu_uuid(uuid(1)), kHalf}}}};
  std::string error;
  ASSERT_TRUE(write_placement_record(dir, record, &error)) << error;
  const auto back = read_placement_record(dir);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->grants, record.grants);
  PriorPlacement prior{{"running", {{uuid(0), kWhole, true}}}};
  add_recorded_placement(dir, &prior);
  ASSERT_EQ(prior.count("x"), 1u);
  EXPECT_FALSE(prior.at("x")[0].running);
  EXPECT_EQ(prior.at("x")[0].uuid, uuid(1));
  std::filesystem::remove_all(dir);
}

TEST(Placement, ConfigRecordsWhyEachTenantIsWhereItIs) {
  const PriorPlacement prior{{"kept", {{uuid(1), kQuarter}}}};
  const ConfigResult r = parse(kTwoGpus +
                                   "[[tenant]]\nname = \"auto\"\ngpus = 0.5\n"
                                   "[[tenant]]\nname = \"pinned\"\ngpus = 0.25\ndevices = [1]\n"
                                   "[[tenant]]\nname = \"kept\"\ngpus = 0.25\n"
                                   "[[tenant]]\nname = \"mem\"\nmemory = { \"0\" = \"1GiB\" }\n",
                               &prior);
  ASSERT_TRUE(r.ok()) << all_errors(r);
  EXPECT_EQ(r.config->find_tenant("auto")->placement, PlacementReason::kPolicy);
  EXPECT_EQ(r.config->find_tenant("pinned")->placement, PlacementReason::kPinned);
  EXPECT_EQ(r.config->find_tenant("kept")->placement, PlacementReason::kKept);
  EXPECT_EQ(r.config->find_tenant("kept")->grants[0].gpu, 1u);
  EXPECT_EQ(r.config->find_tenant("mem")->placement, PlacementReason::kMemoryOnly);
  // bundle: GPU 1 (0.5 free after pinned and kept) is fuller than GPU 0.
  EXPECT_EQ(r.config->find_tenant("auto")->grants[0].gpu, 1u);
}

TEST(PlacementConfig, DefaultsAndBadValues) {
  const ConfigResult def = parse(kTwoGpus);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def.config->daemon.placement, PlacementPolicy::kBundle);
  EXPECT_EQ(def.config->daemon.metrics_address, "127.0.0.1:9410");

  const ConfigResult bad = parse("[daemon]\n\nplacement = \"pack\"\n" + kTwoGpus);
  ASSERT_EQ(bad.errors.size(), 1u);
  EXPECT_EQ(bad.errors[0].to_string(),
            "test.toml:3: [daemon]: placement \"pack\" is not a placement policy (use bundle, spread)");
  const ConfigResult typed = parse("[daemon]\nplacement = 1\n" + kTwoGpus);
  ASSERT_EQ(typed.errors.size(), 1u);
  EXPECT_EQ(typed.errors[0].to_string(), "test.toml:2: [daemon]: placement must be a string, not an integer");
}

TEST(PlacementConfig, LivenessTimeout) {
  const ConfigResult def = parse(kTwoGpus);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def.config->daemon.liveness_timeout, std::chrono::seconds(30));
  const ConfigResult set = parse("[daemon]\nliveness_timeout = \"5s\"\n" + kTwoGpus);
  ASSERT_TRUE(set.ok()) << all_errors(set);
  EXPECT_EQ(set.config->daemon.liveness_timeout, std::chrono::seconds(5));
  const ConfigResult small = parse("[daemon]\nliveness_timeout = \"100ms\"\n" + kTwoGpus);
  ASSERT_EQ(small.errors.size(), 1u);
  EXPECT_NE(small.errors[0].to_string().find("test.toml:2: [daemon]: liveness_timeout \"100ms\" is out of range"),
            std::string::npos)
      << small.errors[0].to_string();
  const ConfigResult ticks = parse("[daemon]\nreap_interval_ms = 1000\nliveness_timeout = \"2s\"\n" + kTwoGpus);
  ASSERT_EQ(ticks.errors.size(), 1u);
  EXPECT_NE(ticks.errors[0].to_string().find("test.toml:3: [daemon]: liveness_timeout \"2s\" must be at least 3 "
                                             "times reap_interval_ms (1000 ms)"),
            std::string::npos)
      << ticks.errors[0].to_string();
}

TEST(PlacementConfig, MetricsAddress) {
  auto address = [](const std::string& value) {
    const ConfigResult r = parse("[daemon]\nmetrics_address = \"" + value + "\"\n" + kTwoGpus);
    return r.ok() ? r.config->daemon.metrics_address : "error: " + all_errors(r);
  };
  EXPECT_EQ(address("off"), "");
  EXPECT_EQ(address(""), "");
  EXPECT_EQ(address("0.0.0.0:9999"), "0.0.0.0:9999");
  EXPECT_EQ(address("[::1]:9410"), "[::1]:9410");
  EXPECT_EQ(address("localhost:0"), "localhost:0");
  EXPECT_EQ(address("9410"), "error: test.toml:2: [daemon]: metrics_address \"9410\" has no port (write host:port, "
                             "e.g. \"127.0.0.1:9410\", or \"off\")\n");
  EXPECT_NE(address("127.0.0.1:65536").find("test.toml:2: [daemon]: metrics_address \"127.0.0.1:65536\" has a bad port"),
            std::string::npos);
  EXPECT_NE(address("127.0.0.1:http").find("has a bad port \"http\""), std::string::npos);
  EXPECT_NE(address("metrics.example:9410").find("is not a numeric IP address"), std::string::npos);
  std::string why;
  const auto v6 = parse_host_port("[::1]:80", &why);
  ASSERT_TRUE(v6);
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 80);
  EXPECT_EQ(format_host_port(*v6), "[::1]:80");
  EXPECT_EQ(parse_host_port("localhost:9", &why)->host, "127.0.0.1");
}

}  // namespace
