// The control API's parts that need no daemon: a request's SPEC checked
// (field + reason), resolved against a config and booked beside its tenants;
// the file API tenants persist in; a config read beside API tenants; who may
// use the socket; how the client library takes `busy`. End to end (the daemon, the socket, the CLI):
// controller_control_test.cpp.
#include <grp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/api_tenant.h"
#include "config/config.h"
#include "control/client.h"
#include "control/protocol.h"
#include "daemon/control_server.h"

using namespace fracgpu::controller;
using nlohmann::json;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;
const char* const kUuid0 = "GPU-00000000-1111-2222-3333-444444444444";
const char* const kUuid1 = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
const char* const kUnmanaged = "GPU-cccccccc-1111-2222-3333-444444444444";

std::vector<DiscoveredGpu> node() { return {{0, kUuid0, "Sim A", 80 * kGiB}, {1, kUuid1, "Sim B", 80 * kGiB}}; }

// GPU 0 and 1 managed; alice holds 0.5 of GPU 0 (40 GiB).
const std::string kConfig =
    "[[gpu]]\nindex = 0\ncontext_memory = \"256MiB\"\n[[gpu]]\nindex = 1\n"
    "[[tenant]]\nname = \"alice\"\ngpus = 0.5\ndevices = [0]\n";

NodeConfig config(const std::string& text = kConfig, const ApiTenants* api = nullptr) {
  ConfigResult r = parse_config(text, "node.toml", node(), nullptr, api);
  std::string errors;
  for (const ConfigError& e : r.errors) errors += e.to_string() + "\n";
  EXPECT_TRUE(r.ok()) << errors;
  return r.ok() ? *r.config : NodeConfig{};
}

json spec(const std::string& name, json gpus) { return {{"name", name}, {"gpus", std::move(gpus)}}; }
json gpu(const char* uuid, double share) { return {{"uuid", uuid}, {"share", share}}; }

// The SPEC is refused as invalid, at `field`, with a message that starts
// with the field and contains `part`.
void expect_invalid(const json& s, const std::string& field, const std::string& part) {
  SpecError e;
  EXPECT_FALSE(parse_api_spec(s, &e).has_value()) << s.dump();
  EXPECT_EQ(e.code, fracgpu::control::code::kInvalid) << s.dump();
  EXPECT_EQ(e.field, field) << s.dump() << " -> " << e.message;
  EXPECT_EQ(e.message.rfind(field + ": ", 0), 0u) << e.message;
  EXPECT_NE(e.message.find(part), std::string::npos) << "expected \"" << part << "\" in: " << e.message;
}

TEST(ApiSpec, EachMistakeNamesItsFieldAndReason) {
  expect_invalid(json::array(), "tenant", "must be an object");
  expect_invalid({{"gpus", json::array({gpu(kUuid0, 0.5)})}}, "name", "missing");
  expect_invalid(spec("Bad Name", {gpu(kUuid0, 0.5)}), "name", "is invalid (1 to 63 of a-z");
  expect_invalid(spec(std::string(64, 'a'), {gpu(kUuid0, 0.5)}), "name", "is invalid");
  expect_invalid({{"name", 5}, {"gpus", json::array({gpu(kUuid0, 0.5)})}}, "name", "must be a string, not a number");
  expect_invalid(spec("a", json::array()), "gpus", "0 GPUs: a tenant holds 1 to 16");
  json seventeen = json::array();
  for (int i = 0; i < 17; ++i) seventeen.push_back(gpu(kUuid0, 0.01));
  expect_invalid(spec("a", seventeen), "gpus", "17 GPUs");
  expect_invalid(spec("a", {gpu(kUuid0, 1.5)}), "gpus[0].share", "1.5 must be above 0 and at most 1.0 (one GPU)");
  expect_invalid(spec("a", {gpu(kUuid0, 0)}), "gpus[0].share", "must be above 0");
  expect_invalid(spec("a", {gpu(kUuid0, 0.0000001)}), "gpus[0].share", "is below the smallest share (0.000001)");
  expect_invalid(spec("a", {{{"uuid", kUuid0}, {"share", "half"}}}), "gpus[0].share", "must be a fraction");
  expect_invalid(spec("a", {{{"uuid", kUuid0}}}), "gpus[0].share", "missing");
  expect_invalid(spec("a", {{{"uuid", "GPU-123"}, {"share", 0.5}}}), "gpus[0].uuid", "is not a GPU UUID");
  expect_invalid(spec("a", {gpu(kUuid0, 0.5), gpu(kUuid1, 0.5), gpu(kUuid0, 0.1)}), "gpus[2].uuid",
                 "is named twice (also gpus[0])");
  expect_invalid(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"limit", 0.25}}}), "gpus[0].limit",
                 "0.25 is below the tenant's share 0.5");
  expect_invalid(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"limit", 2}}}), "gpus[0].limit",
                 "must be above 0 and at most 1.0");
  expect_invalid(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"memory", 0}}}), "gpus[0].memory",
                 "must be a number of bytes greater than zero");
  expect_invalid(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"memory", -5}}}), "gpus[0].memory", "greater than zero");
  expect_invalid(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"memory", 1.5e9}}}), "gpus[0].memory", "(an integer)");
  expect_invalid(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"memmory", 5}}}), "gpus[0].memmory",
                 "unknown key (known keys: uuid, share, memory, limit)");
  json extra = spec("a", {gpu(kUuid0, 0.5)});
  extra["gpu"] = 1;
  expect_invalid(extra, "gpu", "unknown key");
  json managed = spec("a", {gpu(kUuid0, 0.5)});
  managed["count_managed"] = "yes";
  expect_invalid(managed, "count_managed", "must be true or false");
}

