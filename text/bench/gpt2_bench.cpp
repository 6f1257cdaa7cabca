#include "text/bench/gpt2_bench.h"

#include "cache/util/bench.h"
#include "kernels/op_timing.h"
#include "text/gpt2/gpt2_load.h"
#include "text/params.h"

#include <chrono>
#include <cstring>
#include <random>

namespace anchor::text {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Copy bandwidth of this machine in the same run: memcpy of a buffer much larger than the caches, counting the
// bytes read plus the bytes written (the figure a weight-streaming kernel is compared with uses reads only).
Spread copy_bandwidth_gbs(int repeats) {
    const size_t n = size_t(256) << 20;
    std::vector<char> a(n, 1), b(n, 0);
    std::vector<double> gbs;
    for (int r = 0; r < repeats; ++r) {
        auto t0 = Clock::now();
        std::memcpy(b.data(), a.data(), n);
        gbs.push_back(2.0 * double(n) / since(t0) / 1e9);
    }
    volatile char sink = b[n / 2];
    (void)sink;
    return Spread::of(gbs);
}

Gpt2Model random_gpt2_small() {
    Gpt2Config c; // defaults are GPT-2 small: 12 layers x 768, 12 heads, 1024 positions, 50257 tokens
    Gpt2Model m(c);
    torch::NoGradGuard ng;
    torch::manual_seed(0);
    for (auto& p : m->named_parameters()) {
        const std::string& n = p.key();
        if (n.find("ln_") != std::string::npos && n.find("weight") != std::string::npos)
            p.value().fill_(1.0);
        else if (p.value().dim() == 2)
            p.value().normal_(0.0, 0.02);
        else
            p.value().zero_();
    }
    m->finalize();
    return m;
}

// Per-token latency of `steps` single-token steps on `stream` (after whatever it was fed).
std::vector<double> time_steps(Gpt2Stream& stream, int steps, std::mt19937_64& rng, int64_t vocab) {
    std::vector<double> t;
    std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
    for (int i = 0; i < steps; ++i) {
        auto t0 = Clock::now();
        auto l = stream.feed(tok(rng)); // host logits: a device step has finished when feed returns
        (void)l.data_ptr<float>();
        t.push_back(since(t0));
    }
    return t;
}

// The decode kernel and CUDA graph switch of the run, restored afterwards (they are process-wide).
struct KernelChoice {
    bool before = fast_decode_kernel(), graphs_before = decode_cuda_graphs();
    KernelChoice(bool fast, bool graphs) {
        set_fast_decode_kernel(fast);
        set_decode_cuda_graphs(graphs);
    }
    ~KernelChoice() {
        set_fast_decode_kernel(before);
        set_decode_cuda_graphs(graphs_before);
    }
};

// Bytes of one weight in a decode copy (the gemv rows of the op table read rows x cols of them).
double bytes_per_weight(const std::string& kind) {
    if (kind == "gemv f32") return 4.0;
    if (kind == "gemv f16") return 2.0;
    if (kind == "gemv q8_0") return 34.0 / 32.0;
    if (kind == "gemv q4_0") return 18.0 / 32.0;
    return 0.0;
}

// `tokens` more one-token steps on a stream at `context` with every op of the step timed: per op kind and shape the
// calls, milliseconds and (gemv) weight GB/s per token, and what the step spends outside the timed ops.
Gpt2BenchReport::OpTable profile_steps(Gpt2Model& model, const std::string& weights, int64_t context, int tokens,
                                       std::mt19937_64& rng, const std::vector<int64_t>& prompt) {
    const int64_t V = model->config().vocab_size;
    Gpt2BenchReport::OpTable t;
    t.weights = weights;
    t.context = context;
    t.tokens = tokens;
    Gpt2Stream s(model, KvSpec::parse("full"), PositionMode::Absolute);
    s.feed(prompt);
    (void)time_steps(s, 1, rng, V); // warm
    kernels::op_timing_start();
    const auto steps = time_steps(s, tokens, rng, V);
    const auto calls = kernels::op_timing_stop();
    double total = 0, timed = 0;
    for (double x : steps) total += x;
    for (const auto& g : kernels::group_op_times(calls)) {
        Gpt2BenchReport::OpRow row;
        row.kind = g.kind;
        row.shape = g.shape;
        row.calls = double(g.calls) / tokens;
        row.ms = g.ms / tokens;
        const double bpw = bytes_per_weight(g.kind);
        if (bpw > 0 && g.ms > 0) row.gbs = g.macs * bpw / (g.ms / 1e3) / 1e9;
        timed += g.ms;
        t.rows.push_back(row);
    }
    t.step_ms = 1e3 * total / tokens;
    t.other_ms = t.step_ms - timed / tokens;
    return t;
}

} // namespace

