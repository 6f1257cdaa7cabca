// `anchor-text diffusion generate|calibrate|train|bench`: masked text diffusion with time-anchor gates and the
// cross-step latent cache. The work is the text library's (text/diffusion/mdlm_run.h, text/bench/mdlm_bench.h, text/diffusion/mdlm_calibrate.h,
// text/train/mdlm_train.h); here: options, text I/O through the GPT-2 tokenizer, printing, output files.
//
// Text goes through the GPT-2 tokenizer (text/gpt2/gpt2_tokenizer.h, vocabulary from --vocab or assets/vocab/gpt2);
// --prompt-ids / --ids work with raw ids.
#include "cache/io/assets.h"
#include "cache/io/atomic_file.h"
#include "cache/io/enum_table.h"
#include "cache/io/error.h"
#include "cache/modes/mode_list.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "cli/loss_plot.h"
#include "cli/text_commands.h"
#include "cli/text_diffusion_family.h"
#include "text/gpt2/gpt2_tokenizer.h"
#include "text/bench/mdlm_bench.h"
#include "text/diffusion/mdlm_calibrate.h"
#include "text/diffusion/mdlm_run.h"
#include "text/text_job.h"
#include "text/token_file.h"
#include "text/train/diffugpt_train.h"
#include "text/train/mdlm_train.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

namespace anchor::cli {

using namespace anchor::text;

namespace {

// ---- text I/O (tokenizer plug-in point) -----------------------------------------------------------------------------

struct TextIo {
    std::string vocab;      // --vocab ("": the default folder)
    bool print_ids = false; // --ids

    const Gpt2Tokenizer& tokenizer() const {
        if (!tok_) tok_ = std::make_shared<Gpt2Tokenizer>(Gpt2Tokenizer::load_default(vocab));
        return *tok_;
    }
    // Text of `ids` with every [MASK] shown as "[MASK]" (runs between masks are decoded together so multi-token
    // characters stay whole); with --ids, the ids themselves.
    std::string decode(const std::vector<int64_t>& ids) const {
        std::ostringstream os;
        std::vector<int64_t> run;
        auto flush = [&] {
            if (!run.empty()) os << tokenizer().decode(run), run.clear();
        };
        for (size_t i = 0; i < ids.size(); ++i) {
            if (print_ids) {
                os << (i ? " " : "");
                if (ids[i] == kMdlmMaskId)
                    os << "[MASK]";
                else
                    os << ids[i];
            } else if (ids[i] == kMdlmMaskId) {
                flush();
                os << "[MASK]";
            } else {
                run.push_back(ids[i]);
            }
        }
        flush();
        return os.str();
    }

private:
    mutable std::shared_ptr<Gpt2Tokenizer> tok_;
};

std::vector<int64_t> parse_ids(const std::string& s, const std::string& what) {
    return parse_token_ids(s, what, kGpt2VocabSize, "a GPT-2 token id");
}

std::string cache_help() {
    std::string s = "Cache mode, 'help' lists them: one of " + cache_mode_forms() + ", optionally +key=value,... of";
    for (const auto& [k, h] : decode_spec_keys()) s += " " + k;
    return s;
}

// `--cache help`: the modes, their keys and defaults, and the decoding keys after '+'.
int print_cache_help() {
    std::cout << cache_modes_help() << "\n"
              << "A mode may carry its own sampler settings after '+', e.g. dual+threshold=0.9,block=32:\n";
    for (const auto& [k, h] : decode_spec_keys()) std::cout << "    " << k << ": " << h << "\n";
    return 0;
}

// The embedded demo model used when -m is not given (as anchor-sd's embedded model).
std::string default_mdlm_model() {
    return embedded_text_model("kjv-mdlm", "embedded text-diffusion model (kjv-mdlm)");
}

// The flags of the sampler's fields (SamplerOptions) and of the model.
const FlagNames& sampler_flags() {
    static const FlagNames f = {{"model", "--model"},
                                {"n_heads", "--heads"},
                                {"length", "--length"},
                                {"steps", "--steps"},
                                {"temperature", "--temperature"},
                                {"top_k", "--top-k"},
                                {"top_p", "--top-p"},
                                {"min_p", "--min-p"},
                                {"block_length", "--block-length"},
                                {"threshold", "--threshold"},
                                {"factor", "--factor"},
                                {"prompt", "--prompt"},
                                {"score_with", "--score-with"},
                                {"gemm", "--gemm"}};
    return f;
}

FlagNames with(FlagNames base, const FlagNames& more) {
    base.insert(base.begin(), more.begin(), more.end()); // earlier entries win: `more` overrides
    return base;
}

// ---- shared option groups -------------------------------------------------------------------------------------------

void add_attention_option(CLI::App& app, kernels::AttentionKernel& k, kernels::GemmBackend& g) {
    add_enum_option(app, "--attention", k, kernels::attention_kernel_table(),
                    "Attention arithmetic: exact (SEDD's, the default), fused or flash (the tiled kernel: no L x L "
                    "score buffer, within 2e-6 relative)");
    add_enum_option(
        app, "--gemm", g, kernels::gemm_backend_table(),
        "Linear layers: torch = SEDD's bits over the sequence (a cached step's few rows stream the weights through "
        "our kernel); onednn = oneDNN's matmul, the model ~1.5x faster on one thread, the last bits differ (winograd: "
        "the same here); bf16 = bfloat16 operands (AVX512-BF16 or AMX CPUs)");
}

struct SampleArgs {
    std::string model;
    std::string prompt, prompt_ids;
    int64_t n_heads = 0;
    SamplerOptions o; // every field but the prompt
    TextIo io;
    kernels::AttentionKernel attention = kernels::AttentionKernel::Exact;
    kernels::GemmBackend gemm = kernels::GemmBackend::Torch;

