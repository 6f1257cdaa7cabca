#include "cache/anchor_policy.h"
#include "cache/dct.h"
#include "cache/divergence_guard.h"
#include "cache/io/error.h"
#include "cache/latent_cache.h"
#include "cache/metrics.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <limits>

using namespace anchor;
using namespace anchor::cache;

namespace {

CacheKey key(const std::string& ns, int layer, int slot = 0, int64_t anchor = 0) {
    return {ns, layer, slot, anchor};
}

} // namespace

// ================================================================================================================
// LatentCache
// ================================================================================================================

TEST_CASE("latent cache: hits, misses and staleness window", "[cache]") {
    LatentCache c; // max_staleness 2
    auto t = torch::arange(6, torch::kFloat32);
    c.put(key("unet", 3), t, 10);
    for (int64_t step : {10, 11, 12}) {
        auto v = c.get(key("unet", 3), step);
        REQUIRE(v.has_value());
        CHECK(torch::equal(*v, t));
    }
    CHECK_FALSE(c.get(key("unet", 3), 13).has_value()); // 3 steps old
    CHECK_FALSE(c.get(key("unet", 3), 9).has_value());  // written after step 9: another loop
    CHECK_FALSE(c.get(key("unet", 4), 10).has_value()); // absent
    auto s = c.stats();
    CHECK(s.hits == 3);
    CHECK(s.stale_rejections == 2);
    CHECK(s.misses == 1);
    CHECK(c.contains(key("unet", 3))); // a stale entry stays until evicted or replaced

    // Per-call and configured staleness.
    CHECK(c.get(key("unet", 3), 15, 5).has_value());
    c.set_max_staleness(0);
    CHECK_FALSE(c.get(key("unet", 3), 11).has_value());
    CHECK(c.get(key("unet", 3), 10).has_value());
    // A put refreshes the step.
    c.put(key("unet", 3), t * 2, 20);
    CHECK(torch::equal(*c.get(key("unet", 3), 20), t * 2));
    CHECK(c.stats().replacements == 1);
    CHECK(c.meta(key("unet", 3))->step == 20);
    CHECK_THROWS_WITH(c.set_max_staleness(-1), Catch::Contains("max_staleness must be >= 0"));
}

TEST_CASE("latent cache: LRU order and byte budget", "[cache]") {
    LatentCacheOptions o;
    o.byte_budget = 4 * 16; // four float32 [4] tensors
    LatentCache c(o);
    auto t = torch::ones({4});
    for (int i = 0; i < 4; ++i) c.put(key("a", i), t * i, 0);
    CHECK(c.bytes() == 64);
    CHECK(c.size() == 4);
    // Touch 0 so 1 becomes least recent.
    REQUIRE(c.get(key("a", 0), 0).has_value());
    auto order = c.lru_keys();
    REQUIRE(order.size() == 4);
    CHECK(order[0].layer == 0);
    CHECK(order[1].layer == 3);
    CHECK(order[3].layer == 1);
    c.put(key("a", 4), t * 4, 0); // evicts 1
    CHECK_FALSE(c.contains(key("a", 1)));
    CHECK(c.contains(key("a", 0)));
    CHECK(c.stats().evictions == 1);
    CHECK(c.bytes() <= o.byte_budget);
    // A bigger tensor evicts as many as needed, least recent first (2 then 3).
    c.put(key("a", 5), torch::ones({8}), 0);
    CHECK_FALSE(c.contains(key("a", 2)));
    CHECK_FALSE(c.contains(key("a", 3)));
    CHECK(c.contains(key("a", 0)));
    CHECK(c.contains(key("a", 4)));
    CHECK(c.bytes() == 64);
    CHECK(c.stats().evictions == 3);
    // Larger than the whole budget: not stored, nothing evicted.
    CHECK_FALSE(c.put(key("a", 6), torch::ones({17}), 0));
    CHECK(c.stats().oversize_rejections == 1);
    CHECK(c.size() == 3);
    // Shrinking the budget evicts immediately.
    c.set_byte_budget(32); // LRU order is 5 (32 bytes), 4, 0: 0 and 4 go
    CHECK(c.size() == 1);
    CHECK(c.lru_keys()[0].layer == 5);
    CHECK(c.bytes() == 32);
}

TEST_CASE("latent cache: shrinking the budget keeps the most recent entries that fit", "[cache]") {
    LatentCacheOptions o;
    LatentCache c(o);
    for (int i = 0; i < 10; ++i) c.put(key("n", i), torch::zeros({4}), 0); // 16 bytes each
    c.set_byte_budget(48);
    auto keys = c.lru_keys();
    REQUIRE(keys.size() == 3);
    CHECK(keys[0].layer == 9);
    CHECK(keys[1].layer == 8);
    CHECK(keys[2].layer == 7);
    CHECK(c.bytes() == 48);
}