void Gpt2BenchParams::validate() const {
    if (n_head < 0) throw ParamError("n_head", "must be >= 0, got " + std::to_string(n_head));
    if (repeats < 1) throw ParamError("repeats", "must be >= 1, got " + std::to_string(repeats));
    if (recompute_repeats < 1)
        throw ParamError("recompute_repeats", "must be >= 1, got " + std::to_string(recompute_repeats));
    for (size_t i = 0; i < stream_tokens.size(); ++i)
        if (stream_tokens[i] < 1 || (i > 0 && stream_tokens[i] < stream_tokens[i - 1]))
            throw ParamError("stream_tokens", "must be ascending counts >= 1");
    for (auto c : contexts)
        if (c < 1) throw ParamError("contexts", "must be >= 1, got " + std::to_string(c));
    if (op_table_tokens < 0) throw ParamError("op_table_tokens", "must be >= 0, got " + std::to_string(op_table_tokens));
    if (op_table_tokens > 0 && contexts.empty()) throw ParamError("op_table_tokens", "needs a decode context");
    placement.validate();
    if (cuda_graphs && (!placement.device.is_cuda() || !kernels::CudaGraph::available()))
        throw ParamError("cuda_graphs", "need a CUDA device and a build with LibTorch >= 2 and CUDA (the torch2 build)");
}

nlohmann::json Gpt2BenchReport::to_json() const {
    nlohmann::json j = {{"model", model},
                        {"config", config},
                        {"kernel", kernel},
                        {"placement", placement},
                        {"threads", threads},
                        {"repeats", repeats},
                        {"n_positions", n_positions},
                        {"memcpy_gbs", memcpy_gbs.to_json()},
                        {"weight_bytes", weight_bytes},
                        {"prompt", {{"tokens", prompt_tokens}, {"seconds", prompt_s.to_json()}}},
                        {"copies_skipped", copies_skipped},
                        {"sink", {{"spec", sink_spec}, {"kv_bytes", sink_kv_bytes}}},
                        {"recompute", {{"window", recompute_window}, {"seconds", recompute_s.to_json()}}},
                        {"sink_speedup", sink_speedup},
                        {"peak_rss_bytes", peak_rss}};
    for (const auto& sec : decode) {
        nlohmann::json rows = nlohmann::json::array();
        for (const auto& d : sec.rows)
            rows.push_back({{"context", d.context},
                            {"skipped", d.skipped},
                            {"seconds", d.seconds.to_json()},
                            {"gbs", d.gbs},
                            {"memcpy_read_percent", d.memcpy_read_percent},
                            {"speedup_vs_f32", d.speedup_vs_f32}});
        j["decode"].push_back({{"weights", sec.weights}, {"weight_bytes", sec.weight_bytes}, {"rows", rows}});
    }
    for (const auto& t : op_tables) {
        nlohmann::json rows = nlohmann::json::array();
        for (const auto& o : t.rows)
            rows.push_back(
                {{"kind", o.kind}, {"shape", o.shape}, {"calls", o.calls}, {"ms", o.ms}, {"gbs", o.gbs}});
        j["op_tables"].push_back({{"weights", t.weights},
                                  {"context", t.context},
                                  {"tokens", t.tokens},
                                  {"step_ms", t.step_ms},
                                  {"other_ms", t.other_ms},
                                  {"rows", rows}});
    }
    for (const auto& s : stream)
        j["sink"]["stream"].push_back({{"tokens", s.tokens},
                                       {"tail", s.tail},
                                       {"seconds", s.seconds.to_json()},
                                       {"tokens_per_s", s.tokens_per_s},
                                       {"rss_bytes", s.rss_bytes},
                                       {"latency_change_percent", s.latency_change_percent},
                                       {"rss_change_percent", s.rss_change_percent}});
    return j;
}

