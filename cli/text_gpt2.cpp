// `anchor-text gpt2 ppl|generate|bench`: GPT-2 streaming with attention-sink rolling KV buffers (StreamingLLM,
// Xiao et al. 2023) next to full, window and recompute baselines.
#include "cli/text_commands.h"

#include "cache/io/atomic_file.h"
#include "cache/io/enum_table.h"
#include "cache/io/error.h"
#include "cache/sink_rolling_kv.h"
#include "cli/bench_util.h"
#include "cli/common.h"
#include "cli/loss_plot.h"
#include "kernels/gemv.h"
#include "text/gpt2_model.h"
#include "text/gpt2_tokenizer.h"
#include "text/params.h"
#include "text/sampler_chain.h"
#include "text/train/gpt2_train.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>

namespace anchor::cli {

using bench::peak_rss_bytes;
using bench::rss_now_bytes;

namespace {

using Clock = std::chrono::steady_clock;

std::string policy_help() {
    return enum_choices(text::position_mode_table(), "|");
}

std::string human_bytes(double b) {
    const char* units[] = {"B", "KiB", "MiB", "GiB"};
    int u = 0;
    while (b >= 1024.0 && u < 3) b /= 1024.0, ++u;
    std::ostringstream os;
    os << std::fixed << std::setprecision(u ? 1 : 0) << b << " " << units[u];
    return os.str();
}

text::Gpt2Tokenizer load_tokenizer(const std::string& explicit_dir, const text::LoadedGpt2& m) {
    if (!explicit_dir.empty()) return text::Gpt2Tokenizer::from_dir(explicit_dir);
    if (!m.folder.empty() && text::Gpt2Tokenizer::dir_has_vocab(m.folder))
        return text::Gpt2Tokenizer::from_dir(m.folder);
    return text::Gpt2Tokenizer::load_default();
}

struct ModelOptions {
    std::string model;
    std::string vocab;
    int64_t n_head = 0;
    std::string kv = "full";
    std::string positions = "wrap";
    std::string decode_weights = "f32";
};

const EnumTable<torch::ScalarType>& decode_weight_table() {
    static const EnumTable<torch::ScalarType> t = {{"f32", torch::kFloat32}, {"f16", torch::kFloat16}};
    return t;
}

// Loads the model and applies --decode-weights (parsed by the caller before anything is loaded).
text::LoadedGpt2 load_model(const ModelOptions& o, torch::ScalarType decode) {
    auto loaded = text::load_gpt2(o.model, o.n_head);
    loaded.model->set_decode_weights(decode);
    return loaded;
}

void add_model_options(CLI::App* sub, ModelOptions& o, bool kv = true) {
    sub->add_option("-m,--model", o.model, "GPT-2 model: folder (config.json + any *.safetensors), file or index")
        ->required();
    sub->add_option("--vocab", o.vocab,
                    "Tokenizer folder (encoder.json+vocab.bpe or vocab.json+merges.txt); default: the model folder "
                    "if it has one, else " +
                        text::Gpt2Tokenizer::default_dir());
    sub->add_option("--n-head", o.n_head, "Head count when the model has no config.json (default n_embd/64)");
    sub->add_option("--decode-weights", o.decode_weights,
                    "Weights one-token steps read (" + enum_choices(decode_weight_table(), "|") +
                        "): f16 keeps a half-size copy and halves the bytes per token (logits move by ~1e-3)")
        ->capture_default_str();
    if (kv) {
        sub->add_option("--kv", o.kv, "KV cache: " + text::KvSpec::syntax_help())->capture_default_str();
        sub->add_option("--positions", o.positions,
                        "Position ids past the cache (" + policy_help() +
                            "): wrap = i % n_positions, cache = min(i, S+W-1), absolute = i (error past n_positions), "
                            "reencode = in-order positions; when the S+W buffer is full the sinks and the newest W/2 "
                            "tokens are encoded again at 0.. (window/sink modes; matches recompute:S+W perplexity)")
            ->capture_default_str();
    }
}

std::string read_text_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error("cannot read text file '" + path + "'");
    std::ostringstream ss;
    ss << in.rdbuf();
    if (in.bad()) throw Error("error while reading text file '" + path + "'");
    return ss.str();
}

// ---- ppl ---------------------------------------------------------------------------------------------------------

struct PplOptions {
    ModelOptions m;
    std::string file;
    std::string compare;
    int64_t max_tokens = 0;
    std::string json_out;
    bool overwrite = false;
};

int run_ppl(const PplOptions& o) {
    // Parse everything the user typed before loading anything.
    const auto policy = enum_from_string(text::position_mode_table(), o.m.positions, "position policy");
    std::vector<text::KvSpec> specs;
    if (!o.compare.empty()) {
        std::string item;
        // "full,window:32,sink:4,28,recompute:32": a bare number after sink:S belongs to it (S,W).
        std::vector<std::string> parts;
        std::stringstream ss(o.compare);
        while (std::getline(ss, item, ',')) {
            if (!parts.empty() && !item.empty() && item.find_first_not_of("0123456789") == std::string::npos &&
                parts.back().rfind("sink:", 0) == 0 && parts.back().find(',') == std::string::npos)
                parts.back() += "," + item;
            else
                parts.push_back(item);
        }
        for (const auto& p : parts) specs.push_back(text::KvSpec::parse(p));
    } else {
        specs.push_back(text::KvSpec::parse(o.m.kv));
    }
    if (o.max_tokens < 0) throw UsageError("--max-tokens must be >= 0");
    if (!o.json_out.empty()) check_output_path(o.json_out, o.overwrite);
    const auto decode = enum_from_string(decode_weight_table(), o.m.decode_weights, "--decode-weights");
    const std::string text = read_text_file(o.file);
    auto loaded = load_model(o.m, decode);
    auto tok = load_tokenizer(o.m.vocab, loaded);
    auto ids = o.max_tokens > 0 ? tok.encode_first(text, static_cast<size_t>(o.max_tokens)) : tok.encode(text);
    if (ids.size() < 2) throw Error("text file '" + o.file + "' encodes to fewer than 2 tokens; nothing to score");
    const int64_t P = loaded.config.n_positions;
    std::cout << "model: " << loaded.config.describe() << "\n";
    std::cout << "text: " << o.file << ", " << ids.size() << " tokens, scoring " << ids.size() - 1
              << " next-token predictions (one token per forward), positions "
              << enum_name(text::position_mode_table(), policy) << "\n";
    nlohmann::json report = {{"model", o.m.model},
                             {"config", loaded.config.describe()},
                             {"file", o.file},
                             {"tokens", ids.size()},
                             {"positions", enum_name(text::position_mode_table(), policy)},
                             {"threads", at::get_num_threads()},
                             {"runs", nlohmann::json::array()}};
    std::cout << std::left << std::setw(18) << "kv" << std::right << std::setw(10) << "tokens" << std::setw(14) << "ppl"
              << std::setw(12) << "mean_nll" << std::setw(11) << "tok/s" << std::setw(13) << "KV bytes" << std::setw(14)
              << "peak RSS"
              << "\n";
    // A single mode that cannot run is a usage error; in --compare it is a row that says why.
    if (specs.size() == 1) {
        const int64_t N = static_cast<int64_t>(ids.size());
        if (specs[0].mode == text::KvMode::Full && N > P)
            throw UsageError("--kv full cannot go past n_positions=" + std::to_string(P) + " (the text has " +
                             std::to_string(N) + " tokens); use sink:S,W, window:W or recompute:W, or --max-tokens " +
                             std::to_string(P));
        if (policy == text::PositionMode::Absolute && N > P)
            throw UsageError("--positions absolute cannot go past n_positions=" + std::to_string(P) +
                             " (the text has " + std::to_string(N) +
                             " tokens); use --positions reencode|wrap|cache or --max-tokens " + std::to_string(P));
    }
    for (const auto& spec : specs) {
        std::cout << std::left << std::setw(18) << spec.str() << std::right << std::flush;
        const int64_t N = static_cast<int64_t>(ids.size());
        if (spec.mode == text::KvMode::Full && N > P) {
            std::cout << "  cannot go past n_positions=" << P << " (the text has " << N
                      << " tokens); use sink:S,W, window:W or recompute:W, or --max-tokens " << P << "\n";
            report["runs"].push_back({{"kv", spec.str()}, {"skipped", "the text is longer than n_positions"}});
            continue;
        }
        if (policy == text::PositionMode::Absolute && N > P) {
            std::cout << "  --positions absolute cannot go past n_positions=" << P << " (" << N << " tokens)\n";
            report["runs"].push_back({{"kv", spec.str()}, {"skipped", "--positions absolute past n_positions"}});
            continue;
        }
        try {
            const auto t0 = Clock::now();
            text::Gpt2Stream probe(loaded.model, spec, policy); // validates S+W against the policy up front
            const int64_t kv_bytes = probe.kv_bytes();
            auto ev = text::evaluate_stream(loaded.model, ids, spec, policy);
            const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
            std::cout << std::setw(10) << ev.tokens << std::setw(14) << std::setprecision(6) << std::defaultfloat
                      << std::exp(ev.mean_nll) << std::setw(12) << std::fixed << std::setprecision(5) << ev.mean_nll
                      << std::setw(11) << std::setprecision(1) << ev.tokens / secs << std::setw(13)
                      << human_bytes(static_cast<double>(kv_bytes)) << std::setw(14)
                      << human_bytes(static_cast<double>(peak_rss_bytes())) << "\n"
                      << std::defaultfloat;
            report["runs"].push_back({{"kv", spec.str()},
                                      {"tokens", ev.tokens},
                                      {"scored", ev.tokens - 1},
                                      {"ppl", std::exp(ev.mean_nll)},
                                      {"mean_nll", ev.mean_nll},
                                      {"kv_bytes", kv_bytes},
                                      {"seconds", secs}});
        } catch (const UsageError&) {
            throw;
        } catch (const Error& e) {
            std::cout << "  failed: " << e.what() << "\n";
            report["runs"].push_back({{"kv", spec.str()}, {"failed", e.what()}});
        }
    }
    std::cout << "(peak RSS is the process high-water mark so far, VmHWM)\n";
    if (!o.json_out.empty()) {
        write_file_atomic(o.json_out, report.dump(2) + "\n", o.overwrite);
        std::cout << "wrote " << o.json_out << "\n";
    }
    return 0;
}

// ---- generate ----------------------------------------------------------------------------------------------------

struct GenOptions {
    ModelOptions m;
    std::string prompt;
    int64_t max_new = 64;
    text::SamplingParams sampling;
    bool stop_at_eos = false;
    bool allow_special = false;
    int64_t report_every = 0; // soak: RSS and latency every N generated tokens
    std::string report_json;  // ... and written here at the end
    bool overwrite = false;
};

int run_generate(const GenOptions& o) {
    const auto policy = enum_from_string(text::position_mode_table(), o.m.positions, "position policy");
    const auto spec = text::KvSpec::parse(o.m.kv);
    if (o.prompt.empty()) throw UsageError("the prompt is empty (-p TEXT)");
    if (o.max_new < 0) throw UsageError("--max-new must be >= 0");
    try {
        o.sampling.validate();
    } catch (const text::ParamError& e) {
        throw UsageError(text::with_flags(e, {{"temperature", "--temperature"},
                                              {"top_k", "--top-k"},
                                              {"top_p", "--top-p"},
                                              {"min_p", "--min-p"},
                                              {"repeat_penalty", "--repeat-penalty"},
                                              {"repeat_last_n", "--repeat-last-n"}}));
    }
    const auto decode = enum_from_string(decode_weight_table(), o.m.decode_weights, "--decode-weights");
    auto loaded = load_model(o.m, decode);
    auto tok = load_tokenizer(o.m.vocab, loaded);
    auto prompt = tok.encode(o.prompt, o.allow_special);
    const int64_t P = loaded.config.n_positions, total = static_cast<int64_t>(prompt.size()) + o.max_new;
    if ((spec.mode == text::KvMode::Full || policy == text::PositionMode::Absolute) && total > P)
        throw UsageError("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-new " +
                         std::to_string(o.max_new) + " exceeds n_positions " + std::to_string(P) + " with --kv " +
                         spec.str() + " --positions " + enum_name(text::position_mode_table(), policy) +
                         "; use --kv sink:S,W with --positions reencode, wrap or cache to go further");
    if (o.report_every < 0) throw UsageError("--report-every must be >= 0");
    if (!o.report_json.empty()) {
        if (o.report_every == 0) throw UsageError("--report-json needs --report-every N");
        check_output_path(o.report_json, o.overwrite);
    }
    text::Gpt2Stream stream(loaded.model, spec, policy);
    auto chain = text::make_sampler_chain(o.sampling);
    for (auto t : prompt) chain.accept(t);
    // Soak report: per window of `report_every` tokens, the mean latency and the RSS at its end. Growth and drift are
    // measured from the first window (warm-up: allocator pools and the ring fill) to the worst later one.
    struct Window {
        int64_t tokens;
        double ms_per_token;
        int64_t rss;
    };
    std::vector<Window> windows;
    auto window_start = Clock::now();
    text::Utf8StreamDecoder dec;
    std::cout << o.prompt << std::flush;
    const auto t0 = Clock::now();
    auto logits = stream.feed(prompt);
    const double prefill = std::chrono::duration<double>(Clock::now() - t0).count();
    const auto t1 = Clock::now();
    int64_t produced = 0;
    for (int64_t k = 0; k < o.max_new; ++k) {
        const int64_t id = chain.sample(logits);
        chain.accept(id);
        ++produced;
        std::cout << dec.push(tok.token_bytes(id)) << std::flush;
        if (o.stop_at_eos && id == text::Gpt2Tokenizer::kEndOfText) break;
        if (k + 1 < o.max_new) logits = stream.feed(id);
        if (o.report_every > 0 && produced % o.report_every == 0) {
            const auto now = Clock::now();
            Window w{produced, 1e3 * std::chrono::duration<double>(now - window_start).count() / double(o.report_every),
                     rss_now_bytes()};
            windows.push_back(w);
            std::cerr << "\n[report] " << w.tokens << " tokens: " << std::fixed << std::setprecision(3)
                      << w.ms_per_token << " ms/token, RSS " << human_bytes(double(w.rss)) << std::endl;
            window_start = Clock::now(); // the report itself is not timed
        }
    }
    std::cout << dec.flush() << std::endl;
    const double gen = std::chrono::duration<double>(Clock::now() - t1).count();
    std::cerr << "prompt: " << prompt.size() << " tokens in " << std::fixed << std::setprecision(3) << prefill
              << " s; generated " << produced << " tokens, " << std::setprecision(1) << (gen > 0 ? produced / gen : 0.0)
              << " tok/s; kv " << spec.str() << " (" << human_bytes(static_cast<double>(stream.kv_bytes()))
              << "), positions " << enum_name(text::position_mode_table(), policy) << "; peak RSS "
              << human_bytes(static_cast<double>(peak_rss_bytes())) << "\n";
    if (windows.size() >= 2) {
        const auto& first = windows.front();
        int64_t rss_max = first.rss;
        std::vector<double> later;
        for (size_t i = 1; i < windows.size(); ++i)
            rss_max = std::max(rss_max, windows[i].rss), later.push_back(windows[i].ms_per_token);
        const double growth = 100.0 * double(rss_max - first.rss) / double(first.rss);
        const auto lat = bench::stats_of(later);
        // Drift: median latency of the last quarter of the later windows against the first quarter (medians, so that
        // a burst of other load on a shared machine does not count as drift).
        const size_t q = std::max<size_t>(1, later.size() / 4);
        const auto head = bench::stats_of(std::vector<double>(later.begin(), later.begin() + q));
        const auto tail = bench::stats_of(std::vector<double>(later.end() - q, later.end()));
        const double drift = 100.0 * (tail.median / head.median - 1.0);
        std::cerr << std::fixed << std::setprecision(2) << "soak: " << windows.size() << " windows of "
                  << o.report_every << " tokens; RSS " << human_bytes(double(first.rss)) << " after the first, max "
                  << human_bytes(double(rss_max)) << " later (growth " << growth << " %); latency " << lat.min << " / "
                  << lat.median << " / " << lat.max
                  << " ms/token (min/median/max of later windows); drift, last vs first quarter (medians) " << drift
                  << " %\n";
        if (!o.report_json.empty()) {
            nlohmann::json j;
            j["model"] = o.m.model;
            j["kv"] = spec.str();
            j["positions"] = enum_name(text::position_mode_table(), policy);
            j["threads"] = at::get_num_threads();
            j["report_every"] = o.report_every;
            j["generated"] = produced;
            j["rss_growth_percent"] = growth;
            j["latency_drift_percent"] = drift;
            j["latency_ms"] = {{"min", lat.min}, {"median", lat.median}, {"max", lat.max}};
            for (const auto& w : windows)
                j["windows"].push_back({{"tokens", w.tokens}, {"ms_per_token", w.ms_per_token}, {"rss_bytes", w.rss}});
            write_file_atomic(o.report_json, j.dump(1) + "\n", o.overwrite);
            std::cerr << "wrote " << o.report_json << "\n";
        }
    }
    return 0;
}

} // namespace