    SampleArgs() { o.rule = UnmaskRule::Ancestral; }
    void add(CLI::App* app) {
        app->add_option("-m,--model", model,
                        "MDLM model folder or .safetensors (config.json next to it; default: the embedded "
                        "assets/models/kjv-mdlm)");
        app->add_option("-p,--prompt", prompt, "Prompt text (GPT-2 BPE)");
        app->add_option("--vocab", io.vocab,
                        "GPT-2 vocabulary folder (encoder.json + vocab.bpe; default " + Gpt2Tokenizer::default_dir() +
                            ")");
        app->add_flag("--ids", io.print_ids, "Print token ids instead of text");
        app->add_option("--prompt-ids", prompt_ids, "Prompt as GPT-2 ids, comma or space separated");
        app->add_option("--length", o.length, "Total sequence length, prompt included")->capture_default_str();
        app->add_option("--steps", o.steps, "Denoising steps (all blocks together)")->capture_default_str();
        add_enum_option(*app, "--unmask", o.rule, unmask_rule_table(), "Unmasking rule");
        app->add_option("--temperature", o.temperature, "Sampling temperature (0 = argmax)")->capture_default_str();
        app->add_option("--top-k", o.top_k, "Sample from the k most likely tokens (0 = all)")->capture_default_str();
        app->add_option("--top-p", o.top_p, "Nucleus cut after the temperature (1 = off)")->capture_default_str();
        app->add_option("--min-p", o.min_p, "Keep tokens with probability >= min-p x the most likely one's (0 = off)")
            ->capture_default_str();
        app->add_option("-s,--seed", o.seed, "Random seed (torch CPU generator)")->capture_default_str();
        app->add_option("--block-length", o.block_length, "Semi-autoregressive block length (0 = one block)")
            ->capture_default_str();
        app->add_option("--threshold", o.threshold,
                        "Parallel decoding (Fast-dLLM): unmask every position whose confidence exceeds this, at least "
                        "one per step (0 = off; not with --unmask ancestral)")
            ->capture_default_str();
        app->add_option("--factor", o.factor, "Parallel decoding by Fast-dLLM's factor rule (0 = off)")
            ->capture_default_str();
        app->add_option("--heads", n_heads, "Attention heads when the model has no config.json (default D/64)");
        add_attention_option(*app, attention, gemm);
    }
    std::vector<int64_t> prompt_tokens() const {
        if (!prompt.empty() && !prompt_ids.empty()) throw UsageError("give either --prompt or --prompt-ids, not both");
        if (!prompt.empty()) return io.tokenizer().encode(prompt);
        return parse_ids(prompt_ids, "--prompt-ids");
    }
    std::string model_path() const { return model.empty() ? default_mdlm_model() : model; }
    SamplerOptions options() const {
        SamplerOptions so = o;
        so.prompt = prompt_tokens();
        return so;
    }
};

// ---- generate -------------------------------------------------------------------------------------------------------

struct GenerateArgs {
    SampleArgs s;
    PlacementArgs place;
    std::string cache = "off", score_with, json_out;
    std::vector<std::string> compare; // --compare lists (repeatable), as anchor-sd splits them
    bool show_steps = false, overwrite = false;
    BatchArgs batch; // --prompts-file
    DlmCliArgs dlm;  // DiffuGPT / LLaDA / Dream (cli/text_diffusion_family.h)

