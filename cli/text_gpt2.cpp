// `anchor-text gpt2 ppl|generate|bench`: GPT-2 streaming with attention-sink rolling KV buffers (StreamingLLM,
// Xiao et al. 2023) next to full, window and recompute baselines.
#include "cli/text_commands.h"

#include "cache/io/error.h"
#include "cache/sink_rolling_kv.h"
#include "text/gpt2_model.h"
#include "text/gpt2_tokenizer.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>

namespace anchor::cli {

int64_t peak_rss_bytes(); // VmHWM of this process

namespace {

using Clock = std::chrono::steady_clock;

std::string policy_help() {
    std::string s;
    for (const auto& [p, name] : cache::position_policy_names()) s += (s.empty() ? "" : "|") + name;
    return s;
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
    if (!m.folder.empty() && text::Gpt2Tokenizer::dir_has_vocab(m.folder)) return text::Gpt2Tokenizer::from_dir(m.folder);
    return text::Gpt2Tokenizer::load_default();
}

struct ModelOptions {
    std::string model;
    std::string vocab;
    int64_t n_head = 0;
    std::string kv = "full";
    std::string positions = "wrap";
};

void add_model_options(CLI::App* sub, ModelOptions& o, bool kv = true) {
    sub->add_option("-m,--model", o.model, "GPT-2 model: folder (config.json + any *.safetensors), file or index")
        ->required();
    sub->add_option("--vocab", o.vocab,
                    "Tokenizer folder (encoder.json+vocab.bpe or vocab.json+merges.txt); default: the model folder "
                    "if it has one, else " +
                        text::Gpt2Tokenizer::default_dir());
    sub->add_option("--n-head", o.n_head, "Head count when the model has no config.json (default n_embd/64)");
    if (kv) {
        sub->add_option("--kv", o.kv, "KV cache: " + text::KvSpec::syntax_help())->capture_default_str();
        sub->add_option("--positions", o.positions,
                        "Position ids past the cache (" + policy_help() +
                            "): wrap = i % n_positions, cache = min(i, S+W-1), absolute = i (error past n_positions)")->capture_default_str();
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
};

int run_ppl(const PplOptions& o) {
    // Parse everything the user typed before loading anything.
    const auto policy = cache::position_policy_from_string(o.m.positions);
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
    const std::string text = read_text_file(o.file);
    auto loaded = text::load_gpt2(o.m.model, o.m.n_head);
    auto tok = load_tokenizer(o.m.vocab, loaded);
    auto ids = tok.encode(text);
    if (o.max_tokens > 0 && static_cast<int64_t>(ids.size()) > o.max_tokens) ids.resize(o.max_tokens);
    if (ids.size() < 2) throw Error("text file '" + o.file + "' encodes to fewer than 2 tokens; nothing to score");
    const int64_t P = loaded.config.n_positions;
    std::cout << "model: " << loaded.config.describe() << "\n";
    std::cout << "text: " << o.file << ", " << ids.size() << " tokens, scoring " << ids.size() - 1
              << " next-token predictions (one token per forward), positions " << cache::to_string(policy) << "\n";
    std::cout << std::left << std::setw(18) << "kv" << std::right << std::setw(10) << "tokens" << std::setw(14)
              << "ppl" << std::setw(12) << "mean_nll" << std::setw(11) << "tok/s" << std::setw(13) << "KV bytes"
              << std::setw(14) << "peak RSS" << "\n";
    for (const auto& spec : specs) {
        std::cout << std::left << std::setw(18) << spec.str() << std::right << std::flush;
        const int64_t N = static_cast<int64_t>(ids.size());
        if (spec.mode == text::KvMode::Full && N > P) {
            std::cout << "  cannot go past n_positions=" << P << " (the text has " << N
                      << " tokens); use sink:S,W, window:W or recompute:W, or --max-tokens " << P << "\n";
            continue;
        }
        if (policy == cache::PositionPolicy::Absolute && N > P) {
            std::cout << "  --positions absolute cannot go past n_positions=" << P << " (" << N << " tokens)\n";
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
        } catch (const UsageError&) {
            throw;
        } catch (const Error& e) {
            std::cout << "  failed: " << e.what() << "\n";
        }
    }
    std::cout << "(peak RSS is the process high-water mark so far, VmHWM)\n";
    return 0;
}

// ---- generate ----------------------------------------------------------------------------------------------------

struct GenOptions {
    ModelOptions m;
    std::string prompt;
    int64_t max_new = 64;
    double temperature = 0.0;
    int64_t top_k = 0;
    double top_p = 1.0;
    uint64_t seed = 0;
    bool stop_at_eos = false;
    bool allow_special = false;
};

// Greedy when temperature == 0; else softmax(logits / T) restricted to the top-k and to the smallest set whose
// probability reaches top-p (Holtzman et al. 2019, nucleus sampling), drawn with a seeded mt19937_64.
int64_t sample(const torch::Tensor& logits, const GenOptions& o, std::mt19937_64& rng) {
    if (o.temperature <= 0.0) return logits.argmax().item<int64_t>();
    auto sorted = (logits.to(torch::kFloat64) / o.temperature).sort(0, true);
    auto vals = std::get<0>(sorted), idx = std::get<1>(sorted);
    int64_t keep = vals.size(0);
    if (o.top_k > 0) keep = std::min(keep, o.top_k);
    auto probs = torch::softmax(vals.narrow(0, 0, keep), 0);
    auto p = probs.accessor<double, 1>();
    if (o.top_p < 1.0) {
        double cum = 0.0;
        int64_t n = 0;
        while (n < keep) {
            cum += p[n++];
            if (cum >= o.top_p) break;
        }
        keep = std::max<int64_t>(1, n);
    }
    double total = 0.0;
    for (int64_t i = 0; i < keep; ++i) total += p[i];
    std::uniform_real_distribution<double> u(0.0, total);
    double r = u(rng), acc = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
        acc += p[i];
        if (r < acc) return idx[i].item<int64_t>();
    }
    return idx[keep - 1].item<int64_t>();
}

int run_generate(const GenOptions& o) {
    const auto policy = cache::position_policy_from_string(o.m.positions);
    const auto spec = text::KvSpec::parse(o.m.kv);
    if (o.prompt.empty()) throw UsageError("the prompt is empty (-p TEXT)");
    if (o.max_new < 0) throw UsageError("--max-new must be >= 0");
    if (o.temperature < 0.0) throw UsageError("--temperature must be >= 0");
    if (o.top_k < 0) throw UsageError("--top-k must be >= 0");
    if (!(o.top_p > 0.0 && o.top_p <= 1.0)) throw UsageError("--top-p must be in (0, 1]");
    auto loaded = text::load_gpt2(o.m.model, o.m.n_head);
    auto tok = load_tokenizer(o.m.vocab, loaded);
    auto prompt = tok.encode(o.prompt, o.allow_special);
    const int64_t P = loaded.config.n_positions, total = static_cast<int64_t>(prompt.size()) + o.max_new;
    if ((spec.mode == text::KvMode::Full || policy == cache::PositionPolicy::Absolute) && total > P)
        throw UsageError("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-new " +
                         std::to_string(o.max_new) + " exceeds n_positions " + std::to_string(P) + " with --kv " +
                         spec.str() + " --positions " + cache::to_string(policy) +
                         "; use --kv sink:S,W with --positions wrap or cache to go further");
    text::Gpt2Stream stream(loaded.model, spec, policy);
    std::mt19937_64 rng(o.seed);
    text::Utf8StreamDecoder dec;
    std::cout << o.prompt << std::flush;
    const auto t0 = Clock::now();
    auto logits = stream.feed(prompt);
    const double prefill = std::chrono::duration<double>(Clock::now() - t0).count();
    const auto t1 = Clock::now();
    int64_t produced = 0;
    for (int64_t k = 0; k < o.max_new; ++k) {
        const int64_t id = sample(logits, o, rng);
        ++produced;
        std::cout << dec.push(tok.token_bytes(id)) << std::flush;
        if (o.stop_at_eos && id == text::Gpt2Tokenizer::kEndOfText) break;
        if (k + 1 < o.max_new) logits = stream.feed(id);
    }
    std::cout << dec.flush() << std::endl;
    const double gen = std::chrono::duration<double>(Clock::now() - t1).count();
    std::cerr << "prompt: " << prompt.size() << " tokens in " << std::fixed << std::setprecision(3) << prefill
              << " s; generated " << produced << " tokens, " << std::setprecision(1)
              << (gen > 0 ? produced / gen : 0.0) << " tok/s; kv " << spec.str() << " ("
              << human_bytes(static_cast<double>(stream.kv_bytes())) << "), positions " << cache::to_string(policy)
              << "; peak RSS " << human_bytes(static_cast<double>(peak_rss_bytes())) << "\n";
    return 0;
}

} // namespace

int64_t peak_rss_bytes() {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line))
        if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024; // "VmHWM:   1234 kB"
    return 0;
}

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
    runners.emplace_back(p, [ppl]() { return run_ppl(*ppl); });

    auto gen = std::make_shared<GenOptions>();
    auto* g = gpt2->add_subcommand("generate", "Generate text, printing tokens as they are produced");
    add_model_options(g, gen->m);
    g->add_option("-p,--prompt", gen->prompt, "Prompt text")->required();
    g->add_option("--max-new", gen->max_new, "New tokens (may exceed n_positions with sink/window modes)")->capture_default_str();
    g->add_option("--temperature", gen->temperature, "0 = greedy")->capture_default_str();
    g->add_option("--top-k", gen->top_k, "Sample from the k most likely tokens (0: all)")->capture_default_str();
    g->add_option("--top-p", gen->top_p, "Nucleus sampling threshold")->capture_default_str();
    g->add_option("--seed", gen->seed, "Sampling seed")->capture_default_str();
    g->add_flag("--stop-at-eos", gen->stop_at_eos, "Stop after <|endoftext|> (id 50256)");
    g->add_flag("--allow-special", gen->allow_special, "Encode a literal <|endoftext|> in the prompt as id 50256");
    runners.emplace_back(g, [gen]() { return run_generate(*gen); });

}

} // namespace anchor::cli