TEST_CASE("latent cache: fp16 storage halves bytes and returns the original dtype", "[cache]") {
    LatentCacheOptions o;
    o.fp16_storage = true;
    LatentCache c(o);
    torch::manual_seed(0);
    auto x = torch::randn({2, 3, 8, 8});
    c.put(key("f", 0), x, 0);
    auto m = c.meta(key("f", 0));
    REQUIRE(m.has_value());
    CHECK(m->stored_fp16);
    CHECK(m->bytes == size_t(x.numel()) * 2);
    CHECK(m->dtype == torch::kFloat32);
    auto y = c.get(key("f", 0), 0);
    REQUIRE(y.has_value());
    CHECK(y->scalar_type() == torch::kFloat32);
    CHECK(y->sizes() == x.sizes());
    // fp16 has an 11-bit significand: relative rounding error <= 2^-11.
    CHECK(((*y - x).abs() / x.abs().clamp_min(1e-3)).max().item<double>() <= std::ldexp(1.0, -11) + 1e-7);
    CHECK(torch::equal(*y, x.to(torch::kHalf).to(torch::kFloat32)));
    // Integer tensors are stored as they are.
    c.put(key("f", 1), torch::arange(5), 0);
    CHECK_FALSE(c.meta(key("f", 1))->stored_fp16);
    CHECK(torch::equal(*c.get(key("f", 1), 0), torch::arange(5)));
}

TEST_CASE("latent cache: namespaces, erase and clear", "[cache]") {
    LatentCache c;
    for (int i = 0; i < 5; ++i) {
        c.put(key("deepcache", i), torch::zeros({2}), 0);
        c.put(key("kv", i, 1, 7), torch::zeros({3}), 0);
    }
    CHECK(c.size() == 10);
    // Same layer/slot/anchor in different namespaces are different entries.
    c.put(key("deepcache", 0, 1, 7), torch::ones({3}), 0);
    CHECK(c.size() == 11);
    CHECK(c.erase_namespace("deepcache") == 6);
    CHECK(c.size() == 5);
    CHECK(c.bytes() == 5 * 12);
    CHECK(c.erase_namespace("deepcache") == 0);
    CHECK(c.contains(key("kv", 3, 1, 7)));
    CHECK(c.erase(key("kv", 3, 1, 7)));
    CHECK_FALSE(c.erase(key("kv", 3, 1, 7)));
    CHECK(c.size() == 4);
    c.clear();
    CHECK(c.size() == 0);
    CHECK(c.bytes() == 0);
    CHECK(c.lru_keys().empty());
    // Slots are reused after clear/erase and the lists stay consistent.
    c.put(key("kv", 1), torch::zeros({1}), 0);
    CHECK(c.lru_keys().size() == 1);
}

TEST_CASE("latent cache: statistics export as JSON", "[cache]") {
    LatentCacheOptions o;
    o.byte_budget = 32;
    LatentCache c(o);
    c.put(key("s", 0), torch::zeros({4}), 0);
    c.put(key("s", 1), torch::zeros({4}), 0);
    c.put(key("s", 2), torch::zeros({4}), 0); // evicts 0
    c.get(key("s", 1), 0);
    c.get(key("s", 0), 0);
    c.get(key("s", 2), 9);
    auto j = c.stats_json();
    CHECK(j["hits"] == 1);
    CHECK(j["misses"] == 1);
    CHECK(j["stale_rejections"] == 1);
    CHECK(j["evictions"] == 1);
    CHECK(j["entries"] == 2);
    CHECK(j["bytes"] == 32);
    CHECK(j["byte_budget"] == 32);
    CHECK(j["max_staleness"] == 2);
    CHECK(j["hit_rate"].get<double>() == Approx(1.0 / 3));
    CHECK(j["ops"]["hash_lookups"].get<uint64_t>() > 0);
    // Round-trips through text.
    auto k = nlohmann::json::parse(j.dump());
    CHECK(k == j);
    c.reset_stats();
    CHECK(c.stats().hits == 0);
    CHECK(c.stats().entries == 2);
    CHECK(c.op_counters().total() == 0);
}

TEST_CASE("cache statistics: one type for the store and the decisions of the cache reading it", "[cache]") {
    CacheStats a;
    a.hits = 3, a.bytes = 100, a.peak_bytes = 120, a.entries = 2;
    CHECK_FALSE(to_json(a).contains("reuse")); // a store alone (the SD caches') reports no decisions
    CHECK(a.reused_fraction() == 0.0);
    CacheStats d; // a denoiser's decisions: 2 steps x 3 positions x 2 layers, 5 of the 12 position-layers anchored
    d.position_layers_total = 12, d.position_layers_reused = 5, d.full_steps = 1, d.drift_refreshes = 1;
    d.active_per_step = {6, 1};
    CacheStats b;
    b.hits = 1, b.bytes = 80, b.peak_bytes = 200, b.entries = 3;
    b.position_layers_total = 6, b.position_layers_reused = 1, b.active_per_step = {5};
    a += d;
    a += b;
    CHECK(a.hits == 4);
    CHECK(a.bytes == 100);
    CHECK(a.peak_bytes == 200);
    CHECK(a.entries == 3);
    CHECK(a.position_layers_total == 18);
    CHECK(a.position_layers_reused == 6);
    CHECK(a.full_steps == 1);
    CHECK(a.drift_refreshes == 1);
    CHECK(a.active_per_step == std::vector<int64_t>{6, 1, 5});
    CHECK(a.reused_fraction() == Approx(6.0 / 18));
    const auto j = to_json(a);
    CHECK(j["hits"] == 4);
    CHECK(j["reuse"]["position_layers_total"] == 18);
    CHECK(j["reuse"]["position_layers_reused"] == 6);
    CHECK(j["reuse"]["reused_fraction"].get<double>() == Approx(1.0 / 3));
    CHECK(j["reuse"]["full_steps"] == 1);
    CHECK(j["reuse"]["drift_refreshes"] == 1);
}

