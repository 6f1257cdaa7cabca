#include "cache/latent_cache.h"

#include "cache/io/error.h"

#include <functional>

namespace anchor::cache {

std::string CacheKey::str() const {
    return ns + "/" + std::to_string(layer) + "/" + std::to_string(slot) + "/" + std::to_string(anchor);
}

size_t CacheKeyHash::operator()(const CacheKey& k) const noexcept {
    // boost-style hash_combine over the four fields.
    size_t h = std::hash<std::string>{}(k.ns);
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<uint32_t>(k.layer));
    mix(static_cast<uint32_t>(k.slot));
    mix(static_cast<uint64_t>(k.anchor));
    return h;
}

LatentCache::LatentCache(LatentCacheOptions opts) : opts_(opts) {
    if (opts_.max_staleness < 0) throw Error("max_staleness must be >= 0, got " + std::to_string(opts_.max_staleness));
}

// ---- intrusive lists (indices into nodes_) --------------------------------------------------------------------

uint32_t LatentCache::alloc_node() {
    if (!free_.empty()) {
        const uint32_t i = free_.back();
        free_.pop_back();
        return i;
    }
    if (nodes_.size() >= kNil) throw Error("LatentCache: too many entries");
    nodes_.emplace_back();
    values_.emplace_back();
    stamps_.emplace_back();
    return static_cast<uint32_t>(nodes_.size() - 1);
}

void LatentCache::lru_unlink(uint32_t i) {
    Node& n = nodes_[i];
    if (n.prev != kNil)
        nodes_[n.prev].next = n.next;
    else
        head_ = n.next;
    if (n.next != kNil)
        nodes_[n.next].prev = n.prev;
    else
        tail_ = n.prev;
    n.prev = n.next = kNil;
    ++ops_.list_unlinks;
}

void LatentCache::lru_push_front(uint32_t i) {
    Node& n = nodes_[i];
    n.prev = kNil;
    n.next = head_;
    if (head_ != kNil) nodes_[head_].prev = i;
    head_ = i;
    if (tail_ == kNil) tail_ = i;
    ++ops_.list_links;
}

void LatentCache::ns_unlink(uint32_t i) {
    Node& n = nodes_[i];
    ++ops_.hash_lookups;
    auto it = namespaces_.find(n.meta.key.ns);
    if (n.ns_prev != kNil)
        nodes_[n.ns_prev].ns_next = n.ns_next;
    else
        it->second.head = n.ns_next;
    if (n.ns_next != kNil) nodes_[n.ns_next].ns_prev = n.ns_prev;
    n.ns_prev = n.ns_next = kNil;
    if (--it->second.count == 0) namespaces_.erase(it);
    ++ops_.list_unlinks;
}

void LatentCache::ns_push_front(uint32_t i) {
    Node& n = nodes_[i];
    ++ops_.hash_lookups;
    NsList& l = namespaces_[n.meta.key.ns];
    n.ns_prev = kNil;
    n.ns_next = l.head;
    if (l.head != kNil) nodes_[l.head].ns_prev = i;
    l.head = i;
    ++l.count;
    ++ops_.list_links;
}

void LatentCache::remove_node(uint32_t i) {
    Node& n = nodes_[i];
    lru_unlink(i);
    ns_unlink(i);
    index_.erase(n.meta.key);
    ++ops_.hash_erases;
    stats_.bytes -= n.meta.bytes;
    --stats_.entries;
    n.used = false;
    n.meta = EntryMeta{};
    values_[i] = torch::Tensor();
    stamps_[i] = torch::Tensor();
    free_.push_back(i);
}

void LatentCache::evict_to_budget_locked() {
    if (opts_.byte_budget == 0) return;
    while (stats_.bytes > opts_.byte_budget && tail_ != kNil) {
        ++ops_.nodes_visited;
        remove_node(tail_);
        ++stats_.evictions;
    }
}

// ---- public API -------------------------------------------------------------------------------------------------

bool LatentCache::put(const CacheKey& key, const torch::Tensor& value, int64_t step) {
    if (!value.defined()) throw Error("LatentCache::put: undefined tensor for key " + key.str());
    const bool to_fp16 = opts_.fp16_storage && value.is_floating_point() && value.scalar_type() != torch::kHalf;
    torch::Tensor stored = to_fp16 ? value.to(torch::kHalf) : value;
    std::lock_guard<std::mutex> lock(mu_);
    return put_locked(key, std::move(stored), value.scalar_type(), to_fp16, step, -1, {});
}

