// The block cache that serves LibTorch's large CPU allocations during forwards (cache/util/heap.h).
#include "cache/util/heap.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

using namespace anchor;

TEST_CASE("heap: freed blocks are reused inside a scope and released when it closes", "[heap]") {
    if (util::configure_heap().rfind("block cache", 0) != 0) {
        WARN("ANCHOR_HEAP=system: the block cache is off in this process");
        return;
    }
    const auto before = util::heap_stats();
    {
        util::HeapScope scope;
        auto a = torch::empty({3 << 18}); // 3 MiB: a cached block (>= 1 MiB), rounded to 4 MiB
        a.fill_(1.f);
        const void* pa = a.data_ptr();
        a = torch::Tensor();
        CHECK(util::heap_stats().cached_bytes >= (int64_t(4) << 20));
        CHECK(util::heap_free_bytes() == util::heap_stats().cached_bytes);
        auto b = torch::empty({3 << 18}); // the same size: the same block again
        CHECK(b.data_ptr() == pa);
        CHECK(util::heap_stats().hits > before.hits);
        // Small tensors never come from the cache.
        auto s = torch::empty({16});
        CHECK(util::heap_stats().live_bytes == before.live_bytes + (int64_t(4) << 20));
        // A larger request does not keep the smaller freed block beside a fresh one: live + cached stays at the
        // high-water mark of what was live.
        b = torch::Tensor();
        auto c = torch::empty({5 << 18}); // 5 MiB -> 6 MiB: the 4 MiB block is released first
        const auto st = util::heap_stats();
        CHECK(st.cached_bytes == 0);
        CHECK(st.live_bytes == before.live_bytes + (int64_t(6) << 20));
        c.fill_(2.f);
        CHECK(c.sum().item<double>() == Approx(2.0 * (5 << 18)));
    }
    // Scope closed: nothing stays cached, and a block freed now goes straight back to the system.
    const auto after = util::heap_stats();
    CHECK(after.cached_bytes == 0);
    CHECK(after.live_bytes == before.live_bytes);
    CHECK(after.released_bytes > before.released_bytes);
    auto outside = torch::empty({3 << 18}); // outside any scope: LibTorch's own allocator
    CHECK(util::heap_stats().live_bytes == before.live_bytes);
    // Nested scopes keep the cache until the outermost closes.
    {
        util::HeapScope outer;
        {
            util::HeapScope inner;
            auto t = torch::empty({1 << 20});
        }
        CHECK(util::heap_stats().cached_bytes > 0);
    }
    CHECK(util::heap_stats().cached_bytes == 0);
}
