// LatentCache: the store behind every anchor cache (DeepCache features, attention K/V blocks, latents). It knows no
// model: entries are tensors keyed by (namespace, layer, slot, anchor id), each tagged with the loop step that wrote
// it.
//
// * Staleness: get(key, step) refuses an entry written more than `max_staleness` steps before `step` (or after it:
//   an entry from a later step belongs to another loop), counts the refusal and leaves the entry to age out.
// * Memory: a byte budget with least-recently-used eviction. Lookup, insert, touch and evict are O(1): a hash map from
//   key to a slot in a metadata slab, and an intrusive doubly linked LRU list threaded through the slab by index (no
//   scans). A second intrusive list per namespace makes erase_namespace O(entries of that namespace).
// * Metadata (key, step, bytes, dtype) lives in the slab; tensors live in a parallel vector, so bookkeeping never
//   touches tensor objects.
// * Optional fp16 storage halves the bytes of float32 entries; get() returns the original dtype.
// * Statistics (hits, misses, stale rejections, evictions, bytes, entries) export as JSON; operation counters (hash
//   and list operations, nodes visited) let tests prove O(1) behaviour by counts rather than timing.
//
// * Row-versioned entries (put with RowVersioned{dim}): a tensor whose slices along `dim` ("rows", e.g. the positions
//   of a sequence) are written and versioned one by one: put_rows writes some rows in place and stamps them with the
//   step, fresh_rows applies the staleness window to every row's stamp. One entry then serves a whole sequence of a
//   layer, however many positions a step recomputes, with per-position staleness (dLLM-Cache's per-token refresh,
//   Liu et al. 2025) instead of one entry per position. The entry's own step is that of its latest write, and get()
//   returns it whatever its age (its rows carry their own versions).
//
// The cache keeps a reference to the tensor given to the plain put() (no copy unless fp16 storage converts it): callers
// must not modify a tensor in place after caching it. A row-versioned put takes a private copy (put_rows writes into
// it), and get() of a row-versioned entry returns that storage itself (no copy unless stored as fp16): later put_rows
// on the key are visible through it. All methods are thread-safe (one mutex).
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace anchor::cache {

struct CacheKey {
    std::string ns;     // owner, e.g. "deepcache" or "gpt2.kv"
    int32_t layer = 0;  // block / layer index
    int32_t slot = 0;   // which tensor of the layer (e.g. 0 = hidden states, 1 = K, 2 = V)
    int64_t anchor = 0; // anchor id (e.g. a token block or a branch id)

    bool operator==(const CacheKey& o) const {
        return layer == o.layer && slot == o.slot && anchor == o.anchor && ns == o.ns;
    }
    std::string str() const; // "ns/layer/slot/anchor" for logs and errors
};

struct CacheKeyHash {
    size_t operator()(const CacheKey& k) const noexcept;
};

struct EntryMeta {
    CacheKey key;
    int64_t step = 0;                          // loop step that wrote the entry (row-versioned: its latest write)
    size_t bytes = 0;                          // bytes as stored (fp16 halves float32), row stamps included
    torch::ScalarType dtype = torch::kFloat32; // dtype given to put() and returned by get()
    bool stored_fp16 = false;
    int64_t row_dim = -1; // row-versioned entries: the dimension of the rows; -1 for a plain entry
    int64_t rows = 0;     // row-versioned entries: the number of rows (size along row_dim)
};

// put() of a tensor whose rows along `dim` are written (put_rows) and versioned one by one.
struct RowVersioned {
    int64_t dim = 0;
};

// fresh_rows: which rows may serve a step, with the counts it added to the statistics.
struct RowFreshness {
    torch::Tensor fresh; // bool [rows]
    int64_t hits = 0, stale = 0, unwritten = 0;
};

struct LatentCacheOptions {
    size_t byte_budget = 0; // 0: unlimited
    int max_staleness = 2;  // an entry written at step s serves steps s .. s + max_staleness
    bool fp16_storage = false;
};

struct CacheStats {
    uint64_t hits = 0;
    uint64_t misses = 0;           // key absent
    uint64_t stale_rejections = 0; // key present but too old (or from a later step)
    uint64_t evictions = 0;        // removed to respect the byte budget
    uint64_t puts = 0;
    uint64_t replacements = 0;        // puts that overwrote an existing key
    uint64_t oversize_rejections = 0; // single tensors larger than the whole budget (not stored)
    size_t bytes = 0;
    size_t peak_bytes = 0;
    size_t entries = 0;
    // Row-versioned entries, counted per row: rows written by put_rows, and the rows fresh_rows found fresh (hits),
    // written but outside the staleness window (stale rejections) or never written (misses).
    uint64_t rows_written = 0;
    uint64_t row_hits = 0;
    uint64_t row_stale_rejections = 0;
    uint64_t row_misses = 0;
    // The decisions of the cache that reads the store (text/diffusion/mdlm_cache.h; LatentCache itself leaves them 0), counted
    // in position-layers (one position of one block at one step): all of them, the anchored ones (served from the
    // store), the steps that recomputed everything, the steps where the drift probe refreshed the deeper layers
    // (drift=G), and the position-layers computed at each step.
    int64_t position_layers_total = 0;
    int64_t position_layers_reused = 0;
    int64_t full_steps = 0;
    int64_t drift_refreshes = 0;
    std::vector<int64_t> active_per_step;
    double reused_fraction() const {
        return position_layers_total ? double(position_layers_reused) / double(position_layers_total) : 0.0;
    }
    // Sums the counters of runs (bytes, peak_bytes and entries: the largest of the two; active_per_step: the steps of
    // both, one after the other).
    CacheStats& operator+=(const CacheStats& o);
};
// Every statistic above as JSON (the keys of LatentCache::stats_json, without the options and operation counts); the
// decisions under "reuse", only when there are any (position_layers_total > 0).
nlohmann::json to_json(const CacheStats& s);

// Counts of the primitive operations the cache performed, for complexity tests.
struct CacheOpCounters {
    uint64_t hash_lookups = 0;
    uint64_t hash_inserts = 0;
    uint64_t hash_erases = 0;
    uint64_t list_links = 0;    // node linked at the front of a list
    uint64_t list_unlinks = 0;  // node removed from a list
    uint64_t nodes_visited = 0; // nodes examined while walking a list (eviction, erase_namespace, lru_keys)
    uint64_t total() const {
        return hash_lookups + hash_inserts + hash_erases + list_links + list_unlinks + nodes_visited;
    }
};

class LatentCache {
public:
    explicit LatentCache(LatentCacheOptions opts = {});

    // Stores `value` under `key`, written at `step` (replaces an existing entry, making it most recent), then evicts
    // least-recently-used entries until the budget holds. A tensor larger than the whole budget is not stored.
    // Returns false when the value was not stored.
    bool put(const CacheKey& key, const torch::Tensor& value, int64_t step);

    // ---- row-versioned entries ----
    // Row stamp of a row that no put_rows has written yet (loop steps start at 0).
    static constexpr int64_t kUnwritten = -1;
    // Stores a private copy of `value` (fp16 storage honoured) whose rows along `rows.dim` are versioned; every row is
    // stamped `step` (kUnwritten: none written yet). Budget, LRU and replacement as put().
    bool put(const CacheKey& key, const torch::Tensor& value, int64_t step, RowVersioned rows);
    // Writes rows[j] into row idx[j] (int64 [n]; `rows` has the entry's shape with n along the row dimension) in place
    // and stamps those rows `step`; the entry becomes most recent and its step `step`. False (counted as a miss) when
    // the key is absent, e.g. evicted; anchor::Error when the entry is not row-versioned or the shapes disagree.
    bool put_rows(const CacheKey& key, const torch::Tensor& idx, const torch::Tensor& rows, int64_t step);
    // Copy of the per-row step stamps (int64 [rows], kUnwritten for rows never written); no statistics, no LRU change.
    std::optional<torch::Tensor> row_steps(const CacheKey& key) const;
    // Which rows may serve `step`: rows_fresh() of the entry's stamps. Counts every row (hit, stale rejection or
    // miss) and makes the entry most recent; nullopt (a miss) when the key is absent.
    std::optional<RowFreshness> fresh_rows(const CacheKey& key, int64_t step, int64_t max_staleness);
    // The staleness window per row, the rule get() applies to a whole entry: 0 <= step - stamp <= max_staleness, and
    // never for kUnwritten rows.
    static torch::Tensor rows_fresh(const torch::Tensor& stamps, int64_t step, int64_t max_staleness);

    // The entry when present and fresh: 0 <= step - entry.step <= max_staleness (the default or `max_staleness`).
    // A hit makes the entry most recent; a stale entry is counted and left in place (not touched).
    std::optional<torch::Tensor> get(const CacheKey& key, int64_t step);
    std::optional<torch::Tensor> get(const CacheKey& key, int64_t step, int max_staleness);

    bool contains(const CacheKey& key) const;                 // no statistics, no LRU change
    std::optional<EntryMeta> meta(const CacheKey& key) const; // no statistics, no LRU change
    bool erase(const CacheKey& key);
    size_t erase_namespace(const std::string& ns); // returns the number of entries removed
    void clear();                                  // drops every entry; statistics are kept

    void set_byte_budget(size_t bytes); // evicts immediately when needed
    void set_max_staleness(int steps);
    const LatentCacheOptions& options() const { return opts_; }

    size_t size() const;
    size_t bytes() const;
    CacheStats stats() const;
    CacheOpCounters op_counters() const;
    void reset_stats(); // statistics and operation counters (bytes/entries stay true)
    nlohmann::json stats_json() const;

    // Keys from most to least recently used (walks the list: O(n), for tests and debugging).
    std::vector<CacheKey> lru_keys() const;

private:
    static constexpr uint32_t kNil = 0xffffffffu;
    struct Node {
        EntryMeta meta;
        uint32_t prev = kNil, next = kNil;       // LRU list, head = most recent
        uint32_t ns_prev = kNil, ns_next = kNil; // namespace list
        bool used = false;
    };
    struct NsList {
        uint32_t head = kNil;
        size_t count = 0;
    };

    uint32_t alloc_node();
    void lru_unlink(uint32_t i);
    void lru_push_front(uint32_t i);
    void ns_unlink(uint32_t i);
    void ns_push_front(uint32_t i);
    void remove_node(uint32_t i); // unlinks from both lists and the index, frees the slot
    void evict_to_budget_locked();
    bool put_locked(const CacheKey& key, torch::Tensor stored, torch::ScalarType dtype, bool fp16, int64_t step,
                    int64_t row_dim, torch::Tensor stamps);
    std::optional<torch::Tensor> get_locked(const CacheKey& key, int64_t step, int max_staleness);
    std::optional<uint32_t> lookup_locked(const CacheKey& key); // counts the lookup, and a miss

    LatentCacheOptions opts_;
    std::vector<Node> nodes_;           // metadata slab
    std::vector<torch::Tensor> values_; // tensors, parallel to nodes_
    std::vector<torch::Tensor> stamps_; // row stamps of row-versioned entries (int64 [rows]), parallel to nodes_
    std::vector<uint32_t> free_;
    std::unordered_map<CacheKey, uint32_t, CacheKeyHash> index_;
    std::unordered_map<std::string, NsList> namespaces_;
    uint32_t head_ = kNil, tail_ = kNil;
    CacheStats stats_;
    mutable CacheOpCounters ops_;
    mutable std::mutex mu_;
};

} // namespace anchor::cache
