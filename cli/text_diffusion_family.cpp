// `anchor-text diffusion generate` on DiffuGPT / LLaDA / Dream folders: options, prompt and chat template, printing.
// The work is the library's (text/diffusion/families/dlm_sampler.h, dlm_chat.h).
#include "cli/text_diffusion_family.h"

#include "cache/io/error.h"
#include "cli/text_commands.h"
#include "cache/io/atomic_file.h"
#include "text/bench/dlm_quality_bench.h"
#include "text/diffusion/families/dlm_bench.h"
#include "text/diffusion/families/dlm_chat.h"
#include "text/diffusion/families/dlm_model.h"
#include "text/diffusion/families/dlm_random.h"
#include "text/diffusion/families/dlm_sampler.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>

namespace anchor::cli {

using namespace anchor::text;

namespace {

const FlagNames& dlm_flags() {
    static const FlagNames f = {{"gen_length", "--gen-length"}, {"block_length", "--block-length"},
                                {"steps", "--steps"},           {"temperature", "--temperature"},
                                {"top_p", "--top-p"},           {"top_k", "--top-k"},
                                {"remask", "--remask"},         {"cache", "--cache"},
                                {"eps", "--eps"},               {"prompt", "--prompt"},
                                {"family", "--family"},         {"chat", "--no-chat"},
                                {"alg_temp", "--alg-temp"},     {"weights_dtype", "--weights-dtype"},
                                {"compare", "--compare"},       {"repeats", "--repeats"},
                                {"qgemm", "--qgemm"},           {"gemm", "--qgemm"}};
    return f;
}

} // namespace

std::vector<int64_t> parse_token_ids(const std::string& s, const std::string& what, int64_t vocab,
                                     const std::string& noun) {
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
            if (used != p.size() || v < 0 || v >= vocab)
                throw UsageError(what + ": '" + p + "' is not " + noun + " (0.." + std::to_string(vocab - 1) + ")");
            out.push_back(v);
        }
    }
    return out;
}

void add_dlm_options(CLI::App* sub, DlmCliArgs& a) {
    a.app = sub;
    sub->add_option("--family", a.family,
                    "Published diffusion LM family of -m: " + enum_choices(dlm_family_table()) +
                        " (default: from its config.json / tensor names)");
    sub->add_option("--gen-length", a.gen_length, "DiffuGPT/LLaDA/Dream: answer length in tokens (default 128)");
    sub->add_option("--remask", a.remask,
                    "DiffuGPT/LLaDA/Dream commit rule: " + enum_choices(dlm_remask_table()) +
                        " (default LLaDA low_confidence, Dream entropy)");
    sub->add_option("--mask-id", a.mask_id, "[MASK] id when the folder does not name it");
    sub->add_option("--eps", a.eps, "Dream: last point of the time grid")->capture_default_str();
    sub->add_option("--alg-temp", a.alg_temp,
                    "Dream: > 0 draws the positions each step commits from softmax(confidence / alg-temp) "
                    "(default 0: the most confident)");
    sub->add_option("--weights-dtype", a.weights_dtype,
                    "LLaDA/Dream weights kept in memory as " + enum_choices(kernels::qweight_type_table()) +
                        " (default: float32 for a folder, the file's own types for a GGUF)");
    sub->add_option("--qgemm", a.qgemm,
                    "LLaDA/Dream products with quantised weights: int8 (the default: llama.cpp's arithmetic, "
                    "activations rounded to q8_0 blocks), bf16 (bfloat16 operands, AVX512-BF16) or f32 (the "
                    "dequantised weights in float32: the reference). Without it, --gemm bf16 means bf16 and another "
                    "--gemm given means f32");
    sub->add_flag("--no-chat", a.no_chat, "Use the prompt as is, not wrapped in the folder's chat template");
    sub->add_flag("--no-eos-stop", a.no_eos_stop, "Keep decoding past the end-of-sequence token");
    sub->add_flag("--stream", a.stream, "Print each committed block as it completes");
}

bool dlm_requested(const DlmCliArgs& a, const std::string& model) {
    if (!a.family.empty() || a.gen_length > 0) return true;
    return !model.empty() && detect_dlm_family(model).has_value();
}