bool LatentCache::put(const CacheKey& key, const torch::Tensor& value, int64_t step, RowVersioned rows) {
    if (!value.defined()) throw Error("LatentCache::put: undefined tensor for key " + key.str());
    if (rows.dim < 0 || rows.dim >= value.dim())
        throw Error("LatentCache::put: row dimension " + std::to_string(rows.dim) + " of a " +
                    std::to_string(value.dim()) + "-D tensor for key " + key.str());
    const bool to_fp16 = opts_.fp16_storage && value.is_floating_point() && value.scalar_type() != torch::kHalf;
    // A private, contiguous copy: put_rows writes into it.
    torch::Tensor stored = to_fp16 ? value.to(torch::kHalf).contiguous() : value.clone(at::MemoryFormat::Contiguous);
    auto stamps = torch::full({value.size(rows.dim)}, step, torch::kInt64);
    std::lock_guard<std::mutex> lock(mu_);
    return put_locked(key, std::move(stored), value.scalar_type(), to_fp16, step, rows.dim, std::move(stamps));
}

bool LatentCache::put_locked(const CacheKey& key, torch::Tensor stored, torch::ScalarType dtype, bool fp16,
                             int64_t step, int64_t row_dim, torch::Tensor stamps) {
    const size_t bytes = static_cast<size_t>(stored.numel()) * stored.element_size() +
                         (stamps.defined() ? static_cast<size_t>(stamps.numel()) * sizeof(int64_t) : 0);
    ++stats_.puts;
    ++ops_.hash_lookups;
    auto it = index_.find(key);
    if (opts_.byte_budget != 0 && bytes > opts_.byte_budget) {
        // Cannot fit even alone: keep the cache as it is, but drop an older value of the same key (it would be stale
        // relative to the caller's intent).
        if (it != index_.end()) remove_node(it->second);
        ++stats_.oversize_rejections;
        return false;
    }
    uint32_t i;
    if (it != index_.end()) {
        i = it->second;
        ++stats_.replacements;
        stats_.bytes -= nodes_[i].meta.bytes;
        lru_unlink(i);
    } else {
        i = alloc_node();
        nodes_[i].meta.key = key;
        nodes_[i].used = true;
        index_.emplace(key, i);
        ++ops_.hash_inserts;
        ns_push_front(i);
        ++stats_.entries;
    }
    Node& n = nodes_[i];
    n.meta.step = step;
    n.meta.bytes = bytes;
    n.meta.dtype = dtype;
    n.meta.stored_fp16 = fp16;
    n.meta.row_dim = row_dim;
    n.meta.rows = row_dim >= 0 ? stored.size(row_dim) : 0;
    values_[i] = std::move(stored);
    stamps_[i] = std::move(stamps);
    lru_push_front(i);
    stats_.bytes += bytes;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.bytes);
    evict_to_budget_locked();
    return true;
}

bool LatentCache::put_rows(const CacheKey& key, const torch::Tensor& idx, const torch::Tensor& rows, int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_.hash_lookups;
    auto it = index_.find(key);
    if (it == index_.end()) {
        ++stats_.misses;
        return false;
    }
    const uint32_t i = it->second;
    const EntryMeta& m = nodes_[i].meta;
    if (m.row_dim < 0) throw Error("LatentCache::put_rows: " + key.str() + " is not a row-versioned entry");
    const auto& stored = values_[i];
    auto want = stored.sizes().vec();
    want[size_t(m.row_dim)] = idx.numel();
    if (idx.dim() != 1 || idx.scalar_type() != torch::kInt64 || rows.sizes().vec() != want)
        throw Error("LatentCache::put_rows: " + key.str() + " takes int64 [n] indices and rows of shape " +
                    shape_str(want) + ", got indices " + shape_str(idx.sizes().vec()) + " and rows " +
                    shape_str(rows.sizes().vec()));
    // A model on a GPU keeps its latents there; the row stamps (host bookkeeping) stay on the CPU.
    values_[i].index_copy_(m.row_dim, idx.to(values_[i].device()),
                           rows.to(values_[i].device(), m.stored_fp16 ? torch::kHalf : values_[i].scalar_type()));
    stamps_[i].index_fill_(0, idx.to(torch::kCPU), step);
    nodes_[i].meta.step = step;
    stats_.rows_written += uint64_t(idx.numel());
    lru_unlink(i);
    lru_push_front(i);
    return true;
}

