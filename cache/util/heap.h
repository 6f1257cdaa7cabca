// How the process's heap hands out the large blocks a forward pass allocates and frees every layer.
//
// Why: glibc serves every block above its mmap threshold (at most 32 MiB, 128 KiB at start) with a fresh mmap() and
// returns it with munmap() on free, so each large activation of every layer is faulted in page by page again: a
// 512x512 VAE decode allocates and frees ~100 blocks of 64-512 MiB. On the virtual machines we measure on a page
// fault costs ~9 us (a 128 MiB block ~300 ms before the first byte is computed): tests/bench/results/
// heap_reuse_2026-12-02.txt measured SD 1.5's VAE decode at 512x512 ~26 s with glibc's defaults and ~8 s with
// freed blocks kept for reuse (UNet CFG step ~11 -> ~7 s; 10.1 M -> 2.1 M minor faults per run). The cost is a
// peak RSS ~12 % higher (7340 -> 8192 MiB there): a freed block in the middle of the heap does not always fit the next
// larger request. The same reason makes Intel recommend jemalloc/tcmalloc for PyTorch CPU inference.
//
// configure_heap() turns off glibc's mmap for large chunks (M_MMAP_MAX 0: they come from the heap and their pages
// stay mapped when freed) and its trimming of the heap top (M_TRIM_THRESHOLD), for the whole process: LibTorch's
// tensors, oneDNN's reorder buffers and scratchpads alike. What is freed is kept and reused by the next allocation
// of that size; the resident size stays at the peak of what was live (it is not returned to the system until exit).
#pragma once

#include <string>

namespace anchor::util {

// Programs call this first thing in main(), before any large allocation (blocks mapped before it are unaffected).
// ANCHOR_HEAP=system in the environment leaves glibc's defaults (for comparisons); returns what is in effect.
std::string configure_heap();

// Bytes freed but kept mapped by the heap (mallinfo2's fordblks, every arena): memory this process can allocate
// again without the system's. 0 where glibc's statistics are not available.
int64_t heap_free_bytes();

// "reuse (mmap off, no trim)", "system (glibc defaults, ANCHOR_HEAP=system)" or "system (not configured)".
std::string heap_mode();

} // namespace anchor::util
