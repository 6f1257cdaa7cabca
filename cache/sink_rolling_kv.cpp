#include "cache/sink_rolling_kv.h"

#include "cache/io/error.h"

namespace anchor::cache {

const std::vector<std::pair<PositionPolicy, std::string>>& position_policy_names() {
    static const std::vector<std::pair<PositionPolicy, std::string>> t = {{PositionPolicy::Wrap, "wrap"},
                                                                          {PositionPolicy::Cache, "cache"},
                                                                          {PositionPolicy::Absolute, "absolute"},
                                                                          {PositionPolicy::Reencode, "reencode"}};
    return t;
}

std::string to_string(PositionPolicy p) {
    for (const auto& [v, s] : position_policy_names())
        if (v == p) return s;
    return "?";
}

PositionPolicy position_policy_from_string(const std::string& s) {
    std::string choices;
    for (const auto& [v, name] : position_policy_names()) {
        if (name == s) return v;
        choices += (choices.empty() ? "" : ", ") + name;
    }
    throw UsageError("unknown position policy '" + s + "' (choices: " + choices + ")");
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
    case PositionPolicy::Reencode:
        throw Error("position policy 'reencode' is decided by the stream (it re-encodes its window)");
    case PositionPolicy::Absolute:
        if (i >= n_positions)
            throw Error("position policy 'absolute': token " + std::to_string(i) + " is past the model's n_positions " +
                        std::to_string(n_positions) + " (use --positions wrap or cache to stream further)");
        return i;
    }
    return i;
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
    slot_stream_.assign(capacity(), -1);
    slot_pos_.assign(capacity(), -1);
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
            slot_stream_[first + j] = count_ + j;
            slot_pos_[first + j] = pos_ids[j];
            slots.push_back(first + j);
        }
        count_ += t;
        filled_ = std::min(count_, capacity());
        return slots;
    }
    for (int64_t j = 0; j < t; ++j) {
        const int64_t s = next_slot();
        k_.narrow(2, s, 1).copy_(k.narrow(2, j, 1));
        v_.narrow(2, s, 1).copy_(v.narrow(2, j, 1));
        slot_stream_[s] = count_;
        slot_pos_[s] = pos_ids[j];
        slots.push_back(s);
        ++count_;
        filled_ = std::min(count_, capacity());
    }
    return slots;
}

torch::Tensor SinkRollingKV::keys() const {
    return k_.narrow(2, 0, filled_);
}
torch::Tensor SinkRollingKV::values() const {
    return v_.narrow(2, 0, filled_);
}

std::vector<int64_t> SinkRollingKV::stream_indices() const {
    return std::vector<int64_t>(slot_stream_.begin(), slot_stream_.begin() + filled_);
}

void SinkRollingKV::clear() {
    count_ = filled_ = 0;
    std::fill(slot_stream_.begin(), slot_stream_.end(), -1);
    std::fill(slot_pos_.begin(), slot_pos_.end(), -1);
}

int64_t SinkRollingKV::bytes() const {
    return (k_.numel() * static_cast<int64_t>(k_.element_size())) +
           (v_.numel() * static_cast<int64_t>(v_.element_size()));
}

} // namespace anchor::cache