TEST_CASE("latent cache: row-versioned entries write rows in place and stamp each one", "[cache][rows]") {
    LatentCache c;
    auto k = key("seq", 1, 0);
    auto init = torch::zeros({2, 5, 3}); // rows along dim 1 (e.g. K [H, L, d] of 5 positions)
    REQUIRE(c.put(k, init, LatentCache::kUnwritten, RowVersioned{1}));
    init.fill_(9); // a private copy: the caller's tensor is not the cache's
    auto m = c.meta(k);
    REQUIRE(m.has_value());
    CHECK(m->row_dim == 1);
    CHECK(m->rows == 5);
    CHECK(m->bytes == size_t(2 * 5 * 3 * 4 + 5 * 8)); // values + one int64 stamp per row
    CHECK(c.row_steps(k)->equal(torch::full({5}, LatentCache::kUnwritten, torch::kInt64)));
    CHECK(torch::equal(*c.get(k, 0), torch::zeros({2, 5, 3})));

    auto rows = torch::arange(2 * 2 * 3, torch::kFloat32).view({2, 2, 3});
    REQUIRE(c.put_rows(k, torch::tensor({3, 0}, torch::kInt64), rows, 4));
    auto stored = *c.get(k, 4);
    CHECK(torch::equal(stored.select(1, 3), rows.select(1, 0)));
    CHECK(torch::equal(stored.select(1, 0), rows.select(1, 1)));
    CHECK(stored.select(1, 2).abs().sum().item<double>() == 0.0);
    CHECK(c.row_steps(k)->equal(torch::tensor({4, -1, -1, 4, -1}, torch::kInt64)));
    CHECK(c.meta(k)->step == 4);
    REQUIRE(c.put_rows(k, torch::tensor({1}, torch::kInt64), torch::ones({2, 1, 3}), 6));
    // get() hands out the storage itself: it sees later writes.
    CHECK(torch::equal(stored.select(1, 1), torch::ones({2, 3})));
    CHECK(c.stats().rows_written == 3);

    // Staleness per row: at step 7 with window 2, rows of step 6 are fresh, rows of step 4 stale, unwritten missing.
    auto fresh = c.fresh_rows(k, 7, 2);
    REQUIRE(fresh.has_value());
    CHECK(fresh->fresh.equal(torch::tensor({false, true, false, false, false})));
    CHECK(fresh->hits == 1);
    CHECK(fresh->stale == 2);
    CHECK(fresh->unwritten == 2);
    auto st = c.stats();
    CHECK(st.row_hits == 1);
    CHECK(st.row_stale_rejections == 2);
    CHECK(st.row_misses == 2);
    CHECK(c.fresh_rows(k, 8, 4)->fresh.equal(torch::tensor({true, true, false, true, false})));
    // The entry is served whatever its age (get's window does not apply: its rows carry their versions).
    CHECK(c.get(k, 100).has_value());
    CHECK_FALSE(c.fresh_rows(key("seq", 2), 0, 2).has_value()); // absent: a miss
    CHECK_FALSE(c.put_rows(key("seq", 2), torch::tensor({0}, torch::kInt64), torch::ones({2, 1, 3}), 0));
    CHECK(c.stats().misses == 2);
    auto j = c.stats_json();
    CHECK(j["rows"]["written"] == 3);
    CHECK(j["rows"]["hits"] == 1 + 3);

    // rows_fresh is get's window per row; an unwritten row or one written at a later step is never fresh.
    auto stamps = torch::tensor({-1, 0, 3, 5, 6}, torch::kInt64);
    CHECK(LatentCache::rows_fresh(stamps, 5, 2).equal(torch::tensor({false, false, true, true, false})));
    CHECK(LatentCache::rows_fresh(stamps, 5, 0).equal(torch::tensor({false, false, false, true, false})));

    // What put_rows refuses: a plain entry, rows of the wrong shape, non-int64 indices; put a bad row dimension.
    c.put(key("plain", 0), torch::zeros({4}), 0);
    CHECK_THROWS_WITH(c.put_rows(key("plain", 0), torch::tensor({0}, torch::kInt64), torch::zeros({1}), 1),
                      Catch::Contains("not a row-versioned entry"));
    CHECK_THROWS_WITH(c.put_rows(k, torch::tensor({0}, torch::kInt64), torch::zeros({2, 1, 4}), 1),
                      Catch::Contains("[2, 1, 3]"));
    CHECK_THROWS_AS(c.put_rows(k, torch::tensor({0}, torch::kInt32), torch::zeros({2, 1, 3}), 1), Error);
    CHECK_THROWS_AS(c.put(key("x", 0), torch::zeros({2}), 0, RowVersioned{1}), Error);
    CHECK_THROWS_AS(c.fresh_rows(key("plain", 0), 0, 1), Error);
}