std::optional<torch::Tensor> LatentCache::row_steps(const CacheKey& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_.hash_lookups;
    auto it = index_.find(key);
    if (it == index_.end() || !stamps_[it->second].defined()) return std::nullopt;
    return stamps_[it->second].clone();
}

namespace {
// The age test of get_locked per row, in one pass over the stamps (a sequence's rows are a few hundred: a loop is
// cheaper than the tensor ops' dispatch). kUnwritten rows are never fresh.
RowFreshness freshness(const torch::Tensor& stamps, int64_t step, int64_t max_staleness) {
    RowFreshness r;
    const auto s = stamps.contiguous();
    const int64_t n = s.numel();
    r.fresh = torch::empty({n}, torch::kBool);
    const int64_t* p = s.data_ptr<int64_t>();
    bool* f = r.fresh.data_ptr<bool>();
    for (int64_t i = 0; i < n; ++i) {
        const int64_t age = step - p[i];
        f[i] = p[i] >= 0 && age >= 0 && age <= max_staleness;
        r.hits += f[i];
        r.unwritten += p[i] < 0;
    }
    r.stale = n - r.hits - r.unwritten;
    return r;
}
} // namespace

torch::Tensor LatentCache::rows_fresh(const torch::Tensor& stamps, int64_t step, int64_t max_staleness) {
    if (stamps.dim() != 1 || stamps.scalar_type() != torch::kInt64)
        throw Error("LatentCache::rows_fresh: stamps must be int64 [rows], got " + shape_str(stamps.sizes().vec()));
    return freshness(stamps, step, max_staleness).fresh;
}

std::optional<RowFreshness> LatentCache::fresh_rows(const CacheKey& key, int64_t step, int64_t max_staleness) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto found = lookup_locked(key);
    if (!found) return std::nullopt;
    const uint32_t i = *found;
    if (!stamps_[i].defined()) throw Error("LatentCache::fresh_rows: " + key.str() + " is not a row-versioned entry");
    auto r = freshness(stamps_[i], step, max_staleness);
    stats_.row_hits += uint64_t(r.hits);
    stats_.row_misses += uint64_t(r.unwritten);
    stats_.row_stale_rejections += uint64_t(r.stale);
    lru_unlink(i);
    lru_push_front(i);
    return r;
}

std::optional<uint32_t> LatentCache::lookup_locked(const CacheKey& key) {
    ++ops_.hash_lookups;
    auto it = index_.find(key);
    if (it == index_.end()) {
        ++stats_.misses;
        return std::nullopt;
    }
    return it->second;
}

std::optional<torch::Tensor> LatentCache::get_locked(const CacheKey& key, int64_t step, int max_staleness) {
    const auto found = lookup_locked(key);
    if (!found) return std::nullopt;
    const uint32_t i = *found;
    const int64_t age = step - nodes_[i].meta.step;
    // A row-versioned entry is served whatever its age: its rows carry their own versions (fresh_rows).
    if (nodes_[i].meta.row_dim < 0 && (age < 0 || age > max_staleness)) {
        ++stats_.stale_rejections;
        return std::nullopt;
    }
    ++stats_.hits;
    lru_unlink(i);
    lru_push_front(i);
    const auto& meta = nodes_[i].meta;
    if (meta.stored_fp16) return values_[i].to(meta.dtype);
    return values_[i];
}

std::optional<torch::Tensor> LatentCache::get(const CacheKey& key, int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    return get_locked(key, step, opts_.max_staleness);
}

std::optional<torch::Tensor> LatentCache::get(const CacheKey& key, int64_t step, int max_staleness) {
    std::lock_guard<std::mutex> lock(mu_);
    return get_locked(key, step, max_staleness);
}

bool LatentCache::contains(const CacheKey& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_.hash_lookups;
    return index_.count(key) != 0;
}

std::optional<EntryMeta> LatentCache::meta(const CacheKey& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_.hash_lookups;
    auto it = index_.find(key);
    if (it == index_.end()) return std::nullopt;
    return nodes_[it->second].meta;
}

bool LatentCache::erase(const CacheKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_.hash_lookups;
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    remove_node(it->second);
    return true;
}

size_t LatentCache::erase_namespace(const std::string& ns) {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_.hash_lookups;
    auto it = namespaces_.find(ns);
    if (it == namespaces_.end()) return 0;
    size_t removed = 0;
    // remove_node erases the namespace record with its last node, so walk from the head until it is gone.
    uint32_t i = it->second.head;
    while (i != kNil) {
        const uint32_t next = nodes_[i].ns_next;
        ++ops_.nodes_visited;
        remove_node(i);
        ++removed;
        i = next;
    }
    return removed;
}

