// SinkRollingKV: slot layout, eviction order, position policies and allocation-free appends.
#include "cache/sink_rolling_kv.h"

#include "cache/io/enum_table.h"
#include "cache/io/error.h"

#include <catch2/catch.hpp>

#include <set>

using namespace anchor;
using namespace anchor::cache;

namespace {

SinkRollingKV make(int64_t S, int64_t W, bool evict = true, int64_t heads = 2, int64_t dim = 3) {
    SinkRollingKVOptions o;
    o.batch = 1;
    o.heads = heads;
    o.head_dim = dim;
    o.sinks = S;
    o.window = W;
    o.evict = evict;
    return SinkRollingKV(o);
}

// K of token i is filled with i + 0.25 * head, V with -(i + 1); exact in float32.
torch::Tensor k_of(int64_t i, int64_t heads = 2, int64_t dim = 3) {
    auto h = torch::arange(heads, torch::kFloat32).view({1, heads, 1, 1}) * 0.25f;
    return (h + static_cast<float>(i)).expand({1, heads, 1, dim}).contiguous();
}
torch::Tensor v_of(int64_t i, int64_t heads = 2, int64_t dim = 3) {
    return torch::full({1, heads, 1, dim}, -static_cast<float>(i + 1));
}

// The set of stream indices the buffer must hold after token i was appended: A(i) u {i} (README sec. 3).
std::set<int64_t> expected_set(int64_t i, int64_t S, int64_t W) {
    std::set<int64_t> s;
    for (int64_t j = 0; j < std::min(S, i); ++j) s.insert(j);
    for (int64_t j = std::max(S, i - W + 1); j < i; ++j) s.insert(j);
    s.insert(i);
    return s;
}

void check_contents(const SinkRollingKV& kv, int64_t i, int64_t S, int64_t W) {
    auto want = expected_set(i, S, W);
    REQUIRE(kv.filled() == static_cast<int64_t>(want.size()));
    auto idx = kv.stream_indices();
    REQUIRE(std::set<int64_t>(idx.begin(), idx.end()) == want);
    auto K = kv.keys(), V = kv.values();
    for (int64_t s = 0; s < kv.filled(); ++s) {
        const int64_t t = kv.stream_index(s);
        // Sinks sit in their own slot; window tokens at S + (t - S) % W.
        const int64_t slot = t < S ? t : S + (t - S) % W;
        REQUIRE(slot == s);
        REQUIRE(torch::equal(K.narrow(2, s, 1), k_of(t)));
        REQUIRE(torch::equal(V.narrow(2, s, 1), v_of(t)));
    }
}

} // namespace

TEST_CASE("SinkRollingKV keeps sinks and rolls the window, contents exact after every append", "[kv]") {
    for (auto [S, W] : std::vector<std::pair<int64_t, int64_t>>{{4, 28}, {2, 3}, {0, 5}, {1, 1}, {3, 1}}) {
        auto kv = make(S, W);
        const void* kp = kv.k_storage().data_ptr();
        const void* vp = kv.v_storage().data_ptr();
        for (int64_t i = 0; i < 3 * (S + W) + 7; ++i) {
            REQUIRE(kv.next_slot() == (i < S ? i : S + (i - S) % W));
            kv.append(k_of(i), v_of(i), i % 128);
            REQUIRE(kv.count() == i + 1);
            check_contents(kv, i, S, W);
            // No reallocation: the storage and the attended view keep their data pointers.
            REQUIRE(kv.k_storage().data_ptr() == kp);
            REQUIRE(kv.v_storage().data_ptr() == vp);
            REQUIRE(kv.keys().data_ptr() == kp);
            REQUIRE(kv.values().data_ptr() == vp);
        }
        // Sinks were never overwritten.
        for (int64_t s = 0; s < S; ++s) REQUIRE(kv.stream_index(s) == s);
        CHECK(kv.bytes() == 2 * 2 * (S + W) * 3 * 4);
    }
}