// ---- bench -------------------------------------------------------------------------------------------------------

namespace {

struct BenchOptions {
    ModelOptions m;
    int repeats = 5;
    std::string stream_tokens = "1000,10000";
    bool long_stream = false;
    int recompute_repeats = 2;
};

using Summary = ::anchor::cli::bench::Stats;

Summary summarize(std::vector<double> v) {
    return ::anchor::cli::bench::stats_of(std::move(v));
}

std::string fmt_ms(const Summary& s) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(2) << s.min * 1e3 << " / " << s.median * 1e3 << " / " << s.max * 1e3 << " ms";
    return os.str();
}

// Copy bandwidth of this machine in the same run: memcpy of a buffer much larger than the caches, counting the
// bytes read plus the bytes written (the figure a weight-streaming kernel is compared with uses reads only).
Summary copy_bandwidth_gbs(int repeats) {
    const size_t n = size_t(256) << 20;
    std::vector<char> a(n, 1), b(n, 0);
    std::vector<double> gbs;
    for (int r = 0; r < repeats; ++r) {
        auto t0 = Clock::now();
        std::memcpy(b.data(), a.data(), n);
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        gbs.push_back(2.0 * n / s / 1e9);
    }
    volatile char sink = b[n / 2];
    (void)sink;
    return summarize(gbs);
}