void LatentCache::clear() {
    std::lock_guard<std::mutex> lock(mu_);
    nodes_.clear();
    values_.clear();
    stamps_.clear();
    free_.clear();
    index_.clear();
    namespaces_.clear();
    head_ = tail_ = kNil;
    stats_.bytes = 0;
    stats_.entries = 0;
}

void LatentCache::set_byte_budget(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    opts_.byte_budget = bytes;
    evict_to_budget_locked();
}

void LatentCache::set_max_staleness(int steps) {
    if (steps < 0) throw Error("max_staleness must be >= 0, got " + std::to_string(steps));
    std::lock_guard<std::mutex> lock(mu_);
    opts_.max_staleness = steps;
}

size_t LatentCache::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_.entries;
}

size_t LatentCache::bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_.bytes;
}

CacheStats LatentCache::stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
}

CacheOpCounters LatentCache::op_counters() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_;
}

void LatentCache::reset_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t bytes = stats_.bytes, entries = stats_.entries;
    stats_ = CacheStats{};
    stats_.bytes = stats_.peak_bytes = bytes;
    stats_.entries = entries;
    ops_ = CacheOpCounters{};
}

nlohmann::json to_json(const CacheStats& s) {
    const uint64_t lookups = s.hits + s.misses + s.stale_rejections;
    nlohmann::json j{
        {"hits", s.hits},
        {"misses", s.misses},
        {"stale_rejections", s.stale_rejections},
        {"evictions", s.evictions},
        {"puts", s.puts},
        {"replacements", s.replacements},
        {"oversize_rejections", s.oversize_rejections},
        {"bytes", s.bytes},
        {"peak_bytes", s.peak_bytes},
        {"entries", s.entries},
        {"hit_rate", lookups ? double(s.hits) / double(lookups) : 0.0},
        {"rows",
         {{"written", s.rows_written},
          {"hits", s.row_hits},
          {"stale_rejections", s.row_stale_rejections},
          {"misses", s.row_misses}}},
    };
    if (s.position_layers_total > 0)
        j["reuse"] = {{"position_layers_total", s.position_layers_total},
                      {"position_layers_reused", s.position_layers_reused},
                      {"reused_fraction", s.reused_fraction()},
                      {"full_steps", s.full_steps},
                      {"drift_refreshes", s.drift_refreshes}};
    return j;
}

CacheStats& CacheStats::operator+=(const CacheStats& o) {
    hits += o.hits, misses += o.misses, stale_rejections += o.stale_rejections, evictions += o.evictions;
    puts += o.puts, replacements += o.replacements, oversize_rejections += o.oversize_rejections;
    bytes = std::max(bytes, o.bytes), peak_bytes = std::max(peak_bytes, o.peak_bytes);
    entries = std::max(entries, o.entries);
    rows_written += o.rows_written, row_hits += o.row_hits, row_stale_rejections += o.row_stale_rejections;
    row_misses += o.row_misses;
    position_layers_total += o.position_layers_total, position_layers_reused += o.position_layers_reused;
    full_steps += o.full_steps, drift_refreshes += o.drift_refreshes;
    active_per_step.insert(active_per_step.end(), o.active_per_step.begin(), o.active_per_step.end());
    return *this;
}

nlohmann::json LatentCache::stats_json() const {
    std::lock_guard<std::mutex> lock(mu_);
    auto j = to_json(stats_);
    j["byte_budget"] = opts_.byte_budget;
    j["max_staleness"] = opts_.max_staleness;
    j["fp16_storage"] = opts_.fp16_storage;
    j["ops"] = {{"hash_lookups", ops_.hash_lookups}, {"hash_inserts", ops_.hash_inserts},
                {"hash_erases", ops_.hash_erases},   {"list_links", ops_.list_links},
                {"list_unlinks", ops_.list_unlinks}, {"nodes_visited", ops_.nodes_visited}};
    return j;
}

std::vector<CacheKey> LatentCache::lru_keys() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<CacheKey> keys;
    keys.reserve(stats_.entries);
    for (uint32_t i = head_; i != kNil; i = nodes_[i].next) {
        ++ops_.nodes_visited;
        keys.push_back(nodes_[i].meta.key);
    }
    return keys;
}

} // namespace anchor::cache