namespace {

LoadedDlm dlm_load(const DlmCliArgs& a, const DlmSharedArgs& s) {
    if (s.model.empty()) throw UsageError("--family / --gen-length need -m <DiffuGPT, LLaDA or Dream folder or GGUF>");
    std::optional<DlmFamily> fam;
    if (!a.family.empty())
        fam = with_flag_errors(dlm_flags(), [&] { return enum_from_string(dlm_family_table(), a.family, "family"); });
    std::optional<kernels::QWeightType> weights;
    if (!a.weights_dtype.empty())
        weights = with_flag_errors(dlm_flags(), [&] {
            return enum_from_string(kernels::qweight_type_table(), a.weights_dtype, "weights_dtype");
        });
    LoadedDlm loaded = load_dlm(s.model, fam, a.mask_id, weights);
    // The products' arithmetic (kernels/qgemm_arith.h): --qgemm, else the --gemm given on this command (bf16 keeps
    // bfloat16 operands, the float32 backends the float32 reference), else the default.
    with_flag_errors(dlm_flags(), [&] {
        const CLI::Option* g = a.app ? a.app->get_option_no_throw("--gemm") : nullptr;
        if (!a.qgemm.empty())
            loaded.model->set_qgemm(enum_from_string(kernels::qgemm_arithmetic_table(), a.qgemm, "qgemm"));
        else if (g && g->count() > 0 && !g->results().empty())
            loaded.model->set_qgemm(g->results().front() == "bf16" ? kernels::QGemmArithmetic::Bf16
                                                                   : kernels::QGemmArithmetic::F32);
        return 0;
    });
    return loaded;
}

DlmSampleOptions dlm_options(const DlmCliArgs& a, const DlmSharedArgs& s, const DlmConfig& c) {
    auto given = [&](const char* flag) { return a.app && a.app->get_option_no_throw(flag) && a.app->count(flag) > 0; };
    DlmSampleOptions o;
    o.gen_length = a.gen_length > 0 ? a.gen_length : 128;
    o.steps = given("--steps") ? s.steps : o.gen_length;
    o.block_length = s.block_length;
    if (given("--temperature")) o.temperature = s.temperature;
    if (given("--top-p")) o.top_p = s.top_p;
    if (given("--top-k") && s.top_k > 0) o.top_k = s.top_k;
    o.eps = a.eps;
    if (given("--alg-temp")) o.alg_temp = a.alg_temp;
    o.stop_at_eos = !a.no_eos_stop;
    with_flag_errors(dlm_flags(), [&] {
        if (!a.remask.empty()) o.remask = enum_from_string(dlm_remask_table(), a.remask, "remask");
        o.cache = enum_from_string(dlm_cache_table(), s.cache, "cache");
        o.validate(c);
        return 0;
    });
    return o;
}

// One generation, its answer printed (block by block with --stream, cut at the first EOS) and its figures on stderr.
DlmSampleResult dlm_run_printed(DlmModel& model, const DlmTokenizer* tok, const std::vector<int64_t>& prompt,
                                const DlmSampleOptions& o, const DlmCliArgs& a, const DlmSharedArgs& s) {
    const auto& c = model.config();
    auto print = [&](const std::vector<int64_t>& ids) {
        if (s.print_ids || !tok)
            for (auto t : ids) std::cout << t << " ";
        else
            std::cout << tok->decode(ids);
        std::cout.flush();
    };
    size_t shown = 0;
    bool ended = false;
    DlmBlockCallback on_block;
    if (a.stream)
        on_block = [&](const std::vector<int64_t>& committed) {
            std::vector<int64_t> fresh;
            for (size_t i = shown; i < committed.size() && !ended; ++i) {
                const int64_t t = committed[i];
                if (o.stop_at_eos && std::count(c.eos_token_ids.begin(), c.eos_token_ids.end(), t)) ended = true;
                else if (t != c.mask_token_id) fresh.push_back(t);
            }
            shown = committed.size();
            print(fresh);
        };
    const auto t1 = std::chrono::steady_clock::now();
    const auto r = with_flag_errors(dlm_flags(), [&] {
        return dlm_generate(model, prompt, o, dlm_seeded_draws(static_cast<uint64_t>(s.seed)), on_block);
    });
    const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    if (!a.stream) print(r.generated);
    std::cout << "\n";
    std::cerr << enum_name(dlm_family_table(), c.family) << " (" << c.describe() << "): " << r.prompt_tokens
              << " prompt + " << r.generated.size() << " tokens, " << r.steps_run << " steps, cache "
              << enum_name(dlm_cache_table(), o.cache) << ", " << r.positions_computed << " positions computed, "
              << gen_s << " s, weights " << model.weight_bytes() / 1e6 << " MB, products "
              << enum_name(kernels::qgemm_arithmetic_table(), model.qgemm()) << "\n";
    return r;
}

// One row of --compare / bench as it completes (the header before the first).
void print_dlm_bench_row(const DlmBenchReport& rep, size_t i) {
    const auto& r = rep.rows[i];
    if (i == 0)
        std::cout << "cache | steps | s/step | total s (min/med/max) | positions computed | speed-up | agreement | "
                     "weights MB | peak RSS MB\n";
    std::cout << std::fixed << std::setprecision(4) << enum_name(dlm_cache_table(), r.cache) << " | " << r.steps
              << " | " << r.per_step_s() << " | " << std::setprecision(3) << r.min_s() << " / " << r.median_s()
              << " / " << r.max_s() << " | " << r.positions << " | " << std::setprecision(2) << rep.speedup(i)
              << "x | " << std::setprecision(1) << 100 * r.agreement << "% | " << rep.weight_bytes / 1e6 << " | "
              << rep.peak_rss_bytes / 1e6 << std::defaultfloat << std::endl;
}

// `diffusion bench -m MODEL --prompts-from F [--score-with G]`: the quality table of text/bench/dlm_quality_bench.h.
int run_dlm_quality_bench(DlmModel& model, const DlmConfig& c, DlmSampleOptions o, const std::vector<DlmCache>& modes,
                          const DlmBenchCliArgs& b) {
    std::optional<LoadedGpt2> scorer;
    if (!b.score_with.empty()) scorer = load_gpt2(b.score_with);
    const auto prompts = dlm_prompts_from(b.prompts_from, c, b.repeats, b.prompt_len);
    nlohmann::json all = nlohmann::json::array();
    for (auto steps : b.steps.empty() ? std::vector<int64_t>{o.steps} : b.steps) {
        o.steps = steps;
        std::cout << c.describe() << " | " << prompts.size() << " prompts of " << b.prompt_len << " from "
                  << b.prompts_from << ", gen " << o.gen_length << ", block " << o.block_length << ", steps " << steps
                  << ", temperature " << o.temperature_for(c.family) << ", seeds " << b.seed << ".."
                  << b.seed + prompts.size() - 1 << std::endl;
        const auto rep = with_flag_errors(dlm_flags(), [&] {
            return dlm_quality_bench(model, prompts, o, modes, b.seed, scorer ? &scorer->model : nullptr,
                                     [](size_t k) { std::cerr << "prompt " << k + 1 << " done" << std::endl; });
        });
        std::cout << "cache | speed-up per prompt (median) | full forwards per prompt | forward ratio | agreement | "
                     "entropy (change) | gen-PPL +-95% (change)\n";
        for (size_t i = 0; i < rep.rows.size(); ++i) {
            const auto& r = rep.rows[i];
            std::cout << std::fixed << enum_name(dlm_cache_table(), r.cache) << " | " << std::setprecision(2)
                      << rep.median_speedup(i) << "x | " << std::setprecision(1) << r.full_forwards << " | "
                      << std::setprecision(2) << rep.forward_ratio(i) << "x | " << std::setprecision(1)
                      << 100 * r.agreement << "% | " << std::setprecision(3) << r.entropy.mean << " ("
                      << std::showpos << std::setprecision(1) << 100 * rep.entropy_change(i) << "%)" << std::noshowpos;
            if (r.gen_ppl.mean >= 0)
                std::cout << " | " << std::setprecision(2) << r.gen_ppl.mean << " +- " << r.gen_ppl.ci95 << " ("
                          << std::showpos << std::setprecision(1) << 100 * rep.gen_ppl_change(i) << "%)"
                          << std::noshowpos;
            std::cout << std::defaultfloat << "\n";
        }
        auto j = rep.to_json();
        j["steps"] = steps;
        all.push_back(j);
    }
    if (!b.json_out.empty()) {
        nlohmann::json doc = {{"model", b.model},         {"config", c.describe()},       {"prompts_from", b.prompts_from},
                              {"score_with", b.score_with}, {"seed", b.seed},             {"runs", all}};
        write_file_atomic(b.json_out, doc.dump(1) + "\n", b.overwrite);
        std::cout << "wrote " << b.json_out << "\n";
    }
    return 0;
}

} // namespace