TEST_CASE("latent cache: row-versioned entries honour fp16 storage, the byte budget and LRU", "[cache][rows]") {
    LatentCacheOptions o;
    o.fp16_storage = true;
    o.byte_budget = 3 * (8 * 2 + 4 * 8); // three [4, 2] float32 entries stored as fp16, with their 4 stamps
    LatentCache c(o);
    torch::manual_seed(3);
    for (int i = 0; i < 3; ++i) REQUIRE(c.put(key("r", i), torch::zeros({4, 2}), LatentCache::kUnwritten, {0}));
    auto m = c.meta(key("r", 0));
    CHECK(m->stored_fp16);
    CHECK(m->dtype == torch::kFloat32);
    CHECK(m->bytes == size_t(8 * 2 + 4 * 8));
    CHECK(c.bytes() == o.byte_budget);
    auto rows = torch::randn({2, 2});
    REQUIRE(c.put_rows(key("r", 0), torch::tensor({1, 2}, torch::kInt64), rows, 0));
    auto got = *c.get(key("r", 0), 0);
    CHECK(got.scalar_type() == torch::kFloat32);
    CHECK(torch::equal(got.narrow(0, 1, 2), rows.to(torch::kHalf).to(torch::kFloat32)));
    // put_rows made r/0 most recent: the next entry evicts r/1, the least recently used.
    REQUIRE(c.put(key("r", 3), torch::zeros({4, 2}), 0, {0}));
    CHECK(c.stats().evictions == 1);
    CHECK_FALSE(c.contains(key("r", 1)));
    CHECK(c.contains(key("r", 0)));
    CHECK(c.bytes() == o.byte_budget);
    // An evicted entry takes no rows (the caller re-creates it).
    CHECK_FALSE(c.put_rows(key("r", 1), torch::tensor({0}, torch::kInt64), torch::zeros({1, 2}), 1));
    // Replacing a row-versioned entry by a plain one drops its stamps.
    c.put(key("r", 0), torch::zeros({2}), 5);
    CHECK_FALSE(c.row_steps(key("r", 0)).has_value());
    CHECK(c.meta(key("r", 0))->row_dim == -1);
    c.erase_namespace("r");
    CHECK(c.bytes() == 0);
}

// O(1) by counts: with 1,000,000 entries every get / put / evict does the same small, fixed number of hash and list
// operations as with 1,000, and eviction visits exactly one node per evicted entry (no scans).
TEST_CASE("latent cache: O(1) get/put/evict at 1,000,000 entries by operation counts", "[cache][slow]") {
    auto per_op_costs = [](int64_t n) {
        LatentCacheOptions o;
        o.byte_budget = size_t(n) * 4; // float32 [1] per entry
        LatentCache c(o);
        auto v = torch::zeros({1});
        for (int64_t i = 0; i < n; ++i) c.put(key("big", int(i % 1000), 0, i / 1000), v, 0);
        REQUIRE(c.size() == size_t(n));

        std::vector<uint64_t> costs;
        // 1000 gets spread over the key space.
        auto before = c.op_counters();
        for (int64_t i = 0; i < 1000; ++i) {
            const int64_t id = (i * 7919) % n;
            REQUIRE(c.get(key("big", int(id % 1000), 0, id / 1000), 0).has_value());
        }
        auto after = c.op_counters();
        costs.push_back(after.total() - before.total());
        CHECK(after.nodes_visited == before.nodes_visited);
        // 1000 puts of new keys: each evicts exactly one entry, visiting one node.
        before = after;
        const auto ev0 = c.stats().evictions;
        for (int64_t i = 0; i < 1000; ++i) c.put(key("new", int(i)), v, 1);
        after = c.op_counters();
        costs.push_back(after.total() - before.total());
        CHECK(c.stats().evictions - ev0 == 1000);
        CHECK(after.nodes_visited - before.nodes_visited == 1000);
        // 1000 replacements.
        before = after;
        for (int64_t i = 0; i < 1000; ++i) c.put(key("new", int(i)), v, 2);
        after = c.op_counters();
        costs.push_back(after.total() - before.total());
        // 1000 row writes and row-staleness lookups on row-versioned entries.
        for (int64_t i = 0; i < 10; ++i) c.put(key("rows", int(i)), torch::zeros({8}), 0, RowVersioned{0});
        before = c.op_counters();
        const auto idx = torch::tensor({1, 5}, torch::kInt64);
        for (int64_t i = 0; i < 1000; ++i) {
            REQUIRE(c.put_rows(key("rows", int(i % 10)), idx, v.expand({2}), 3));
            REQUIRE(c.fresh_rows(key("rows", int(i % 10)), 3, 1).has_value());
        }
        after = c.op_counters();
        costs.push_back(after.total() - before.total());
        CHECK(after.nodes_visited == before.nodes_visited);
        return costs;
    };
    const auto small = per_op_costs(1000);
    const auto large = per_op_costs(1000000);
    REQUIRE(small.size() == large.size());
    for (size_t i = 0; i < small.size(); ++i) {
        INFO("operation group " << i << ": " << small[i] << " ops at 1e3 entries, " << large[i] << " at 1e6");
        CHECK(small[i] == large[i]);
        CHECK(large[i] <= 1000 * 12); // a handful of primitive operations per call
    }
}

// ================================================================================================================
// Anchor policies
// ================================================================================================================

TEST_CASE("fixed-interval policy", "[cache][policy]") {
    FixedIntervalPolicy p(3);
    std::string pattern;
    for (int i = 0; i < 10; ++i) pattern += p.decide({i, 10, {}, 0.0}).action == Action::Full ? 'F' : 'r';
    CHECK(pattern == "FrrFrrFrrF");
    FixedIntervalPolicy every(1);
    CHECK(every.decide({5, 10, {}, 0.0}).action == Action::Full);
    CHECK_THROWS_AS(FixedIntervalPolicy(0), UsageError);
    CHECK(p.describe() == "interval:3");
}