TEST(ApiSpec, PriorityIsLatencyNormalOrBatch) {
  const auto with = [](json priority) {
    json s = spec("a", {gpu(kUuid0, 0.5)});
    s["priority"] = std::move(priority);
    return s;
  };
  SpecError e;
  const auto absent = parse_api_spec(spec("a", {gpu(kUuid0, 0.5)}), &e);
  ASSERT_TRUE(absent) << e.message;
  EXPECT_EQ(absent->priority, Priority::kNormal);
  for (const char* name : {"latency", "normal", "batch"}) {
    const auto t = parse_api_spec(with(name), &e);
    ASSERT_TRUE(t) << e.message;
    EXPECT_EQ(priority_name(t->priority), name);
  }
  expect_invalid(with("urgent"), "priority", "\"urgent\" is not a priority (use latency, normal, batch)");
  expect_invalid(with("LATENCY"), "priority", "is not a priority");
  expect_invalid(with(2), "priority", "2 is not a priority");
  expect_invalid(with(nullptr), "priority", "null is not a priority");
}

TEST(ApiSpec, AnnotationsAreBoundedPrintableText) {
  const auto with = [](json annotations) {
    json s = spec("a", {gpu(kUuid0, 0.5)});
    s["annotations"] = std::move(annotations);
    return s;
  };
  SpecError e;
  const auto ok = parse_api_spec(with({{"pod", "default/x"}, {"claim", std::string(256, 'v')}}), &e);
  ASSERT_TRUE(ok) << e.message;
  EXPECT_EQ(ok->annotations.at("pod"), "default/x");
  json seventeen = json::object();
  for (int i = 0; i < 17; ++i) seventeen["k" + std::to_string(i)] = "v";
  expect_invalid(with(seventeen), "annotations", "17 entries, above the 16 allowed");
  expect_invalid(with({{std::string(64, 'k'), "v"}}), "annotations", "must be 1 to 63 printable ASCII characters");
  expect_invalid(with({{"k", std::string(257, 'v')}}), "annotations.k", "at most 256 printable ASCII characters");
  // A terminal escape would reach `fracgpu status`: refused.
  expect_invalid(with({{"k", "\x1b]0;owned\x07"}}), "annotations.k", "printable ASCII");
  expect_invalid(with({{"k\n", "v"}}), "annotations", "printable ASCII");
  expect_invalid(with({{"k", 5}}), "annotations.k", "must be a string");
}

