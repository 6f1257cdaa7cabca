// `anchor-text diffusion generate|calibrate|train|bench`: masked text diffusion with time-anchor gates and the
// cross-step latent cache (text/mdlm_*.h).
//
// Text I/O goes through the GPT-2 tokenizer (text/gpt2_tokenizer.h, vocabulary from --vocab or assets/vocab/gpt2);
// --prompt-ids / --ids work with raw ids.
#include "cache/io/atomic_file.h"
#include "cache/io/enum_table.h"
#include "cache/io/error.h"
#include "cli/bench_util.h"
#include "cli/common.h"
#include "cli/loss_plot.h"
#include "cli/text_commands.h"
#include "text/gpt2_model.h"
#include "text/gpt2_tokenizer.h"
#include "text/mdlm_calibrate.h"
#include "text/token_file.h"
#include "text/train/mdlm_train.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

namespace anchor::cli {

using namespace anchor::text;

namespace {

// ---- text I/O (tokenizer plug-in point) -----------------------------------------------------------------------------

std::string g_vocab_dir;  // --vocab (empty: default folder)
bool g_print_ids = false; // --ids

const Gpt2Tokenizer& tokenizer() {
    static std::unique_ptr<Gpt2Tokenizer> tok;
    if (!tok) tok = std::make_unique<Gpt2Tokenizer>(Gpt2Tokenizer::load_default(g_vocab_dir));
    return *tok;
}

std::vector<int64_t> encode_text(const std::string& text) {
    return tokenizer().encode(text);
}

// Text of `ids` with every [MASK] shown as "[MASK]" (runs between masks are decoded together so multi-token
// characters stay whole); with --ids, the ids themselves.
std::string decode_ids(const std::vector<int64_t>& ids) {
    std::ostringstream os;
    if (g_print_ids) {
        for (size_t i = 0; i < ids.size(); ++i) {
            if (i) os << ' ';
            if (ids[i] == kMdlmMaskId)
                os << "[MASK]";
            else
                os << ids[i];
        }
        return os.str();
    }
    std::vector<int64_t> run;
    for (auto id : ids) {
        if (id == kMdlmMaskId) {
            if (!run.empty()) os << tokenizer().decode(run), run.clear();
            os << "[MASK]";
        } else {
            run.push_back(id);
        }
    }
    if (!run.empty()) os << tokenizer().decode(run);
    return os.str();
}

std::vector<int64_t> parse_ids(const std::string& s, const std::string& what) {
    std::vector<int64_t> out;
    std::string tok;
    std::stringstream ss(s);
    while (ss >> tok) {
        std::stringstream parts(tok);
        std::string p;
        while (std::getline(parts, p, ',')) {
            if (p.empty()) continue;
            size_t used = 0;
            long long v = -1;
            try {
                v = std::stoll(p, &used);
            } catch (...) {
                used = 0;
            }
            if (used != p.size() || v < 0 || v >= kGpt2VocabSize)
                throw UsageError(what + ": '" + p + "' is not a GPT-2 token id (0.." +
                                 std::to_string(kGpt2VocabSize - 1) + ")");
            out.push_back(v);
        }
    }
    return out;
}

// Prompt windows must use tokens the model knows (held-out text may hold tokens a compact vocabulary lacks).
std::function<bool(const std::vector<int64_t>&)> known_by(const MdlmModel& model) {
    return [model](const std::vector<int64_t>& w) { return model->in_vocabulary(w); };
}

std::string table_choices() {
    return enum_choices(unmask_rule_table(), "|");
}

std::string cache_help() {
    std::string s = "off | anchor[:key=value,...] with keys";
    for (const auto& [k, h] : cache_spec_keys()) s += "\n    " + k + ": " + h;
    return s;
}

// ---- shared option groups -------------------------------------------------------------------------------------------

struct SampleArgs {
    std::string model;
    std::string prompt, prompt_ids;
    int64_t length = 128, steps = 64, top_k = 0, block_length = 0, n_heads = 0;
    double temperature = 1.0, top_p = 1.0, min_p = 0.0;
    uint64_t seed = 0;
    std::string unmask = "ancestral";

