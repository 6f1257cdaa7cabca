#include "text/text_job.h"

#include "text/diffusion/mdlm_model.h"

#include <memory>

namespace anchor::text {

batch::ItemJobResult run_gpt2_prompts(const GenerateParams& p, const batch::ItemJob& job,
                                      const std::function<void(const nlohmann::json&)>& done) {
    job.validate();
    GenerateParams first = p; // the prompt comes from the job
    first.prompt = job.items.front();
    first.validate();
    const LoadedGpt2 model = load_gpt2_model(p.model);
    const auto tok = std::make_shared<const Gpt2Tokenizer>(load_gpt2_tokenizer(p.model, model));
    return batch::run_item_job(
        job,
        [&](int64_t k, const std::string& prompt) {
            GenerateParams g = p;
            g.prompt = prompt;
            g.sampling.seed = p.sampling.seed + uint64_t(k);
            StreamRunner runner(g, model, tok);
            std::string text;
            const auto r = runner.run([&](const std::string& piece) { text += piece; });
            batch::ItemOutput o;
            o.content = prompt + text + "\n";
            o.record = {{"prompt", prompt},
                        {"seed", g.sampling.seed},
                        {"max_new_tokens", g.max_new_tokens},
                        {"prompt_tokens", r.prompt_tokens},
                        {"generated", r.generated},
                        {"finish_reason", runner.finish_reason()},
                        {"kv", r.kv.str()},
                        {"positions", enum_name(position_mode_table(), r.positions)},
                        {"sampler", r.sampler},
                        {"timings_s", {{"prefill", r.prefill_s}, {"generate", r.generate_s}}},
                        {"model", p.model.model}};
            return o;
        },
        done);
}

std::string generated_text(const std::vector<int64_t>& tokens, int64_t from, const Gpt2Tokenizer& tok) {
    std::vector<int64_t> gen;
    for (size_t i = size_t(std::max<int64_t>(from, 0)); i < tokens.size(); ++i)
        if (tokens[i] != kMdlmMaskId) gen.push_back(tokens[i]);
    return tok.decode(gen);
}

batch::ItemJobResult run_diffusion_prompts(const DiffusionGenerateParams& p, const Gpt2Tokenizer& tok,
                                           const batch::ItemJob& job,
                                           const std::function<void(const nlohmann::json&)>& done) {
    job.validate();
    p.validate();
    if (p.caches.size() != 1) throw ParamError("caches", "a prompts file runs one cache mode, not a comparison");
    MdlmModel model = load_mdlm(p.model, p.n_heads);
    configure_mdlm(model, p.attention, p.placement, p.gemm);
    std::optional<LoadedGpt2> scorer;
    if (!p.score_with.empty()) scorer = load_gpt2(p.score_with);
    return batch::run_item_job(
        job,
        [&](int64_t k, const std::string& prompt) {
            DiffusionGenerateParams d = p;
            d.sampler.prompt = tok.encode(prompt);
            d.sampler.seed = p.sampler.seed + uint64_t(k);
            const auto rep = generate_diffusion(model, d, {}, scorer ? &*scorer : nullptr);
            const auto& run = rep.runs.at(0);
            batch::ItemOutput o;
            o.content = prompt + generated_text(run.result.tokens, rep.prompt_tokens, tok) + "\n";
            o.record = run.to_json();
            o.record["prompt"] = prompt;
            o.record["seed"] = d.sampler.seed;
            o.record["prompt_tokens"] = rep.prompt_tokens;
            o.record["timings_s"] = {{"sample", run.result.seconds}};
            o.record["model"] = p.model;
            return o;
        },
        done);
}

} // namespace anchor::text
