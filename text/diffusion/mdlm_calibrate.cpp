#include "text/diffusion/mdlm_calibrate.h"

#include "cache/calibration.h"
#include "cache/io/error.h"
#include "text/params.h"

namespace anchor::text {

void CalibrateOptions::validate() const {
    if (prompts.empty()) throw ParamError("prompts", "is empty: at least one prompt is needed");
    if (classes < 1) throw ParamError("classes", "must be >= 1, got " + std::to_string(classes));
    if (max_stale < 1) throw ParamError("max_stale", "must be >= 1, got " + std::to_string(max_stale));
    for (const auto& p : prompts) {
        auto so = sampler;
        so.prompt = p;
        so.validate();
    }
}

cache::AnchorProfile calibrate_mdlm(MdlmModel& model, const CalibrateOptions& opt,
                                    std::vector<std::vector<double>>* out) {
    opt.validate();
    const int64_t nl = model->config().n_blocks, T = opt.sampler.steps;
    std::vector<std::vector<double>> sum(static_cast<size_t>(nl), std::vector<double>(static_cast<size_t>(T), 0.0));
    std::vector<std::vector<int64_t>> cnt(static_cast<size_t>(nl), std::vector<int64_t>(static_cast<size_t>(T), 0));
    const int64_t mask = model->internal_mask_id();
    for (const auto& prompt : opt.prompts) {
        MdlmDenoiser den(model, CacheSpec{});
        std::vector<torch::Tensor> prev_h(static_cast<size_t>(nl));
        std::vector<torch::Tensor> prev_ids(static_cast<size_t>(nl));
        den.on_layer_output = [&](int64_t step, int64_t l, const torch::Tensor& ids, const torch::Tensor& h) {
            auto& ph = prev_h[static_cast<size_t>(l)];
            auto& pi = prev_ids[static_cast<size_t>(l)];
            if (ph.defined() && step < T) {
                auto keep = (ids == pi) & (ids != mask);
                auto d = (h - ph).norm(2, {1}); // [L]
                double delta = keep.any().item<bool>()
                                   ? d.index_select(0, torch::nonzero(keep).reshape(-1)).mean().item<double>()
                                   : d.mean().item<double>();
                sum[static_cast<size_t>(l)][static_cast<size_t>(step)] += delta;
                cnt[static_cast<size_t>(l)][static_cast<size_t>(step)]++;
            }
            ph = h.clone();
            pi = ids.clone();
        };
        SamplerOptions so = opt.sampler;
        so.prompt = prompt;
        sample(den, so);
    }
    std::vector<std::vector<double>> deltas(static_cast<size_t>(nl), std::vector<double>(static_cast<size_t>(T), 0.0));
    for (int64_t l = 0; l < nl; ++l) {
        for (int64_t s = 1; s < T; ++s) deltas[l][s] = cnt[l][s] ? sum[l][s] / double(cnt[l][s]) : 0.0;
        deltas[l][0] = T > 1 ? deltas[l][1] : 0.0; // no previous step: like the next one
    }
    auto prof = cache::build_layer_profile(deltas, opt.classes, opt.max_stale);
    prof.meta = {{"steps", T},
                 {"length", opt.sampler.length},
                 {"prompts", opt.prompts.size()},
                 {"unmask", unmask_rule_name(opt.sampler.rule)},
                 {"max_stale", opt.max_stale},
                 {"delta", "mean ||H_s - H_{s-1}|| over positions decoded at both steps, per layer and step"}};
    if (out) *out = deltas;
    return prof;
}

} // namespace anchor::text