    // The run's parameters but the caches; the prompt from --prompt/--prompt-ids when `with_prompt`.
    DiffusionGenerateParams params(bool with_prompt) const {
        DiffusionGenerateParams p;
        p.model = s.model_path();
        p.n_heads = s.n_heads;
        p.sampler = with_prompt ? s.options() : s.o;
        p.score_with = score_with;
        p.attention = s.attention;
        p.gemm = s.gemm;
        p.placement = resolve_placement(place);
        return p;
    }
};

// Runs of equal / differing tokens of r against o, decoded together; differing runs are wrapped in [[ ]].
std::string marked(const TextIo& io, const std::vector<int64_t>& r, const std::vector<int64_t>& o, int64_t from) {
    std::ostringstream os;
    const int64_t n = static_cast<int64_t>(r.size());
    for (int64_t i = from; i < n;) {
        const bool diff = r[size_t(i)] != o[size_t(i)];
        int64_t j = i;
        while (j < n && (r[size_t(j)] != o[size_t(j)]) == diff) ++j;
        os << (diff ? "[[" : "") << io.decode(std::vector<int64_t>(r.begin() + i, r.begin() + j)) << (diff ? "]]" : "")
           << (io.print_ids && j < n ? " " : "");
        i = j;
    }
    return os.str();
}

void print_generated(const GenerateArgs& a, const DiffusionReport& rep) {
    const auto& io = a.s.io;
    const int64_t P = rep.prompt_tokens;
    if (rep.runs.size() == 1) {
        const auto& r = rep.runs[0];
        std::cout << io.decode(std::vector<int64_t>(r.result.tokens.begin() + P, r.result.tokens.end())) << "\n";
        std::cerr << "cache " << r.cache.display() << ": " << std::fixed << std::setprecision(3) << r.result.seconds
                  << " s, reused " << std::setprecision(1) << 100.0 * r.result.cache.reused_fraction()
                  << "% of position-layer computations";
        if (r.gen_ppl >= 0) std::cerr << ", generative perplexity " << std::setprecision(2) << r.gen_ppl;
        std::cerr << "\n";
        return;
    }
    const auto &ra = rep.runs[0], &rb = rep.runs[1];
    const auto entropy = [P](const DiffusionRun& r) { return unigram_entropy(r.result.tokens, P); };
    std::cout << "[" << ra.cache.display() << "]\n" << marked(io, ra.result.tokens, rb.result.tokens, P) << "\n\n";
    std::cout << "[" << rb.cache.display() << "]\n" << marked(io, rb.result.tokens, ra.result.tokens, P) << "\n\n";
    std::cout << std::fixed << std::setprecision(3) << "token agreement: " << 100.0 * rep.agreement()
              << "% (differing tokens marked [[ ]])\n"
              << "wall time: " << ra.result.seconds << " s vs " << rb.result.seconds << " s, speed-up "
              << ra.result.seconds / rb.result.seconds << "x\n"
              << "reused position-layer computations: " << 100.0 * ra.result.cache.reused_fraction() << "% vs "
              << 100.0 * rb.result.cache.reused_fraction() << "%\n"
              << "denoiser forward passes: " << ra.result.forward_passes << " vs " << rb.result.forward_passes << "\n"
              << "unigram entropy (nats): " << entropy(ra) << " vs " << entropy(rb) << "\n";
    if (ra.gen_ppl >= 0)
        std::cout << std::setprecision(2) << "generative perplexity under " << rep.score_with << ": " << ra.gen_ppl
                  << " vs " << rb.gen_ppl << "\n";
}

// --prompts-file: one --cache mode over every prompt, one text file and record each (text/text_job.h).
int run_generate_prompts(const GenerateArgs& a, const FlagNames& flags) {
    if (!a.s.prompt.empty() || !a.s.prompt_ids.empty() || !a.compare.empty() || a.show_steps || !a.json_out.empty())
        throw UsageError("--prompts-file runs one --cache mode over its prompts: not with --prompt, --prompt-ids, "
                         "--compare, --show-steps or --json");
    return with_flag_errors(flags, [&] {
        auto p = a.params(false);
        p.caches = {parse_decode_spec(a.cache)};
        const auto job =
            make_item_job(a.batch, a.overwrite, {{"program", "anchor-text diffusion generate"}, {"cache", a.cache}});
        const auto r = run_diffusion_prompts(p, a.s.io.tokenizer(), job, [](const nlohmann::json& rec) {
            std::cerr << "wrote " << rec["output"].get<std::string>() << " (" << rec["seconds"] << " s, "
                      << rec["forward_passes"] << " forward passes)\n";
        });
        print_item_job_result(r);
        return 0;
    });
}

int run_generate(const GenerateArgs& a) {
    if (dlm_requested(a.dlm, a.s.model)) {
        DlmSharedArgs d{a.s.model, a.s.prompt, a.s.prompt_ids, a.s.io.vocab, a.cache, a.s.o.steps,
                        a.s.o.block_length, a.s.o.top_k, static_cast<int64_t>(a.s.o.seed), a.s.o.temperature,
                        a.s.o.top_p, a.s.io.print_ids};
        d.compare = a.compare;
        return run_dlm_generate(a.dlm, d);
    }
    const auto flags = with(sampler_flags(), {{"cache", a.compare.empty() ? "--cache" : "--compare"},
                                              {"caches", a.compare.empty() ? "--cache" : "--compare"}});
    if (a.cache == "help" || (a.compare.size() == 1 && a.compare[0] == "help")) return print_cache_help();
    if (!a.json_out.empty()) check_output_path(a.json_out, a.overwrite);
    if (!a.batch.prompts_file.empty()) return run_generate_prompts(a, flags);
    const auto rep = with_flag_errors(flags, [&] {
        auto p = a.params(true);
        // --compare A,B (or A;B, or --compare A --compare B): both runs side by side with the same seed. The list is
        // split as anchor-sd splits its own (cache/modes/mode_list.h), so a mode with commas inside stays one.
        std::vector<std::string> modes;
        if (!a.compare.empty()) {
            try {
                modes = cache::modes::split_mode_lists(a.compare, "compare");
            } catch (const anchor::ParamError& e) {
                throw UsageError("--compare: " + e.detail());
            }
            if (modes.size() != 2)
                throw UsageError("--compare: expected two cache modes (e.g. off,anchor or 'off;dual:decoded=reuse'), "
                                 "got " +
                                 std::to_string(modes.size()));
        }
        // A mode's own keys (threshold=...) stay as written: only the field names the flag.
        p.caches = with_flag_errors({{"cache", a.compare.empty() ? "--cache" : "--compare"}}, [&] {
            return a.compare.empty()
                       ? std::vector<DecodeSpec>{parse_decode_spec(a.cache)}
                       : std::vector<DecodeSpec>{parse_decode_spec(modes[0]), parse_decode_spec(modes[1])};
        });
        const int64_t P = static_cast<int64_t>(p.sampler.prompt.size());
        auto show = [&](const StepInfo& st) {
            const auto masked = std::count(st.tokens->begin(), st.tokens->end(), kMdlmMaskId);
            std::cout << "step " << st.step << " (block " << st.block << ", t=" << std::fixed << std::setprecision(3)
                      << st.t << "): +" << st.unmasked << " unmasked, " << masked << " masked\n  "
                      << a.s.io.decode(std::vector<int64_t>(st.tokens->begin() + P, st.tokens->end())) << "\n";
        };
        try {
            return generate_diffusion(p, a.show_steps ? StepCallback(show) : StepCallback());
        } catch (const text::TokenOutsideVocabulary& e) {
            // The library knows the token; the user typed the text: name the piece.
            throw UsageError(std::string(a.s.prompt.empty() ? "--prompt-ids" : "--prompt") + ": " +
                             e.describe(a.s.io.decode({e.id()})) + "; leave it out or reword it");
        }
    });
    print_generated(a, rep);
    if (!a.json_out.empty()) {
        write_file_atomic(a.json_out, rep.to_json().dump(1) + "\n", a.overwrite);
        std::cout << "wrote " << a.json_out << "\n";
    }
    return 0;
}

// ---- calibrate ------------------------------------------------------------------------------------------------------

struct CalibrateArgs {
    SampleArgs s;
    std::vector<std::string> prompt_id_lists;
    std::string prompts_from;
    int64_t n_prompts = 8, prompt_len = 32;
    CalibrateOptions co;
    std::string out;
    bool overwrite = false;
};

int run_calibrate(CalibrateArgs a) {
    check_output_path(a.out, a.overwrite);
    const auto flags = with(sampler_flags(), {{"prompts", "--prompt-id-list, --prompts-from or --prompt"},
                                              {"classes", "--classes"},
                                              {"max_stale", "--max-stale"}});
    const auto prof = with_flag_errors(flags, [&] {
        auto model = load_mdlm(a.s.model_path(), a.s.n_heads);
        configure_mdlm(model, a.s.attention, {}, a.s.gemm); // calibration records CPU float32 statistics
        for (const auto& p : a.prompt_id_lists) a.co.prompts.push_back(parse_ids(p, "--prompt-ids"));
        if (!a.prompts_from.empty())
            for (auto& p :
                 token_file_windows(a.prompts_from, a.n_prompts, a.prompt_len,
                                    [model](const std::vector<int64_t>& w) { return model->in_vocabulary(w); }))
                a.co.prompts.push_back(p);
        if (!a.s.prompt.empty()) a.co.prompts.push_back(a.s.io.tokenizer().encode(a.s.prompt));
        a.co.sampler = a.s.o;
        a.co.validate();
        auto p = calibrate_mdlm(model, a.co);
        p.meta["model"] = a.s.model_path();
        return p;
    });
    prof.save(a.out, a.overwrite);
    std::cout << "anchor profile: " << prof.centroids.size() << " classes over " << prof.n_layers << " layers x "
              << prof.time_bins << " steps -> " << a.out << "\n";
    for (size_t c = 0; c < prof.centroids.size(); ++c)
        std::cout << "  class " << c << ": mean delta " << prof.centroids[c] << ", staleness " << prof.class_stale[c]
                  << "\n";
    return 0;
}

// ---- train ----------------------------------------------------------------------------------------------------------

const EnumTable<torch::ScalarType>& export_dtype_table() {
    static const EnumTable<torch::ScalarType> t = {{"f16", torch::kFloat16}, {"f32", torch::kFloat32}};
    return t;
}

struct TrainArgs {
    TrainOptions o;
    int64_t layers = 4, dim = 128, heads = 4, cond = 64;
    GateKind gate = GateKind::TimeAnchor;
    std::string holdout = "books:Ruth,Eccl,Jonah,Titus";
    bool full_vocab = false, no_resume = false;
    // --family diffugpt --init-from AR_GPT2: DiffuGPT's adaptation (text/train/diffugpt_train.h) instead of an MDLM.
    std::string family, init_from;
    int64_t anneal_steps = 200, eval_every = 100;
    bool seq_len_set = false;
};

int run_train_diffugpt(const TrainArgs& a) {
    DiffuGptTrainOptions d;
    d.init_from = a.init_from, d.kjv_path = a.o.kjv_path, d.vocab_dir = a.o.vocab_dir, d.out_dir = a.o.out_dir;
    d.export_dir = a.o.export_dir, d.export_dtype = a.o.export_dtype;
    d.seq_len = a.seq_len_set ? a.o.seq_len : 0;
    d.batch = a.o.batch, d.steps = a.o.steps, d.warmup = a.o.warmup, d.anneal_steps = a.anneal_steps;
    d.lr = a.o.lr, d.weight_decay = a.o.weight_decay, d.seed = a.o.seed, d.log_every = a.o.log_every;
    d.eval_every = a.eval_every, d.time_budget_s = a.o.time_budget_s;
    d.log = [](const std::string& s) { std::cout << s << std::endl; };
    const FlagNames flags = {{"holdout", "--holdout"},         {"out_dir", "--out"},      {"batch", "--batch"},
                             {"seq_len", "--seq-len"},         {"steps", "--steps"},      {"init_from", "--init-from"},
                             {"anneal_steps", "--anneal-steps"}, {"export_dir", "--export"}, {"eval_every", "--eval-every"},
                             {"time_budget_s", "--time-budget"}, {"warmup", "--warmup"},  {"lr", "--lr"}};
    const auto r = with_flag_errors(flags, [&] {
        d.holdout = text::HoldoutSpec::parse(a.holdout);
        return train_diffugpt(d);
    });
    std::cout << "trained steps 0.." << r.steps_run << " of " << r.planned_steps << "; held-out NELBO "
              << r.val_nelbo_start << " -> " << r.val_nelbo << " nats/token\n";
    return 0;
}

int run_train(TrainArgs a) {
    a.o.config.n_blocks = a.layers;
    a.o.config.hidden_size = a.dim;
    a.o.config.n_heads = a.heads;
    a.o.config.cond_dim = a.cond;
    a.o.config.gate = a.gate;
    a.o.config.max_seq_len = a.o.seq_len;
    try {
        a.o.config.validate();
    } catch (const Error& e) {
        throw UsageError(e.what());
    }
    a.o.compact_vocab = !a.full_vocab;
    a.o.resume = !a.no_resume;
    a.o.log = [](const std::string& s) { std::cout << s << std::endl; };
    const FlagNames flags = {{"holdout", "--holdout"}, {"out_dir", "--out"},   {"batch", "--batch"},
                             {"seq_len", "--seq-len"}, {"steps", "--steps"},   {"tokens_path", "--tokens"},
                             {"use_kjv", "--kjv"},     {"device", "--device"}, {"time_budget_s", "--time-budget"}};
    const auto r = with_flag_errors(flags, [&] {
        a.o.holdout = text::HoldoutSpec::parse(a.holdout);
        return train_mdlm(a.o);
    });
    std::cout << "trained steps " << r.start_step << ".." << r.end_step << "\n";
    return 0;
}

// ---- bench ----------------------------------------------------------------------------------------------------------

struct BenchArgs {
    DiffusionBenchParams p;
    PlacementArgs place;
    std::string steps_list = "64,128,256", json_out, plot_out;
    std::vector<std::string> caches = {"anchor"};
    std::string baseline = "off";
    bool overwrite = false;
    DlmCliArgs dlm; // a published family's model (-m LLaDA / Dream / DiffuGPT, or --family)
};

void print_bench(const DiffusionBenchReport& rep, const DiffusionBenchRow* row) {
    if (!row) {
        const auto& cfg = rep.config;
        std::cout << "model: " << rep.model << " (" << cfg["n_blocks"] << " x " << cfg["hidden_size"]
                  << "), L=" << rep.length << ", prompt " << rep.prompt_len << " (" << rep.prompts << "), unmask "
                  << unmask_rule_name(rep.unmask) << ", temperature " << rep.temperature << ", threads " << rep.threads
                  << ", " << rep.kernels << ", load " << rep.load_start << ", baseline " << rep.baseline << "\n"
                  << "mode | steps | base s (min/med/max) | mode s (min/med/max) | speed-up per prompt (min/med/max) | "
                     "forwards base/mode | reused | agreement | entropy base / mode"
                  << (rep.score_with.empty() ? "" : " | gen-PPL base / mode (+-95% CI) | gen-PPL change") << "\n";
        return;
    }
    const auto& r = *row;
    std::cout << std::fixed << std::setprecision(3) << r.cache << " | " << r.steps << " | " << r.off_s.min << " / "
              << r.off_s.median << " / " << r.off_s.max << " | " << r.cached_s.min << " / " << r.cached_s.median
              << " / " << r.cached_s.max << " | " << std::setprecision(2) << r.speedups.min << " / "
              << r.speedups.median << " / " << r.speedups.max << "x | " << std::setprecision(1) << r.forwards_off
              << " / " << r.forwards_cached << " | " << 100 * r.reused << "% | " << 100 * r.agreement << "% | "
              << std::setprecision(3) << r.entropy_off.mean << " / " << r.entropy_cached.mean << " (" << std::showpos
              << std::setprecision(1) << 100 * r.entropy_change() << std::noshowpos << "%)";
    if (r.gen_ppl_off.mean >= 0)
        std::cout << std::setprecision(2) << " | " << r.gen_ppl_off.mean << " +- " << r.gen_ppl_off.ci95 << " / "
                  << r.gen_ppl_cached.mean << " +- " << r.gen_ppl_cached.ci95 << " | " << std::showpos
                  << std::setprecision(1) << 100 * r.gen_ppl_change() << std::noshowpos << "%";
    std::cout << std::defaultfloat << std::endl;
}

// The speed/quality curve: one series per step count, points by speed-up; gen-PPL change against the baseline when
// scored, else token agreement.
void write_bench_plot(const BenchArgs& a, const DiffusionBenchReport& rep) {
    const bool ppl = !rep.score_with.empty();
    std::vector<LossSeries> series;
    for (auto T : a.p.steps) {
        std::vector<std::pair<double, double>> pts;
        for (const auto& r : rep.rows)
            if (r.steps == T) pts.emplace_back(r.speedup(), ppl ? 100.0 * r.gen_ppl_change() : 100.0 * r.agreement);
        std::sort(pts.begin(), pts.end());
        LossSeries s;
        s.label = "T = " + std::to_string(T);
        for (const auto& [x, y] : pts) s.steps.push_back(x), s.losses.push_back(y);
        series.push_back(s);
    }
    PlotAxes ax;
    ax.title = std::string("text diffusion: ") + (ppl ? "gen-PPL change" : "token agreement") + " vs speed-up over " +
               rep.baseline + " (L=" + std::to_string(a.p.length) + ")";
    ax.x_label = "speed-up over " + rep.baseline + " (median wall time)";
    ax.y_label = ppl ? "gen-PPL change %" : "agreement %";
    ax.log_y = false;
    write_file_atomic(a.plot_out, line_plot_png(series, ax), a.overwrite);
    std::cout << "wrote " << a.plot_out << "\n";
}

int run_bench(BenchArgs a) {
    if (dlm_requested(a.dlm, a.p.model)) {
        DlmBenchCliArgs d;
        d.model = a.p.model, d.baseline = a.baseline, d.json_out = a.json_out, d.overwrite = a.overwrite;
        if (a.dlm.app->count("--cache")) d.caches = a.caches;
        if (a.dlm.app->count("--steps-list")) d.steps = parse_int_list(a.steps_list, "--steps-list");
        d.prompt_len = a.p.prompt_len, d.block_length = a.p.block_length, d.repeats = int(a.p.repeats);
        d.seed = a.p.seed, d.temperature = a.p.temperature;
        d.prompts_from = a.p.prompts_from, d.score_with = a.p.score_with;
        return run_dlm_bench(a.dlm, d);
    }
    if (!a.json_out.empty()) check_output_path(a.json_out, a.overwrite);
    if (!a.plot_out.empty()) check_output_path(a.plot_out, a.overwrite);
    a.p.steps = parse_int_list(a.steps_list, "--steps-list");
    a.p.placement = resolve_placement(a.place);
    const FlagNames flags = with(sampler_flags(), {{"steps", "--steps-list"},
                                                   {"cache", "--cache"},
                                                   {"caches", "--cache"},
                                                   {"repeats", "--repeats"},
                                                   {"prompt_len", "--prompt-len"},
                                                   {"layers", "--layers"},
                                                   {"dim", "--dim"},
                                                   {"prompt", "--prompt-len"},
                                                   {"block_length", "--block-length"}});
    if (std::find(a.caches.begin(), a.caches.end(), "help") != a.caches.end() || a.baseline == "help")
        return print_cache_help();
    const auto rep = with_flag_errors(flags, [&] {
        with_flag_errors({{"cache", "--cache or --baseline"}}, [&] {
            a.p.baseline = parse_decode_spec(a.baseline);
            for (const auto& c : cache::modes::split_mode_lists(a.caches, "cache"))
                a.p.caches.push_back(parse_decode_spec(c));
        });
        return run_diffusion_bench(a.p, print_bench);
    });
    std::cout << "load at end: " << rep.load_end << "\n";
    if (!a.plot_out.empty()) write_bench_plot(a, rep);
    if (!a.json_out.empty()) {
        write_file_atomic(a.json_out, rep.to_json().dump(1) + "\n", a.overwrite);
        std::cout << "wrote " << a.json_out << "\n";
    }
    return 0;
}

} // namespace

void add_diffusion_commands(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners) {
    auto* diff = app.add_subcommand("diffusion", "Masked text diffusion (MDLM) with time-anchor gates and caches");
    diff->require_subcommand(1);

    auto g = std::make_shared<GenerateArgs>();
    auto* gen = diff->add_subcommand("generate", "Sample text; --compare runs two cache modes side by side");
    g->s.add(gen);
    add_placement_options(gen, g->place, "the MDLM and its caches");
    gen->add_option("--cache", g->cache, cache_help())->capture_default_str();
    cli::add_mode_list_option(*gen, "--compare", g->compare,
                              "Two cache modes, e.g. off,anchor:stale=2 or 'off;dual:decoded=reuse,masked=reuse' "
                              "(repeatable: --compare off --compare anchor)");
    gen->add_flag("--show-steps", g->show_steps, "Print the sequence after every step");
    gen->add_option("--score-with", g->score_with, "GPT-2 model: print each text's generative perplexity under it");
    gen->add_option("--json", g->json_out, "Also write every run (tokens, timings, cache and store statistics) here");
    add_batch_options(gen, g->batch, "text file");
    gen->add_flag("--overwrite", g->overwrite, "Replace existing output files (--json, --prompts-file outputs)");
    add_dlm_options(gen, g->dlm);
    runners.emplace_back(gen, [g] { return run_generate(*g); });
    add_dlm_chat_command(diff, runners);
    add_dlm_random_model_command(diff, runners);

    auto c = std::make_shared<CalibrateArgs>();
    auto* cal =
        diff->add_subcommand("calibrate", "Uncached sampling on prompts -> anchor profile JSON (k-means classes)");
    c->s.add(cal);
    cal->add_option("--prompt-id-list", c->prompt_id_lists, "A prompt as ids (repeatable)");
    cal->add_option("--prompts-from", c->prompts_from, "Token file (uint16 LE) to take prompts from");
    cal->add_option("--n-prompts", c->n_prompts, "Prompts taken from --prompts-from")->capture_default_str();
    cal->add_option("--prompt-len", c->prompt_len, "Length of prompts taken from --prompts-from")
        ->capture_default_str();
    cal->add_option("--classes", c->co.classes, "k-means stability classes")->capture_default_str();
    cal->add_option("--max-stale", c->co.max_stale, "Staleness of the most stable class")->capture_default_str();
    cal->add_option("-o,--output", c->out, "Profile JSON to write")->required();
    cal->add_flag("--overwrite", c->overwrite, "Replace an existing output file");
    runners.emplace_back(cal, [c] { return run_calibrate(*c); });

    auto t = std::make_shared<TrainArgs>();
    auto* tr = diff->add_subcommand("train", "Train an MDLM on a token file (MDLM objective, AdamW, resumable)");
    auto* tok_opt = tr->add_option("--tokens", t->o.tokens_path, "Token file: uint16 LE GPT-2 ids");
    auto* kjv_opt = tr->add_option("--kjv", t->o.kjv_path,
                                   "Train on the King James Version (bible.data, a .Z file or tagged text; without a "
                                   "value: the installed bible-kjv-text), GPT-2 tokenizer")
                        ->expected(0, 1);
    tok_opt->excludes(kjv_opt);
    tr->add_option("--holdout", t->holdout, "With --kjv: held-out text, " + text::HoldoutSpec::syntax_help())
        ->capture_default_str();
    tr->add_option("--vocab", t->o.vocab_dir, "With --kjv: GPT-2 tokenizer folder");
    tr->add_option("-o,--out", t->o.out_dir, "Run folder (checkpoints, log; resumed when it holds a state)")
        ->required();
    tr->add_option("--layers", t->layers, "Blocks")->capture_default_str();
    tr->add_option("--dim", t->dim, "Hidden size")->capture_default_str();
    tr->add_option("--heads", t->heads, "Attention heads")->capture_default_str();
    tr->add_option("--cond-dim", t->cond, "Conditioning size")->capture_default_str();
    add_enum_option(*tr, "--gate", t->gate, gate_kind_table(), "Residual gate");
    tr->add_flag("--full-vocab", t->full_vocab, "Keep all 50258 rows instead of the corpus' tokens");
    tr->add_option("--seq-len", t->o.seq_len, "Context length")->capture_default_str();
    tr->add_option("--batch", t->o.batch, "Sequences per step")->capture_default_str();
    tr->add_option("--steps", t->o.steps, "Total optimizer steps")->capture_default_str();
    tr->add_option("--stop-after", t->o.stop_after, "Stop after this many steps in this invocation");
    tr->add_option("--lr", t->o.lr, "Peak learning rate")->capture_default_str();
    tr->add_option("--warmup", t->o.warmup, "Warm-up steps")->capture_default_str();
    tr->add_option("--weight-decay", t->o.weight_decay, "AdamW weight decay")->capture_default_str();
    add_enum_option(*tr, "--loss-weight", t->o.loss_weight, mdlm_loss_weight_table(),
                    "Masked-token weight: nelbo (1/t, MDLM) or masked_mean (1/#masked per sequence, lower variance "
                    "for small batches)");
    tr->add_option("-s,--seed", t->o.seed, "Seed")->capture_default_str();
    tr->add_option("--checkpoint-every", t->o.checkpoint_every, "Checkpoint interval")->capture_default_str();
    tr->add_option("--log-every", t->o.log_every, "Log interval")->capture_default_str();
    tr->add_option("--export", t->o.export_dir, "Folder for the final weights (config.json + model.safetensors)");
    add_enum_option(*tr, "--export-dtype", t->o.export_dtype, export_dtype_table(), "Dtype of the exported weights");
    tr->add_flag("--no-resume", t->no_resume, "Start fresh even when the run folder has a state");
    tr->add_option("--device", t->o.device, "Where training runs: cpu, cuda or cuda:N (TF32 matmuls on CUDA)")
        ->capture_default_str();
    tr->add_option("--time-budget", t->o.time_budget_s,
                   "Seconds: size the schedule from the measured step rate so that training ends within them (at most "
                   "--steps); 0 = --steps as given")
        ->capture_default_str();
    tr->add_option("--family", t->family, "mdlm (default) or diffugpt: adapt the GPT-2 of --init-from (DiffuGPT)");
    tr->add_option("--init-from", t->init_from, "With --family diffugpt: the autoregressive GPT-2 folder to adapt");
    tr->add_option("--anneal-steps", t->anneal_steps,
                   "With --family diffugpt: steps over which the causal mask is relaxed to full attention")
        ->capture_default_str();
    tr->add_option("--eval-every", t->eval_every, "With --family diffugpt: held-out NELBO interval")
        ->capture_default_str();
    runners.emplace_back(tr, [t, tr] {
        t->o.use_kjv = tr->count("--kjv") > 0;
        t->seq_len_set = tr->count("--seq-len") > 0;
        if (t->family == "diffugpt" || (t->family.empty() && !t->init_from.empty())) {
            if (t->init_from.empty()) throw UsageError("train --family diffugpt: give --init-from GPT2_FOLDER");
            if (!t->o.use_kjv) throw UsageError("train --family diffugpt: trains on --kjv (--tokens is for MDLMs)");
            return run_train_diffugpt(*t);
        }
        if (!t->family.empty() && t->family != "mdlm")
            throw UsageError("train: --family '" + t->family + "' is not mdlm or diffugpt");
        if (!t->init_from.empty()) throw UsageError("train: --init-from is for --family diffugpt");
        if (!t->o.use_kjv && t->o.tokens_path.empty()) throw UsageError("train: give --tokens FILE or --kjv");
        return run_train(*t);
    });

    auto b = std::make_shared<BenchArgs>();
    auto& bp = b->p;
    auto* be = diff->add_subcommand(
        "bench", "Speed-up over a baseline, gen-PPL, unigram entropy and agreement of decoding modes");
    be->add_option("-m,--model", bp.model, "Model (default: random weights of --layers x --dim)");
    be->add_option("--layers", bp.layers, "Random model blocks")->capture_default_str();
    be->add_option("--dim", bp.dim, "Random model hidden size")->capture_default_str();
    be->add_option("--heads", bp.n_heads, "Heads when the model has no config.json");
    be->add_option("--length", bp.length, "Sequence length")->capture_default_str();
    be->add_option("--prompt-len", bp.prompt_len, "Prompt tokens")->capture_default_str();
    be->add_option("--steps-list", b->steps_list, "Step counts, comma separated")->capture_default_str();
    be->add_option("--repeats", bp.repeats, "Runs per step count (min/median/max)")->capture_default_str();
    add_enum_option(*be, "--unmask", bp.unmask, unmask_rule_table(), "Unmasking rule");
    add_attention_option(*be, bp.attention, bp.gemm);
    add_placement_options(be, b->place, "the MDLM and its caches");
    cli::add_mode_list_option(*be, "--cache", b->caches,
                              "Modes to measure against the baseline: a list as --compare takes ('anchor;dual', "
                              "repeatable). " +
                                  cache_help())
        ->capture_default_str();
    be->add_option("--baseline", b->baseline, "The mode every --cache is measured against")->capture_default_str();
    be->add_option("--block-length", bp.block_length, "Block length of modes that do not set block=")
        ->capture_default_str();
    be->add_option("--prompts-from", bp.prompts_from,
                   "Token file (uint16 LE) whose evenly spaced windows are the prompts");
    be->add_option("--temperature", bp.temperature, "Sampling temperature (0: argmax, so agreement measures the cache)")
        ->capture_default_str();
    be->add_option("--score-with", bp.score_with, "GPT-2 model: generative perplexity of every sample");
    be->add_option("-s,--seed", bp.seed, "Seed")->capture_default_str();
    be->add_option("--json", b->json_out, "Write every row to this JSON file");
    be->add_option("--plot", b->plot_out,
                   "Write the speed-quality curve (gen-PPL change with --score-with, else agreement, vs speed-up) to "
                   "this PNG");
    be->add_flag("--overwrite", b->overwrite, "Replace existing --json / --plot files");
    add_dlm_options(be, b->dlm);
    runners.emplace_back(be, [b] { return run_bench(*b); });
}

} // namespace anchor::cli
