#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/sha256.h"
#include "cache/io/weight_map.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <random>

using namespace anchor;

namespace {

std::string header_bytes(const std::string& json, const std::string& data) {
    std::string out(8, '\0');
    uint64_t n = json.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + json + data;
}

std::string error_of(const std::string& bytes) {
    try {
        SafeTensorsFile::from_bytes(bytes, "test.safetensors");
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

} // namespace

TEST_CASE("safetensors round-trip for every dtype", "[io][safetensors]") {
    NamedTensors ts;
    ts.emplace_back("f32", torch::randn({3, 4}));
    ts.emplace_back("f16", torch::randn({5}).to(torch::kFloat16));
    ts.emplace_back("bf16", torch::randn({2, 2}).to(torch::kBFloat16));
    ts.emplace_back("f64", torch::randn({7}, torch::kFloat64));
    ts.emplace_back("i64", torch::arange(0, 9, torch::kInt64).reshape({3, 3}));
    ts.emplace_back("i32", torch::arange(-4, 4, torch::kInt32));
    ts.emplace_back("u8", torch::arange(0, 255, torch::kInt32).to(torch::kUInt8));
    ts.emplace_back("bool", torch::tensor({true, false, true}));
    ts.emplace_back("scalar", torch::tensor(3.5f));
    ts.emplace_back("empty", torch::zeros({0, 4}));
    const std::string dir = test::scratch_dir("roundtrip");
    const std::string path = dir + "/all.safetensors";
    save_safetensors(path, ts, {{"format", "pt"}, {"note", "x"}});
    auto f = SafeTensorsFile::open(path);
    REQUIRE(f->tensors().size() == ts.size());
    CHECK(f->metadata().at("format") == "pt");
    CHECK(f->metadata().at("note") == "x");
    for (const auto& [name, t] : ts) {
        auto r = f->tensor(name);
        INFO(name);
        CHECK(r.scalar_type() == t.scalar_type());
        CHECK(r.sizes() == t.sizes());
        CHECK(torch::equal(r, t));
    }
    // Writing to a returned view never reaches the file (copy-on-write mapping).
    f->tensor("f32").fill_(0);
    CHECK(torch::equal(SafeTensorsFile::open(path)->tensor("f32"), ts[0].second));
}

TEST_CASE("safetensors reads the golden files with their metadata", "[io][safetensors]") {
    auto f = SafeTensorsFile::open(test::golden("text/gpt2_tiny/forward.safetensors"));
    CHECK(f->metadata().at("format") == "pt");
    CHECK(f->info("input_ids").dtype == DType::I64);
    CHECK(f->tensor("input_ids").numel() == 40);
}

TEST_CASE("safetensors corruptions fail with their own messages", "[io][safetensors]") {
    const std::string ok_json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    REQUIRE(error_of(header_bytes(ok_json, std::string(8, '\0'))).empty());

    CHECK_THAT(error_of("abc"), Catch::Contains("is truncated: 3 bytes"));
    CHECK_THAT(error_of(header_bytes(ok_json, std::string(4, '\0'))),
               Catch::Contains("is truncated: the header describes 8 data bytes but only 4 follow"));
    {
        std::string b = header_bytes(ok_json, std::string(8, '\0'));
        b[0] = static_cast<char>(0xff);
        b[1] = static_cast<char>(0xff);
        CHECK_THAT(error_of(b), Catch::Contains("header length 65535") && Catch::Contains("larger than the file"));
    }
    CHECK_THAT(error_of(header_bytes(R"({"a":{"dtype":"F32",)", "")), Catch::Contains("invalid JSON header"));
    CHECK_THAT(error_of(header_bytes(R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", "xx")),
               Catch::Contains("tensor 'a': unknown dtype 'F8'"));
    CHECK_THAT(error_of(header_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})",
                                     std::string(12, '\0'))),
               Catch::Contains("tensor 'b': data_offsets [16, 24) are outside the data area of 12 bytes"));
    CHECK_THAT(error_of(header_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                     std::string(12, '\0'))),
               Catch::Contains("data of tensor 'b' [4, 12) overlaps tensor 'a' [0, 8)"));
    CHECK_THAT(
        error_of(header_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'))),
        Catch::Contains("tensor 'a': shape [3] x F32 (4 bytes) needs 12 bytes but data_offsets span 8"));
    CHECK_THAT(
        error_of(header_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, '\0'))),
        Catch::Contains("are reversed"));
    CHECK_THAT(error_of(header_bytes(R"({"__metadata__":{"k":1}})", "")),
               Catch::Contains("__metadata__ value of 'k' is not a string"));
    CHECK_THAT(error_of(header_bytes(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", "")),
               Catch::Contains("shape entries must be non-negative integers"));
    CHECK_THAT(error_of(header_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})",
                                     std::string(8, '\0'))),
               Catch::Contains("more than 2^64"));
}

TEST_CASE("safetensors open names the file", "[io][safetensors]") {
    try {
        SafeTensorsFile::open("/nonexistent/x.safetensors");
        FAIL("no error");
    } catch (const Error& e) {
        CHECK_THAT(e.what(), Catch::Contains("cannot open '/nonexistent/x.safetensors'"));
    }
}

