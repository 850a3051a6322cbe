// Config parsing and validation: every kind of bad config is reported with its
// file, line and reason; good configs resolve to the expected placement.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "config/config.h"
#include "controller_test_util.h"
#include "common/units.h"
#include "common/uuid.h"

using namespace fracgpu::controller;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;
const char* const kUuid0 = "GPU-00000000-1111-2222-3333-444444444444";
const char* const kUuid1 = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
const char* const kUuid2 = "GPU-bbbbbbbb-1111-2222-3333-444444444444";

// Three 80 GiB GPUs, as discovery would report them.
std::vector<DiscoveredGpu> node() {
  return {{0, kUuid0, "Sim A", 80 * kGiB}, {1, kUuid1, "Sim B", 80 * kGiB}, {2, kUuid2, "Sim C", 80 * kGiB}};
}

ConfigResult parse(const std::string& text) { return parse_config(text, "test.toml", node()); }

// The config must be rejected with an error at `line` whose message contains `part`.
void expect_error(const std::string& text, int line, const std::string& part) {
  const ConfigResult r = parse(text);
  EXPECT_FALSE(r.ok()) << text;
  bool found = false;
  std::string all;
  for (const ConfigError& e : r.errors) {
    all += e.to_string() + "\n";
    EXPECT_EQ(e.file, "test.toml");
    if (e.line == line && e.message.find(part) != std::string::npos) found = true;
  }
  EXPECT_TRUE(found) << "expected test.toml:" << line << ": ..." << part << "...\ngot:\n" << all;
}

const std::string kGpu0 = "[[gpu]]\nindex = 0\n";  // lines 1-2 of most configs below

// ---- Bad configs: one test per kind of error ----

TEST(ConfigErrors, TomlSyntaxErrorHasItsLine) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"alice\"\ngpus = \n", 5, "TOML syntax error");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nname = \"b\"\n", 5, "TOML syntax error");  // duplicate key
}

TEST(ConfigErrors, UnknownKeySuggestsTheNearestKnownOne) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"alice\"\ngpus = 0.5\nmemroy = \"1GiB\"\n", 6,
               "tenant \"alice\": unknown key \"memroy\" (did you mean \"memory\"?)");
  expect_error("[daemon]\nrundir = \"/x\"\n" + kGpu0, 2, "[daemon]: unknown key \"rundir\" (did you mean \"run_dir\"?)");
  expect_error(kGpu0 + "conetxt_memory = 5\n", 3, "[[gpu]] index 0: unknown key \"conetxt_memory\"");
  expect_error(kGpu0 + "[[tenants]]\nname = \"x\"\n", 3, "unknown key \"tenants\" (did you mean \"tenant\"?)");
  expect_error(kGpu0 + "[frobnicate]\n", 3, "unknown key \"frobnicate\" (known keys: daemon, gpu, tenant)");
}

TEST(ConfigErrors, WrongType) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"alice\"\ngpus = \"half\"\n", 5,
               "tenant \"alice\": gpus must be a number of GPUs such as 0.5 or 2, not a string");
  expect_error("[daemon]\nallow_overcommit = \"yes\"\n" + kGpu0, 2, "allow_overcommit must be true or false, not a string");
  expect_error("[daemon]\nreap_interval_ms = 1.5\n" + kGpu0, 2, "reap_interval_ms must be an integer, not a float");
  expect_error(kGpu0 + "[[tenant]]\nname = 7\ngpus = 1\n", 4, "[[tenant]]: name must be a string, not an integer");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 1\ndevices = 0\n", 6, "devices must be an array");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = \"1GiB\"\n", 5, "memory must be a table of per-GPU quotas");
  expect_error("[gpu]\nindex = 0\n", 1, "gpu must be an array of tables ([[gpu]]), not a table");
  expect_error(kGpu0 + "memory = 1.5\n", 3, "memory must be a size such as \"16GiB\" or an integer number of bytes");
}

TEST(ConfigErrors, UnknownUnit) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"alice\"\n[tenant.memory]\n\"0\" = \"12 gb\"\n", 6,
               "tenant \"alice\": memory \"12 gb\" for GPU 0 has an unknown unit \"gb\" (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)");
  expect_error(kGpu0 + "context_memory = \"256M\"\n", 3, "context_memory \"256M\" has an unknown unit \"M\"");
}

TEST(ConfigErrors, UnparsableSize) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"alice\"\nmemory = { \"0\" = \"lots\" }\n", 5,
               "memory \"lots\" for GPU 0 is not a size");
  expect_error(kGpu0 + "memory = \"1.GiB\"\n", 3, "a digit must follow the decimal point");
  expect_error(kGpu0 + "memory = \"99999999999TiB\"\n", 3, "is too large");
}

TEST(ConfigErrors, NegativeOrZeroAmounts) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0\n", 5, "gpus = 0 must be greater than zero");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = -0.5\n", 5, "gpus = -0.5 must be greater than zero");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = { \"0\" = \"0GiB\" }\n", 5, "must be greater than zero");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = { \"0\" = -5 }\n", 5, "is negative");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = { \"0\" = \"-1GiB\" }\n", 5, "is negative");
  expect_error("[daemon]\nreap_interval_ms = 0\n" + kGpu0, 2, "reap_interval_ms 0 must be greater than zero");
  expect_error("[daemon]\nreap_interval_ms = -10\n" + kGpu0, 2, "reap_interval_ms -10 must be greater than zero");
  expect_error(kGpu0 + "memory = 0\n", 3, "memory 0 must be greater than zero");
}

TEST(ConfigErrors, ReapIntervalOutOfRange) {
  expect_error("[daemon]\nreap_interval_ms = 5000\n" + kGpu0, 2, "reap_interval_ms 5000 is out of range (10..1000)");
}

