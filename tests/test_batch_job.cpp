// The batch-job core (cache/util/batch_job.h): sharding, the device a rank takes, numbered outputs, resuming, the
// manifest; and the memory check every job and request makes (cache/util/memory.h).
#include "cache/io/error.h"
#include "cache/util/batch_job.h"
#include "cache/util/memory.h"
#include "test_util.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

using namespace anchor;
namespace fs = std::filesystem;

namespace {
std::string read_all(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}
// The item job the tests run: item k's output is its text upper-cased with k, the record its length.
batch::ItemOutput shout(int64_t k, const std::string& item) {
    std::string s = item;
    for (auto& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
    return {s + " #" + std::to_string(k) + "\n", {{"length", item.size()}}};
}
} // namespace

TEST_CASE("batch: a shard owns every size-th item and checks its ranks", "[batch]") {
    batch::Shard s{1, 3, 1};
    CHECK(!s.owns(0));
    CHECK(s.owns(1));
    CHECK(s.owns(4));
    CHECK(!s.owns(5));
    CHECK_NOTHROW(s.validate());
    CHECK_THROWS_AS((batch::Shard{3, 3, 0}).validate(), ParamError);
    CHECK_THROWS_AS((batch::Shard{0, 0, 0}).validate(), ParamError);
    CHECK_THROWS_AS((batch::Shard{0, 1, -1}).validate(), ParamError);
}

TEST_CASE("batch: the device of a rank", "[batch]") {
    using batch::DeviceSpec;
    using batch::select_device;
    CHECK(DeviceSpec::parse("cpu").str() == "cpu");
    CHECK(DeviceSpec::parse("cuda:1").str() == "cuda:1");
    CHECK(DeviceSpec::parse("auto").str() == "auto");
    for (const char* bad : {"gpu", "cuda:", "cpu:0", "cuda:x", "", "auto:1", "cuda:-1"}) {
        INFO(bad);
        const auto e = test::error_of([&] { (void)DeviceSpec::parse(bad, "device"); });
        CHECK(e.find("device: expected auto, cpu, cuda or cuda:N") == 0);
    }
    // auto: the CPU without a GPU; one GPU per local rank, round-robin past the device count.
    CHECK(select_device(DeviceSpec::parse("auto"), 3, 0) == torch::Device(torch::kCPU));
    CHECK(select_device(DeviceSpec::parse("auto"), 0, 2) == torch::Device(torch::kCUDA, 0));
    CHECK(select_device(DeviceSpec::parse("auto"), 3, 2) == torch::Device(torch::kCUDA, 1));
    CHECK(select_device(DeviceSpec::parse("cuda"), 2, 4) == torch::Device(torch::kCUDA, 2));
    CHECK(select_device(DeviceSpec::parse("cuda:1"), 0, 4) == torch::Device(torch::kCUDA, 1));
    CHECK(select_device(DeviceSpec::parse("cpu"), 1, 4) == torch::Device(torch::kCPU));
    CHECK(test::error_of([] {
              (void)select_device(DeviceSpec::parse("cuda"), 0, 0);
          }).find("device: 'cuda': this LibTorch sees no CUDA device") == 0);
    CHECK(test::error_of([] {
              (void)select_device(DeviceSpec::parse("cuda:2"), 0, 2);
          }).find("this machine has 2 CUDA device(s)") != std::string::npos);
    // This build: auto is whatever LibTorch has; cpu always works.
    CHECK(select_device(DeviceSpec::parse("cpu"), 0) == torch::Device(torch::kCPU));
}

TEST_CASE("batch: numbered outputs and the manifest path", "[batch]") {
    CHECK(batch::numbered_output("out/", 0, ".txt") == "out/00000.txt");
    CHECK(batch::numbered_output("out/", 12, ".png") == "out/00012.png");
    CHECK(batch::numbered_output("dir/a.txt", 0, ".png") == "dir/a.txt");
    CHECK(batch::numbered_output("dir/a.txt", 2, ".png") == "dir/a_2.txt");
    CHECK(batch::manifest_path("out/") == "out/manifest.json");
    CHECK(batch::manifest_path("dir/a.txt") == "dir/a_manifest.json");
    CHECK(batch::sidecar_of("out/00001.txt") == "out/00001.txt.json");
}

TEST_CASE("batch: two shards write what one process writes, and a rerun resumes", "[batch]") {
    const std::string dir = test::scratch_dir("batch_job");
    batch::ItemJob job;
    job.items = {"alpha", "beta", "gamma", "delta", "epsilon"};
    job.output = dir + "/one/";
    job.facts = {{"program", "test"}};
    const auto one = batch::run_item_job(job, shout);
    CHECK(one.ran == 5);
    CHECK(one.manifest == dir + "/one/manifest.json");

    // Rank 1 first: rank 0 waits for the other shard's sidecars before it writes the manifest.
    job.output = dir + "/two/";
    job.shard = {1, 2, 1};
    const auto r1 = batch::run_item_job(job, shout);
    CHECK(r1.ran == 2);
    CHECK(r1.manifest.empty());
    job.shard = {0, 2, 0};
    const auto r0 = batch::run_item_job(job, shout, {}, 5);
    CHECK(r0.ran == 3);
    for (int k = 0; k < 5; ++k) {
        const std::string a = batch::numbered_output(dir + "/one/", k, ".txt");
        const std::string b = batch::numbered_output(dir + "/two/", k, ".txt");
        CHECK(read_all(a) == read_all(b));
    }
    CHECK(read_all(dir + "/two/00003.txt") == "DELTA #3\n");
    const auto m = nlohmann::json::parse(read_all(r0.manifest));
    CHECK(m["count"] == 5);
    CHECK(m["shards"] == 2);
    REQUIRE(m["items"].size() == 5);
    for (int k = 0; k < 5; ++k) {
        CHECK(m["items"][k]["index"] == k);
        CHECK(m["items"][k]["item"] == job.items[size_t(k)]);
        CHECK(m["items"][k]["length"] == job.items[size_t(k)].size());
        CHECK(m["items"][k]["program"] == "test");
    }

    // Without --skip-existing an existing output is refused before anything runs; with it only the missing one runs.
    fs::remove(dir + "/two/00002.txt");
    fs::remove(dir + "/two/00002.txt.json");
    job.shard = {};
    int calls = 0;
    auto counted = [&](int64_t k, const std::string& item) { return ++calls, shout(k, item); };
    CHECK(test::error_of([&] { (void)batch::run_item_job(job, counted); }).find("00000.txt") != std::string::npos);
    CHECK(calls == 0);
    CHECK(!fs::exists(dir + "/two/00002.txt"));
    job.skip_existing = true;
    const auto again = batch::run_item_job(job, counted);
    CHECK(calls == 1);
    CHECK(again.ran == 1);
    CHECK(again.skipped == 4);
    CHECK(read_all(dir + "/two/00002.txt") == "GAMMA #2\n");

    // Rank 0 names the sidecar that never came when a shard failed.
    job.output = dir + "/lost/";
    job.skip_existing = false;
    job.shard = {0, 2, 0};
    CHECK(test::error_of([&] {
              (void)batch::run_item_job(job, shout, {}, 0.2);
          }).find("00001.txt.json' (output 1 of 5) did not appear") != std::string::npos);
}

TEST_CASE("memory: a request larger than the memory available names its field", "[batch]") {
    CHECK_NOTHROW(check_fits_memory("length", 1e9, "x", "y", int64_t(2e9)));
    CHECK_NOTHROW(check_fits_memory("length", 1e12, "x", "y", -1)); // unknown: not checked
    const auto e = test::error_of(
        [] { check_fits_memory("kv", 3.0 * (1LL << 30), "kv sink:4,9", "choose less", int64_t(1LL << 30)); });
    CHECK(e == "kv: kv sink:4,9 needs about 3.0 GiB of memory, this machine has 1.0 GiB available; choose less");
    CHECK(available_memory_bytes() > 0);
}