TEST_CASE("time-gate policy anchors layers whose gate mean exceeds tau", "[cache][policy]") {
    TimeGatePolicy p(0.5);
    auto d0 = p.decide({0, 10, {0.1, 0.2}, 0.0});
    CHECK(d0.action == Action::Full); // nothing cached at step 0
    CHECK(d0.layers == std::vector<Action>{Action::Full, Action::Full});
    auto d1 = p.decide({1, 10, {0.7, 0.3, 0.5}, 0.0});
    CHECK(d1.layers == std::vector<Action>{Action::Full, Action::Reuse, Action::Reuse}); // 0.5 is not > 0.5
    CHECK(d1.action == Action::Full);
    auto d2 = p.decide({2, 10, {0.1, 0.3}, 0.0});
    CHECK(d2.action == Action::Reuse);
    CHECK_THROWS_AS(p.decide({3, 10, {}, 0.0}), Error);
    CHECK_THROWS_WITH(TimeGatePolicy(1.5), Catch::Contains("tau must be in [0, 1]"));

    // The other direction (the masked diffusion LM): a gate mean above tau means Reuse (the long staleness), no step
    // is forced Full, and tau may lie outside [0, 1] (plain adaLN gates are unbounded).
    TimeGatePolicy r(0.5, GateDirection::HighReuses);
    CHECK(r.decide({0, 10, {0.7, 0.3}, 0.0}).layers == std::vector<Action>{Action::Reuse, Action::Full});
    auto r1 = r.decide({1, 10, {0.9, 0.6}, 0.0});
    CHECK(r1.layers == std::vector<Action>{Action::Reuse, Action::Reuse});
    CHECK(r1.action == Action::Reuse);
    CHECK(r.describe() == "gate:0.5:high-reuses");
    CHECK(TimeGatePolicy(-1, GateDirection::HighReuses).decide({2, 0, {-0.5}, 0.0}).layers[0] == Action::Reuse);
    CHECK(TimeGatePolicy(2, GateDirection::HighReuses).decide({2, 0, {1.5}, 0.0}).layers[0] == Action::Full);
    CHECK_THROWS_AS(TimeGatePolicy(std::nan(""), GateDirection::HighReuses), Error);

    // g = sigmoid(W E + b): W [2, 3], E = [1, 0, -1], b = [0, 1] -> logits [w00 - w02, 1 + w10 - w12].
    auto W = torch::tensor({1.0, 5.0, -1.0, 0.5, 9.0, 0.5}).reshape({2, 3});
    auto b = torch::tensor({0.0, 1.0});
    auto e = torch::tensor({1.0, 0.0, -1.0});
    auto g = TimeGatePolicy::gate_means(W, b, e);
    REQUIRE(g.size() == 2);
    CHECK(g[0] == Approx(1.0 / (1.0 + std::exp(-2.0))));
    CHECK(g[1] == Approx(1.0 / (1.0 + std::exp(-1.0))));
    // Grouped gates: mean over G units.
    auto Wg = torch::zeros({1, 2, 3});
    Wg[0][0][0] = 2.0;
    auto bg = torch::zeros({1, 2});
    auto gg = TimeGatePolicy::gate_means(Wg, bg, e);
    CHECK(gg[0] == Approx(0.5 * (1.0 / (1.0 + std::exp(-2.0)) + 0.5)));
    CHECK_THROWS_AS(TimeGatePolicy::gate_means(torch::zeros({2, 4}), b, e), Error);
}

TEST_CASE("DCT change policy accumulates change, caps reuse, keeps first and last full", "[cache][policy]") {
    DctChangePolicy p(0.3, 3);
    // Scripted per-step change rates.
    const std::vector<double> r = {0.0, 0.1, 0.1, 0.15, 0.05, 0.05, 0.05, 0.05, 0.05, 0.5, 0.01, 0.01};
    std::string pattern;
    for (int i = 0; i < int(r.size()); ++i)
        pattern += p.decide({i, int(r.size()), {}, r[i]}).action == Action::Full ? 'F' : 'r';
    // step0 F; 1: .1 r; 2: .2 r; 3: .35 F; 4: .05 r; 5: .1 r; 6: .15 r; 7: 3 reuses done -> F; 8: r; 9: .55 F;
    // 10: r; 11: last -> F.
    CHECK(pattern == "FrrFrrrFrFrF");
    CHECK_THROWS_AS(p.decide({1, 12, {}, std::nan("")}), Error);
    CHECK_THROWS_AS(DctChangePolicy(0.0, 2), UsageError);
    DctChangePolicy never_reuse(0.3, 0);
    CHECK(never_reuse.decide({0, 5, {}, 0.0}).action == Action::Full);
    CHECK(never_reuse.decide({1, 5, {}, 0.0}).action == Action::Full);
}

