// Where the large blocks of a forward pass come from: a cache of freed blocks on 2 MiB pages, LibTorch's CPU
// allocator while a forward runs.
//
// Why: glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap() and returns it with
// munmap() on free, so each large activation of every layer is faulted in again, page by page: a 512x512 VAE decode
// allocates and frees ~100 blocks of 64-512 MiB, a UNet step ~1000 smaller ones. On the virtual machines we measure
// on a 4 KiB page fault costs ~9 us (a 128 MiB block ~300 ms before its first byte is computed). Keeping freed blocks
// for the next allocation of that size and backing them with 2 MiB transparent huge pages (one fault per 2 MiB)
// removes that cost: tests/bench/results/heap_reuse_2026-12-02.txt. The same reason makes Intel recommend
// jemalloc/tcmalloc for PyTorch CPU inference.
//
// Bounded memory: the cache is active only while some HeapScope is alive (the UNet and VAE forwards and the
// denoising loop open one), and then it never holds more than it must: a new block is mapped only after freed blocks
// have been released down to the high-water mark of live + cached bytes (so the resident size stays at the peak of
// what was live, rounded to 2 MiB per block), and when the last scope closes every cached block is unmapped.
// Outside scopes, and for blocks under 1 MiB, LibTorch's own allocator serves (model loading, weights, small
// tensors).
#pragma once

#include <cstdint>
#include <string>

namespace anchor::util {

// Installs the block cache as LibTorch's CPU allocator (once; later calls return the same). Programs call it first
// thing in main(). ANCHOR_HEAP=system in the environment leaves LibTorch's allocator (for comparisons). Returns
// heap_mode().
std::string configure_heap();

// "block cache (2 MiB pages, during forwards)", "system (LibTorch's allocator, ANCHOR_HEAP=system)" or
// "system (not configured)".
std::string heap_mode();

// While alive, freed blocks of >= 1 MiB are kept for reuse (see above); nests, and may be opened on any thread.
class HeapScope {
public:
    HeapScope();
    ~HeapScope();
    HeapScope(const HeapScope&) = delete;
    HeapScope& operator=(const HeapScope&) = delete;
};

struct HeapStats {
    int64_t live_bytes = 0;   // blocks of the cache handed out and not yet freed
    int64_t cached_bytes = 0; // freed, kept mapped for reuse
    int64_t hits = 0, misses = 0;
    int64_t mapped_bytes = 0, released_bytes = 0; // totals since start
};
HeapStats heap_stats();

// Returns the pages of glibc's free heap chunks to the system (malloc_trim(0): the free pages in the middle of each
// arena too, not only its top). For after a large transient allocation of blocks under glibc's mmap threshold, e.g.
// the float32 weights freed once --weights-dtype has converted them: without it they stay resident.
void release_free_heap();

// Bytes freed but kept mapped for reuse: memory this process can allocate again without the system's (the memory
// check counts them as available).
int64_t heap_free_bytes();

} // namespace anchor::util