TEST(ApiSpec, DefaultsAndWholeGpus) {
  SpecError e;
  auto t = parse_api_spec(spec("dra-1", {gpu(kUuid0, 0.25), {{"uuid", kUuid1}, {"share", 1}, {"limit", 0.5}}}), &e);
  ASSERT_TRUE(t) << e.message;
  EXPECT_TRUE(t->count_managed);
  EXPECT_EQ(t->gpus[0].share_ppm, 250'000u);
  EXPECT_EQ(t->gpus[0].limit_ppm, 250'000u);  // a hard cap unless asked otherwise
  EXPECT_EQ(t->gpus[1].limit_ppm, 1'000'000u);  // the whole GPU: its limit is ignored
  EXPECT_EQ(t->gpus[0].memory, 0u);  // not given: resolved against the config

  const NodeConfig c = config();
  ASSERT_TRUE(resolve_api_tenant(&*t, c, &e)) << e.message;
  EXPECT_EQ(t->gpus[0].memory, 20 * kGiB);  // 0.25 x 80 GiB
  EXPECT_EQ(t->gpus[1].memory, 80 * kGiB);
  // UUIDs in any case name the same GPU.
  std::string upper = kUuid1;
  for (char& ch : upper) ch = static_cast<char>(toupper(ch));
  upper.replace(0, 3, "GPU");
  auto u = parse_api_spec(spec("b", {gpu(upper.c_str(), 0.3)}), &e);
  ASSERT_TRUE(u) << e.message;
  ASSERT_TRUE(resolve_api_tenant(&*u, c, &e)) << e.message;
  EXPECT_EQ(tenant_of(*u, c).grants.at(0).gpu, 1u);
  // Default quotas round down to 2 MiB, as a config fraction's do.
  auto odd = parse_api_spec(spec("c", {gpu(kUuid1, 0.333333)}), &e);
  ASSERT_TRUE(resolve_api_tenant(&*odd, c, &e)) << e.message;
  EXPECT_EQ(odd->gpus[0].memory % (2 * kMiB), 0u);
  EXPECT_LE(odd->gpus[0].memory, 80 * kGiB / 3);
}

TEST(ApiSpec, ResolvingChecksTheNodesGpusAndQuotas) {
  const NodeConfig c = config();
  const auto resolve_error = [&](json s) {
    SpecError e;
    auto t = parse_api_spec(s, &e);
    EXPECT_TRUE(t) << e.message;
    if (t) {
      EXPECT_FALSE(resolve_api_tenant(&*t, c, &e)) << s.dump();
    }
    return e;
  };
  SpecError e = resolve_error(spec("a", {gpu(kUuid0, 0.1), gpu(kUnmanaged, 0.5)}));
  EXPECT_EQ(e.field, "gpus[1].uuid");
  EXPECT_NE(e.message.find(std::string(kUnmanaged) + " is not a GPU this fracgpud manages (managed: " + kUuid0),
            std::string::npos)
      << e.message;
  e = resolve_error(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"memory", 81 * kGiB}}}));
  EXPECT_EQ(e.field, "gpus[0].memory");
  EXPECT_NE(e.message.find("memory quota 81 GiB on GPU 0 is above the GPU's memory (80 GiB)"), std::string::npos)
      << e.message;
  // The same rule, and words, as a [[tenant]]'s quota below context_memory.
  e = resolve_error(spec("a", {{{"uuid", kUuid0}, {"share", 0.5}, {"memory", 128 * kMiB}}}));
  EXPECT_NE(e.message.find("is below its context_memory (256 MiB): no CUDA context would fit"), std::string::npos)
      << e.message;
  e = resolve_error(spec("a", {gpu(kUuid0, 0.000001)}));  // default quota: 80 KiB, below a context
  EXPECT_NE(e.message.find("(the default: share x the GPU's memory)"), std::string::npos) << e.message;
}

ApiTenant resolved(const json& s, const NodeConfig& c) {
  SpecError e;
  auto t = parse_api_spec(s, &e);
  EXPECT_TRUE(t) << e.message;
  EXPECT_TRUE(resolve_api_tenant(&*t, c, &e)) << e.message;
  return *t;
}