TEST(ConfigErrors, TimeSliceOutOfRange) {
  const std::string range = "is out of range (2ms..200ms)";
  expect_error("[daemon]\ntime_slice = \"1ms\"\n" + kGpu0, 2, "[daemon]: time_slice \"1ms\" " + range);
  expect_error("[daemon]\ntime_slice = \"1999us\"\n" + kGpu0, 2, "time_slice \"1999us\" " + range);
  expect_error("[daemon]\ntime_slice = \"0ms\"\n" + kGpu0, 2, "time_slice \"0ms\" " + range);
  expect_error("[daemon]\ntime_slice = \"201ms\"\n" + kGpu0, 2, "time_slice \"201ms\" " + range);
  expect_error("[daemon]\ntime_slice = \"1s\"\n" + kGpu0, 2, "time_slice \"1s\" " + range);
  // The bounds themselves are allowed.
  EXPECT_TRUE(parse("[daemon]\ntime_slice = \"2ms\"\n" + kGpu0).ok());
  EXPECT_TRUE(parse("[daemon]\ntime_slice = \"200ms\"\n" + kGpu0).ok());
}

TEST(ConfigErrors, TimeSliceIsNotADuration) {
  // Errors are at the line of the key, after other [daemon] keys.
  const std::string d = "[daemon]\nlog_level = \"info\"\n";  // time_slice on line 3
  expect_error(d + "time_slice = 20\n" + kGpu0, 3,
               "[daemon]: time_slice must be a duration such as \"20ms\", not an integer");
  expect_error(d + "time_slice = 0.02\n" + kGpu0, 3, "time_slice must be a duration such as \"20ms\", not a float");
  expect_error(d + "time_slice = \"20\"\n" + kGpu0, 3,
               "time_slice \"20\" has no unit (write a number and a unit, e.g. \"20ms\"; units: us, ms, s)");
  expect_error(d + "time_slice = \"20 msec\"\n" + kGpu0, 3,
               "time_slice \"20 msec\" has an unknown unit \"msec\" (use us, ms, s)");
  expect_error(d + "time_slice = \"20MS\"\n" + kGpu0, 3, "has an unknown unit \"MS\"");  // units are case-sensitive
  expect_error(d + "time_slice = \"fast\"\n" + kGpu0, 3, "time_slice \"fast\" is not a duration");
  expect_error(d + "time_slice = \"-5ms\"\n" + kGpu0, 3, "time_slice \"-5ms\" is negative");
  expect_error(d + "time_slice = \"2.ms\"\n" + kGpu0, 3, "a digit must follow the decimal point");
  expect_error(d + "time_slice = \"99999999999999999s\"\n" + kGpu0, 3, "is too long");
  // The old integer key is gone; the unknown-key error lists the new one.
  expect_error(d + "time_slice_ms = 20\n" + kGpu0, 3, "unknown key \"time_slice_ms\" (known keys: run_dir, log_level, "
                                                       "reap_interval_ms, allow_overcommit, time_slice, ");
  expect_error(d + "time_slise = \"20ms\"\n" + kGpu0, 3, "unknown key \"time_slise\" (did you mean \"time_slice\"?)");
}

TEST(ConfigErrors, LimitOfTheWrongType) {
  const std::string t = kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.3\n";  // limit on line 6
  expect_error(t + "limit = \"all\"\n", 6,
               "tenant \"a\": limit must be a fraction of one GPU such as 0.5 or 1.0, not a string");
  expect_error(t + "limit = true\n", 6, "limit must be a fraction of one GPU such as 0.5 or 1.0, not a boolean");
  expect_error(t + "limmit = 0.5\n", 6, "tenant \"a\": unknown key \"limmit\" (did you mean \"limit\"?)");
}

TEST(ConfigErrors, LimitOutOfRange) {
  const std::string t = kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.3\n";  // limit on line 6
  expect_error(t + "limit = 1.5\n", 6, "tenant \"a\": limit = 1.5 must be above 0 and at most 1.0 (one GPU)");
  expect_error(t + "limit = 2\n", 6, "limit = 2 must be above 0 and at most 1.0 (one GPU)");
  expect_error(t + "limit = 0\n", 6, "limit = 0 must be above 0 and at most 1.0 (one GPU)");
  expect_error(t + "limit = -0.5\n", 6, "limit = -0.5 must be above 0 and at most 1.0 (one GPU)");
  expect_error(t + "limit = nan\n", 6, "limit = nan must be above 0 and at most 1.0 (one GPU)");
  expect_error(t + "limit = inf\n", 6, "limit = inf must be above 0 and at most 1.0 (one GPU)");
  // Above zero but nothing in parts per million: not silently "no limit given".
  expect_error(t + "limit = 0.0000001\n", 6, "limit = 1e-07 is below the smallest share (0.000001)");
}

TEST(ConfigErrors, LimitBelowTheShare) {
  // Pinned to GPU 1: the message names the GPU's index, the limit's line.
  expect_error(kGpu0 + "[[gpu]]\nindex = 1\n[[tenant]]\nname = \"a\"\ngpus = 0.3\ndevices = [1]\nlimit = 0.2\n", 9,
               "tenant \"a\": limit = 0.2 is below the tenant's share 0.3 of GPU 1: a limit caps what the share "
               "guarantees, it cannot be lower");
  // Only the fractional piece counts: 0.4 is below the 0.5 of gpus = 1.5.
  expect_error(kGpu0 + "[[gpu]]\nindex = 1\n[[tenant]]\nname = \"a\"\nlimit = 0.4\ngpus = 1.5\n", 7,
               "limit = 0.4 is below the tenant's share 0.5 of GPU 1");
  const ConfigResult r = parse(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.3\nlimit = 0.2\n");
  ASSERT_EQ(r.errors.size(), 1u);  // one error, and no config
  EXPECT_FALSE(r.config.has_value());
}

TEST(ConfigErrors, LimitNeedsGpus) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"m\"\nlimit = 0.5\n[tenant.memory]\n0 = \"1GiB\"\n", 5,
               "tenant \"m\": limit needs gpus: a tenant with only memory quotas has no share of GPU time to cap");
  // Memory-only tenants get idle time without any limit key.
  EXPECT_TRUE(parse(kGpu0 + "[[tenant]]\nname = \"m\"\n[tenant.memory]\n0 = \"1GiB\"\n").ok());
}

