// The GPT-2 decode benchmark (`anchor-text gpt2 bench`): prompt throughput, per-token latency by context with float32
// and float16 decode weights, attention-sink streaming latency and RSS over long streams, the speed-up over
// recompute, and the decode kernel's bandwidth against this machine's memcpy, all in one run.
#pragma once

#include "text/bench/bench_report.h"
#include "text/params.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

struct Gpt2BenchParams {
    std::string model;                                  // "": random weights of GPT-2-small shapes, in memory
    int64_t n_head = 0;                                 // when the model has no config.json
    int repeats = 5;                                    // timed repeats per measurement
    std::vector<int64_t> stream_tokens = {1000, 10000}; // stream lengths of the sink run, ascending
    int recompute_repeats = 2;
    bool reference_kernel = false; // decode with torch::addmv/mv instead of the gemv kernel (for the run only)
    std::vector<int64_t> contexts = {16, 256, 900}; // decode latency rows (full KV cache at these contexts)
    Placement placement; // --device / --dtype: the model and its KV buffers there; f16/q8_0 copies CPU f32 only
    bool cuda_graphs = false; // one-token steps replay a CUDA graph (set_decode_cuda_graphs) for the run only
    // --op-table: per weight type, this many more one-token steps at the first context with every op of the step
    // timed (kernels/op_timing.h), reported per token (0 = none).
    int op_table_tokens = 0;
    void validate() const;         // ParamError naming the field
};

struct Gpt2BenchReport {
    std::string model, config, kernel;
    std::string placement; // "cpu f32", "cuda:0 f16"
    int threads = 0, repeats = 0;
    int64_t n_positions = 0;
    Spread memcpy_gbs;       // read + write bandwidth of a 256 MiB memcpy
    double weight_bytes = 0; // streamed per decode step, float32 weights
    int64_t prompt_tokens = 0;
    Spread prompt_s; // one batched forward
    struct DecodeRow {
        int64_t context = 0;
        bool skipped = false; // context + repeats > n_positions
        Spread seconds;       // per token
        double gbs = 0, memcpy_read_percent = 0;
        double speedup_vs_f32 = 0; // f16 / q8_0 rows: the f32 median over this one's (0: no f32 row)
    };
    struct DecodeSection {
        std::string weights;     // "f32" | "f16" | "q8_0"
        double weight_bytes = 0; // streamed per token
        std::vector<DecodeRow> rows;
    };
    std::vector<DecodeSection> decode; // full KV cache, by decode weights
    // The decode profile: per op kind and shape, per token, at the first context.
    struct OpRow {
        std::string kind, shape;
        double calls = 0, ms = 0; // per token
        double gbs = 0;           // gemv rows: weight bytes read / time (0 for the other ops)
    };
    struct OpTable {
        std::string weights;
        int64_t context = 0;
        int tokens = 0;
        double step_ms = 0;  // mean wall time of one step (Gpt2Stream::feed) while timed
        double other_ms = 0; // of it, outside the timed ops (stream bookkeeping, logits checks, thread wake-ups)
        std::vector<OpRow> rows;
    };
    std::vector<OpTable> op_tables;
    bool copies_skipped = false;       // f16 / q8_0: the reference kernel reads f32 weights only
    std::string sink_spec;
    int64_t sink_kv_bytes = 0;
    struct StreamRow {
        int64_t tokens = 0; // stream length so far
        size_t tail = 0;    // steps the latency is taken over (the last ones)
        Spread seconds;
        double tokens_per_s = 0; // over the segment
        int64_t rss_bytes = 0;
        double latency_change_percent = 0, rss_change_percent = 0; // against the first row
    };
    std::vector<StreamRow> stream;
    int64_t recompute_window = 0;
    Spread recompute_s;
    double sink_speedup = 0; // recompute median over the last sink median
    int64_t peak_rss = 0;
    nlohmann::json to_json() const;
};

// What run_gpt2_bench has just added to the report.
enum class Gpt2BenchStage { Started, Prompt, DecodeSection, DecodeRow, StreamStarted, StreamRow, Recompute, OpTable };

Gpt2BenchReport run_gpt2_bench(const Gpt2BenchParams& p,
                               const std::function<void(const Gpt2BenchReport&, Gpt2BenchStage)>& progress = {});

} // namespace anchor::text
