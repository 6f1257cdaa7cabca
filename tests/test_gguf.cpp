// GGUF reading (text/io/gguf.h): ggml's block layouts on hand-made blocks, and the header errors. The container as
// llama.cpp's gguf-py writes it is checked by golden_runner tests/golden (text/gguf).
#include "cache/io/error.h"
#include "text/io/gguf.h"

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

// The tests live in the namespace instead of importing it: a using-directive at file scope would reach the other
// sources of the same unity batch (anchor::text and anchor::unet both have cache_mode_table).
namespace anchor::text {

namespace {

void put_u32(std::string& s, uint32_t v) {
    s.append(reinterpret_cast<const char*>(&v), 4);
}
void put_u64(std::string& s, uint64_t v) {
    s.append(reinterpret_cast<const char*>(&v), 8);
}
void put_str(std::string& s, const std::string& v) {
    put_u64(s, v.size());
    s += v;
}

std::string gguf_temp_file(const std::string& bytes) {
    const auto p = std::filesystem::temp_directory_path() / ("anchor_test_gguf_" + std::to_string(std::rand()) + ".gguf");
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
}

// A GGUF v3 with one tensor `t` of type `type`, ne = {ne0, ne1}, data `payload` (alignment 32).
std::string one_tensor_gguf(uint32_t type, uint64_t ne0, uint64_t ne1, const std::string& payload,
                            uint32_t version = 3, uint64_t offset = 0) {
    std::string s = "GGUF";
    put_u32(s, version);
    put_u64(s, 1); // tensors
    put_u64(s, 1); // kv
    put_str(s, "general.architecture");
    put_u32(s, 8);
    put_str(s, "llada");
    put_str(s, "t");
    put_u32(s, 2);
    put_u64(s, ne0);
    put_u64(s, ne1);
    put_u32(s, type);
    put_u64(s, offset);
    while (s.size() % 32) s += '\0';
    return s + payload;
}

} // namespace

TEST_CASE("ggml q8_0 and q4_0 blocks dequantise per llama.cpp's layout", "[gguf]") {
    // q8_0: f16 d = 0.5 (0x3800), then 32 int8.
    std::vector<uint8_t> q8 = {0x00, 0x38};
    for (int j = 0; j < 32; ++j) q8.push_back(static_cast<uint8_t>(static_cast<int8_t>(j - 16)));
    std::vector<float> out(32);
    ggml_dequantize(GgmlType::Q8_0, q8.data(), out.data(), 32);
    for (int j = 0; j < 32; ++j) CHECK(out[j] == 0.5f * float(j - 16));
    // q4_0: f16 d = -2 (0xC000), 16 bytes: low nibble -> weight j, high nibble -> weight j + 16, both minus 8.
    std::vector<uint8_t> q4 = {0x00, 0xC0};
    for (int j = 0; j < 16; ++j) q4.push_back(static_cast<uint8_t>((j & 15) | ((15 - j) << 4)));
    ggml_dequantize(GgmlType::Q4_0, q4.data(), out.data(), 32);
    for (int j = 0; j < 16; ++j) {
        CHECK(out[j] == -2.0f * float(j - 8));
        CHECK(out[j + 16] == -2.0f * float(15 - j - 8));
    }
}

TEST_CASE("ggml f16 and bf16 widen exactly", "[gguf]") {
    const uint16_t h[] = {0x3C00, 0xC000, 0x0001, 0x7C00, 0x0000, 0x8000, 0x3555};
    std::vector<float> out(7);
    ggml_dequantize(GgmlType::F16, reinterpret_cast<const uint8_t*>(h), out.data(), 7);
    CHECK(out[0] == 1.0f);
    CHECK(out[1] == -2.0f);
    CHECK(out[2] == std::ldexp(1.0f, -24)); // smallest subnormal
    CHECK(std::isinf(out[3]));
    CHECK(out[4] == 0.0f);
    CHECK(std::signbit(out[5]));
    CHECK(out[6] == float(torch::tensor(0.33325195f).to(torch::kHalf).item<float>()));
    const uint16_t b[] = {0x3F80, 0x4049}; // 1.0, 3.140625
    ggml_dequantize(GgmlType::BF16, reinterpret_cast<const uint8_t*>(b), out.data(), 2);
    CHECK(out[0] == 1.0f);
    CHECK(out[1] == 3.140625f);
}

TEST_CASE("gguf reads a hand-made file: shape reversed, q8_0 rows", "[gguf]") {
    std::string payload;
    for (int blk = 0; blk < 2; ++blk) {
        payload += std::string("\x00\x3c", 2); // d = 1
        for (int j = 0; j < 32; ++j) payload += static_cast<char>(blk * 32 + j - 40);
    }
    const auto path = gguf_temp_file(one_tensor_gguf(8, 32, 2, payload));
    auto g = GgufFile::open(path);
    CHECK(g->metadata()["general.architecture"] == "llada");
    const auto& t = g->info("t");
    CHECK(t.shape == std::vector<int64_t>{2, 32});
    auto w = g->dequantize("t");
    CHECK(w[1][0].item<float>() == float(32 - 40));
    CHECK(w[0][31].item<float>() == float(31 - 40));
    std::filesystem::remove(path);
}

TEST_CASE("gguf header errors name the file and the problem", "[gguf]") {
    auto msg = [](const std::string& bytes) {
        const auto path = gguf_temp_file(bytes);
        std::string m;
        try {
            GgufFile::open(path);
        } catch (const anchor::Error& e) {
            m = e.what();
        }
        std::filesystem::remove(path);
        return m;
    };
    const std::string ok_payload(34, '\0');
    CHECK(msg("GGML....").find("magic") != std::string::npos);
    CHECK(msg(one_tensor_gguf(8, 32, 1, ok_payload, 1)).find("version 1") != std::string::npos);
    CHECK(msg(one_tensor_gguf(8, 32, 1, ok_payload).substr(0, 40)).find("truncated") != std::string::npos);
    CHECK(msg(one_tensor_gguf(8, 32, 2, ok_payload)).find("past the end") != std::string::npos);
    CHECK(msg(one_tensor_gguf(8, 30, 1, ok_payload)).find("multiple of 32") != std::string::npos);
    CHECK(msg(one_tensor_gguf(8, 32, 1, ok_payload, 3, 8)).find("not aligned") != std::string::npos);
    // A K-quant is listed but refused when read, naming its type.
    const auto path = gguf_temp_file(one_tensor_gguf(12, 256, 1, std::string(144, '\0')));
    auto g = GgufFile::open(path);
    CHECK_THROWS_WITH(g->dequantize("t"), Catch::Contains("q4_K"));
    std::filesystem::remove(path);
}

} // namespace anchor::text