int run_dlm_generate(const DlmCliArgs& a, const DlmSharedArgs& s) {
    LoadedDlm loaded = dlm_load(a, s);
    auto& model = *loaded.model;
    const auto& c = model.config();
    const DlmSampleOptions o = dlm_options(a, s, c);
    // Text in and out: the folder's tokenizer (GPT-2's for DiffuGPT, tokenizer.json for LLaDA / Dream).
    std::shared_ptr<DlmTokenizer> tok;
    if (!s.prompt.empty() || !s.print_ids) tok = load_dlm_tokenizer(loaded, s.vocab);
    std::vector<int64_t> prompt;
    if (!s.prompt.empty() && !s.prompt_ids.empty()) throw UsageError("give either --prompt or --prompt-ids, not both");
    if (!s.prompt.empty()) {
        const auto tmpl = a.no_chat ? ChatTemplate::None : detect_chat_template(loaded.folder);
        prompt = tok->encode_with_specials(apply_chat_template(tmpl, s.prompt));
    } else if (!s.prompt_ids.empty()) {
        prompt = parse_token_ids(s.prompt_ids, "--prompt-ids", c.vocab_size, "a token id of this model");
    } else if (c.family == DlmFamily::DiffuGpt) {
        throw UsageError("DiffuGPT needs a --prompt or --prompt-ids (its first position is kept)");
    }
    if (!s.compare.empty()) {
        const auto modes = with_flag_errors(dlm_flags(), [&] { return parse_dlm_cache_list(s.compare, "compare"); });
        const auto rep = with_flag_errors(dlm_flags(), [&] {
            return dlm_bench(model, prompt, o, modes, 1, static_cast<uint64_t>(s.seed), print_dlm_bench_row);
        });
        for (const auto& r : rep.rows) {
            std::cout << "--- " << enum_name(dlm_cache_table(), r.cache) << ": ";
            if (s.print_ids || !tok)
                for (auto t : r.generated) std::cout << t << " ";
            else
                std::cout << tok->decode(r.generated);
            std::cout << "\n";
        }
        return 0;
    }
    dlm_run_printed(model, tok.get(), prompt, o, a, s);
    return 0;
}