TEST(ConfigErrors, PriorityIsLatencyNormalOrBatch) {
  const std::string t = kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.3\n";  // priority on line 6
  expect_error(t + "priority = \"urgent\"\n", 6,
               "tenant \"a\": priority \"urgent\" is not a priority (use latency, normal, batch)");
  expect_error(t + "priority = \"Latency\"\n", 6, "priority \"Latency\" is not a priority");  // case-sensitive
  expect_error(t + "priority = \"\"\n", 6, "priority \"\" is not a priority");
  expect_error(t + "priority = 2\n", 6, "tenant \"a\": priority must be a string, not an integer");
  expect_error(t + "priorty = \"batch\"\n", 6, "unknown key \"priorty\" (did you mean \"priority\"?)");
  const ConfigResult r = parse(t + "priority = \"high\"\n");
  ASSERT_EQ(r.errors.size(), 1u);  // one error, and no config
  EXPECT_FALSE(r.config.has_value());
}

TEST(ConfigErrors, DuplicateTenantName) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"alice\"\ngpus = 0.1\n[[tenant]]\nname = \"alice\"\ngpus = 0.1\n", 7,
               "tenant \"alice\": duplicate tenant name (first defined at line 3)");
}

TEST(ConfigErrors, InvalidTenantName) {
  for (const char* bad : {"Alice", "-x", ".hidden", "a/b", "", "x y"})
    expect_error(kGpu0 + "[[tenant]]\nname = \"" + bad + "\"\ngpus = 0.1\n", 4, "is invalid");
  expect_error(kGpu0 + "[[tenant]]\nname = \"" + std::string(64, 'a') + "\"\ngpus = 0.1\n", 4, "is invalid");
  EXPECT_TRUE(parse(kGpu0 + "[[tenant]]\nname = \"" + std::string(63, 'a') + "\"\ngpus = 0.1\n").ok());
  EXPECT_TRUE(parse(kGpu0 + "[[tenant]]\nname = \"team-1.ml_x\"\ngpus = 0.1\n").ok());
}

TEST(ConfigErrors, DuplicateGpu) {
  expect_error(kGpu0 + "[[gpu]]\nindex = 0\n", 3, "GPU 0 (" + std::string(kUuid0) + ") is already configured at line 1");
  // The same GPU by index and by UUID.
  expect_error(kGpu0 + "[[gpu]]\nuuid = \"" + kUuid0 + "\"\n", 3, "is already configured at line 1");
}

TEST(ConfigErrors, GpuNotOnThisNode) {
  expect_error("[[gpu]]\nindex = 7\n", 2, "GPU index 7 is not present on this node (GPUs on this node: 0 (");
  expect_error("[[gpu]]\nuuid = \"GPU-deadbeef-1111-2222-3333-444444444444\"\n", 2,
               "GPU GPU-deadbeef-1111-2222-3333-444444444444 is not present on this node");
  expect_error("[[gpu]]\nuuid = \"GPU-123\"\n", 2, "uuid \"GPU-123\" is not a GPU UUID");
  expect_error("[[gpu]]\nindex = 1\nuuid = \"" + std::string(kUuid0) + "\"\n", 3, "index 1 and uuid");
  const ConfigResult r = parse_config("[[gpu]]\nindex = 0\n", "test.toml", {});
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_NE(r.errors[0].message.find("no GPU was found on this node"), std::string::npos);
}

TEST(ConfigErrors, TenantDeviceNotConfigured) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.5\ndevices = [1]\n", 6,
               "tenant \"a\": devices entry 1 is not a configured [[gpu]] (configured: 0)");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = { \"" + kUuid1 + "\" = \"1GiB\" }\n", 5,
               "memory key " + std::string(kUuid1) + " is not a configured [[gpu]]");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = { \"gpu0\" = \"1GiB\" }\n", 5,
               "memory key \"gpu0\" is neither a GPU index nor a GPU UUID");
}

TEST(ConfigErrors, FractionsThatCannotBePlaced) {
  // Sum of fractions on a pinned GPU above 1.0.
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.75\n[[tenant]]\nname = \"b\"\ngpus = 0.5\ndevices = [0]\n",
               5, "tenant \"a\": cannot place gpus = 0.75: no other configured GPU has 0.75 unallocated (unallocated: GPU 0: 0.5)");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.75\ndevices = [0]\n[[tenant]]\nname = \"b\"\ngpus = 0.5\n"
                       "devices = [0]\n", 10, "tenant \"b\": cannot place 0.5 of GPU 0: only 0.25 of it is unallocated");
  // More GPUs than configured.
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 2\n", 5, "gpus = 2 needs 2 GPUs but only 1 are configured");
  // devices must match the number of pieces.
  expect_error(kGpu0 + "[[gpu]]\nindex = 1\n[[tenant]]\nname = \"a\"\ngpus = 1.5\ndevices = [0]\n", 8,
               "devices lists 1 GPU(s) but gpus = 1.5 is placed on 2");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 17\n", 5, "above the 16 GPUs a tenant may hold");
}

// A pinned tenant that fits on its first GPU but not its second is not
// placed, and holds nothing: the tenants after it are placed beside what is
// really allocated, and the list of errors names the one cause.
TEST(ConfigErrors, APinnedTenantThatDoesNotFitTakesNoCapacityFromTheRest) {
  const ConfigResult r = parse(kGpu0 + "[[gpu]]\nindex = 1\n"
                               "[[tenant]]\nname = \"z\"\ngpus = 0.6\ndevices = [1]\n"       // lines 5-8
                               "[[tenant]]\nname = \"a\"\ngpus = 1.5\ndevices = [0, 1]\n"    // lines 9-12
                               "[[tenant]]\nname = \"c\"\ngpus = 0.5\ndevices = [0]\n"       // lines 13-16
                               "[[tenant]]\nname = \"d\"\ngpus = 0.5\n");                    // lines 17-19
  std::string all;
  for (const ConfigError& e : r.errors) all += e.to_string() + "\n";
  ASSERT_EQ(r.errors.size(), 1u) << all;
  EXPECT_EQ(r.errors[0].line, 12);
  EXPECT_NE(r.errors[0].message.find("tenant \"a\": cannot place 0.5 of GPU 1: only 0.4 of it is unallocated"),
            std::string::npos)
      << all;
}