TEST(ApiBook, SharesAndMemoryOfConfigAndApiTenantsAddUp) {
  ApiTenants api;
  NodeConfig c0 = config();
  api["dra-1"] = resolved(spec("dra-1", {gpu(kUuid0, 0.25)}), c0);
  const NodeConfig c = config(kConfig, &api);
  ASSERT_EQ(c.tenants.size(), 2u);
  EXPECT_EQ(c.tenants[1].name, "dra-1");
  EXPECT_EQ(c.tenants[1].source, TenantSource::kApi);
  EXPECT_EQ(c.tenants[1].placement, PlacementReason::kApi);

  const std::vector<GpuBook> book = book_of(c);
  EXPECT_EQ(book[0].config_ppm, 500'000u);
  EXPECT_EQ(book[0].api_ppm, 250'000u);
  EXPECT_EQ(book[0].free_ppm(), 250'000u);
  EXPECT_EQ(book[0].free_memory(80 * kGiB), 20 * kGiB);
  EXPECT_EQ(book[1].free_ppm(), 1'000'000u);
  EXPECT_EQ(book_of(c, "dra-1")[0].api_ppm, 0u);  // a resize books the tenant as if it were gone

  const auto problem = capacity_problem(resolved(spec("b", {gpu(kUuid0, 0.5)}), c), c, book);
  ASSERT_TRUE(problem);
  EXPECT_EQ(*problem, std::string(kUuid0) + ": share 0.5 asked, 0.25 free (config tenants 0.5, API tenants 0.25)");
  EXPECT_FALSE(capacity_problem(resolved(spec("b", {gpu(kUuid0, 0.25)}), c), c, book));
  // Memory: a small share with a large quota.
  const auto memory =
      capacity_problem(resolved(spec("b", {{{"uuid", kUuid0}, {"share", 0.1}, {"memory", 30 * kGiB}}}), c), c, book);
  ASSERT_TRUE(memory);
  EXPECT_NE(memory->find("memory 30 GiB asked, 20 GiB free of its 80 GiB (config tenants 40 GiB, API tenants 20 GiB)"),
            std::string::npos)
      << *memory;
  // allow_overcommit: only each quota is bounded by its GPU.
  const NodeConfig over = config("[daemon]\nallow_overcommit = true\n" + kConfig, &api);
  EXPECT_FALSE(capacity_problem(resolved(spec("b", {{{"uuid", kUuid0}, {"share", 0.1}, {"memory", 30 * kGiB}}}), over),
                                over, book_of(over)));
}

// A GPU's time is shared among at most 64 tenants: a create past that is
// refused, naming the GPU (never a tenant left unscheduled).
TEST(ApiBook, NoMoreTenantsOnAGpuThanItsTimeCanBeSharedAmong) {
  ApiTenants api;
  const NodeConfig c0 = config();  // one config tenant on GPU 0
  for (int t = 0; t < 63; ++t) {
    const std::string name = "dra-" + std::to_string(t);
    api[name] = resolved(spec(name, {{{"uuid", kUuid0}, {"share", 0.001}, {"memory", 512 * kMiB}}}), c0);
  }
  const NodeConfig c = config(kConfig, &api);
  const std::vector<GpuBook> book = book_of(c);
  EXPECT_EQ(book[0].tenants, 64u);
  const auto problem = capacity_problem(
      resolved(spec("one-more", {{{"uuid", kUuid0}, {"share", 0.001}, {"memory", 512 * kMiB}}}), c), c, book);
  ASSERT_TRUE(problem);
  EXPECT_EQ(*problem, std::string(kUuid0) + ": it has 64 tenants already, the most one GPU's time is shared among");
  // Another GPU has room.
  EXPECT_FALSE(capacity_problem(resolved(spec("one-more", {gpu(kUuid1, 0.1)}), c), c, book));
}

TEST(ApiBook, SameSpecOrWhatDiffers) {
  const NodeConfig c = config();
  const ApiTenant a = resolved(spec("a", {gpu(kUuid0, 0.25)}), c);
  // The default memory written out is the same spec.
  const ApiTenant explicit_memory = resolved(spec("a", {{{"uuid", kUuid0}, {"share", 0.25}, {"memory", 20 * kGiB}}}), c);
  EXPECT_EQ(spec_difference(a, explicit_memory), "");
  const std::string d = spec_difference(resolved(spec("a", {gpu(kUuid0, 0.5), gpu(kUuid1, 0.1)}), c), a);
  EXPECT_NE(d.find(std::string(kUuid0) + ": share 0.5 asked (0.25 held), limit 0.5 asked (0.25 held), memory 40 GiB "
                                         "asked (20 GiB held)"),
            std::string::npos)
      << d;
  EXPECT_NE(d.find(std::string(kUuid1) + " asked, not held"), std::string::npos) << d;
  json latency = spec("a", {gpu(kUuid0, 0.25)});
  latency["priority"] = "latency";
  EXPECT_EQ(spec_difference(resolved(latency, c), a), "priority latency asked, normal held");
  // The tenant the daemon applies has it.
  EXPECT_EQ(tenant_of(resolved(latency, c), c).priority, Priority::kLatency);
}

TEST(ApiFile, RoundTripsAndRefusesDamage) {
  const NodeConfig c = config();
  ApiTenants api;
  json s = spec("dra-1", {gpu(kUuid0, 0.333333), {{"uuid", kUuid1}, {"share", 0.5}, {"limit", 0.75}}});
  s["annotations"] = {{"pod", "ns/p"}};
  s["count_managed"] = false;
  s["priority"] = "latency";
  api["dra-1"] = resolved(s, c);
  api["dra-2"] = resolved(spec("dra-2", {gpu(kUuid1, 0.1)}), c);
  api["dra-2"].draining = true;
  api["dra-2"].priority = Priority::kBatch;
  std::string error;
  const auto back = parse_api_tenants_file(api_tenants_file_text(api), &error);
  ASSERT_TRUE(back) << error;
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ(back->at("dra-1").gpus, api["dra-1"].gpus);  // shares exact to the ppm
  EXPECT_EQ(back->at("dra-1").annotations, api["dra-1"].annotations);
  EXPECT_FALSE(back->at("dra-1").count_managed);
  EXPECT_FALSE(back->at("dra-1").draining);
  EXPECT_TRUE(back->at("dra-2").draining);
  EXPECT_EQ(back->at("dra-1").priority, Priority::kLatency);
  EXPECT_EQ(back->at("dra-2").priority, Priority::kBatch);
  // A file written before priorities existed: its tenants are normal.
  const auto old_file = parse_api_tenants_file(R"({"version": 1, "tenants": [{"name": "x", "gpus": [{"uuid": ")" +
                                                   std::string(kUuid0) + R"(", "share": 0.5, "memory": 1073741824}]}]})",
                                               &error);
  ASSERT_TRUE(old_file) << error;
  EXPECT_EQ(old_file->at("x").priority, Priority::kNormal);

  const auto refused = [&](const std::string& text, const std::string& part) {
    std::string why;
    EXPECT_FALSE(parse_api_tenants_file(text, &why)) << text;
    EXPECT_NE(why.find(part), std::string::npos) << why;
  };
  refused("", "not a file of API tenants");
  refused(R"({"version": 2, "tenants": []})", "version 2 is not one this fracgpud reads");
  refused(R"({"version": 1, "tenants": [{"name": "x", "gpus": [{"uuid": ")" + std::string(kUuid0) +
              R"(", "share": 0.5}]}]})",
          "tenants[0] (\"x\"): gpus[0].memory is missing");
  refused(R"({"version": 1, "tenants": [{"name": "X", "gpus": []}]})", "tenants[0]: name:");
  const std::string one = R"({"name": "x", "gpus": [{"uuid": ")" + std::string(kUuid0) +
                          R"(", "share": 0.5, "memory": 1073741824}]})";
  refused(R"({"version": 1, "tenants": [)" + one + "," + one + "]}", "tenant \"x\" is listed twice");
  refused(R"({"version": 1, "tenants": [{"name": "x", "state": "gone", "gpus": [{"uuid": ")" + std::string(kUuid0) +
              R"(", "share": 0.5, "memory": 1073741824}]}]})",
          "state must be");
  refused(R"({"version": 1, "tenants": [{"name": "x", "priority": "urgent", "gpus": [{"uuid": ")" +
              std::string(kUuid0) + R"(", "share": 0.5, "memory": 1073741824}]}]})",
          "tenants[0]: priority: \"urgent\" is not a priority");
}