text::Gpt2Model random_gpt2_small() {
    text::Gpt2Config c; // defaults are GPT-2 small: 12 layers x 768, 12 heads, 1024 positions, 50257 tokens
    text::Gpt2Model m(c);
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
std::vector<double> time_steps(text::Gpt2Stream& stream, int steps, std::mt19937_64& rng, int64_t vocab) {
    std::vector<double> t;
    std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
    for (int i = 0; i < steps; ++i) {
        auto t0 = Clock::now();
        auto l = stream.feed(tok(rng));
        (void)l.data_ptr<float>();
        t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return t;
}

int run_bench(const BenchOptions& o) {
    if (o.repeats < 1) throw UsageError("--repeats must be >= 1");
    auto stream_counts = parse_int_list(o.stream_tokens, "--stream-tokens");
    if (o.long_stream) stream_counts.push_back(100000);
    text::Gpt2Model model{nullptr};
    std::string what;
    if (!o.m.model.empty()) {
        auto loaded = text::load_gpt2(o.m.model, o.m.n_head);
        model = loaded.model;
        what = o.m.model;
    } else {
        model = random_gpt2_small();
        what = "random GPT-2-small shapes (in memory)";
    }
    const auto& cfg = model->config();
    const int64_t P = cfg.n_positions, V = cfg.vocab_size;
    std::mt19937_64 rng(1234);
    std::uniform_int_distribution<int64_t> tok(0, V - 1);
    auto random_tokens = [&](int64_t n) {
        std::vector<int64_t> v(n);
        for (auto& t : v) t = tok(rng);
        return v;
    };
    std::cout << "# anchor-text gpt2 bench\n"
              << "model: " << what << "\n  " << cfg.describe() << "\n"
              << "threads: " << at::get_num_threads()
              << ", decode matrix-vector kernel: " << (kernels::gemv_uses_avx2() ? "AVX2/FMA gemv" : "portable gemv")
              << ", repeats: " << o.repeats << " (min / median / max)\n";
    const auto copy = copy_bandwidth_gbs(o.repeats);
    const double wbytes = static_cast<double>(model->decode_weight_bytes());
    std::cout << std::fixed << std::setprecision(2) << "memcpy bandwidth (read+write): " << copy.min << " / "
              << copy.median << " / " << copy.max << " GB/s\n"
              << "weights streamed per decode step: " << human_bytes(wbytes) << "\n";

    // Prompt throughput: one batched forward.
    const int64_t prompt_len = std::min<int64_t>(128, P);
    {
        auto ids = torch::tensor(random_tokens(prompt_len), torch::kLong);
        std::vector<double> t;
        for (int r = 0; r < o.repeats; ++r) {
            auto t0 = Clock::now();
            model->forward(ids, false, true);
            t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
        auto s = summarize(t);
        std::cout << "prompt " << prompt_len << " tokens: " << fmt_ms(s) << "  -> " << std::setprecision(1)
                  << prompt_len / s.median << " tokens/s (median)\n";
    }

    // Decode latency at several contexts (full KV cache), with float32 weights and with the float16 copy
    // (--decode-weights f16), measured in the same run.
    std::vector<double> f32_median;
    for (auto dtype : {torch::kFloat32, torch::kFloat16}) {
        if (dtype == torch::kFloat16 && !text::fast_decode_kernel()) {
            std::cout << "decode latency, f16 weights: skipped (the --reference-kernel path reads f32 weights)\n";
            continue;
        }
        model->set_decode_weights(dtype);
        const double bytes = static_cast<double>(model->decode_weight_bytes());
        const bool f16 = dtype == torch::kFloat16;
        std::cout << "decode latency, full KV cache, " << enum_name(decode_weight_table(), dtype) << " weights ("
                  << human_bytes(bytes) << " per token; per token):\n";
        size_t row = 0;
        for (int64_t ctx : {int64_t(16), int64_t(256), int64_t(900)}) {
            if (ctx + o.repeats > P) {
                std::cout << "  context " << ctx << ": skipped (n_positions " << P << ")\n";
                continue;
            }
            text::Gpt2Stream s(model, text::KvSpec::parse("full"), text::PositionMode::Absolute);
            s.feed(random_tokens(ctx));
            auto t = summarize(time_steps(s, o.repeats, rng, V));
            std::cout << "  context " << std::setw(4) << ctx << ": " << fmt_ms(t) << "  -> " << std::setprecision(2)
                      << bytes / t.median / 1e9 << " GB/s of weights (" << std::setprecision(0)
                      << 100.0 * (bytes / t.median / 1e9) / (copy.median / 2.0) << "% of memcpy read bandwidth)";
            if (!f16)
                f32_median.push_back(t.median);
            else if (row < f32_median.size())
                std::cout << std::setprecision(2) << ", " << f32_median[row] / t.median << "x the f32 speed";
            std::cout << "\n";
            ++row;
        }
    }
    model->set_decode_weights(torch::kFloat32);

    // Attention-sink streaming: latency and RSS stay flat however long the stream.
    const int64_t S = 4, W = std::max<int64_t>(1, std::min<int64_t>(1020, P - 4));
    const std::string sink_spec = "sink:" + std::to_string(S) + "," + std::to_string(W);
    double sink_median = 0;
    std::cout << sink_spec << " --positions wrap, streaming:\n";
    {
        text::Gpt2Stream s(model, text::KvSpec::parse(sink_spec), text::PositionMode::Wrap);
        std::cout << "  KV cache: " << human_bytes(static_cast<double>(s.kv_bytes())) << " preallocated\n";
        int64_t done = 0;
        double first_median = 0, first_rss = 0;
        for (int64_t target : stream_counts) {
            std::vector<double> lat;
            const auto t0 = Clock::now();
            while (done < target) {
                auto a = Clock::now();
                s.feed(tok(rng));
                lat.push_back(std::chrono::duration<double>(Clock::now() - a).count());
                ++done;
            }
            const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
            // The last 256 (or `repeats`, if more) steps are the steady state at this stream length: enough that one
            // scheduler hiccup does not move the median.
            const size_t tail = std::min(lat.size(), std::max<size_t>(256, o.repeats));
            auto sm = summarize(std::vector<double>(lat.end() - tail, lat.end()));
            if (first_median == 0) first_median = sm.median;
            sink_median = sm.median;
            const double rss = static_cast<double>(rss_now_bytes());
            if (first_rss == 0) first_rss = rss;
            std::cout << "  after " << std::setw(6) << done << " tokens: " << fmt_ms(sm) << " per token (last " << tail
                      << "), " << std::setprecision(1) << (lat.empty() ? 0.0 : lat.size() / secs)
                      << " tokens/s over the segment, RSS " << human_bytes(rss) << std::showpos << "  (latency "
                      << 100.0 * (sm.median / first_median - 1.0) << " %, RSS " << 100.0 * (rss / first_rss - 1.0)
                      << " % vs the first)" << std::noshowpos << "\n";
        }
    }

    // Sliding window with re-computation over the same window: one full forward per token.
    {
        const int64_t C = std::min<int64_t>(S + W, P);
        text::Gpt2Stream s(model, text::KvSpec::parse("recompute:" + std::to_string(C)), text::PositionMode::Wrap);
        s.feed(random_tokens(C));
        auto t = summarize(time_steps(s, std::max(1, o.recompute_repeats), rng, V));
        std::cout << "recompute:" << C << " (per token): " << fmt_ms(t);
        if (sink_median > 0)
            std::cout << "  -> " << sink_spec << " is " << std::setprecision(1) << t.median / sink_median
                      << "x faster per token";
        std::cout << "\n";
    }
    std::cout << "peak RSS: " << human_bytes(static_cast<double>(peak_rss_bytes())) << "\n";
    return 0;
}

} // namespace

// ---- train -------------------------------------------------------------------------------------------------------

namespace {

const std::vector<std::pair<torch::ScalarType, std::string>>& export_dtype_names() {
    static const std::vector<std::pair<torch::ScalarType, std::string>> t = {
        {torch::kFloat16, "f16"}, {torch::kBFloat16, "bf16"}, {torch::kFloat32, "f32"}};
    return t;
}

struct TrainArgs {
    text::Gpt2TrainOptions o;
    int64_t layers = 4, dim = 128, heads = 4, positions = 256;
    std::string holdout = text::HoldoutSpec().str();
    std::string export_dtype = "f16";
    bool no_resume = false;
};

int run_train(TrainArgs a) {
    a.o.config.n_layer = a.layers;
    a.o.config.n_embd = a.dim;
    a.o.config.n_head = a.heads;
    a.o.config.n_positions = a.positions;
    try {
        a.o.config.validate();
    } catch (const Error& e) {
        throw UsageError(e.what());
    }
    a.o.holdout = text::HoldoutSpec::parse(a.holdout);
    bool dtype_found = false;
    std::string dtypes;
    for (const auto& [t, name] : export_dtype_names()) {
        dtypes += (dtypes.empty() ? "" : "|") + name;
        if (name == a.export_dtype) a.o.export_dtype = t, dtype_found = true;
    }
    if (!dtype_found) throw UsageError("--export-dtype must be " + dtypes + ", got '" + a.export_dtype + "'");
    a.o.resume = !a.no_resume;
    a.o.log = [](const std::string& s) { std::cout << s << std::endl; };
    const auto r = text::train_gpt2(a.o);
    std::cout << std::fixed << std::setprecision(4) << "trained steps " << r.start_step << ".." << r.end_step << ", "
              << r.tokens_seen << " training tokens seen (train text " << r.train_tokens << " tokens), "
              << std::setprecision(1) << r.wall_s << " s\n"
              << std::setprecision(4) << "train loss " << r.train_loss << ", val loss " << r.val_loss << " (ppl "
              << std::setprecision(2) << std::exp(r.val_loss) << ") on " << r.val_tokens << " held-out tokens\n";
    if (r.export_val_loss >= 0)
        std::cout << std::setprecision(4) << "exported model through load_gpt2: val loss " << r.export_val_loss
                  << " (ppl " << std::setprecision(2) << std::exp(r.export_val_loss) << ")\n";
    std::cout << std::defaultfloat;
    // The loss curve over the whole run (all invocations), next to the run's log and, when exporting, the model.
    LossSeries train_s{"train loss", {}, {}}, val_s{"validation loss", {}, {}};
    for (const auto& m : r.metrics) {
        train_s.steps.push_back(double(m.step)), train_s.losses.push_back(m.train_loss);
        if (m.val_loss >= 0) val_s.steps.push_back(double(m.step)), val_s.losses.push_back(m.val_loss);
    }
    const auto png =
        loss_curves_png({train_s, val_s}, "GPT-2 " + std::to_string(a.layers) + "x" + std::to_string(a.dim) +
                                              " on the KJV, held out " + a.o.holdout.str());
    namespace fs = std::filesystem;
    write_file_atomic((fs::path(a.o.out_dir) / "loss.png").string(), png);
    if (!a.o.export_dir.empty()) {
        write_file_atomic((fs::path(a.o.export_dir) / "loss.png").string(), png, a.o.overwrite_export);
        for (const char* f : {"train_log.txt", "metrics.csv"}) {
            const auto src = fs::path(a.o.out_dir) / f, dst = fs::path(a.o.export_dir) / f;
            write_file_atomic(dst.string(), read_text_file(src.string()), a.o.overwrite_export);
        }
        std::cout << "wrote " << a.o.export_dir << "/{config.json,model.safetensors,loss.png,train_log.txt,"
                  << "metrics.csv}\n";
    }
    return 0;
}

} // namespace

void add_gpt2_commands(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners) {
    auto* gpt2 = app.add_subcommand("gpt2", "GPT-2 with KV cache and attention-sink rolling KV buffers");
    gpt2->require_subcommand(1);

    auto ppl = std::make_shared<PplOptions>();
    auto* p = gpt2->add_subcommand("ppl", "Streaming perplexity (StreamingLLM protocol: one token per forward, "
                                          "score the next; ppl = exp(mean NLL))");
    add_model_options(p, ppl->m);
    p->add_option("--file", ppl->file, "UTF-8 text file to score")->required();
    p->add_option("--compare", ppl->compare,
                  "Comma-separated KV modes run over the same text, e.g. full,window:32,sink:4,28,recompute:32");
    p->add_option("--max-tokens", ppl->max_tokens, "Score only the first N tokens (0: all)");
    p->add_option("--json", ppl->json_out, "Also write the results as JSON to this file");
    p->add_flag("--overwrite", ppl->overwrite, "Replace an existing --json file");
    runners.emplace_back(p, [ppl]() { return run_ppl(*ppl); });

    auto gen = std::make_shared<GenOptions>();
    auto* g = gpt2->add_subcommand("generate", "Generate text, printing tokens as they are produced");
    add_model_options(g, gen->m);
    g->add_option("-p,--prompt", gen->prompt, "Prompt text")->required();
    g->add_option("--max-new", gen->max_new, "New tokens (may exceed n_positions with sink/window modes)")
        ->capture_default_str();
    auto& sp = gen->sampling;
    g->add_option("--temperature", sp.temperature, "0 = greedy")->capture_default_str();
    g->add_option("--top-k", sp.top_k, "Sample from the k most likely tokens (0: all)")->capture_default_str();
    g->add_option("--top-p", sp.top_p, "Nucleus sampling threshold")->capture_default_str();
    g->add_option("--min-p", sp.min_p, "Keep tokens with probability >= min-p x the most likely one's (0: off)")
        ->capture_default_str();
    g->add_option("--repeat-penalty", sp.repeat_penalty,
                  "CTRL repetition penalty on the last --repeat-last-n tokens, prompt included (1: off)")
        ->capture_default_str();
    g->add_option("--repeat-last-n", sp.repeat_last_n, "Tokens the repetition penalty looks back over")
        ->capture_default_str();
    g->add_option("--seed", sp.seed, "Sampling seed")->capture_default_str();
    g->add_flag("--stop-at-eos", gen->stop_at_eos, "Stop after <|endoftext|> (id 50256)");
    g->add_flag("--allow-special", gen->allow_special, "Encode a literal <|endoftext|> in the prompt as id 50256");
    g->add_option("--report-every", gen->report_every,
                  "Soak: print latency and RSS every N generated tokens, and the growth/drift at the end");
    g->add_option("--report-json", gen->report_json, "Soak: write the --report-every figures to this JSON file");
    g->add_flag("--overwrite", gen->overwrite, "Replace an existing --report-json file");
    runners.emplace_back(g, [gen]() { return run_generate(*gen); });

    auto bo = std::make_shared<BenchOptions>();
    auto* b =
        gpt2->add_subcommand("bench", "Decode speed: prompt tokens/s, per-token latency by context, sink streaming "
                                      "latency/RSS, speed-up over recompute, GB/s vs memcpy");
    b->add_option("-m,--model", bo->m.model, "GPT-2 model (default: random GPT-2-small shapes in memory)");
    b->add_option("--n-head", bo->m.n_head, "Head count when the model has no config.json");
    b->add_option("--repeats", bo->repeats, "Timed repeats per measurement")->capture_default_str();
    b->add_option("--stream-tokens", bo->stream_tokens, "Stream lengths for the sink:4,1020 run")
        ->capture_default_str();
    b->add_flag("--long", bo->long_stream, "Also stream 100k tokens");
    b->add_option("--recompute-repeats", bo->recompute_repeats, "Timed recompute steps")->capture_default_str();
    b->add_flag_callback(
        "--reference-kernel", [] { text::set_fast_decode_kernel(false); },
        "Decode with torch::addmv/mv instead of the gemv kernel");
    runners.emplace_back(b, [bo]() { return run_bench(*bo); });

    auto ta = std::make_shared<TrainArgs>();
    auto& to = ta->o;
    auto* t = gpt2->add_subcommand("train", "Train a small GPT-2 on the King James Version (bible-kjv-text) with the "
                                            "GPT-2 tokenizer; AdamW, warm-up + cosine, optional EMA, resumable");
    t->add_option("-o,--out", to.out_dir,
                  "Run folder (checkpoint, log, metrics, held-out text; resumed when it "
                  "holds a checkpoint)")
        ->required();
    t->add_option("--export", to.export_dir,
                  "Folder for the final model (config.json + model.safetensors, loss.png, "
                  "train_log.txt, metrics.csv)");
    t->add_option("--export-dtype", ta->export_dtype, "f16|bf16|f32")->capture_default_str();
    t->add_flag("--overwrite", to.overwrite_export, "Replace an existing exported model");
    t->add_option("--kjv", to.kjv_path,
                  "KJV file: bible.data, a .Z file or tagged text (default: the installed "
                  "bible-kjv-text)");
    t->add_option("--vocab", to.vocab_dir,
                  "GPT-2 tokenizer folder (default " + text::Gpt2Tokenizer::default_dir() + ")");
    t->add_option("--holdout", ta->holdout, "Validation text: " + text::HoldoutSpec::syntax_help())
        ->capture_default_str();
    t->add_option("--layers", ta->layers, "Blocks (n_layer)")->capture_default_str();
    t->add_option("--dim", ta->dim, "Hidden size (n_embd)")->capture_default_str();
    t->add_option("--heads", ta->heads, "Attention heads (n_head)")->capture_default_str();
    t->add_option("--positions", ta->positions, "Context (n_positions)")->capture_default_str();
    t->add_option("--seq-len", to.seq_len, "Training sequence length (0: n_positions)")->capture_default_str();
    t->add_flag("--full-vocab", to.full_vocab,
                "Train all 50257 output rows (default: the KJV's tokens, expanded "
                "exactly on export)");
    t->add_option("--batch", to.batch, "Sequences per step")->capture_default_str();
    t->add_option("--steps", to.steps, "Total optimizer steps (the schedule's length)")->capture_default_str();
    t->add_option("--stop-after", to.stop_after, "Stop after this many steps in this invocation");
    t->add_option("--max-minutes", to.max_minutes, "Stop (checkpoint, evaluate, export) after this much wall time");
    t->add_option("--lr", to.lr, "Peak learning rate")->capture_default_str();
    t->add_option("--min-lr-ratio", to.min_lr_ratio, "Cosine floor as a fraction of --lr")->capture_default_str();
    t->add_option("--warmup", to.warmup, "Linear warm-up steps")->capture_default_str();
    t->add_option("--weight-decay", to.weight_decay, "AdamW decoupled weight decay (matrices)")->capture_default_str();
    t->add_option("--beta2", to.beta2, "AdamW beta2")->capture_default_str();
    t->add_option("--grad-clip", to.grad_clip, "Gradient norm clip (0: off)")->capture_default_str();
    t->add_option("--ema", to.ema, "EMA decay of the weights (0: off; evaluated and exported when on)")
        ->capture_default_str();
    t->add_option("--eval-every", to.eval_every, "Validation interval in steps (0: only at the end)")
        ->capture_default_str();
    t->add_option("--log-every", to.log_every, "Progress line interval")->capture_default_str();
    t->add_option("--checkpoint-every", to.checkpoint_every, "Checkpoint interval")->capture_default_str();
    t->add_option("--seed", to.seed, "Seed (initialisation and batches)")->capture_default_str();
    t->add_flag("--no-resume", ta->no_resume, "Start fresh even when the run folder holds a checkpoint");
    runners.emplace_back(t, [ta]() { return run_train(*ta); });
}

} // namespace anchor::cli
