#include "text/mdlm_run.h"

#include "text/gpt2_model.h"
#include "text/params.h"

#include <optional>

namespace anchor::text {

void DiffusionGenerateParams::validate() const {
    if (model.empty()) throw ParamError("model", "is empty: an MDLM folder or .safetensors file is needed");
    if (n_heads < 0) throw ParamError("n_heads", "must be >= 0, got " + std::to_string(n_heads));
    if (caches.empty() || caches.size() > 2)
        throw ParamError("caches", "must hold one cache mode or two to compare, got " + std::to_string(caches.size()));
    sampler.validate();
}

double token_agreement(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int64_t from) {
    int64_t same = 0, n = 0;
    for (size_t i = static_cast<size_t>(from); i < a.size() && i < b.size(); ++i, ++n) same += a[i] == b[i];
    return n ? double(same) / double(n) : 1.0;
}

nlohmann::json DiffusionRun::to_json() const {
    nlohmann::json j = {{"cache", cache.to_string()},
                        {"tokens", result.tokens},
                        {"seconds", result.seconds},
                        {"forward_passes", result.forward_passes},
                        {"unmasked_per_step", result.unmasked_per_step},
                        {"reused_fraction", result.cache.reused_fraction()},
                        {"full_steps", result.cache.full_steps},
                        {"store", cache::to_json(result.store)}};
    if (gen_ppl >= 0) j["gen_ppl"] = gen_ppl;
    return j;
}

double DiffusionReport::agreement() const {
    return runs.size() < 2 ? 1.0 : token_agreement(runs[0].result.tokens, runs[1].result.tokens, prompt_tokens);
}

nlohmann::json DiffusionReport::to_json() const {
    nlohmann::json j = {{"model", model}, {"prompt_tokens", prompt_tokens}, {"threads", threads}};
    if (!score_with.empty()) j["score_with"] = score_with;
    for (const auto& r : runs) j["runs"].push_back(r.to_json());
    if (runs.size() == 2) {
        j["token_agreement"] = agreement();
        j["speedup"] = runs[0].result.seconds / runs[1].result.seconds;
    }
    return j;
}

DiffusionReport generate_diffusion(const DiffusionGenerateParams& p, const StepCallback& on_step) {
    p.validate();
    auto model = load_mdlm(p.model, p.n_heads);
    std::optional<LoadedGpt2> scorer;
    if (!p.score_with.empty()) scorer = load_gpt2(p.score_with);
    DiffusionReport rep;
    rep.model = p.model;
    rep.score_with = p.score_with;
    rep.prompt_tokens = static_cast<int64_t>(p.sampler.prompt.size());
    rep.threads = at::get_num_threads();
    for (const auto& spec : p.caches) {
        MdlmDenoiser den(model, spec);
        DiffusionRun run;
        run.cache = den.spec();
        run.result = sample(den, p.sampler, on_step);
        // Generative perplexity of the sampled tokens under the scoring GPT-2, conditioned on the prompt.
        if (scorer)
            run.gen_ppl = generative_ppl(scorer->model, run.result.tokens, std::max<int64_t>(rep.prompt_tokens, 1));
        rep.runs.push_back(std::move(run));
    }
    return rep;
}

} // namespace anchor::text