TEST(ApiConfig, ApiTenantsKeepTheirPriorityInTheConfig) {
  const NodeConfig c = config();
  ApiTenants api;
  json s = spec("dra-1", {gpu(kUuid1, 0.25)});
  s["priority"] = "latency";
  api["dra-1"] = resolved(s, c);
  const NodeConfig with_api = config(kConfig + "priority = \"batch\"\n", &api);
  ASSERT_NE(with_api.find_tenant("dra-1"), nullptr);
  EXPECT_EQ(with_api.find_tenant("dra-1")->priority, Priority::kLatency);
  EXPECT_EQ(with_api.find_tenant("alice")->priority, Priority::kBatch);
}

// The config as a reload reads it, beside the API tenants it must not move.
void expect_config_error(const std::string& text, const ApiTenants& api, int line, const std::string& part) {
  const ConfigResult r = parse_config(text, "node.toml", node(), nullptr, &api);
  EXPECT_FALSE(r.ok()) << text;
  std::string all;
  bool found = false;
  for (const ConfigError& e : r.errors) {
    all += e.to_string() + "\n";
    if (e.line == line && e.message.find(part) != std::string::npos) found = true;
  }
  EXPECT_TRUE(found) << "expected node.toml:" << line << ": ..." << part << "...\ngot:\n" << all;
}