TEST_CASE("DCT change policy: the span bound is a fraction of the loop's log-sigma range, and says why",
          "[cache][policy]") {
    // sigma_k = exp(-k / 2) over 12 steps: ln sigma falls by 0.5 a step, the range is 5.5; span 0.25 allows 1.375, so
    // a run of reuses ends at the third step after a full one (distance 1.5). No change ever reaches the threshold
    // and there is no count bound.
    std::vector<double> sigmas;
    for (int k = 0; k < 12; ++k) sigmas.push_back(std::exp(-0.5 * k));
    DctChangePolicy p(1e30, std::numeric_limits<int>::max());
    p.set_span_bound(0.25, sigmas);
    std::string pattern, why;
    for (int i = 0; i < 12; ++i) {
        const auto d = p.decide({i, 12, {}, 0.1});
        pattern += d.action == Action::Full ? 'F' : 'r';
        if (d.action == Action::Full) why += std::string(d.why) + " ";
    }
    CHECK(pattern == "FrrFrrFrrFrF");
    CHECK(why == "first span span span last ");
    // The same stretch of the schedule at twice the steps: twice the reuses per run (distance 0.25 a step, bound
    // 0.25 x 5.75 = 1.4375: five reuses, the sixth step is at 1.5).
    std::vector<double> fine;
    for (int k = 0; k < 24; ++k) fine.push_back(std::exp(-0.25 * k));
    p.reset();
    p.set_span_bound(0.25, fine);
    pattern.clear();
    for (int i = 0; i < 24; ++i) pattern += p.decide({i, 24, {}, 0.01}).action == Action::Full ? 'F' : 'r';
    CHECK(pattern == "FrrrrrFrrrrrFrrrrrFrrrrF");
    // A full step the caller decided (mark_full) restarts the run and the distance there.
    p.reset();
    p.set_span_bound(0.25, sigmas);
    CHECK(p.decide({0, 12, {}, 0.0}).action == Action::Full);
    CHECK(p.decide({1, 12, {}, 0.1}).action == Action::Reuse);
    p.mark_full(1);
    CHECK(p.decide({2, 12, {}, 0.1}).action == Action::Reuse);
    CHECK(p.decide({3, 12, {}, 0.1}).action == Action::Reuse);
    CHECK(std::string(p.decide({4, 12, {}, 0.1}).why) == "span");
    // The other reasons.
    DctChangePolicy q(0.3, 1);
    CHECK(std::string(q.decide({0, 6, {}, 0.0}).why) == "first");
    CHECK(std::string(q.decide({1, 6, {}, 0.4}).why) == "change");
    CHECK(std::string(q.decide({2, 6, {}, 0.0}).why).empty());
    CHECK(std::string(q.decide({3, 6, {}, 0.0}).why) == "count");
    CHECK_THROWS_AS(q.set_span_bound(-0.1, sigmas), UsageError);
    CHECK_THROWS_AS(q.set_span_bound(0.2, {1.0, 0.0}), UsageError);
}

TEST_CASE("quality target: the threshold scale halves per db_per_halving above the reference", "[cache][policy]") {
    QualityTargetCalibration c;
    c.ref_db = 30.0, c.db_per_halving = 6.0, c.min_scale = 0.1, c.max_scale = 4.0;
    CHECK(target_threshold_scale(30.0, c) == Approx(1.0));
    CHECK(target_threshold_scale(36.0, c) == Approx(0.5));   // 2^(-6/6)
    CHECK(target_threshold_scale(42.0, c) == Approx(0.25));  // 2^(-12/6)
    CHECK(target_threshold_scale(27.0, c) == Approx(std::sqrt(2.0))); // 2^(3/6)
    CHECK(target_threshold_scale(60.0, c) == Approx(0.1));   // 2^-5 clamped to min_scale
    CHECK(target_threshold_scale(10.0, c) == Approx(4.0));   // 2^(20/6) = 10.08 clamped to max_scale
    CHECK_THROWS_AS(target_threshold_scale(0.0, c), UsageError);
    CHECK_THROWS_AS(target_threshold_scale(std::nan(""), c), UsageError);
    c.db_per_halving = 0;
    CHECK_THROWS_AS(target_threshold_scale(35.0, c), UsageError);
}

TEST_CASE("divergence guard: an image's reuse residuals summed against its budget, then every step full",
          "[cache][policy][guard]") {
    DivergenceGuard g(1.0);
    // Residuals 0.3, 0.4 are spent (0.3, 0.7); 0.25 takes the sum to 0.95 <= 1: still a reuse.
    CHECK_FALSE(g.must_compute(0.3));
    CHECK_FALSE(g.must_compute(0.4));
    CHECK_FALSE(g.must_compute(0.25));
    CHECK(g.spent() == Approx(0.95));
    CHECK_FALSE(g.tripped());
    // A step without a measured residual (NaN) neither spends nor trips.
    CHECK_FALSE(g.must_compute(std::nan("")));
    CHECK(g.spent() == Approx(0.95));
    // 0.95 + 0.1 = 1.05 > 1: this step is computed and not spent, and every later one is computed too, small
    // residuals and unmeasured ones alike.
    CHECK(g.must_compute(0.1));
    CHECK(g.tripped());
    CHECK(g.spent() == Approx(0.95));
    CHECK(g.must_compute(0.0));
    CHECK(g.must_compute(std::nan("")));
    // A new image starts with its whole budget.
    g.reset();
    CHECK_FALSE(g.tripped());
    CHECK(g.spent() == 0.0);
    CHECK_FALSE(g.must_compute(1.0)); // exactly the budget: not past it
    CHECK(g.must_compute(1e-9));
    // Off (budget 0): never full, whatever the residuals.
    DivergenceGuard off;
    for (double r : {0.5, 10.0, 1e6}) CHECK_FALSE(off.must_compute(r));
    CHECK(off.spent() == 0.0);
    CHECK_THROWS_AS(DivergenceGuard(-1.0), UsageError);
    CHECK_THROWS_AS(DivergenceGuard(std::numeric_limits<double>::infinity()), UsageError);
    CHECK_THROWS_AS(DivergenceGuard(std::nan("")), UsageError);
}

TEST_CASE("policy spec strings", "[cache][policy]") {
    CHECK(make_policy("interval:2")->describe() == "interval:2");
    CHECK(make_policy("gate:0.25")->describe() == "gate:0.25");
    CHECK(make_policy("dct:0.2")->describe() == "dct:0.2:4");
    CHECK(make_policy("dct:0.2:6")->describe() == "dct:0.2:6");
    for (const char* bad : {"", "interval", "interval:x", "interval:2.5", "gate:2", "dct:-1", "foo:1", "dct:1:2:3"})
        CHECK_THROWS_AS(make_policy(bad), UsageError);
}