TEST_CASE("SinkRollingKV batched append while filling equals one-by-one", "[kv]") {
    auto a = make(2, 5), b = make(2, 5);
    std::vector<torch::Tensor> ks, vs;
    for (int64_t i = 0; i < 6; ++i) ks.push_back(k_of(i)), vs.push_back(v_of(i));
    auto slots = a.append(torch::cat(ks, 2), torch::cat(vs, 2), std::vector<int64_t>{0, 1, 2, 3, 4, 5});
    CHECK(slots == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
    for (int64_t i = 0; i < 6; ++i) b.append(ks[i], vs[i], i);
    CHECK(torch::equal(a.keys(), b.keys()));
    CHECK(torch::equal(a.values(), b.values()));
    // A block that crosses the wrap-around goes token by token and evicts in order.
    std::vector<torch::Tensor> k2, v2;
    for (int64_t i = 6; i < 10; ++i) k2.push_back(k_of(i)), v2.push_back(v_of(i));
    auto s2 = a.append(torch::cat(k2, 2), torch::cat(v2, 2), std::vector<int64_t>{6, 7, 8, 9});
    CHECK(s2 == std::vector<int64_t>{6, 2, 3, 4});
    check_contents(a, 9, 2, 5);
    CHECK_THROWS_AS(a.append(k_of(0), v_of(0), std::vector<int64_t>{1, 2}), anchor::Error); // shape mismatch
}

TEST_CASE("SinkRollingKV full mode never evicts", "[kv]") {
    auto kv = SinkRollingKV::full(1, 2, 3, 6);
    for (int64_t i = 0; i < 6; ++i) {
        kv.append(k_of(i), v_of(i), i);
        check_contents(kv, i, 0, 1000);
    }
    CHECK_THROWS_AS(kv.append(k_of(6), v_of(6), 6), anchor::Error);
    kv.clear();
    CHECK(kv.filled() == 0);
    kv.append(k_of(0), v_of(0), 0);
    CHECK(kv.stream_index(0) == 0);
}

TEST_CASE("Position policies for learned absolute positions", "[kv]") {
    const int64_t C = 32, P = 128;
    for (int64_t i = 0; i < 1000; ++i) {
        CHECK(position_id(PositionPolicy::Wrap, i, C, P) == i % P);
        CHECK(position_id(PositionPolicy::Cache, i, C, P) == std::min<int64_t>(i, C - 1));
        if (i < P)
            CHECK(position_id(PositionPolicy::Absolute, i, C, P) == i);
        else
            CHECK_THROWS_AS(position_id(PositionPolicy::Absolute, i, C, P), anchor::Error);
    }
    CHECK_THROWS_AS(position_id(PositionPolicy::Cache, 500, 200, P), anchor::Error);
    // The buffer's own policies only: re-encoding is the stream's (text::PositionMode::Reencode).
    CHECK(enum_choices(position_policy_table()) == "wrap, cache, absolute");
    for (const auto& [name, p] : position_policy_table())
        CHECK(enum_from_string(position_policy_table(), name, "") == p);
}

TEST_CASE("SinkRollingKV keeps its slot metadata in KvCells, apart from the tensors", "[kv]") {
    KvCells cells(4);
    CHECK(cells.capacity() == 4);
    CHECK(cells.live_count() == 0);
    cells.assign(2, 7, 3);
    cells.assign(2, 9, 1); // overwriting a live slot keeps the count
    cells.assign(0, 4, 0);
    CHECK(cells.live_count() == 2);
    CHECK(cells.live(2));
    CHECK_FALSE(cells.live(1));
    CHECK(cells.stream_index(2) == 9);
    CHECK(cells.position(2) == 1);
    CHECK(cells.stream_index(1) == -1);
    CHECK(cells.stream_indices(3) == std::vector<int64_t>{4, -1, 9});
    cells.clear();
    CHECK(cells.live_count() == 0);
    CHECK_FALSE(cells.live(2));

    // The buffer records every append in its cells: live slots = filled, stream index and position id per slot.
    auto kv = make(2, 3);
    for (int64_t i = 0; i < 9; ++i) {
        kv.append(k_of(i), v_of(i), 100 + i);
        const auto& c = kv.cells();
        REQUIRE(c.live_count() == kv.filled());
        const int64_t slot = i < 2 ? i : 2 + (i - 2) % 3;
        CHECK(c.stream_index(slot) == i);
        CHECK(c.position(slot) == 100 + i);
    }
    kv.clear();
    CHECK(kv.cells().live_count() == 0);
    CHECK_THROWS_AS(KvCells(2).stream_index(2), std::out_of_range);
}

namespace {
int g_writer_calls = 0;
void counting_writer(torch::Tensor&, torch::Tensor&, const torch::Tensor&, const torch::Tensor&, int64_t) {
    ++g_writer_calls;
}
} // namespace

TEST_CASE("SinkRollingKV: the device ring writer serves buffers off the CPU only", "[kv]") {
    // Off the CPU a one-token write is the fused kernel (kernels::ring_write, CUDA); on the CPU it stays a slice copy.
    // Without a GPU here only the CPU side runs: the writer must not be called, and the contents stay exact.
    SinkRollingKVOptions o;
    o.heads = 2;
    o.head_dim = 3;
    o.sinks = 1;
    o.window = 2;
    o.device_writer = &counting_writer;
    SinkRollingKV kv(o);
    for (int64_t i = 0; i < 7; ++i) {
        kv.append(k_of(i), v_of(i), i);
        check_contents(kv, i, 1, 2);
    }
    CHECK(g_writer_calls == 0);
}