    void add(CLI::App* app, bool model_required) {
        auto* m = app->add_option("-m,--model", model, "MDLM model folder or .safetensors (config.json next to it)");
        if (model_required) m->required();
        app->add_option("-p,--prompt", prompt, "Prompt text (GPT-2 BPE)");
        app->add_option("--vocab", g_vocab_dir,
                        "GPT-2 vocabulary folder (encoder.json + vocab.bpe; default " + Gpt2Tokenizer::default_dir() +
                            ")");
        app->add_flag("--ids", g_print_ids, "Print token ids instead of text");
        app->add_option("--prompt-ids", prompt_ids, "Prompt as GPT-2 ids, comma or space separated");
        app->add_option("--length", length, "Total sequence length, prompt included")->capture_default_str();
        app->add_option("--steps", steps, "Denoising steps (all blocks together)")->capture_default_str();
        app->add_option("--unmask", unmask, "Unmasking rule: " + table_choices())->capture_default_str();
        app->add_option("--temperature", temperature, "Sampling temperature (0 = argmax)")->capture_default_str();
        app->add_option("--top-k", top_k, "Sample from the k most likely tokens (0 = all)")->capture_default_str();
        app->add_option("--top-p", top_p, "Nucleus cut after the temperature (1 = off)")->capture_default_str();
        app->add_option("--min-p", min_p, "Keep tokens with probability >= min-p x the most likely one's (0 = off)")
            ->capture_default_str();
        app->add_option("--seed", seed, "Random seed (torch CPU generator)")->capture_default_str();
        app->add_option("--block-length", block_length, "Semi-autoregressive block length (0 = one block)")
            ->capture_default_str();
        app->add_option("--heads", n_heads, "Attention heads when the model has no config.json (default D/64)");
    }
    std::vector<int64_t> prompt_tokens() const {
        if (!prompt.empty() && !prompt_ids.empty()) throw UsageError("give either --prompt or --prompt-ids, not both");
        if (!prompt.empty()) return encode_text(prompt);
        return parse_ids(prompt_ids, "--prompt-ids");
    }
    SamplerOptions options() const {
        SamplerOptions o;
        o.length = length;
        o.steps = steps;
        o.prompt = prompt_tokens();
        o.rule = unmask_rule_from_string(unmask);
        o.temperature = temperature;
        o.top_k = top_k;
        o.top_p = top_p;
        o.min_p = min_p;
        o.seed = seed;
        o.block_length = block_length;
        o.validate();
        return o;
    }
};

MdlmModel random_model(int64_t layers, int64_t dim, uint64_t seed) {
    MdlmConfig c;
    c.n_blocks = layers;
    c.hidden_size = dim;
    c.n_heads = std::max<int64_t>(1, dim / 64);
    c.cond_dim = 128;
    MdlmModel m(c);
    randomize_mdlm_weights(m, seed);
    m->eval();
    return m;
}

double agreement(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int64_t from) {
    int64_t same = 0, n = 0;
    for (size_t i = static_cast<size_t>(from); i < a.size() && i < b.size(); ++i, ++n) same += a[i] == b[i];
    return n ? double(same) / double(n) : 1.0;
}

// ---- generate -------------------------------------------------------------------------------------------------------

struct GenerateArgs {
    SampleArgs s;
    std::string cache = "off";
    std::string compare, score_with;
    bool show_steps = false;
};

int run_generate(const GenerateArgs& a) {
    auto so = a.s.options();
    auto model = load_mdlm(a.s.model, a.s.n_heads);
    std::optional<LoadedGpt2> scorer;
    if (!a.score_with.empty()) scorer = load_gpt2(a.score_with);
    const int64_t P = static_cast<int64_t>(so.prompt.size());
    // Generative perplexity of the sampled tokens under the scoring GPT-2, conditioned on the prompt.
    auto gen_ppl = [&](const SampleResult& r) {
        return scorer ? text::generative_ppl(scorer->model, r.tokens, std::max<int64_t>(P, 1)) : -1.0;
    };
    auto show = [&](const StepInfo& st) {
        int64_t masked = 0;
        for (auto t : *st.tokens) masked += t == kMdlmMaskId;
        std::cout << "step " << st.step << " (block " << st.block << ", t=" << std::fixed << std::setprecision(3)
                  << st.t << "): +" << st.unmasked << " unmasked, " << masked << " masked\n  "
                  << decode_ids(std::vector<int64_t>(st.tokens->begin() + P, st.tokens->end())) << "\n";
    };
    if (a.compare.empty()) {
        MdlmDenoiser den(model, parse_cache_spec(a.cache));
        auto r = sample(den, so, a.show_steps ? StepCallback(show) : StepCallback());
        std::cout << decode_ids(std::vector<int64_t>(r.tokens.begin() + P, r.tokens.end())) << "\n";
        std::cerr << "cache " << den.spec().to_string() << ": " << std::fixed << std::setprecision(3) << r.seconds
                  << " s, reused " << std::setprecision(1) << 100.0 * r.cache.reused_fraction()
                  << "% of position-layer computations";
        if (scorer) std::cerr << ", generative perplexity " << std::setprecision(2) << gen_ppl(r);
        std::cerr << "\n";
        return 0;
    }
    // --compare A,B: both runs side by side with the same seed; tokens that differ are marked.
    auto comma = a.compare.find(',');
    if (comma == std::string::npos)
        throw UsageError("--compare needs two cache modes separated by a comma, e.g. off,anchor");
    std::string ma = a.compare.substr(0, comma), mb = a.compare.substr(comma + 1);
    MdlmDenoiser da(model, parse_cache_spec(ma)), db(model, parse_cache_spec(mb));
    auto ra = sample(da, so, a.show_steps ? StepCallback(show) : StepCallback());
    auto rb = sample(db, so, a.show_steps ? StepCallback(show) : StepCallback());
    // Runs of equal / differing tokens are decoded together; differing runs are wrapped in [[ ]].
    auto mark = [&](const SampleResult& r, const SampleResult& o) {
        std::ostringstream os;
        int64_t i = P;
        const int64_t n = static_cast<int64_t>(r.tokens.size());
        while (i < n) {
            bool diff = r.tokens[i] != o.tokens[i];
            int64_t j = i;
            while (j < n && (r.tokens[j] != o.tokens[j]) == diff) ++j;
            auto text = decode_ids(std::vector<int64_t>(r.tokens.begin() + i, r.tokens.begin() + j));
            os << (diff ? "[[" : "") << text << (diff ? "]]" : "") << (g_print_ids && j < n ? " " : "");
            i = j;
        }
        return os.str();
    };
    std::cout << "[" << da.spec().to_string() << "]\n" << mark(ra, rb) << "\n\n";
    std::cout << "[" << db.spec().to_string() << "]\n" << mark(rb, ra) << "\n\n";
    std::cout << std::fixed << std::setprecision(3) << "token agreement: " << 100.0 * agreement(ra.tokens, rb.tokens, P)
              << "% (differing tokens marked [[ ]])\n"
              << "wall time: " << ra.seconds << " s vs " << rb.seconds << " s, speed-up " << ra.seconds / rb.seconds
              << "x\n"
              << "reused position-layer computations: " << 100.0 * ra.cache.reused_fraction() << "% vs "
              << 100.0 * rb.cache.reused_fraction() << "%\n";
    if (scorer)
        std::cout << std::setprecision(2) << "generative perplexity under " << a.score_with << ": " << gen_ppl(ra)
                  << " vs " << gen_ppl(rb) << "\n";
    return 0;
}

// ---- calibrate ------------------------------------------------------------------------------------------------------

struct CalibrateArgs {
    SampleArgs s;
    std::vector<std::string> prompt_id_lists;
    std::string prompts_from;
    int64_t n_prompts = 8, prompt_len = 32, classes = 16, max_stale = 8;
    std::string out;
    bool overwrite = false;
};

int run_calibrate(const CalibrateArgs& a) {
    auto model = load_mdlm(a.s.model, a.s.n_heads);
    check_output_path(a.out, a.overwrite);
    CalibrateOptions co;
    for (const auto& p : a.prompt_id_lists) co.prompts.push_back(parse_ids(p, "--prompt-ids"));
    if (!a.prompts_from.empty())
        for (auto& p : token_file_windows(a.prompts_from, a.n_prompts, a.prompt_len, known_by(model)))
            co.prompts.push_back(p);
    if (!a.s.prompt.empty()) co.prompts.push_back(encode_text(a.s.prompt));
    if (co.prompts.empty())
        throw UsageError("calibrate needs prompts: --prompt-ids (repeatable) or --prompts-from TOKENS");
    SampleArgs sa = a.s;
    sa.prompt.clear();
    sa.prompt_ids.clear();
    co.sampler = sa.options();
    for (const auto& p : co.prompts) {
        auto so = co.sampler;
        so.prompt = p;
        so.validate();
    }
    co.classes = a.classes;
    co.max_stale = a.max_stale;
    if (co.classes < 1 || co.max_stale < 1) throw UsageError("--classes and --max-stale must be >= 1");
    auto prof = calibrate_mdlm(model, co);
    prof.meta["model"] = a.s.model;
    prof.save(a.out, a.overwrite);
    std::cout << "anchor profile: " << prof.centroids.size() << " classes over " << prof.n_layers << " layers x "
              << prof.time_bins << " steps -> " << a.out << "\n";
    for (size_t c = 0; c < prof.centroids.size(); ++c)
        std::cout << "  class " << c << ": mean delta " << prof.centroids[c] << ", staleness " << prof.class_stale[c]
                  << "\n";
    return 0;
}

// ---- train ----------------------------------------------------------------------------------------------------------

struct TrainArgs {
    TrainOptions o;
    int64_t layers = 4, dim = 128, heads = 4, cond = 64;
    std::string gate = "time_anchor", export_dtype = "f16", holdout = "books:Ruth,Eccl,Jonah,Titus";
    std::string loss_weight = "nelbo";
    bool full_vocab = false, no_resume = false;
};

int run_train(TrainArgs a) {
    a.o.config.n_blocks = a.layers;
    a.o.config.hidden_size = a.dim;
    a.o.config.n_heads = a.heads;
    a.o.config.cond_dim = a.cond;
    a.o.config.gate = gate_kind_from_string(a.gate);
    a.o.config.max_seq_len = a.o.seq_len;
    try {
        a.o.config.validate();
    } catch (const Error& e) {
        throw UsageError(e.what());
    }
    a.o.compact_vocab = !a.full_vocab;
    a.o.resume = !a.no_resume;
    a.o.holdout = text::HoldoutSpec::parse(a.holdout);
    a.o.loss_weight = enum_from_string(mdlm_loss_weight_table(), a.loss_weight, "--loss-weight");
    if (a.export_dtype == "f16")
        a.o.export_dtype = torch::kFloat16;
    else if (a.export_dtype == "f32")
        a.o.export_dtype = torch::kFloat32;
    else
        throw UsageError("--export-dtype must be f16 or f32");
    a.o.log = [](const std::string& s) { std::cout << s << std::endl; };
    auto r = train_mdlm(a.o);
    std::cout << "trained steps " << r.start_step << ".." << r.end_step << "\n";
    return 0;
}

// ---- bench ----------------------------------------------------------------------------------------------------------

struct BenchArgs {
    std::string model, steps_list = "64,128,256", unmask = "confidence", prompts_from, score_with, json_out, plot_out;
    std::vector<std::string> caches = {"anchor"};
    int64_t length = 256, prompt_len = 64, repeats = 3, layers = 12, dim = 768, n_heads = 0;
    double temperature = 0.0;
    uint64_t seed = 0;
    bool overwrite = false;
};

// One row of the bench: a cache mode at a step count, against `off` run on the same prompts and seeds.
struct BenchRow {
    std::string cache;
    int64_t steps = 0;
    bench::Stats off_s, cached_s;
    double reused = 0, agreement = 0, gen_ppl_off = -1, gen_ppl_cached = -1;
    cache::CacheStats store; // the cached runs' latent store, summed over the repeats
    double speedup() const { return off_s.median / cached_s.median; } // median wall time, off over cached
};

int run_bench(const BenchArgs& a) {
    auto model = a.model.empty() ? random_model(a.layers, a.dim, a.seed) : load_mdlm(a.model, a.n_heads);
    if (!a.json_out.empty()) check_output_path(a.json_out, a.overwrite);
    if (!a.plot_out.empty()) check_output_path(a.plot_out, a.overwrite);
    const auto steps = parse_int_list(a.steps_list, "--steps-list");
    if (a.repeats < 1) throw UsageError("--repeats must be >= 1");
    std::vector<CacheSpec> specs;
    for (const auto& c : a.caches) specs.push_back(parse_cache_spec(c));
    std::optional<LoadedGpt2> scorer;
    if (!a.score_with.empty()) scorer = load_gpt2(a.score_with);
    const auto& cfg = model->config();
    // Prompts: windows of a token file (e.g. held-out text), else random tokens of the model's vocabulary.
    std::vector<std::vector<int64_t>> prompts;
    if (!a.prompts_from.empty()) {
        prompts = token_file_windows(a.prompts_from, a.repeats, a.prompt_len, known_by(model));
    } else {
        for (int64_t r = 0; r < a.repeats; ++r) {
            auto gen = at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(r));
            auto pr = torch::randint(0, 50257, {a.prompt_len}, gen, torch::kInt64);
            if (cfg.compact_vocab)
                pr = model->vocab_ids.index_select(
                    0, torch::randint(0, cfg.vocab_size - 1, {a.prompt_len}, gen, torch::kInt64));
            prompts.emplace_back(pr.data_ptr<int64_t>(), pr.data_ptr<int64_t>() + a.prompt_len);
        }
    }
    std::cout << "model: " << (a.model.empty() ? "random" : a.model) << " (" << cfg.n_blocks << " x " << cfg.hidden_size
              << "), L=" << a.length << ", prompt " << a.prompt_len << " ("
              << (a.prompts_from.empty() ? "random tokens" : a.prompts_from) << "), unmask " << a.unmask
              << ", temperature " << a.temperature << ", threads " << at::get_num_threads() << ", load "
              << bench::load_average() << "\n";
    std::cout << "cache | steps | off s (min/med/max) | cached s (min/med/max) | speed-up (median) | reused | "
                 "agreement"
              << (scorer ? " | gen-PPL off | gen-PPL cached" : "") << "\n";
    auto gen_ppl = [&](const std::vector<int64_t>& toks) {
        return text::generative_ppl(scorer->model, toks, a.prompt_len);
    };
    std::vector<BenchRow> rows;
    for (auto T : steps) {
        // Off runs once per repeat; every cache mode is measured against the same runs, interleaved per repeat.
        std::vector<double> toff;
        std::vector<std::vector<double>> tc(specs.size());
        std::vector<double> reused(specs.size()), agree(specs.size()), ppl_c(specs.size());
        std::vector<cache::CacheStats> store(specs.size());
        double ppl_off = 0;
        for (int64_t r = 0; r < a.repeats; ++r) {
            SamplerOptions so;
            so.length = a.length;
            so.steps = T;
            so.rule = unmask_rule_from_string(a.unmask);
            so.seed = a.seed + static_cast<uint64_t>(r);
            so.temperature = a.temperature;
            so.prompt = prompts[static_cast<size_t>(r)];
            so.validate();
            MdlmDenoiser off(model, CacheSpec{});
            auto ro = sample(off, so);
            toff.push_back(ro.seconds);
            if (scorer) ppl_off += gen_ppl(ro.tokens) / double(a.repeats);
            for (size_t k = 0; k < specs.size(); ++k) {
                MdlmDenoiser anc(model, specs[k]);
                auto ra = sample(anc, so);
                tc[k].push_back(ra.seconds);
                reused[k] += ra.cache.reused_fraction() / double(a.repeats);
                store[k] += ra.store;
                agree[k] += agreement(ro.tokens, ra.tokens, a.prompt_len) / double(a.repeats);
                if (scorer) ppl_c[k] += gen_ppl(ra.tokens) / double(a.repeats);
            }
        }
        for (size_t k = 0; k < specs.size(); ++k) {
            BenchRow row;
            row.cache = specs[k].to_string();
            row.steps = T;
            row.off_s = bench::stats_of(toff);
            row.cached_s = bench::stats_of(tc[k]);
            row.reused = reused[k];
            row.agreement = agree[k];
            row.store = store[k];
            if (scorer) row.gen_ppl_off = ppl_off, row.gen_ppl_cached = ppl_c[k];
            std::cout << std::fixed << std::setprecision(3) << row.cache << " | " << T << " | " << row.off_s.min
                      << " / " << row.off_s.median << " / " << row.off_s.max << " | " << row.cached_s.min << " / "
                      << row.cached_s.median << " / " << row.cached_s.max << " | " << std::setprecision(2)
                      << row.speedup() << "x | " << std::setprecision(1) << 100 * row.reused << "% | "
                      << 100 * row.agreement << "%";
            if (scorer) std::cout << std::setprecision(2) << " | " << row.gen_ppl_off << " | " << row.gen_ppl_cached;
            std::cout << std::endl;
            rows.push_back(row);
        }
    }
    std::cout << "load at end: " << bench::load_average() << "\n";
    if (!a.plot_out.empty()) { // the speed/quality curve: one series per step count, points by speed-up
        std::vector<LossSeries> series;
        for (auto T : steps) {
            std::vector<std::pair<double, double>> pts;
            for (const auto& r : rows)
                if (r.steps == T) pts.emplace_back(r.speedup(), 100.0 * r.agreement);
            std::sort(pts.begin(), pts.end());
            LossSeries s;
            s.label = "T = " + std::to_string(T);
            for (const auto& [x, y] : pts) s.steps.push_back(x), s.losses.push_back(y);
            series.push_back(s);
        }
        PlotAxes ax;
        ax.title = "text-diffusion cache: token agreement with off vs speed-up (L=" + std::to_string(a.length) + ")";
        ax.x_label = "speed-up over off (median wall time)";
        ax.y_label = "agreement %";
        ax.log_y = false;
        write_file_atomic(a.plot_out, line_plot_png(series, ax), a.overwrite);
        std::cout << "wrote " << a.plot_out << "\n";
    }
    if (!a.json_out.empty()) {
        nlohmann::json j;
        j["model"] = a.model.empty() ? "random" : a.model;
        j["config"] = cfg.to_json();
        j["length"] = a.length;
        j["prompt_len"] = a.prompt_len;
        j["prompts"] = a.prompts_from.empty() ? "random tokens" : a.prompts_from;
        j["unmask"] = a.unmask;
        j["temperature"] = a.temperature;
        j["repeats"] = a.repeats;
        j["threads"] = at::get_num_threads();
        if (scorer) j["score_with"] = a.score_with;
        for (const auto& r : rows) {
            nlohmann::json o = {{"cache", r.cache},
                                {"steps", r.steps},
                                {"off_s", {r.off_s.min, r.off_s.median, r.off_s.max}},
                                {"cached_s", {r.cached_s.min, r.cached_s.median, r.cached_s.max}},
                                {"speedup_median", r.speedup()},
                                {"reused_fraction", r.reused},
                                {"token_agreement", r.agreement},
                                {"store", cache::to_json(r.store)}};
            if (scorer) o["gen_ppl_off"] = r.gen_ppl_off, o["gen_ppl_cached"] = r.gen_ppl_cached;
            j["rows"].push_back(o);
        }
        write_file_atomic(a.json_out, j.dump(1) + "\n", a.overwrite);
        std::cout << "wrote " << a.json_out << "\n";
    }
    return 0;
}

} // namespace