TEST(ConfigErrors, MemoryQuotasAboveTheGpuWithoutOvercommit) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.5\n[[tenant]]\nname = \"b\"\n[tenant.memory]\n\"0\" = \"41GiB\"\n",
               9, "tenant \"b\": memory quotas on GPU 0 add up to 81 GiB, above its 80 GiB (a 40 GiB, b 41 GiB)");
  EXPECT_TRUE(parse("[daemon]\nallow_overcommit = true\n" + kGpu0 +
                    "[[tenant]]\nname = \"a\"\ngpus = 0.5\n[[tenant]]\nname = \"b\"\nmemory = { \"0\" = \"41GiB\" }\n")
                  .ok());
}

// A GPU's time is shared among at most 64 tenants (its arbiter's table):
// the 65th is refused where it is written, never left unscheduled.
TEST(ConfigErrors, MoreTenantsOnAGpuThanItsTimeCanBeSharedAmong) {
  const auto tenant = [](int t) {
    return "[[tenant]]\nname = \"t" + std::to_string(t) + "\"\ngpus = 0.01\ndevices = [0]\nmemory = { \"0\" = \"1GiB\" }\n";
  };
  std::string text = kGpu0;
  for (int t = 0; t < 64; ++t) text += tenant(t);
  EXPECT_TRUE(parse(text).ok()) << "64 fit";
  text += tenant(64);
  // Five lines per tenant after the two of [[gpu]]: the 65th's gpus is on line 3 + 64 * 5 + 2.
  expect_error(text, 3 + 64 * 5 + 2, "GPU 0 would have more than 64 tenants (API tenants included)");
}

TEST(ConfigErrors, ExplicitQuotaAboveTheGpusMemory) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\n[tenant.memory]\n\"0\" = \"81GiB\"\n", 6,
               "memory quota 81 GiB on GPU 0 is above the GPU's memory (80 GiB)");
  // Even with overcommit: one tenant cannot hold more than the GPU has.
  expect_error("[daemon]\nallow_overcommit = true\n" + kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = { \"0\" = \"81GiB\" }\n",
               7, "is above the GPU's memory");
  // The per-GPU override lowers what quotas may use.
  expect_error(kGpu0 + "memory = \"40GiB\"\n[[tenant]]\nname = \"a\"\nmemory = { \"0\" = \"41GiB\" }\n", 6,
               "above the GPU's memory (40 GiB)");
  expect_error(kGpu0 + "memory = \"81GiB\"\n", 3, "memory 81 GiB is above the 80 GiB the GPU has");
}

TEST(ConfigErrors, QuotaTooSmallForAContext) {
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.001\n", 5,
               "memory quota 80 MiB on GPU 0 is below its context_memory (256 MiB): no CUDA context would fit");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\nmemory = { \"0\" = \"100MiB\" }\n", 5, "is below its context_memory");
  // A memory override below the default context_memory: one error, at the
  // override, none for the tenants on that GPU.
  const ConfigResult r = parse(kGpu0 + "memory = \"128MiB\"\n[[tenant]]\nname = \"a\"\ngpus = 0.5\n");
  ASSERT_EQ(r.errors.size(), 1u) << (r.errors.empty() ? "" : r.errors[0].to_string());
  EXPECT_EQ(r.errors[0].line, 3);
  EXPECT_NE(r.errors[0].message.find("memory 128 MiB is not above the context_memory of 256 MiB (the default"),
            std::string::npos)
      << r.errors[0].to_string();
  EXPECT_TRUE(parse(kGpu0 + "memory = \"128MiB\"\ncontext_memory = \"64MiB\"\n").ok());
}

TEST(ConfigErrors, BadLogLevel) {
  expect_error("[daemon]\nlog_level = \"verbose\"\n" + kGpu0, 2,
               "log_level \"verbose\" is not a log level (use trace, debug, info, warn, error)");
}

TEST(ConfigErrors, MissingRequiredKeys) {
  expect_error(kGpu0 + "[[tenant]]\ngpus = 0.5\n", 3, "[[tenant]]: missing required key \"name\"");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\n", 3, "tenant \"a\": missing required key: gpus or memory");
  expect_error("[[gpu]]\ncontext_memory = \"1GiB\"\n", 1, "[[gpu]]: missing required key: index or uuid");
  expect_error(kGpu0 + "[[tenant]]\nname = \"a\"\ndevices = [0]\nmemory = { \"0\" = 1 }\n", 5, "devices needs gpus");
}

TEST(ConfigErrors, EmptyConfigOrNoGpu) {
  expect_error("", 1, "no [[gpu]] table");
  expect_error("# nothing here\n[daemon]\n", 1, "no [[gpu]] table");
  expect_error("[[tenant]]\nname = \"a\"\ngpus = 1\n", 1, "no [[gpu]] table");
}

