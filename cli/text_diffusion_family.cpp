// `anchor-text diffusion generate` on DiffuGPT / LLaDA / Dream folders: options, prompt and chat template, printing.
// The work is the library's (text/diffusion/families/dlm_sampler.h, dlm_chat.h).
#include "cli/text_diffusion_family.h"

#include "cache/io/error.h"
#include "cli/text_commands.h"
#include "text/diffusion/families/dlm_chat.h"
#include "text/diffusion/families/dlm_model.h"
#include "text/diffusion/families/dlm_sampler.h"

#include <algorithm>
#include <chrono>
#include <iostream>
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
                                {"alg_temp", "--alg-temp"}};
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
    return load_dlm(s.model, fam, a.mask_id);
}

DlmSampleOptions dlm_options(const DlmCliArgs& a, const DlmSharedArgs& s, const DlmConfig& c) {
    auto given = [&](const char* flag) { return a.app && a.app->count(flag) > 0; };
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
              << gen_s << " s\n";
    return r;
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
    dlm_run_printed(model, tok.get(), prompt, o, a, s);
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

} // namespace anchor::cli
