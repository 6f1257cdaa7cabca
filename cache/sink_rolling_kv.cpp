#include "cache/sink_rolling_kv.h"

#include "cache/io/error.h"

namespace anchor::cache {

const EnumTable<PositionPolicy>& position_policy_table() {
    static const EnumTable<PositionPolicy> t = {
        {"wrap", PositionPolicy::Wrap}, {"cache", PositionPolicy::Cache}, {"absolute", PositionPolicy::Absolute}};
    return t;
}

int64_t position_id(PositionPolicy policy, int64_t i, int64_t capacity, int64_t n_positions) {
    switch (policy) {
    case PositionPolicy::Wrap:
        return i % n_positions;
    case PositionPolicy::Cache: {
        const int64_t p = std::min(i, capacity - 1);
        if (p >= n_positions)
            throw Error("position policy 'cache': slot " + std::to_string(p) + " is past the model's n_positions " +
                        std::to_string(n_positions) + " (use a smaller cache)");
        return p;
    }
    case PositionPolicy::Absolute:
        if (i >= n_positions)
            throw Error("position policy 'absolute': token " + std::to_string(i) + " is past the model's n_positions " +
                        std::to_string(n_positions) + " (use --positions wrap or cache to stream further)");
        return i;
    }
    return i;
}

KvCells::KvCells(int64_t capacity)
    : stream_(static_cast<size_t>(capacity), -1), pos_(static_cast<size_t>(capacity), -1) {}

void KvCells::assign(int64_t slot, int64_t stream_index, int64_t position) {
    auto& s = stream_.at(static_cast<size_t>(slot));
    if (s < 0) ++live_;
    s = stream_index;
    pos_[static_cast<size_t>(slot)] = position;
}

void KvCells::clear() {
    std::fill(stream_.begin(), stream_.end(), -1);
    std::fill(pos_.begin(), pos_.end(), -1);
    live_ = 0;
}

std::vector<int64_t> KvCells::stream_indices(int64_t n) const {
    return std::vector<int64_t>(stream_.begin(), stream_.begin() + n);
}

SinkRollingKV::SinkRollingKV(const SinkRollingKVOptions& opt) : opt_(opt) {
    if (opt.batch < 1 || opt.heads < 1 || opt.head_dim < 1)
        throw Error("SinkRollingKV: batch, heads and head_dim must be >= 1");
    if (opt.sinks < 0 || opt.window < 1)
        throw Error("SinkRollingKV: need sinks >= 0 and window >= 1 (got S=" + std::to_string(opt.sinks) +
                    ", W=" + std::to_string(opt.window) + ")");
    auto o = torch::TensorOptions().dtype(opt.dtype).device(opt.device);
    // Zero-filled so that no uninitialised memory ever reaches a kernel, even through a bug in the slot bookkeeping.
    k_ = torch::zeros({opt.batch, opt.heads, capacity(), opt.head_dim}, o);
    v_ = torch::zeros({opt.batch, opt.heads, capacity(), opt.head_dim}, o);
    cells_ = KvCells(capacity());
}

SinkRollingKV SinkRollingKV::full(int64_t batch, int64_t heads, int64_t head_dim, int64_t capacity,
                                  torch::ScalarType dtype) {
    SinkRollingKVOptions o;
    o.batch = batch;
    o.heads = heads;
    o.head_dim = head_dim;
    o.sinks = 0;
    o.window = capacity;
    o.evict = false;
    o.dtype = dtype;
    return SinkRollingKV(o);
}

int64_t SinkRollingKV::next_slot() const {
    const int64_t i = count_;
    if (i < opt_.sinks) return i;
    if (!opt_.evict && i >= capacity())
        throw Error("KV cache is full (" + std::to_string(capacity()) + " tokens) and this mode does not evict");
    return opt_.sinks + (i - opt_.sinks) % opt_.window;
}

std::vector<int64_t> SinkRollingKV::append(const torch::Tensor& k, const torch::Tensor& v,
                                           const std::vector<int64_t>& pos_ids) {
    const int64_t t = static_cast<int64_t>(pos_ids.size());
    auto check = [&](const torch::Tensor& x, const char* what) {
        if (x.dim() != 4 || x.size(0) != opt_.batch || x.size(1) != opt_.heads || x.size(2) != t ||
            x.size(3) != opt_.head_dim)
            throw Error(std::string("SinkRollingKV::append: ") + what + " has shape " + shape_str(x.sizes().vec()) +
                        ", expected " + shape_str({opt_.batch, opt_.heads, t, opt_.head_dim}));
    };
    check(k, "k");
    check(v, "v");
    std::vector<int64_t> slots;
    slots.reserve(t);
    if (t == 0) return slots;
    const int64_t first = next_slot();
    if (count_ + t <= capacity() && first == count_) {
        // Still filling: the T tokens go to consecutive slots [count, count + T).
        k_.narrow(2, first, t).copy_(k);
        v_.narrow(2, first, t).copy_(v);
        for (int64_t j = 0; j < t; ++j) {
            cells_.assign(first + j, count_ + j, pos_ids[j]);
            slots.push_back(first + j);
        }
        count_ += t;
        filled_ = std::min(count_, capacity());
        return slots;
    }
    for (int64_t j = 0; j < t; ++j) {
        const int64_t s = next_slot();
        if (opt_.device_writer && !k_.device().is_cpu()) {
            opt_.device_writer(k_, v_, k.narrow(2, j, 1), v.narrow(2, j, 1), s);
        } else {
            k_.narrow(2, s, 1).copy_(k.narrow(2, j, 1));
            v_.narrow(2, s, 1).copy_(v.narrow(2, j, 1));
        }
        cells_.assign(s, count_, pos_ids[j]);
        slots.push_back(s);
        ++count_;
        filled_ = std::min(count_, capacity());
    }
    return slots;
}

int64_t SinkRollingKV::advance(int64_t pos_id) {
    const int64_t s = next_slot();
    cells_.assign(s, count_, pos_id);
    ++count_;
    filled_ = std::min(count_, capacity());
    return s;
}

torch::Tensor SinkRollingKV::keys() const {
    return k_.narrow(2, 0, filled_);
}
torch::Tensor SinkRollingKV::values() const {
    return v_.narrow(2, 0, filled_);
}

std::vector<int64_t> SinkRollingKV::stream_indices() const {
    return cells_.stream_indices(filled_);
}

void SinkRollingKV::clear() {
    count_ = filled_ = 0;
    cells_.clear();
}

int64_t SinkRollingKV::bytes() const {
    return (k_.numel() * static_cast<int64_t>(k_.element_size())) +
           (v_.numel() * static_cast<int64_t>(v_.element_size()));
}

} // namespace anchor::cache
