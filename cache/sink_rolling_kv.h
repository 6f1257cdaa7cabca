// Attention-sink rolling KV buffer (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
// StreamingLLM, sec. 3.2): the first S tokens of a stream stay in the cache for ever ("sinks") and the most recent
// tokens live in a W-slot ring. One instance serves one attention layer; it knows nothing about the model.
//
// Storage is preallocated once as K, V = [batch, heads, S + W, head_dim]:
//   slots [0, S)      sinks: stream tokens 0..S-1, in order, never evicted;
//   slots [S, S + W)  ring: stream token i (i >= S) lives in slot S + (i - S) % W, overwriting token i - W.
// `append` copies the new K/V into its slot (no allocation after construction), so the data pointers never change; the
// slot metadata (stream index, position id, live) is in a KvCells beside the tensors.
// `full` mode is the same class with S = 0 and W = capacity and no eviction (appending past capacity throws).
//
// Semantics (tests/golden/text/README.md sec. 3): the new token i is appended *before* its attention; afterwards the
// filled slots hold exactly A(i) u {i}, A(i) = {j < min(S, i)} u {max(S, i-W+1) <= j < i}: the eviction of token
// i - W happens when token i arrives, as in the reference's shift buffer. Attention is order-independent, so the
// attention set is the slot range [0, filled) in slot order (not stream order; see stream_index()).
#pragma once

#include "cache/io/enum_table.h"

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace anchor::cache {

// Position ids for models with learned absolute positions (n_positions rows of wpe) while streaming past them. These
// are the policies a buffer can execute alone; re-encoding the window in order is the stream's (text/gpt2/gpt2_model.h,
// PositionMode::Reencode).
enum class PositionPolicy {
    Wrap,     // i % n_positions
    Cache,    // min(i, capacity - 1): the slot the token is written to, the last slot once the buffer is full
    Absolute, // i; an error once i >= n_positions
};

// "wrap" / "cache" / "absolute" (the table also drives --help).
const EnumTable<PositionPolicy>& position_policy_table();

// Position id of stream token i under `policy` for a buffer of `capacity` slots and a model with `n_positions`.
int64_t position_id(PositionPolicy policy, int64_t i, int64_t capacity, int64_t n_positions);

// Slot metadata of a KV buffer, kept apart from the K/V tensors as llama.cpp keeps llama_kv_cells apart from
// llama_kv_cache: which slots are live, and the stream index and position id each one holds. The buffer decides
// where a token goes; the cells only record it, so bookkeeping never touches a tensor.
class KvCells {
public:
    explicit KvCells(int64_t capacity = 0);
    void assign(int64_t slot, int64_t stream_index, int64_t position); // the slot becomes live (or is overwritten)
    void clear();                                                      // every slot empty
    int64_t capacity() const { return static_cast<int64_t>(stream_.size()); }
    int64_t live_count() const { return live_; }
    bool live(int64_t slot) const { return stream_.at(static_cast<size_t>(slot)) >= 0; }
    int64_t stream_index(int64_t slot) const { return stream_.at(static_cast<size_t>(slot)); } // -1 when empty
    int64_t position(int64_t slot) const { return pos_.at(static_cast<size_t>(slot)); }        // -1 when empty
    // Stream indices of slots [0, n) in slot order.
    std::vector<int64_t> stream_indices(int64_t n) const;

private:
    std::vector<int64_t> stream_, pos_;
    int64_t live_ = 0;
};

// Writes one token's K and V rows ([B, H, 1, D]) into `slot` of the [B, H, C, D] buffers in one step (the fused
// kernel of kernels/dispatch.h on CUDA). cache/ sits below kernels/ among the libraries, so the model that owns the
// buffers passes it in (Gpt2ModelImpl::make_caches passes kernels::ring_write).
using RingWriter = void (*)(torch::Tensor& k_buf, torch::Tensor& v_buf, const torch::Tensor& k, const torch::Tensor& v,
                            int64_t slot);

struct SinkRollingKVOptions {
    int64_t batch = 1;
    int64_t heads = 1;
    int64_t head_dim = 1;
    int64_t sinks = 0;  // S
    int64_t window = 0; // W (ring slots)
    bool evict = true;  // false: `full` mode, appending past S + W throws
    torch::ScalarType dtype = torch::kFloat32;
    torch::Device device = torch::kCPU;
    // One-token writes into buffers off the CPU go through it when set (CPU buffers: a slice copy_, as always).
    RingWriter device_writer = nullptr;
};

class SinkRollingKV {
public:
    explicit SinkRollingKV(const SinkRollingKVOptions& opt);

    // A `full` cache of `capacity` slots (no eviction).
    static SinkRollingKV full(int64_t batch, int64_t heads, int64_t head_dim, int64_t capacity,
                              torch::ScalarType dtype = torch::kFloat32);

    // Appends T tokens, k/v = [batch, heads, T, head_dim], with their position ids (metadata only). Returns the slot
    // of each token. Several tokens at once are copied as one block when they fit without eviction.
    std::vector<int64_t> append(const torch::Tensor& k, const torch::Tensor& v, const std::vector<int64_t>& pos_ids);
    void append(const torch::Tensor& k, const torch::Tensor& v, int64_t pos_id) {
        append(k, v, std::vector<int64_t>{pos_id});
    }

    // The bookkeeping of append() for one token whose K/V rows the caller writes into next_slot() itself (a captured
    // CUDA graph writes them from a slot index held on the device): the slot is recorded and returned.
    int64_t advance(int64_t pos_id);

    // Keys/values to attend over: slots [p0, p1) = [0, filled()) of the buffers, [batch, heads, filled, head_dim]
    // views (no copy), in slot order.
    torch::Tensor keys() const;
    torch::Tensor values() const;
    std::pair<int64_t, int64_t> view_range() const { return {0, filled()}; }

    int64_t filled() const { return filled_; } // slots in use, min(count, capacity)
    int64_t count() const { return count_; }   // tokens appended so far (stream length)
    int64_t capacity() const { return opt_.sinks + opt_.window; }
    int64_t sinks() const { return opt_.sinks; }
    int64_t window() const { return opt_.window; }
    bool evicts() const { return opt_.evict; }
    // Slot the next token goes to (throws in full mode when the buffer is full).
    int64_t next_slot() const;
    // Stream index / position id held in `slot` (-1 when empty).
    int64_t stream_index(int64_t slot) const { return cells_.stream_index(slot); }
    int64_t position(int64_t slot) const { return cells_.position(slot); }
    const KvCells& cells() const { return cells_; }
    // Stream indices of the filled slots in slot order (the order of keys()).
    std::vector<int64_t> stream_indices() const;

    void clear(); // back to empty; storage is kept
    // Bytes of the preallocated K and V storage.
    int64_t bytes() const;
    const torch::Tensor& k_storage() const { return k_; }
    const torch::Tensor& v_storage() const { return v_; }

private:
    SinkRollingKVOptions opt_;
    torch::Tensor k_, v_;
    int64_t count_ = 0, filled_ = 0;
    KvCells cells_;
};

} // namespace anchor::cache