Gpt2BenchReport run_gpt2_bench(const Gpt2BenchParams& p,
                               const std::function<void(const Gpt2BenchReport&, Gpt2BenchStage)>& progress) {
    p.validate();
    const KernelChoice kernel(!p.reference_kernel, p.cuda_graphs);
    auto tell = [&](const Gpt2BenchReport& r, Gpt2BenchStage s) {
        if (progress) progress(r, s);
    };
    Gpt2BenchReport r;
    Gpt2Model model = p.model.empty() ? random_gpt2_small() : load_gpt2(p.model, p.n_head).model;
    r.model = p.model.empty() ? "random GPT-2-small shapes (in memory)" : p.model;
    model->place(p.placement);
    r.placement = p.placement.str();
    const auto& cfg = model->config();
    const int64_t P = cfg.n_positions, V = cfg.vocab_size;
    std::mt19937_64 rng(1234);
    std::uniform_int_distribution<int64_t> tok(0, V - 1);
    auto random_tokens = [&](int64_t n) {
        std::vector<int64_t> v(static_cast<size_t>(n));
        for (auto& t : v) t = tok(rng);
        return v;
    };
    r.config = cfg.describe();
    r.n_positions = P;
    r.kernel = p.placement.reference() ? decode_kernel()
               : "LibTorch operators on " + p.placement.str() + (p.cuda_graphs ? ", one-token steps as a CUDA graph" : "");
    r.threads = at::get_num_threads();
    r.repeats = p.repeats;
    r.memcpy_gbs = copy_bandwidth_gbs(p.repeats);
    r.weight_bytes = static_cast<double>(model->decode_weight_bytes());
    tell(r, Gpt2BenchStage::Started);

    // Prompt throughput: one batched forward.
    r.prompt_tokens = std::min<int64_t>(128, P);
    {
        auto ids = torch::tensor(random_tokens(r.prompt_tokens), torch::kLong);
        std::vector<double> t;
        for (int i = 0; i < p.repeats; ++i) {
            auto t0 = Clock::now();
            (void)model->forward(ids, false, true).logits.to(torch::kCPU); // waits for a device
            t.push_back(since(t0));
        }
        r.prompt_s = Spread::of(t);
    }
    tell(r, Gpt2BenchStage::Prompt);

    // Decode latency at several contexts (full KV cache), with float32 weights and with the float16, q8_0 and q4_0
    // copies (--decode-weights f16 / q8_0 / q4_0), measured in the same run.
    std::vector<double> f32_median;
    for (auto dw : {DecodeWeights::F32, DecodeWeights::F16, DecodeWeights::Q8_0, DecodeWeights::Q4_0}) {
        if (dw != DecodeWeights::F32 && (!fast_decode_kernel() || !p.placement.reference())) {
            if (!r.copies_skipped) {
                r.copies_skipped = true;
                tell(r, Gpt2BenchStage::DecodeSection);
            }
            continue;
        }
        model->set_decode_weights(dw);
        const double bytes = static_cast<double>(model->decode_weight_bytes());
        const bool copy = dw != DecodeWeights::F32;
        // Off CPU float32 the model reads its own weights in the compute dtype: the section is named after it.
        const auto dtype_name = p.placement.reference() ? enum_name(decode_weight_table(), dw) : p.placement.str();
        r.decode.push_back({dtype_name, bytes, {}});
        tell(r, Gpt2BenchStage::DecodeSection);
        size_t n = 0;
        for (int64_t ctx : p.contexts) {
            Gpt2BenchReport::DecodeRow row;
            row.context = ctx;
            row.skipped = ctx + p.repeats > P;
            if (!row.skipped) {
                Gpt2Stream s(model, KvSpec::parse("full"), PositionMode::Absolute);
                s.feed(random_tokens(ctx));
                row.seconds = Spread::of(time_steps(s, p.repeats, rng, V));
                row.gbs = bytes / row.seconds.median / 1e9;
                row.memcpy_read_percent = 100.0 * row.gbs / (r.memcpy_gbs.median / 2.0);
                if (!copy)
                    f32_median.push_back(row.seconds.median);
                else if (n < f32_median.size())
                    row.speedup_vs_f32 = f32_median[n] / row.seconds.median;
                ++n;
            }
            r.decode.back().rows.push_back(row);
            tell(r, Gpt2BenchStage::DecodeRow);
        }
        const int64_t ctx0 = p.contexts.empty() ? 0 : p.contexts.front();
        if (p.op_table_tokens > 0 && ctx0 + p.op_table_tokens + 1 <= P) {
            r.op_tables.push_back(profile_steps(model, dtype_name, ctx0, p.op_table_tokens, rng, random_tokens(ctx0)));
            tell(r, Gpt2BenchStage::OpTable);
        }
    }
    model->set_decode_weights(DecodeWeights::F32);

    // Attention-sink streaming: latency and RSS stay flat however long the stream.
    const int64_t S = 4, W = std::max<int64_t>(1, std::min<int64_t>(1020, P - 4));
    r.sink_spec = "sink:" + std::to_string(S) + "," + std::to_string(W);
    double sink_median = 0;
    {
        Gpt2Stream s(model, KvSpec::parse(r.sink_spec), PositionMode::Wrap);
        r.sink_kv_bytes = s.kv_bytes();
        tell(r, Gpt2BenchStage::StreamStarted);
        int64_t done = 0;
        double first_median = 0, first_rss = 0;
        for (int64_t target : p.stream_tokens) {
            std::vector<double> lat;
            const auto t0 = Clock::now();
            while (done < target) {
                auto a = Clock::now();
                s.feed(tok(rng));
                lat.push_back(since(a));
                ++done;
            }
            const double secs = since(t0);
            // The last 256 (or `repeats`, if more) steps are the steady state at this stream length: enough that one
            // scheduler hiccup does not move the median.
            Gpt2BenchReport::StreamRow row;
            row.tokens = done;
            row.tail = std::min(lat.size(), std::max<size_t>(256, size_t(p.repeats)));
            row.seconds = Spread::of(std::vector<double>(lat.end() - long(row.tail), lat.end()));
            if (first_median == 0) first_median = row.seconds.median;
            sink_median = row.seconds.median;
            row.tokens_per_s = lat.empty() ? 0.0 : double(lat.size()) / secs;
            row.rss_bytes = util::rss_now_bytes();
            if (first_rss == 0) first_rss = double(row.rss_bytes);
            row.latency_change_percent = 100.0 * (row.seconds.median / first_median - 1.0);
            row.rss_change_percent = 100.0 * (double(row.rss_bytes) / first_rss - 1.0);
            r.stream.push_back(row);
            tell(r, Gpt2BenchStage::StreamRow);
        }
    }

    // Sliding window with re-computation over the same window: one full forward per token.
    {
        r.recompute_window = std::min<int64_t>(S + W, P);
        Gpt2Stream s(model, KvSpec::parse("recompute:" + std::to_string(r.recompute_window)), PositionMode::Wrap);
        s.feed(random_tokens(r.recompute_window));
        r.recompute_s = Spread::of(time_steps(s, p.recompute_repeats, rng, V));
        r.sink_speedup = sink_median > 0 ? r.recompute_s.median / sink_median : 0.0;
    }
    r.peak_rss = util::peak_rss_bytes();
    tell(r, Gpt2BenchStage::Recompute);
    return r;
}

} // namespace anchor::text