TEST(ApiConfig, AConfigThatNoLongerFitsBesideApiTenantsNamesThem) {
  const NodeConfig c = config();
  ApiTenants api;
  api["dra-1"] = resolved(spec("dra-1", {{{"uuid", kUuid0}, {"share", 0.5}, {"memory", 30 * kGiB}}}), c);
  ASSERT_TRUE(parse_config(kConfig, "node.toml", node(), nullptr, &api).ok());
  // Shares: alice wants more of GPU 0 than dra-1 left.
  expect_config_error("[[gpu]]\nindex = 0\n[[gpu]]\nindex = 1\n[[tenant]]\nname = \"alice\"\ngpus = 0.75\ndevices = [0]\n",
                      api, 8, "cannot place 0.75 of GPU 0: only 0.5 of it is unallocated (sum of fractions on a GPU "
                              "cannot exceed 1.0); API tenants hold 0.5 of GPU 0 (\"dra-1\" 0.5)");
  // Automatic placement says so too.
  expect_config_error("[[gpu]]\nindex = 0\n[[tenant]]\nname = \"alice\"\ngpus = 0.75\n", api, 5,
                      "API tenants hold 0.5 of GPU 0 (\"dra-1\" 0.5)");
  // Memory: alice's explicit quota tips GPU 0 over.
  expect_config_error("[[gpu]]\nindex = 0\n[[tenant]]\nname = \"alice\"\nmemory = { \"0\" = \"60GiB\" }\n", api, 5,
                      "memory quotas on GPU 0 add up to 90 GiB, above its 80 GiB (API tenant \"dra-1\" 30 GiB, alice "
                      "60 GiB)");
  // The name is taken.
  expect_config_error("[[gpu]]\nindex = 0\n[[tenant]]\nname = \"dra-1\"\ngpus = 0.1\n", api, 4,
                      "the name belongs to a tenant created through the control API");
  // Its GPU is no longer configured, or no longer large enough.
  expect_config_error("[[gpu]]\nindex = 1\n", api, 0,
                      std::string("API tenant \"dra-1\": holds ") + kUuid0 + ", which is not a configured [[gpu]] any more");
  expect_config_error("[[gpu]]\nindex = 0\nmemory = \"20GiB\"\n", api, 0,
                      "API tenant \"dra-1\": memory quota 30 GiB on GPU 0 is above the GPU's memory (20 GiB)");
  expect_config_error("[[gpu]]\nindex = 0\ncontext_memory = \"31GiB\"\n", api, 0,
                      "API tenant \"dra-1\": memory quota 30 GiB on GPU 0 is below its context_memory");
}

TEST(ControlAccessRules, RootTheDaemonsUserAndTheGroup) {
  ControlAccess access;
  access.daemon_uid = 1000;
  EXPECT_TRUE(access.allows(0, 12345));
  EXPECT_TRUE(access.allows(1000, 1000));
  EXPECT_FALSE(access.allows(1001, 1001));
  EXPECT_FALSE(access.allows(1001, 0));  // a group of root's is no group of the API's
  access.group = 4242;
  access.members = {1002};
  EXPECT_TRUE(access.allows(1001, 4242));  // primary group
  EXPECT_TRUE(access.allows(1002, 7));     // listed as a member of the group
  EXPECT_FALSE(access.allows(1003, 7));
}