// ================================================================================================================
// DCT
// ================================================================================================================

namespace {

// Direct O(N^4) orthonormal 2-D DCT-II of one [H, W] map.
torch::Tensor direct_dct2(const torch::Tensor& x) {
    const int64_t h = x.size(0), w = x.size(1);
    auto xa = x.to(torch::kFloat64).contiguous();
    auto a = xa.accessor<double, 2>();
    auto out = torch::zeros({h, w}, torch::kFloat64);
    auto o = out.accessor<double, 2>();
    for (int64_t u = 0; u < h; ++u)
        for (int64_t v = 0; v < w; ++v) {
            double s = 0;
            for (int64_t i = 0; i < h; ++i)
                for (int64_t j = 0; j < w; ++j)
                    s += a[i][j] * std::cos(M_PI * (2 * i + 1) * u / (2.0 * h)) *
                         std::cos(M_PI * (2 * j + 1) * v / (2.0 * w));
            const double au = u == 0 ? std::sqrt(1.0 / h) : std::sqrt(2.0 / h);
            const double av = v == 0 ? std::sqrt(1.0 / w) : std::sqrt(2.0 / w);
            o[u][v] = au * av * s;
        }
    return out;
}

} // namespace

TEST_CASE("DCT-II matches the direct formula, inverts, and preserves energy", "[cache][dct]") {
    torch::manual_seed(1);
    auto x = torch::randn({2, 3, 5, 7}, torch::kFloat64);
    auto X = dct2(x);
    CHECK(X.sizes() == x.sizes());
    for (int b = 0; b < 2; ++b)
        for (int c = 0; c < 3; ++c) CHECK(test::max_abs_diff(X[b][c], direct_dct2(x[b][c])) < 1e-12);
    CHECK(test::max_abs_diff(idct2(X), x) < 1e-12); // DCT-III(DCT-II(x)) = x
    CHECK(X.square().sum().item<double>() == Approx(x.square().sum().item<double>()).epsilon(1e-12)); // Parseval
    auto C = dct_basis(6, torch::kFloat64);
    CHECK(test::max_abs_diff(torch::matmul(C, C.t()), torch::eye(6, torch::kFloat64)) < 1e-12); // orthonormal
    // float32 path.
    auto xf = x.to(torch::kFloat32);
    CHECK(test::max_abs_diff(idct2(dct2(xf)), xf) < 1e-5);
    // A constant map has only the DC coefficient: X(0,0) = sqrt(H W) * c.
    auto k = torch::full({4, 4}, 3.0, torch::kFloat64);
    auto K = dct2(k);
    CHECK(K[0][0].item<double>() == Approx(12.0));
    CHECK(K.abs().sum().item<double>() == Approx(12.0));
    // Bases are cached per (N, dtype).
    const size_t n0 = dct_basis_cache_entries();
    dct2(torch::randn({5, 7}, torch::kFloat64));
    CHECK(dct_basis_cache_entries() == n0);
    dct2(torch::randn({9, 9}));
    CHECK(dct_basis_cache_entries() == n0 + 1);
    CHECK_THROWS_AS(dct2(torch::randn({5})), Error);
    CHECK_THROWS_AS(dct2(torch::ones({3, 3}, torch::kInt64)), Error);
}

TEST_CASE("Kronecker DCT path, low-band coefficients and the float32 change rate", "[cache][dct]") {
    torch::manual_seed(12);
    // Maps up to 16x16 take the one-GEMM Kronecker path, larger ones the two-matmul path: both equal the definition.
    for (const auto& hw : std::vector<std::pair<int64_t, int64_t>>{{16, 16}, {8, 8}, {3, 11}, {17, 16}}) {
        auto x = torch::randn({2, 3, hw.first, hw.second}, torch::kFloat64);
        auto X = dct2(x);
        CHECK(test::max_abs_diff(X[1][2], direct_dct2(x[1][2])) < 1e-12);
        CHECK(test::max_abs_diff(idct2(X), x) < 1e-12);
    }
    // The banded basis: rows u + v < band in row-major (u, v) order, so the low band is a gather of the full spectrum.
    CHECK(low_band_indices(4, 4, 2) == std::vector<int64_t>{0, 1, 4});
    CHECK(low_band_indices(2, 3, -1).size() == 6);
    for (const auto& c : std::vector<std::array<int64_t, 3>>{{8, 8, 4}, {6, 5, 3}, {8, 8, 1}, {4, 4, 9}}) {
        auto x = torch::randn({3, 2, c[0], c[1]}, torch::kFloat64);
        const auto idx = low_band_indices(c[0], c[1], c[2]);
        auto want = dct2(x).flatten(-2).index_select(-1, torch::tensor(idx, torch::kInt64));
        auto got = dct2_low_band(x, c[2]);
        CHECK(got.sizes() == want.sizes());
        CHECK(test::max_abs_diff(got, want) < 1e-12);
    }
    CHECK(dct2_kron_basis(8, 8, 4).size(0) == 10);
    CHECK_THROWS_AS(dct2_low_band(torch::randn({4, 4}), 0), Error);
    CHECK_THROWS_AS(dct2_kron_basis(128, 128, -1), Error); // 16384^2 would be 1 GiB: refused
    // relative_spectral_change: the one-pass float32 loop equals the float64 tensor formula.
    auto e0 = torch::rand({20, 32, 10}), e1 = e0 + 0.1 * torch::randn({20, 32, 10});
    CHECK(relative_spectral_change(e1, e0) ==
          Approx(relative_spectral_change(e1.to(torch::kFloat64), e0.to(torch::kFloat64))).epsilon(1e-12));
}

