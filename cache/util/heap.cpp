#include "cache/util/heap.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <malloc.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>

namespace anchor::util {

namespace {

constexpr size_t kPage = size_t(2) << 20;     // a transparent huge page
constexpr size_t kMinBlock = size_t(1) << 20; // smaller blocks: LibTorch's allocator

// c10::Allocator::allocate is const in LibTorch 1.x and not in 2.x since 2.3 (c10/core/Allocator.h).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define ANCHOR_ALLOCATE_CONST
#else
#define ANCHOR_ALLOCATE_CONST const
#endif

class BlockCache final : public c10::Allocator {
public:
    explicit BlockCache(c10::Allocator* base) : base_(base) {}

    c10::DataPtr allocate(size_t n) ANCHOR_ALLOCATE_CONST override {
        if (n < kMinBlock || scopes_.load(std::memory_order_acquire) == 0) return base_->allocate(n);
        const size_t size = (n + kPage - 1) / kPage * kPage;
        void* p = nullptr;
        size_t got = size;
        {
            std::lock_guard<std::mutex> lock(mu_);
            // A cached block of this size, or up to 1/8 larger (a few 2 MiB pages for the large ones).
            auto it = free_.lower_bound(size);
            if (it != free_.end() && it->first <= size + size / 8) {
                got = it->first, p = it->second;
                free_.erase(it);
                cached_ -= got;
                ++hits_;
            } else {
                ++misses_;
                // Release cached blocks (largest first) until a fresh one keeps live + cached at the high-water mark.
                while (!free_.empty() && live_ + cached_ + size > high_water_) {
                    auto last = std::prev(free_.end());
                    unmap(last->second, last->first);
                    cached_ -= last->first;
                    free_.erase(last);
                }
            }
            live_ += got;
        }
        const bool fresh = p == nullptr;
        if (fresh) p = map(size); // outside the lock: the mapping's system call
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (p == nullptr) { // out of address space or memory: the system allocator says so its own way
                live_ -= got;
            } else {
                if (fresh) {
                    mapped_ += size;
                    high_water_ = std::max(high_water_, live_ + cached_);
                }
                sizes_.emplace(p, got);
            }
        }
        if (p == nullptr) return base_->allocate(n);
        // The context is the pointer itself, as LibTorch's raw_allocate/raw_deallocate require.
        return {p, p, &BlockCache::release, c10::Device(c10::DeviceType::CPU)};
    }

    // Frees a pointer of either kind: one of ours (a cached block) or one LibTorch's allocator made for us.
    c10::DeleterFnPtr raw_deleter() const override { return &BlockCache::release; }

    // LibTorch 2.x's Allocator asks for this (not a virtual of 1.x's).
    void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }

    void open() { scopes_.fetch_add(1, std::memory_order_acq_rel); }
    void close() {
        if (scopes_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
        std::lock_guard<std::mutex> lock(mu_);
        if (scopes_.load() != 0) return; // a scope opened meanwhile keeps the cache
        for (const auto& [size, p] : free_) unmap(p, size);
        free_.clear();
        cached_ = 0;
        high_water_ = live_;
    }

    HeapStats stats() const {
        std::lock_guard<std::mutex> lock(mu_);
        return {int64_t(live_), int64_t(cached_), hits_, misses_, int64_t(mapped_), int64_t(released_)};
    }

    static BlockCache* instance;

private:
    static void release(void* p) { instance->give_back(p); }

    void give_back(void* p) const {
        std::unique_lock<std::mutex> lock(mu_);
        auto it = sizes_.find(p);
        if (it == sizes_.end()) { // LibTorch's allocator made it (a small block, or outside scopes)
            lock.unlock();
            if (auto d = base_->raw_deleter()) d(p);
            return;
        }
        const size_t size = it->second;
        sizes_.erase(it);
        live_ -= size;
        if (scopes_.load(std::memory_order_acquire) > 0) {
            free_.emplace(size, p);
            cached_ += size;
        } else {
            unmap(p, size);
        }
    }

    // 2 MiB-aligned anonymous memory asked to be backed by huge pages (one fault per 2 MiB; Linux's THP setting is
    // madvise-only on many systems, ours included).
    static void* map(size_t size) {
        void* raw = mmap(nullptr, size + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) return nullptr;
        const auto a = reinterpret_cast<uintptr_t>(raw);
        const uintptr_t aligned = (a + kPage - 1) / kPage * kPage;
        if (aligned > a) munmap(raw, aligned - a);
        const uintptr_t end = a + size + kPage;
        if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
        void* p = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
        madvise(p, size, MADV_HUGEPAGE);
#endif
        return p;
    }
    void unmap(void* p, size_t size) const {
        munmap(p, size);
        released_ += size;
    }

    c10::Allocator* base_;
    mutable std::mutex mu_;
    mutable std::multimap<size_t, void*> free_;       // cached blocks by size
    mutable std::unordered_map<void*, size_t> sizes_; // blocks handed out
    mutable size_t live_ = 0, cached_ = 0, high_water_ = 0, mapped_ = 0, released_ = 0;
    mutable int64_t hits_ = 0, misses_ = 0;
    std::atomic<int> scopes_{0};
};

BlockCache* BlockCache::instance = nullptr;

std::string& mode() {
    static std::string m = "system (not configured)";
    return m;
}

} // namespace

std::string configure_heap() {
    static std::once_flag once;
    std::call_once(once, [] {
        const char* env = std::getenv("ANCHOR_HEAP");
        if (env != nullptr && std::strcmp(env, "system") == 0) {
            mode() = "system (LibTorch's allocator, ANCHOR_HEAP=system)";
            return;
        }
        // Never destroyed: blocks may be freed by static destructors after main returns.
        BlockCache::instance = new BlockCache(c10::GetCPUAllocator());
        c10::SetCPUAllocator(BlockCache::instance, /*priority=*/1);
        mode() = "block cache (2 MiB pages, during forwards)";
    });
    return mode();
}

std::string heap_mode() {
    return mode();
}

HeapScope::HeapScope() {
    if (BlockCache::instance) BlockCache::instance->open();
}

HeapScope::~HeapScope() {
    if (BlockCache::instance) BlockCache::instance->close();
}

HeapStats heap_stats() {
    return BlockCache::instance ? BlockCache::instance->stats() : HeapStats{};
}

int64_t heap_free_bytes() {
    return heap_stats().cached_bytes;
}

void release_free_heap() {
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
}

} // namespace anchor::util