TEST(ConfigErrors, KeysNestedTooDeepAreRefusedBeforeParsing) {
  // 50,000 components overflowed the stack inside the TOML parser (a crash
  // of fracgpud --check); refused at their line, before parsing.
  std::string key = "a";
  for (int i = 0; i < 50'000; ++i) key += ".a";
  expect_error(kGpu0 + "[[tenant]]\n" + key + " = 1\n", 4, "more than 128 '.' outside strings on one line");
  expect_error(kGpu0 + "[" + key + "]\n", 3, "keys or table headers nested this deep are refused");
  // Dots in comments and strings (escaped quotes and multi-line ones too) do not count.
  const std::string dots(500, '.');
  const ConfigResult ok = parse(kGpu0 + "# " + dots + "\n[[tenant]]\nname = \"a\"\ngpus = 0.5\n" +
                                "[tenant.memory] # '" + dots + "\n\"0\" = \"1GiB\" # \"\"\"" + dots + "\n");
  EXPECT_TRUE(ok.ok()) << (ok.errors.empty() ? "" : ok.errors[0].to_string());
  const ConfigResult in_strings = parse("x = \"" + dots + "\\\"" + dots + "\"\ny = '''\n" + dots + "\n'''\nz = \"\"\"\n" +
                                        dots + "\n\"\"\"\nw = '" + dots + "'\n" + kGpu0);
  ASSERT_EQ(in_strings.errors.size(), 4u);  // x, y, z, w are unknown keys: the dots were not the problem
  for (const ConfigError& e : in_strings.errors)
    EXPECT_NE(e.message.find("unknown key"), std::string::npos) << e.to_string();
}

TEST(ConfigErrors, RunDirMustBeAbsolute) {
  expect_error("[daemon]\nrun_dir = \"run/fracgpu\"\n" + kGpu0, 2, "run_dir \"run/fracgpu\" must be an absolute path");
}

TEST(ConfigErrors, MemoryForAGpuTheTenantIsNotPlacedOn) {
  expect_error(kGpu0 + "[[gpu]]\nindex = 1\n[[tenant]]\nname = \"a\"\ngpus = 0.5\nmemory = { \"1\" = \"1GiB\" }\n", 8,
               "memory quota for GPU 1, but gpus placed the tenant on GPU 0");
}

TEST(ConfigErrors, AllErrorsAreCollectedInLineOrder) {
  const ConfigResult r = parse(
      "[daemon]\n"
      "log_level = \"loud\"\n"        // 2
      "[[gpu]]\n"
      "index = 9\n"                   // 4
      "[[tenant]]\n"
      "name = \"Bad\"\n"              // 6
      "gpus = 0.5\n"
      "[[tenant]]\n"
      "name = \"ok\"\n"
      "gpus = 0.5\n"
      "colour = \"red\"\n");          // 11
  ASSERT_FALSE(r.ok());
  ASSERT_EQ(r.errors.size(), 4u);
  EXPECT_EQ(r.errors[0].line, 2);
  EXPECT_EQ(r.errors[1].line, 4);
  EXPECT_EQ(r.errors[2].line, 6);
  EXPECT_EQ(r.errors[3].line, 11);
  EXPECT_EQ(r.errors[3].to_string(), "test.toml:11: tenant \"ok\": unknown key \"colour\" (known keys: name, gpus, "
                                     "devices, count_managed, memory, limit, priority)");
}

TEST(ConfigErrors, UnreadableFile) {
  const ConfigResult r = load_config("/nonexistent/fracgpud.toml", node());
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.errors[0].line, 0);  // the file as a whole
  EXPECT_EQ(r.errors[0].to_string(),
            "/nonexistent/fracgpud.toml: cannot read the config file: cannot open: No such file or directory");
}

// ---- Good configs ----