int run_dlm_bench(const DlmCliArgs& a, const DlmBenchCliArgs& b) {
    if (!b.json_out.empty()) check_output_path(b.json_out, b.overwrite);
    DlmSharedArgs s;
    s.model = b.model, s.block_length = b.block_length, s.seed = int64_t(b.seed), s.temperature = b.temperature;
    LoadedDlm loaded = dlm_load(a, s);
    auto& model = *loaded.model;
    const auto& c = model.config();
    DlmSampleOptions o = dlm_options(a, s, c);
    o.temperature = b.temperature;
    o.stop_at_eos = false; // every run does the same work
    const bool blocks = c.family == DlmFamily::Llada || o.diffugpt_blockwise(c);
    std::vector<std::string> lists = {b.baseline};
    if (b.caches.empty())
        lists.push_back(blocks ? "prefix,dual" : "");
    else
        lists.insert(lists.end(), b.caches.begin(), b.caches.end());
    const auto modes = with_flag_errors(
        {{"compare", "--cache or --baseline"}}, [&] { return parse_dlm_cache_list(lists, "compare"); });
    if (!b.prompts_from.empty()) return run_dlm_quality_bench(model, c, o, modes, b);
    const auto prompt = dlm_synthetic_prompt(c, b.prompt_len);
    nlohmann::json all = nlohmann::json::array();
    for (auto steps : b.steps.empty() ? std::vector<int64_t>{o.steps} : b.steps) {
        o.steps = steps;
        std::cout << c.describe() << " | products " << enum_name(kernels::qgemm_arithmetic_table(), model.qgemm())
                  << " | gen " << o.gen_length << ", block " << o.block_length << ", steps " << steps
                  << ", prompt " << prompt.size() << ", repeats " << b.repeats << "\n";
        const auto rep = with_flag_errors(dlm_flags(), [&] {
            return dlm_bench(model, prompt, o, modes, b.repeats, b.seed, print_dlm_bench_row);
        });
        auto j = rep.to_json();
        j["steps"] = steps;
        all.push_back(j);
    }
    if (!b.json_out.empty()) {
        nlohmann::json doc = {{"model", b.model},
                              {"config", c.describe()},
                              {"weights", a.weights_dtype.empty() ? "default" : a.weights_dtype},
                              {"qgemm", enum_name(kernels::qgemm_arithmetic_table(), model.qgemm())},
                              {"gen_length", o.gen_length},
                              {"block_length", o.block_length},
                              {"runs", all}};
        write_file_atomic(b.json_out, doc.dump(1) + "\n", b.overwrite);
        std::cout << "wrote " << b.json_out << "\n";
    }
    return 0;
}