void add_diffusion_commands(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners) {
    auto* diff = app.add_subcommand("diffusion", "Masked text diffusion (MDLM) with time-anchor gates and caches");
    diff->require_subcommand(1);

    static GenerateArgs g;
    auto* gen = diff->add_subcommand("generate", "Sample text; --compare runs two cache modes side by side");
    g.s.add(gen, true);
    gen->add_option("--cache", g.cache, cache_help())->capture_default_str();
    gen->add_option("--compare", g.compare, "Two cache modes, e.g. off,anchor:stale=2");
    gen->add_flag("--show-steps", g.show_steps, "Print the sequence after every step");
    gen->add_option("--score-with", g.score_with, "GPT-2 model: print each text's generative perplexity under it");
    runners.emplace_back(gen, [] { return run_generate(g); });

    static CalibrateArgs c;
    auto* cal =
        diff->add_subcommand("calibrate", "Uncached sampling on prompts -> anchor profile JSON (k-means classes)");
    c.s.add(cal, true);
    cal->add_option("--prompt-id-list", c.prompt_id_lists, "A prompt as ids (repeatable)");
    cal->add_option("--prompts-from", c.prompts_from, "Token file (uint16 LE) to take prompts from");
    cal->add_option("--n-prompts", c.n_prompts, "Prompts taken from --prompts-from")->capture_default_str();
    cal->add_option("--prompt-len", c.prompt_len, "Length of prompts taken from --prompts-from")->capture_default_str();
    cal->add_option("--classes", c.classes, "k-means stability classes")->capture_default_str();
    cal->add_option("--max-stale", c.max_stale, "Staleness of the most stable class")->capture_default_str();
    cal->add_option("-o,--output", c.out, "Profile JSON to write")->required();
    cal->add_flag("--overwrite", c.overwrite, "Replace an existing output file");
    runners.emplace_back(cal, [] { return run_calibrate(c); });

    static TrainArgs t;
    auto* tr = diff->add_subcommand("train", "Train an MDLM on a token file (MDLM objective, AdamW, resumable)");
    auto* tok_opt = tr->add_option("--tokens", t.o.tokens_path, "Token file: uint16 LE GPT-2 ids");
    auto* kjv_opt = tr->add_option("--kjv", t.o.kjv_path,
                                   "Train on the King James Version (bible.data, a .Z file or tagged text; without a "
                                   "value: the installed bible-kjv-text), GPT-2 tokenizer")
                        ->expected(0, 1);
    tok_opt->excludes(kjv_opt);
    tr->add_option("--holdout", t.holdout, "With --kjv: held-out text, " + text::HoldoutSpec::syntax_help())
        ->capture_default_str();
    tr->add_option("--vocab", t.o.vocab_dir, "With --kjv: GPT-2 tokenizer folder");
    tr->add_option("-o,--out", t.o.out_dir, "Run folder (checkpoints, log; resumed when it holds a state)")->required();
    tr->add_option("--layers", t.layers, "Blocks")->capture_default_str();
    tr->add_option("--dim", t.dim, "Hidden size")->capture_default_str();
    tr->add_option("--heads", t.heads, "Attention heads")->capture_default_str();
    tr->add_option("--cond-dim", t.cond, "Conditioning size")->capture_default_str();
    tr->add_option("--gate", t.gate, "Residual gate: time_anchor|adaln")->capture_default_str();
    tr->add_flag("--full-vocab", t.full_vocab, "Keep all 50258 rows instead of the corpus' tokens");
    tr->add_option("--seq-len", t.o.seq_len, "Context length")->capture_default_str();
    tr->add_option("--batch", t.o.batch, "Sequences per step")->capture_default_str();
    tr->add_option("--steps", t.o.steps, "Total optimizer steps")->capture_default_str();
    tr->add_option("--stop-after", t.o.stop_after, "Stop after this many steps in this invocation");
    tr->add_option("--lr", t.o.lr, "Peak learning rate")->capture_default_str();
    tr->add_option("--warmup", t.o.warmup, "Warm-up steps")->capture_default_str();
    tr->add_option("--weight-decay", t.o.weight_decay, "AdamW weight decay")->capture_default_str();
    tr->add_option("--loss-weight", t.loss_weight,
                   "Masked-token weight: nelbo (1/t, MDLM) or masked_mean (1/#masked per sequence, lower variance "
                   "for small batches): " +
                       enum_choices(mdlm_loss_weight_table(), "|"))
        ->capture_default_str();
    tr->add_option("--seed", t.o.seed, "Seed")->capture_default_str();
    tr->add_option("--checkpoint-every", t.o.checkpoint_every, "Checkpoint interval")->capture_default_str();
    tr->add_option("--log-every", t.o.log_every, "Log interval")->capture_default_str();
    tr->add_option("--export", t.o.export_dir, "Folder for the final weights (config.json + model.safetensors)");
    tr->add_option("--export-dtype", t.export_dtype, "f16|f32")->capture_default_str();
    tr->add_flag("--no-resume", t.no_resume, "Start fresh even when the run folder has a state");
    runners.emplace_back(tr, [tr] {
        t.o.use_kjv = tr->count("--kjv") > 0;
        if (!t.o.use_kjv && t.o.tokens_path.empty()) throw UsageError("train: give --tokens FILE or --kjv");
        return run_train(t);
    });

    static BenchArgs b;
    auto* be = diff->add_subcommand("bench", "Wall time off vs a cache mode, reused fraction, token agreement");
    be->add_option("-m,--model", b.model, "Model (default: random weights of --layers x --dim)");
    be->add_option("--layers", b.layers, "Random model blocks")->capture_default_str();
    be->add_option("--dim", b.dim, "Random model hidden size")->capture_default_str();
    be->add_option("--heads", b.n_heads, "Heads when the model has no config.json");
    be->add_option("--length", b.length, "Sequence length")->capture_default_str();
    be->add_option("--prompt-len", b.prompt_len, "Prompt tokens")->capture_default_str();
    be->add_option("--steps-list", b.steps_list, "Step counts, comma separated")->capture_default_str();
    be->add_option("--repeats", b.repeats, "Runs per step count (min/median/max)")->capture_default_str();
    be->add_option("--unmask", b.unmask, "Unmasking rule: " + table_choices())->capture_default_str();
    be->add_option("--cache", b.caches, "Cache modes to measure against off (repeatable): " + cache_help())
        ->capture_default_str();
    be->add_option("--prompts-from", b.prompts_from,
                   "Token file (uint16 LE) whose evenly spaced windows are the prompts");
    be->add_option("--temperature", b.temperature, "Sampling temperature (0: argmax, so agreement measures the cache)")
        ->capture_default_str();
    be->add_option("--score-with", b.score_with, "GPT-2 model: generative perplexity of every sample");
    be->add_option("--seed", b.seed, "Seed")->capture_default_str();
    be->add_option("--json", b.json_out, "Write every row to this JSON file");
    be->add_option("--plot", b.plot_out, "Write the agreement vs speed-up curve to this PNG");
    be->add_flag("--overwrite", b.overwrite, "Replace existing --json / --plot files");
    runners.emplace_back(be, [] { return run_bench(b); });
}

} // namespace anchor::cli
