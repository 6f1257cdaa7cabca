#include "text/diffusion/mdlm_run.h"

#include "cache/util/memory.h"
#include "text/gpt2/gpt2_model.h"
#include "text/params.h"

#include <cmath>
#include <map>
#include <optional>
#include <sstream>

namespace anchor::text {

const std::vector<std::pair<std::string, std::string>>& decode_spec_keys() {
    static const std::vector<std::pair<std::string, std::string>> k = {
        {"unmask", "unmasking rule of this mode (ancestral, confidence, margin, entropy, random)"},
        {"threshold", "Fast-dLLM confidence threshold in (0, 1]: unmask every position above it, at least one"},
        {"factor", "Fast-dLLM factor rule f > 0"},
        {"block", "semi-autoregressive block length of this mode (0 = one block)"},
        {"steps", "denoising steps of this mode (fewer than the run's: several tokens per step)"},
        {"gemm", "linear layers of this mode (torch, onednn, bf16; default the run's --gemm)"}};
    return k;
}

void DecodeSpec::apply(SamplerOptions& o) const {
    if (rule) o.rule = *rule;
    if (threshold) o.threshold = *threshold;
    if (factor) o.factor = *factor;
    if (block_length) o.block_length = *block_length;
    if (steps) o.steps = *steps;
}

std::string DecodeSpec::to_string() const {
    std::ostringstream os;
    os << cache.to_string();
    std::string sep = "+";
    auto add = [&](const std::string& k, const std::string& v) { os << sep << k << "=" << v, sep = ","; };
    auto num = [](double x) {
        std::ostringstream n;
        n << x;
        return n.str();
    };
    if (rule) add("unmask", unmask_rule_name(*rule));
    if (threshold) add("threshold", num(*threshold));
    if (factor) add("factor", num(*factor));
    if (block_length) add("block", std::to_string(*block_length));
    if (steps) add("steps", std::to_string(*steps));
    if (gemm) add("gemm", enum_name(kernels::gemm_backend_table(), *gemm));
    return os.str();
}

DecodeSpec parse_decode_spec(const std::string& s) {
    DecodeSpec d;
    d.label = s;
    const auto plus = s.find('+');
    d.cache = parse_cache_spec(s.substr(0, plus));
    if (plus == std::string::npos) return d;
    std::stringstream ss(s.substr(plus + 1));
    std::string item;
    while (std::getline(ss, item, ',')) {
        const auto eq = item.find('=');
        const std::string k = item.substr(0, eq), v = eq == std::string::npos ? "" : item.substr(eq + 1);
        auto number = [&] {
            size_t used = 0;
            double x = 0;
            try {
                x = std::stod(v, &used);
            } catch (...) {
                used = 0;
            }
            if (v.empty() || used != v.size() || !std::isfinite(x) || x < 0)
                throw ParamError("cache", "'" + s + "': " + k + "=" + v + " is not a number >= 0");
            return x;
        };
        if (k == "unmask")
            d.rule = enum_from_string(unmask_rule_table(), v, "cache '" + s + "': unmask");
        else if (k == "gemm")
            d.gemm = enum_from_string(kernels::gemm_backend_table(), v, "cache '" + s + "': gemm");
        else if (k == "threshold")
            d.threshold = number();
        else if (k == "factor")
            d.factor = number();
        else if (k == "block" || k == "steps") {
            const double x = number();
            if (x != std::floor(x) || x > 1e9)
                throw ParamError("cache", "'" + s + "': " + k + "=" + v + " is not an integer");
            (k == "block" ? d.block_length : d.steps) = static_cast<int64_t>(x);
        } else {
            std::string keys;
            for (const auto& [n, h] : decode_spec_keys()) keys += (keys.empty() ? "" : ", ") + n;
            throw ParamError("cache", "'" + s + "': '" + item + "' is not one of the decoding keys (" + keys + ")");
        }
    }
    return d;
}

GemmScope::GemmScope(MdlmModel model, const DecodeSpec& spec, kernels::GemmBackend fallback)
    : model_(std::move(model)), before_(model_->gemm_backend()) {
    // Only a change is written: a run on the model's own library (every server request) leaves the shared model as
    // it is.
    if (const auto g = spec.gemm.value_or(fallback); g != before_) model_->set_gemm_backend(g);
}

GemmScope::~GemmScope() {
    if (model_->gemm_backend() != before_) model_->set_gemm_backend(before_);
}

double unigram_entropy(const std::vector<int64_t>& ids, int64_t from) {
    std::map<int64_t, int64_t> counts;
    int64_t n = 0;
    for (size_t i = static_cast<size_t>(std::max<int64_t>(from, 0)); i < ids.size(); ++i, ++n) counts[ids[i]]++;
    double h = 0;
    for (const auto& [id, c] : counts) {
        const double p = double(c) / double(n);
        h -= p * std::log(p);
    }
    return h;
}

void DiffusionGenerateParams::validate() const {
    if (model.empty()) throw ParamError("model", "is empty: an MDLM folder or .safetensors file is needed");
    if (n_heads < 0) throw ParamError("n_heads", "must be >= 0, got " + std::to_string(n_heads));
    placement.validate();
    if (caches.empty() || caches.size() > 2)
        throw ParamError("caches", "must hold one cache mode or two to compare, got " + std::to_string(caches.size()));
    sampler.validate();
    for (const auto& c : caches) {
        SamplerOptions o = sampler;
        c.apply(o);
        o.validate();
    }
}

double token_agreement(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int64_t from) {
    int64_t same = 0, n = 0;
    for (size_t i = static_cast<size_t>(from); i < a.size() && i < b.size(); ++i, ++n) same += a[i] == b[i];
    return n ? double(same) / double(n) : 1.0;
}

nlohmann::json DiffusionRun::to_json() const {
    nlohmann::json j = {{"cache", cache.display()},
                        {"resolved", cache.to_string()},
                        {"cache_params", cache.cache.params_json()},
                        {"tokens", result.tokens},
                        {"seconds", result.seconds},
                        {"forward_passes", result.forward_passes},
                        {"unmasked_per_step", result.unmasked_per_step},
                        {"reused_fraction", result.cache.reused_fraction()},
                        {"full_steps", result.cache.full_steps},
                        {"drift_refreshes", result.cache.drift_refreshes},
                        {"store", cache::to_json(result.cache)}};
    if (gen_ppl >= 0) j["gen_ppl"] = gen_ppl;
    j["unigram_entropy"] = unigram_entropy(result.tokens, prompt_tokens);
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

int64_t estimate_sampling_bytes(const MdlmConfig& c, const SamplerOptions& o) {
    const double L = double(o.length), D = double(c.hidden_size), F = double(c.mlp_ratio) * D;
    // A block's working set (q, k, v, attention output, MLP hidden, residuals) and one head-batched score matrix
    // (with its softmax), the logits of every position with their softmax, and the cache's stored features (up to
    // the input, attention and MLP outputs of every block).
    const double block = L * (8 * D + 2 * F) + 2.0 * double(c.n_heads) * L * L;
    const double logits = 2.0 * L * double(c.vocab_size);
    const double cache = 3.0 * double(c.n_blocks) * L * D;
    return int64_t(4.0 * (block + logits + cache));
}

void check_sampling_memory(const MdlmConfig& c, const SamplerOptions& o) {
    // Rotary positions run past the training length without an error, into positions the model never saw.
    if (o.length > c.max_seq_len)
        throw ParamError("length", "must be <= " + std::to_string(c.max_seq_len) +
                                       ", the context the weights were trained for (config max_seq_len), got " +
                                       std::to_string(o.length));
    check_fits_memory("length", double(estimate_sampling_bytes(c, o)),
                      "sampling " + std::to_string(o.length) + " positions", "choose a smaller length");
}

void check_prompt_vocabulary(const MdlmModelImpl& model, const std::vector<int64_t>& prompt) {
    for (size_t i = 0; i < prompt.size(); ++i)
        if (!model.in_vocabulary({prompt[i]})) throw TokenOutsideVocabulary(i, prompt[i], model.config().vocab_size);
}

DiffusionReport generate_diffusion(const DiffusionGenerateParams& p, const StepCallback& on_step) {
    p.validate();
    auto model = load_mdlm(p.model, p.n_heads);
    configure_mdlm(model, p.attention, p.placement, p.gemm);
    return generate_diffusion(model, p, on_step);
}

DiffusionReport generate_diffusion(const MdlmModel& model, const DiffusionGenerateParams& p,
                                   const StepCallback& on_step, const LoadedGpt2* scorer_in) {
    p.validate();
    check_sampling_memory(model->config(), p.sampler);
    check_prompt_vocabulary(*model, p.sampler.prompt);
    std::optional<LoadedGpt2> loaded;
    if (!scorer_in && !p.score_with.empty()) loaded = load_gpt2(p.score_with);
    const LoadedGpt2* scorer = scorer_in ? scorer_in : loaded ? &*loaded : nullptr;
    DiffusionReport rep;
    rep.model = p.model;
    rep.score_with = p.score_with;
    rep.prompt_tokens = static_cast<int64_t>(p.sampler.prompt.size());
    rep.threads = at::get_num_threads();
    for (const auto& spec : p.caches) {
        GemmScope gemm(model, spec, model->gemm_backend());
        MdlmDenoiser den(model, spec.cache);
        DiffusionRun run;
        run.cache = spec;
        run.prompt_tokens = rep.prompt_tokens;
        SamplerOptions so = p.sampler;
        spec.apply(so);
        run.result = sample(den, so, on_step);
        // Generative perplexity of the sampled tokens under the scoring GPT-2, conditioned on the prompt.
        if (scorer)
            run.gen_ppl = generative_ppl(scorer->model, run.result.tokens, std::max<int64_t>(rep.prompt_tokens, 1));
        rep.runs.push_back(std::move(run));
    }
    return rep;
}

} // namespace anchor::text