namespace {
struct Tiny : torch::nn::Module {
    Tiny() {
        lin = register_module("lin", torch::nn::Linear(3, 2));
        register_buffer("pos", torch::zeros({4}));
    }
    torch::nn::Linear lin{nullptr};
};
} // namespace

TEST_CASE("WeightMap reports all missing, unexpected and wrong-shape names at once", "[io][weights]") {
    WeightMap wm;
    wm.insert("lin.weight", torch::ones({2, 4}), "ckpt.safetensors");
    wm.insert("extra.a", torch::ones({1}), "ckpt.safetensors");
    wm.insert("extra.b", torch::ones({1}), "ckpt.safetensors");
    Tiny m;
    try {
        wm.load_into(m);
        FAIL("no error");
    } catch (const Error& e) {
        std::string msg = e.what();
        CHECK_THAT(msg, Catch::Contains("2 missing tensor(s):\n  lin.bias [2]\n  pos [4]"));
        CHECK_THAT(msg, Catch::Contains("lin.weight: expected [2, 3], got [2, 4] in 'ckpt.safetensors'"));
        CHECK_THAT(msg, Catch::Contains("2 unexpected tensor(s):\n  extra.a (ckpt.safetensors)\n  extra.b"));
    }
    WeightMap good;
    good.insert("lin.weight", torch::full({2, 3}, 2.0, torch::kFloat16));
    good.insert("lin.bias", torch::ones({2}));
    good.insert("ignored.thing", torch::ones({1}));
    good.load_into(m, {"ignored\\..*"}, {"pos"});
    CHECK(m.lin->weight.scalar_type() == torch::kFloat32);
    CHECK(m.lin->weight.sum().item<float>() == 12.0f);
    CHECK_THROWS_WITH(good.get("lin.bias", {3}), Catch::Contains("tensor 'lin.bias': expected shape [3], got [2]"));
    CHECK_THROWS_WITH(good.get("nope"), Catch::Contains("missing tensor 'nope'"));
}

TEST_CASE("WeightMap loads sharded checkpoints through the index", "[io][weights]") {
    const std::string dir = test::scratch_dir("sharded");
    save_safetensors(dir + "/model-00001-of-00002.safetensors", {{"a", torch::ones({2})}});
    save_safetensors(dir + "/model-00002-of-00002.safetensors", {{"b", torch::zeros({3})}});
    nlohmann::json idx = {
        {"metadata", {{"total_size", 20}}},
        {"weight_map", {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}}};
    std::ofstream(dir + "/model.safetensors.index.json") << idx.dump();
    auto wm = WeightMap::load(dir);
    CHECK(wm.size() == 2);
    CHECK(wm.get("b", {3}).sum().item<float>() == 0.0f);
    auto wm2 = WeightMap::load(dir + "/model.safetensors.index.json");
    CHECK(wm2.names() == std::vector<std::string>{"a", "b"});
    // An index naming a tensor its shard does not hold is reported.
    idx["weight_map"]["c"] = "model-00001-of-00002.safetensors";
    std::ofstream(dir + "/model.safetensors.index.json") << idx.dump();
    CHECK_THROWS_WITH(WeightMap::load(dir), Catch::Contains("c (expected in"));
}

TEST_CASE("save refuses to overwrite unless asked", "[io][atomic]") {
    const std::string dir = test::scratch_dir("overwrite");
    save_safetensors(dir + "/x.safetensors", {{"a", torch::ones({1})}});
    CHECK_THROWS_WITH(save_safetensors(dir + "/x.safetensors", {{"a", torch::ones({1})}}, {}, false),
                      Catch::Contains("already exists"));
    // No temporary files are left behind.
    int n = 0;
    for (auto& e : std::filesystem::directory_iterator(dir)) (void)e, ++n;
    CHECK(n == 1);
}

TEST_CASE("SHA-256: FIPS 180-4 vectors, and the SHA-NI path equals the portable one on every length and split",
          "[io][sha256]") {
    const bool had = anchor::detail::use_sha256_fast_path(true);
    INFO("SHA-NI on this CPU: " << anchor::detail::sha256_fast_path_available());
    std::mt19937 rng(11);
    std::string big(3 * 65536 + 77, '\0');
    for (auto& ch : big) ch = char(rng());
    for (const bool fast : {false, true}) {
        anchor::detail::use_sha256_fast_path(fast);
        CHECK(sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        CHECK(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
        CHECK(sha256_hex(std::string(1000000, 'a')) ==
              "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    }
    // Every length around the 64-byte block and its padding boundary, and a file read in 64 KiB pieces.
    std::vector<std::string> portable;
    anchor::detail::use_sha256_fast_path(false);
    for (size_t n = 0; n <= 200; ++n) portable.push_back(sha256_hex(big.substr(0, n)));
    portable.push_back(sha256_hex(big));
    const auto file = test::scratch_dir("sha256") + "/big.bin";
    test::write_bytes(file, big);
    const std::string portable_file = sha256_file(file);
    CHECK(portable_file == portable.back());
    anchor::detail::use_sha256_fast_path(true);
    for (size_t n = 0; n <= 200; ++n) CHECK(sha256_hex(big.substr(0, n)) == portable[n]);
    CHECK(sha256_hex(big) == portable.back());
    CHECK(sha256_file(file) == portable_file);
    anchor::detail::use_sha256_fast_path(had);
}