namespace {

// `diffusion chat`: one user turn per line of standard input; the conversation is rendered through the folder's chat
// template every turn, the answer (cut at EOS) becoming the assistant's turn.
int run_dlm_chat(const DlmCliArgs& a, const DlmSharedArgs& s) {
    LoadedDlm loaded = dlm_load(a, s);
    auto& model = *loaded.model;
    const DlmSampleOptions o = dlm_options(a, s, model.config());
    const auto tok = load_dlm_tokenizer(loaded, s.vocab);
    const auto tmpl = detect_chat_template(loaded.folder);
    if (tmpl == ChatTemplate::None)
        throw UsageError("'" + loaded.folder + "' has no chat_template in tokenizer_config.json (an instruct model's " +
                         "folder has one); use diffusion generate for a base model");
    std::vector<ChatMessage> history;
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) break;
        history.push_back({"user", line});
        const auto r = dlm_run_printed(model, tok.get(), tok->encode_with_specials(render_chat(tmpl, history)), o, a, s);
        history.push_back({"assistant", tok->decode(r.generated)});
    }
    return 0;
}

} // namespace

void add_dlm_chat_command(CLI::App* diffusion, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto args = std::make_shared<std::pair<DlmCliArgs, DlmSharedArgs>>();
    auto& [a, s] = *args;
    auto* chat = diffusion->add_subcommand(
        "chat", "Chat with a LLaDA / Dream instruct folder (or GGUF next to its tokenizer): one user turn per stdin line");
    chat->add_option("-m,--model", s.model, "Model folder or .gguf (tokenizer.json and tokenizer_config.json next to it)")
        ->required();
    chat->add_option("--vocab", s.vocab, "Tokenizer folder or tokenizer.json (default: the model's folder)");
    chat->add_option("--steps", s.steps, "Denoising steps (default: --gen-length)");
    chat->add_option("--block-length", s.block_length, "LLaDA's semi-autoregressive block length (0 = one block)");
    chat->add_option("--temperature", s.temperature, "Sampling temperature (default: the family's)");
    chat->add_option("--top-p", s.top_p, "Nucleus cut (default: the family's)");
    chat->add_option("--top-k", s.top_k, "Dream: keep the k most likely tokens");
    chat->add_option("-s,--seed", s.seed, "Random seed")->capture_default_str();
    chat->add_option("--cache", s.cache, "off, prefix or dual (LLaDA)")->capture_default_str();
    chat->add_flag("--ids", s.print_ids, "Print token ids instead of text");
    add_dlm_options(chat, a);
    runners.emplace_back(chat, [args] { return run_dlm_chat(args->first, args->second); });
}

void add_dlm_random_model_command(CLI::App* diffusion,
                                  std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    struct Args {
        std::string preset, out, weights = "q4_0";
        int64_t layers = 0;
        uint64_t seed = 0;
    };
    auto a = std::make_shared<Args>();
    std::string presets;
    for (const auto& p : dlm_random_presets()) presets += (presets.empty() ? "" : ", ") + p;
    auto* cmd = diffusion->add_subcommand(
        "random-model", "Write a random-weight LLaDA / Dream GGUF of a published shape (streamed to disk)");
    cmd->add_option("--preset", a->preset, "Shape: " + presets)->required();
    cmd->add_option("-o,--output", a->out, "GGUF file to write (refused if it exists)")->required();
    cmd->add_option("--weights-dtype", a->weights, "Matrix storage: " + enum_choices(kernels::qweight_type_table()))
        ->capture_default_str();
    cmd->add_option("--layers", a->layers, "Fewer layers than the preset's (a quick file of the same widths)");
    cmd->add_option("-s,--seed", a->seed, "Random seed")->capture_default_str();
    runners.emplace_back(cmd, [a] {
        const auto wt = with_flag_errors(FlagNames{{"weights_dtype", "--weights-dtype"}}, [&] {
            return enum_from_string(kernels::qweight_type_table(), a->weights, "weights_dtype");
        });
        DlmConfig c;
        try {
            c = dlm_random_preset(a->preset);
        } catch (const Error& e) {
            throw UsageError(std::string("--preset: ") + e.what());
        }
        if (a->layers < 0 || a->layers > c.n_layers)
            throw UsageError("--layers: " + std::to_string(a->layers) + " is not in 1.." + std::to_string(c.n_layers));
        if (a->layers > 0) c.n_layers = a->layers;
        std::error_code ec;
        if (std::filesystem::exists(a->out, ec))
            throw UsageError("--output: '" + a->out + "' exists (not overwritten)");
        const auto t0 = std::chrono::steady_clock::now();
        write_random_dlm_gguf(a->out, c, wt, a->seed);
        std::cerr << "wrote " << a->out << " (" << c.describe() << ", " << a->weights << ", "
                  << std::filesystem::file_size(a->out) / 1e6 << " MB) in "
                  << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s\n";
        return 0;
    });
}

} // namespace anchor::cli