TEST(ConfigGood, DefaultsAndAHalfGpu) {
  const ConfigResult r = parse(kGpu0 + "[[tenant]]\nname = \"alice\"\ngpus = 0.5\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  const NodeConfig& c = *r.config;
  EXPECT_EQ(c.daemon.run_dir, "/run/fracgpu");
  EXPECT_EQ(c.daemon.log_level, LogLevel::kInfo);
  EXPECT_EQ(c.daemon.reap_interval.count(), 200);
  EXPECT_FALSE(c.daemon.allow_overcommit);
  ASSERT_EQ(c.gpus.size(), 1u);
  EXPECT_EQ(c.gpus[0].uuid, kUuid0);
  EXPECT_EQ(c.gpus[0].memory_bytes, 80 * kGiB);
  EXPECT_EQ(c.gpus[0].context_memory, 256 * kMiB);
  ASSERT_EQ(c.tenants.size(), 1u);
  const Tenant& alice = c.tenants[0];
  EXPECT_TRUE(alice.count_managed);
  EXPECT_EQ(alice.gpus_ppm, 500'000u);
  ASSERT_EQ(alice.grants.size(), 1u);
  EXPECT_EQ(alice.grants[0].gpu, 0u);
  EXPECT_EQ(alice.grants[0].share_ppm, 500'000u);
  EXPECT_EQ(alice.grants[0].memory_quota, 40 * kGiB);
}

TEST(ConfigGood, TwoAndAHalfGpusSpanThreeGpus) {
  const ConfigResult r = parse(kGpu0 + "[[gpu]]\nindex = 1\n[[gpu]]\nindex = 2\n[[tenant]]\nname = \"big\"\ngpus = 2.5\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  const Tenant& big = r.config->tenants[0];
  ASSERT_EQ(big.grants.size(), 3u);
  EXPECT_EQ(big.grants[0].gpu, 0u);
  EXPECT_EQ(big.grants[0].share_ppm, 1'000'000u);
  EXPECT_EQ(big.grants[0].memory_quota, 80 * kGiB);
  EXPECT_EQ(big.grants[1].gpu, 1u);
  EXPECT_EQ(big.grants[1].share_ppm, 1'000'000u);
  EXPECT_EQ(big.grants[2].gpu, 2u);
  EXPECT_EQ(big.grants[2].share_ppm, 500'000u);
  EXPECT_EQ(big.grants[2].memory_quota, 40 * kGiB);
}

TEST(ConfigGood, LimitsDefaultToTheShareAndCapOnlyFractions) {
  const std::string gpus = kGpu0 + "[[gpu]]\nindex = 1\n[[gpu]]\nindex = 2\n";
  // Overcommit lets the memory-only tenant sit next to big's whole GPU 1.
  const ConfigResult ok = parse("[daemon]\nallow_overcommit = true\n" + gpus + "[[tenant]]\nname = \"big\"\ngpus = 2.5\n"
                                       "[[tenant]]\nname = \"small\"\ngpus = 0.3\n"
                                       "[[tenant]]\nname = \"m\"\n[tenant.memory]\n2 = \"1GiB\"\n1 = \"2GiB\"\n");
  ASSERT_TRUE(ok.ok()) << ok.errors[0].to_string();
  const Tenant& big = ok.config->tenants[0];
  ASSERT_EQ(big.grants.size(), 3u);
  EXPECT_EQ(big.grants[0].limit_ppm, 1'000'000u);  // whole GPUs are never capped
  EXPECT_EQ(big.grants[1].limit_ppm, 1'000'000u);
  EXPECT_EQ(big.grants[2].share_ppm, 500'000u);
  EXPECT_EQ(big.grants[2].limit_ppm, 500'000u);    // the fraction: a hard cap at its share
  const Tenant& small = ok.config->tenants[1];
  ASSERT_EQ(small.grants.size(), 1u);
  EXPECT_EQ(small.grants[0].gpu, 2u);              // next to big's half
  EXPECT_EQ(small.grants[0].share_ppm, 300'000u);
  EXPECT_EQ(small.grants[0].limit_ppm, 300'000u);
  const Tenant& m = ok.config->tenants[2];         // memory-only: no share, may use idle time
  ASSERT_EQ(m.grants.size(), 2u);
  for (const Grant& g : m.grants) {
    EXPECT_EQ(g.share_ppm, 0u);
    EXPECT_EQ(g.limit_ppm, 1'000'000u);
  }
}

TEST(ConfigGood, AWholeGpuTenantIsNeverCapped) {
  const ConfigResult r = parse(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 1\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  EXPECT_EQ(r.config->tenants[0].grants[0].share_ppm, 1'000'000u);
  EXPECT_EQ(r.config->tenants[0].grants[0].limit_ppm, 1'000'000u);
}

TEST(ConfigGood, AnExplicitLimitCapsOnlyTheFractionalPiece) {
  const std::string gpus = kGpu0 + "[[gpu]]\nindex = 1\n[[gpu]]\nindex = 2\n";
  const ConfigResult r = parse(gpus + "[[tenant]]\nname = \"big\"\ngpus = 2.5\nlimit = 0.8\n"
                                      "[[tenant]]\nname = \"free\"\ngpus = 0.25\nlimit = 1\n"  // integer 1
                                      "[[tenant]]\nname = \"exact\"\ngpus = 0.25\nlimit = 0.25\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  const Tenant& big = r.config->tenants[0];
  ASSERT_EQ(big.grants.size(), 3u);
  EXPECT_EQ(big.grants[0].share_ppm, 1'000'000u);
  EXPECT_EQ(big.grants[0].limit_ppm, 1'000'000u);
  EXPECT_EQ(big.grants[1].share_ppm, 1'000'000u);
  EXPECT_EQ(big.grants[1].limit_ppm, 1'000'000u);
  EXPECT_EQ(big.grants[2].share_ppm, 500'000u);
  EXPECT_EQ(big.grants[2].limit_ppm, 800'000u);
  EXPECT_EQ(r.config->tenants[1].grants[0].share_ppm, 250'000u);
  EXPECT_EQ(r.config->tenants[1].grants[0].limit_ppm, 1'000'000u);  // fully work-conserving
  EXPECT_EQ(r.config->tenants[2].grants[0].limit_ppm, 250'000u);    // a limit equal to the share is allowed
  // The limit changes nothing else: the memory quota still follows the share.
  EXPECT_EQ(big.grants[2].memory_quota, 40 * kGiB);
  EXPECT_EQ(r.config->tenants[1].grants[0].memory_quota, 20 * kGiB);
}

TEST(ConfigGood, PriorityDefaultsToNormal) {
  const ConfigResult r = parse(kGpu0 +
                               "[[tenant]]\nname = \"l\"\ngpus = 0.25\npriority = \"latency\"\n"
                               "[[tenant]]\nname = \"n\"\ngpus = 0.25\npriority = \"normal\"\n"
                               "[[tenant]]\nname = \"b\"\ngpus = 0.25\npriority = \"batch\"\n"
                               "[[tenant]]\nname = \"d\"\ngpus = 0.25\n");
  ASSERT_TRUE(r.ok()) << r.errors.at(0).to_string();
  EXPECT_EQ(r.config->find_tenant("l")->priority, Priority::kLatency);
  EXPECT_EQ(r.config->find_tenant("n")->priority, Priority::kNormal);
  EXPECT_EQ(r.config->find_tenant("b")->priority, Priority::kBatch);
  EXPECT_EQ(r.config->find_tenant("d")->priority, Priority::kNormal);
  // A memory-only tenant may have one too: it takes idle time as the others do.
  EXPECT_TRUE(parse(kGpu0 + "[[tenant]]\nname = \"m\"\npriority = \"batch\"\nmemory = { \"0\" = \"1GiB\" }\n").ok());
}

TEST(ConfigGood, PriorityNamesAndStoredValues) {
  for (const Priority p : {Priority::kLatency, Priority::kNormal, Priority::kBatch}) {
    EXPECT_EQ(parse_priority(priority_name(p)), p);
    EXPECT_EQ(priority_of_stored(static_cast<uint32_t>(p)), p);
  }
  EXPECT_FALSE(parse_priority("LATENCY"));
  // What an arbiter file may hold when stale or damaged reads as normal.
  EXPECT_EQ(priority_of_stored(3), Priority::kNormal);
  EXPECT_EQ(priority_of_stored(0xffffffffu), Priority::kNormal);
}

TEST(ConfigGood, TimeSlice) {
  EXPECT_EQ(DaemonSettings{}.time_slice, std::chrono::microseconds(20'000));
  const ConfigResult def = parse(kGpu0);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def.config->daemon.time_slice, std::chrono::microseconds(20'000));
  auto slice = [](const std::string& value) {
    const ConfigResult r = parse("[daemon]\ntime_slice = \"" + value + "\"\n" + kGpu0);
    EXPECT_TRUE(r.ok()) << value << ": " << (r.errors.empty() ? "" : r.errors[0].to_string());
    return r.ok() ? r.config->daemon.time_slice.count() : -1;
  };
  EXPECT_EQ(slice("50ms"), 50'000);
  EXPECT_EQ(slice("2ms"), 2'000);
  EXPECT_EQ(slice("200ms"), 200'000);
  EXPECT_EQ(slice("2500us"), 2'500);
  EXPECT_EQ(slice("0.05s"), 50'000);
  EXPECT_EQ(slice("0.2s"), 200'000);
  EXPECT_EQ(slice("12.5ms"), 12'500);
  EXPECT_EQ(slice(" 10 ms "), 10'000);
  EXPECT_EQ(slice("7.0009ms"), 7'000);  // rounded down to whole microseconds
}

TEST(ConfigGood, FirstFitTakesRemainingCapacityIntoAccount) {
  const ConfigResult r = parse(kGpu0 +
                               "[[gpu]]\nindex = 1\n"
                               "[[tenant]]\nname = \"a\"\ngpus = 0.5\n"
                               "[[tenant]]\nname = \"b\"\ngpus = 0.75\n"   // does not fit next to a: GPU 1
                               "[[tenant]]\nname = \"c\"\ngpus = 0.5\n"    // fits next to a: GPU 0
                               "[[tenant]]\nname = \"d\"\ngpus = 1.25\n"   // whole GPU? none left
                               "devices = [\"" + std::string(kUuid1) + "\", 0]\n");
  // d is pinned, so it is placed first: its whole GPU 1 pushes b out.
  ASSERT_FALSE(r.ok());
  const ConfigResult ok = parse(kGpu0 +
                                "[[gpu]]\nindex = 1\n"
                                "[[tenant]]\nname = \"a\"\ngpus = 0.5\n"
                                "[[tenant]]\nname = \"b\"\ngpus = 0.75\n"
                                "[[tenant]]\nname = \"c\"\ngpus = 0.5\n"
                                "[[tenant]]\nname = \"d\"\ngpus = 0.25\n");
  ASSERT_TRUE(ok.ok()) << ok.errors[0].to_string();
  auto gpu_of = [&](size_t t) { return ok.config->gpus[ok.config->tenants[t].grants.at(0).gpu].index; };
  EXPECT_EQ(gpu_of(0), 0);
  EXPECT_EQ(gpu_of(1), 1);
  EXPECT_EQ(gpu_of(2), 0);
  EXPECT_EQ(gpu_of(3), 1);
}

TEST(ConfigGood, PinnedTenantsArePlacedBeforeAutomaticOnes) {
  const ConfigResult r = parse(kGpu0 + "[[gpu]]\nindex = 1\n"
                               "[[tenant]]\nname = \"auto\"\ngpus = 1\n"
                               "[[tenant]]\nname = \"pinned\"\ngpus = 0.5\ndevices = [0]\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  EXPECT_EQ(r.config->tenants[0].grants[0].gpu, 1u);  // "auto" lands on the GPU "pinned" did not ask for
  EXPECT_EQ(r.config->tenants[1].grants[0].gpu, 0u);
}

TEST(ConfigGood, ExplicitMemoryQuotas) {
  const ConfigResult r = parse(kGpu0 + "[[gpu]]\nuuid = \"" + std::string(kUuid2) + "\"\n"
                               "[[tenant]]\nname = \"bob\"\ncount_managed = false\n"
                               "[tenant.memory]\n\"" + kUuid2 + "\" = \"1.5GiB\"\n\"0\" = \"12GiB\"\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  const Tenant& bob = r.config->tenants[0];
  EXPECT_FALSE(bob.count_managed);
  EXPECT_EQ(bob.gpus_ppm, 0u);
  ASSERT_EQ(bob.grants.size(), 2u);  // in config order of the GPUs
  EXPECT_EQ(bob.grants[0].gpu, 0u);
  EXPECT_EQ(bob.grants[0].memory_quota, 12 * kGiB);
  EXPECT_EQ(bob.grants[0].share_ppm, 0u);
  EXPECT_EQ(bob.grants[1].gpu, 1u);
  EXPECT_EQ(r.config->gpus[1].index, 2);
  EXPECT_EQ(bob.grants[1].memory_quota, 3 * kGiB / 2);
}

TEST(ConfigGood, ExplicitMemoryWithAFractionReplacesItsQuota) {
  const ConfigResult r = parse(kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 0.5\nmemory = { \"0\" = \"10GiB\" }\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  ASSERT_EQ(r.config->tenants[0].grants.size(), 1u);
  EXPECT_EQ(r.config->tenants[0].grants[0].share_ppm, 500'000u);
  EXPECT_EQ(r.config->tenants[0].grants[0].memory_quota, 10 * kGiB);
}

TEST(ConfigGood, GpuOverridesAndDaemonSettings) {
  const ConfigResult r = parse(
      "[daemon]\nrun_dir = \"/var/run/x\"\nlog_level = \"debug\"\nreap_interval_ms = 50\nallow_overcommit = true\n"
      "[[gpu]]\nuuid = \"GPU-AAAAAAAA-1111-2222-3333-444444444444\"\nindex = 1\n"  // upper case, and consistent
      "memory = \"60GiB\"\ncontext_memory = 0\n"
      "[[tenant]]\nname = \"a\"\ngpus = 0.3\n");
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  const NodeConfig& c = *r.config;
  EXPECT_EQ(c.daemon.run_dir, "/var/run/x");
  EXPECT_EQ(c.daemon.log_level, LogLevel::kDebug);
  EXPECT_EQ(c.daemon.reap_interval.count(), 50);
  EXPECT_TRUE(c.daemon.allow_overcommit);
  EXPECT_EQ(c.gpus[0].index, 1);
  EXPECT_EQ(c.gpus[0].uuid, kUuid1);
  EXPECT_EQ(c.gpus[0].memory_bytes, 60 * kGiB);
  EXPECT_EQ(c.gpus[0].context_memory, 0u);
  // 0.3 of 60 GiB = 18432 MiB exactly; rounded down to 2 MiB it stays.
  EXPECT_EQ(c.tenants[0].grants[0].memory_quota, 18432 * kMiB);
}

TEST(ConfigGood, FractionQuotasRoundDownTo2MiB) {
  const ConfigResult r = parse_config("[[gpu]]\nindex = 0\n[[tenant]]\nname = \"a\"\ngpus = 0.333333\n", "t",
                                      {{0, kUuid0, "x", 1000 * kMiB + 12345}});
  ASSERT_TRUE(r.ok());
  const uint64_t quota = r.config->tenants[0].grants[0].memory_quota;
  EXPECT_EQ(quota % (2 * kMiB), 0u);
  EXPECT_EQ(quota, 332 * kMiB);  // floor(0.333333 * 1000.01 MiB) = 333.33 MiB -> 332 MiB
}

TEST(ConfigGood, NoTenantsIsAValidConfig) {
  const ConfigResult r = parse(kGpu0);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.config->tenants.empty());
}

TEST(ConfigGood, FileOnDisk) {
  fracgpu::testing::TempDir dir;
  fracgpu::testing::write_file(dir / "f.toml", kGpu0 + "[[tenant]]\nname = \"a\"\ngpus = 1\n");
  const ConfigResult r = load_config(dir / "f.toml", node());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.config->source, dir / "f.toml");
}

TEST(ConfigGood, TheShippedExampleIsValidOnOne16GiBGpu) {
  const ConfigResult r = load_config(FRACGPU_EXAMPLES_DIR "/fracgpud.toml",
                                     {{0, "GPU-00000000-0000-0000-0000-000000000001", "Sim", 16 * kGiB}});
  ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
  ASSERT_EQ(r.config->tenants.size(), 3u);
  EXPECT_EQ(r.config->tenants[0].grants[0].memory_quota, 8 * kGiB);
  EXPECT_EQ(r.config->tenants[1].grants[0].memory_quota, 4 * kGiB);
  EXPECT_EQ(r.config->tenants[2].grants[0].memory_quota, 2 * kGiB);
}

// ---- Units and UUIDs ----

TEST(Units, ParseSize) {
  std::string why;
  EXPECT_EQ(parse_size("4096", &why), 4096u);
  EXPECT_EQ(parse_size("1B", &why), 1u);
  EXPECT_EQ(parse_size("1KiB", &why), 1024u);
  EXPECT_EQ(parse_size("1KB", &why), 1000u);
  EXPECT_EQ(parse_size("12 GB", &why), 12'000'000'000u);
  EXPECT_EQ(parse_size("16GiB", &why), 16 * kGiB);
  EXPECT_EQ(parse_size("1.5GiB", &why), 3 * kGiB / 2);
  EXPECT_EQ(parse_size("1.1GB", &why), 1'100'000'000u);  // exact, no float rounding
  EXPECT_EQ(parse_size("2TiB", &why), 2ull << 40);
  EXPECT_EQ(parse_size("3TB", &why), 3'000'000'000'000u);
  EXPECT_EQ(parse_size("0.5B", &why), 0u);  // rounded down to whole bytes
  EXPECT_EQ(parse_size(" 256MiB ", &why), 256 * kMiB);
  EXPECT_FALSE(parse_size("1gib", &why));
  EXPECT_NE(why.find("unknown unit \"gib\""), std::string::npos);
  EXPECT_FALSE(parse_size("GiB", &why));
  EXPECT_FALSE(parse_size("1e9", &why));
  EXPECT_FALSE(parse_size("-1", &why));
  EXPECT_FALSE(parse_size("20000000TiB", &why));
}

TEST(Units, FormatSizeAndGpus) {
  EXPECT_EQ(format_size(0), "0 B");
  EXPECT_EQ(format_size(1023), "1023 B");
  EXPECT_EQ(format_size(256 * kMiB), "256 MiB");
  EXPECT_EQ(format_size(3 * kGiB / 2), "1.50 GiB");
  EXPECT_EQ(format_size(80 * kGiB), "80 GiB");
  EXPECT_EQ(format_gpus(500'000), "0.5");
  EXPECT_EQ(format_gpus(2'500'000), "2.5");
  EXPECT_EQ(format_gpus(1'000'000), "1");
  EXPECT_EQ(format_gpus(333'333), "0.333333");
}

TEST(Uuid, FormatAndParseRoundTrip) {
  const uint8_t bytes[16] = {0xde, 0xad, 0xbe, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0, 1, 2, 3};
  const std::string text = format_gpu_uuid(bytes);
  EXPECT_EQ(text, "GPU-deadbeef-0123-4567-89ab-cdef00010203");
  auto parsed = parse_gpu_uuid("GPU-DEADBEEF-0123-4567-89AB-CDEF00010203");
  ASSERT_TRUE(parsed);
  EXPECT_EQ(std::memcmp(parsed->data(), bytes, 16), 0);
  EXPECT_FALSE(parse_gpu_uuid("GPU-deadbeef-0123-4567-89ab-cdef0001020"));
  EXPECT_FALSE(parse_gpu_uuid("GPU-deadbeef0-123-4567-89ab-cdef00010203"));
  EXPECT_FALSE(parse_gpu_uuid("MIG-deadbeef-0123-4567-89ab-cdef00010203"));
  EXPECT_FALSE(parse_gpu_uuid("GPU-deadbeef-0123-4567-89ab-cdef0001020g"));
}

}  // namespace