TEST(ControlAccessRules, ControlGroupMustExist) {
  const ConfigResult bad =
      parse_config("[daemon]\ncontrol_group = \"no-such-group-fracgpu\"\n[[gpu]]\nindex = 0\n", "node.toml", node());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.errors.at(0).to_string(),
            "node.toml:2: [daemon]: control_group \"no-such-group-fracgpu\" is not a group on this node (see getent "
            "group)");
  const struct group* root = getgrgid(0);
  ASSERT_NE(root, nullptr);
  const ConfigResult good = parse_config("[daemon]\ncontrol_group = \"" + std::string(root->gr_name) +
                                             "\"\n[[gpu]]\nindex = 0\n",
                                         "node.toml", node());
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good.config->daemon.control_group, root->gr_name);
  EXPECT_EQ(good.config->daemon.control_gid, 0u);
}

// A stand-in daemon on a Unix socket in a temporary directory: its first
// connection is refused `busy` with `retry_after_ms`, every later one is
// answered ok. Records when each connection came.
class BusyOnceServer {
 public:
  explicit BusyOnceServer(unsigned retry_after_ms) : retry_after_ms_(retry_after_ms) {
    char dir[] = "/tmp/control-client-XXXXXX";
    dir_ = mkdtemp(dir);
    path_ = dir_ + "/control.sock";
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr {};
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path_.c_str());
    EXPECT_EQ(bind(fd_, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(listen(fd_, 8), 0);
    thread_ = std::thread([this] { run(); });
  }
  ~BusyOnceServer() {
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  const std::string& path() const { return path_; }
  std::vector<std::chrono::steady_clock::time_point> connected() {
    std::lock_guard lock(mutex_);
    return connected_;
  }

 private:
  void run() {
    for (;;) {
      const int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      size_t seen;
      {
        std::lock_guard lock(mutex_);
        connected_.push_back(std::chrono::steady_clock::now());
        seen = connected_.size();
      }
      std::string reply = R"({"ok":true})" "\n";
      if (seen == 1)
        reply = json{{"ok", false}, {"code", "busy"}, {"error", "full"}, {"retry_after_ms", retry_after_ms_}}.dump() +
                "\n";
      else  // the request first: a reply to a client that sent none yet proves nothing
        for (char ch = 0; ch != '\n' && read(c, &ch, 1) == 1;) {
        }
      EXPECT_EQ(send(c, reply.data(), reply.size(), MSG_NOSIGNAL), static_cast<ssize_t>(reply.size()));
      close(c);
    }
  }
  unsigned retry_after_ms_;
  std::string dir_, path_;
  int fd_ = -1;
  std::thread thread_;
  std::mutex mutex_;
  std::vector<std::chrono::steady_clock::time_point> connected_;
};

TEST(ControlClient, ABusyDaemonIsAskedAgainNoSoonerThanItSaid) {
  BusyOnceServer server(300);
  const auto asked = std::chrono::steady_clock::now();
  const fracgpu::control::Reply r = fracgpu::control::call(server.path(), {{"op", "list"}}, std::chrono::seconds(3));
  EXPECT_TRUE(r.ok) << r.code << ": " << r.error;
  const auto connected = server.connected();
  ASSERT_EQ(connected.size(), 2u);
  EXPECT_GE(connected[1] - connected[0], std::chrono::milliseconds(300));
  EXPECT_LT(std::chrono::steady_clock::now() - asked, std::chrono::seconds(2));
}

TEST(ControlClient, ARetryAfterPastTheTimeoutEndsTheCallAtOnce) {
  BusyOnceServer server(5000);
  const auto asked = std::chrono::steady_clock::now();
  const fracgpu::control::Reply r = fracgpu::control::call(server.path(), {{"op", "list"}}, std::chrono::seconds(2));
  EXPECT_EQ(r.code, "busy");
  EXPECT_EQ(r.body.value("retry_after_ms", 0u), 5000u);
  EXPECT_EQ(server.connected().size(), 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - asked, std::chrono::milliseconds(1000));
}

}  // namespace