TEST_CASE("band energies and change rates", "[cache][dct]") {
    auto e = torch::arange(16, torch::kFloat64).reshape({1, 4, 4}); // E(u,v) = 4u + v
    auto b = band_energies(e, 2);                                   // u + v < 2: (0,0), (0,1), (1,0) -> 0 + 1 + 4
    CHECK(b.low.item<double>() == Approx(5.0));
    CHECK(b.total.item<double>() == Approx(120.0));
    CHECK(b.high.item<double>() == Approx(115.0));
    CHECK(band_energies(e, 0).low.item<double>() == 0.0);
    CHECK(band_energies(e, 7).low.item<double>() == Approx(120.0));
    auto e1 = e * 1.5;
    auto r = energy_change_rate(e1, e, 0.0);
    CHECK(r[0][3][3].item<double>() == Approx(0.5));
    CHECK(relative_spectral_change(e1, e) == Approx(0.5));
    CHECK(relative_spectral_change(e, e) == 0.0);
    // Energy of a feature map, end to end: a pure cosine mode puts all energy in one coefficient.
    auto C = dct_basis(8, torch::kFloat64);
    auto mode = torch::outer(C[2], C[3]); // basis image (2, 3)
    auto E = spectral_energy(mode);
    CHECK(E[2][3].item<double>() == Approx(1.0));
    CHECK(E.sum().item<double>() == Approx(1.0));
    CHECK_THROWS_AS(energy_change_rate(e, e[0]), Error);
}

// ================================================================================================================
// Metrics
// ================================================================================================================

TEST_CASE("PSNR: identical is inf, constant offset is analytic", "[cache][metrics]") {
    torch::manual_seed(2);
    auto a = torch::rand({16, 16, 3});
    CHECK(std::isinf(psnr(a, a, 1.0)));
    // MSE = d^2 -> PSNR = 10 log10(L^2 / d^2) = 20 log10(L / d).
    const double d = 0.05;
    CHECK(psnr(a, a + d, 1.0) == Approx(20 * std::log10(1.0 / d)).epsilon(1e-5));
    CHECK(psnr(a * 255, a * 255 + 5, 255.0) == Approx(20 * std::log10(255.0 / 5)).epsilon(1e-5));
    // Hand case: 2x1 image, errors 0 and 0.5 -> MSE 0.125 -> 10 log10(8) dB.
    auto x = torch::tensor({0.0f, 0.0f}).reshape({2, 1});
    auto y = torch::tensor({0.0f, 0.5f}).reshape({2, 1});
    CHECK(psnr(x, y, 1.0) == Approx(10 * std::log10(8.0)));
    CHECK_THROWS_AS(psnr(a, torch::rand({16, 15, 3}), 1.0), Error);
}

TEST_CASE("SSIM: identity, constants and the offset case by hand", "[cache][metrics]") {
    torch::manual_seed(3);
    auto a = torch::rand({24, 20, 3});
    CHECK(ssim(a, a, 1.0) == Approx(1.0).epsilon(1e-12));
    const double L = 1.0, C1 = std::pow(0.01 * L, 2);
    // Constant images a, b: sigma terms vanish, SSIM = (2ab + C1) / (a^2 + b^2 + C1).
    auto ca = torch::full({11, 11, 1}, 0.2), cb = torch::full({11, 11, 1}, 0.6);
    CHECK(ssim(ca, cb, L) == Approx((2 * 0.2 * 0.6 + C1) / (0.04 + 0.36 + C1)).epsilon(1e-6));
    // 11x11 image (one window) and y = x + c: variances and covariance are equal, so
    // SSIM = (2 m (m + c) + C1) / (m^2 + (m + c)^2 + C1) with m the Gaussian-weighted mean of x.
    auto x = torch::rand({11, 11}, torch::kFloat32);
    const double c = 0.1;
    std::vector<double> g(11);
    double gs = 0;
    for (int i = 0; i < 11; ++i) gs += g[i] = std::exp(-(i - 5.0) * (i - 5.0) / (2 * 1.5 * 1.5));
    double m = 0;
    auto xa = x.accessor<float, 2>();
    for (int i = 0; i < 11; ++i)
        for (int j = 0; j < 11; ++j) m += g[i] * g[j] / (gs * gs) * xa[i][j];
    const double want = (2 * m * (m + c) + C1) / (m * m + (m + c) * (m + c) + C1);
    CHECK(ssim(x, x + float(c), L) == Approx(want).epsilon(1e-5));
    // Negated contrast is strongly dissimilar; noise lowers SSIM monotonically.
    auto noisy1 = (a + 0.05 * torch::randn_like(a)), noisy2 = (a + 0.2 * torch::randn_like(a));
    const double s1 = ssim(a, noisy1, L), s2 = ssim(a, noisy2, L);
    CHECK(s1 < 1.0);
    CHECK(s2 < s1);
    CHECK(ssim(a, 1 - a, L) < 0.0);
    // Symmetric.
    CHECK(ssim(a, noisy1, L) == Approx(ssim(noisy1, a, L)).epsilon(1e-12));
    CHECK_THROWS_AS(ssim(torch::rand({10, 10, 3}), torch::rand({10, 10, 3}), 1.0), Error);
}
