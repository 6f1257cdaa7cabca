// The pieces every demo-model trainer of unet/train/ shares (sd_train.cpp's VAE, UNet and classifier, and
// controlnet_train.cpp's ControlNet): the warm-up + cosine learning rate, the EMA of the weights, resumable
// checkpoints (<out>/checkpoint/<what>/) and the "step loss lr seconds" log with its progress line.
#pragma once

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "cache/train/optim.h"
#include "cache/util/bench.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/train/fashion_mnist.h"
#include "unet/train/sd_train.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace anchor::unet::train {

inline double lr_at(const TrainOptions& o, int step) {
    return cache::warmup_cosine_lr(o.lr, step, o.warmup, o.steps, o.min_lr_fraction);
}

inline NamedTensors named_params(torch::nn::Module& m) {
    NamedTensors out;
    for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
    for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
    return out;
}

// Exponential moving average of the parameters (Polyak averaging), decay warmed up as min(d, (1+s)/(10+s)) so early
// averages are not dominated by the random initialisation.
class Ema {
public:
    Ema(torch::nn::Module& m, double decay) : decay_(decay) {
        torch::NoGradGuard ng;
        for (const auto& p : m.named_parameters()) shadow_.emplace_back(p.key(), p.value().detach().clone());
    }
    void update(torch::nn::Module& m, int step) {
        if (decay_ <= 0) return;
        torch::NoGradGuard ng;
        const double d = std::min(decay_, (1.0 + step) / (10.0 + step));
        size_t i = 0;
        for (const auto& p : m.named_parameters()) shadow_[i++].second.mul_(d).add_(p.value().detach(), 1 - d);
    }
    const NamedTensors& tensors() const { return shadow_; }
    void load(const WeightMap& w) {
        torch::NoGradGuard ng;
        for (auto& [n, t] : shadow_) t.copy_(w.get(n));
    }
    // The weights to save: the EMA when enabled, else the live ones.
    NamedTensors weights(torch::nn::Module& m) const { return decay_ > 0 ? shadow_ : named_params(m); }

private:
    double decay_;
    NamedTensors shadow_;
};

// A checkpoint's state.json, written last (a checkpoint counts once it is there): the step it holds, the training
// seconds until then and the model it belongs to.
struct CheckpointState {
    int step = 0;
    double seconds = 0.0;
    std::string what;
    std::vector<JsonField> fields() {
        return {ANCHOR_JSON_FIELD(*this, step), ANCHOR_JSON_FIELD(*this, seconds), ANCHOR_JSON_FIELD(*this, what)};
    }
};

struct Loop {
    const TrainOptions& o;
    std::string what;
    std::filesystem::path ckpt;
    std::ofstream log;
    double t0 = util::now_s(), t_resume = 0;
    double sum = 0;
    int count = 0, start = 0;
    std::vector<double> window_means;
    // With a time budget (> 0 seconds) the learning-rate schedule runs on the larger of the step fraction and the
    // elapsed fraction of the budget, so that a run the budget stops ends annealed whatever the machine's speed.
    double time_budget = 0;

    Loop(const TrainOptions& opt, const std::string& w) : o(opt), what(w) {
        if (o.out.empty()) throw ParamError("out", "train: an output folder is required");
        if (o.steps < 1 || o.batch < 1)
            throw ParamError(o.steps < 1 ? "steps" : "batch", "train: steps and batch must be >= 1");
        ckpt = std::filesystem::path(o.out) / "checkpoint" / what; // created by begin(), once the inputs have loaded
    }
    std::string log_path() const { return (std::filesystem::path(o.out) / ("train_" + what + "_log.txt")).string(); }
    // Training seconds so far (a resumed run counts its earlier segments).
    double elapsed() const { return t_resume + util::now_s() - t0; }
    double lr(int step) const {
        if (time_budget <= 0) return lr_at(o, step);
        return lr_at(o, std::max(step, std::min(o.steps - 1, int(elapsed() / time_budget * o.steps))));
    }

    // Restores model/EMA/optimizer from the checkpoint when resuming; returns the step to continue from.
    int begin(torch::nn::Module& m, Ema& ema, torch::optim::Optimizer& opt) {
        std::filesystem::create_directories(ckpt);
        if (o.resume && std::filesystem::exists(ckpt / "state.json")) {
            const auto j = JsonConfig::load((ckpt / "state.json").string(), "checkpoint state");
            if (!j.has("step")) j.fail("'step' is missing (not a checkpoint's state.json)");
            CheckpointState st;
            j.read(st.fields());
            start = st.step;
            t_resume = st.seconds;
            WeightMap::load((ckpt / "model.safetensors").string()).load_into(m);
            if (std::filesystem::exists(ckpt / "ema.safetensors"))
                ema.load(WeightMap::load((ckpt / "ema.safetensors").string()));
            torch::load(opt, (ckpt / "optimizer.pt").string());
            std::fprintf(stderr, "%s: resuming at step %d of %d\n", what.c_str(), start, o.steps);
        }
        t0 = util::now_s(); // data loading and model set-up are not training time
        log.open(log_path(), start > 0 ? std::ios::app : std::ios::trunc);
        if (start == 0) log << "# step loss lr seconds\n";
        return start;
    }
    void set_lr(torch::optim::Optimizer& opt, int step) {
        for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr(step));
    }
    // `last`: the final step of the run (written to the log and checkpointed even off the regular intervals).
    void record(int step, double loss, torch::nn::Module& m, Ema& ema, torch::optim::Optimizer& opt,
                bool last = false) {
        sum += loss;
        ++count;
        last = last || step + 1 == o.steps;
        if ((step + 1) % o.log_every == 0 || last) {
            const double mean = sum / count;
            window_means.push_back(mean);
            log << step + 1 << " " << mean << " " << lr(step) << " " << elapsed() << "\n" << std::flush;
            sum = 0, count = 0;
        }
        if (!o.quiet) {
            const double per = (util::now_s() - t0) / double(step + 1 - start);
            std::fprintf(stderr, "\r%s: step %d/%d  loss %.4f (last %d: %.4f)  lr %.2e  %.2fs/step  ETA %.0fs   ",
                         what.c_str(), step + 1, o.steps, loss, o.log_every,
                         window_means.empty() ? loss : window_means.back(), lr(step), per,
                         per * double(o.steps - step - 1));
            std::fflush(stderr);
        }
        if ((step + 1) % o.checkpoint_every == 0 || last) save_checkpoint(step + 1, m, ema, opt, elapsed());
    }
    void save_checkpoint(int step, torch::nn::Module& m, Ema& ema, torch::optim::Optimizer& opt, double secs) {
        save_safetensors((ckpt / "model.safetensors").string(), named_params(m));
        save_safetensors((ckpt / "ema.safetensors").string(), ema.tensors());
        const auto tmp = (ckpt / "optimizer.pt.tmp").string();
        torch::save(opt, tmp);
        std::filesystem::rename(tmp, ckpt / "optimizer.pt");
        // state.json last: a checkpoint counts only once all its files are in place.
        CheckpointState st{step, secs, what};
        write_file_atomic((ckpt / "state.json").string(), json_of(st.fields()).dump() + "\n", true);
    }
    TrainResult finish(int steps_done) {
        if (!o.quiet) std::fprintf(stderr, "\n");
        TrainResult r;
        r.steps_done = steps_done;
        r.first_loss = window_means.empty() ? 0 : window_means.front();
        r.final_loss = window_means.empty() ? 0 : window_means.back();
        r.seconds = elapsed();
        r.log_path = log_path();
        return r;
    }
};

// The token ids of every training prompt of the fashion demo (bundled CLIP tokenizer): row c * T + k is template k of
// class c, row 10 * T the empty prompt (caption dropout, the unconditional rows). [10 * T + 1, 77].
inline torch::Tensor fashion_prompt_ids() {
    const auto tok = ClipTokenizer::bundled();
    const auto& templates = fashion_prompt_templates();
    std::vector<torch::Tensor> rows;
    for (int c = 0; c < 10; ++c)
        for (size_t k = 0; k < templates.size(); ++k)
            rows.push_back(torch::tensor(tok.tokenize(fashion_prompt(c, int(k))).ids, torch::kLong));
    rows.push_back(torch::tensor(tok.tokenize("").ids, torch::kLong));
    return torch::stack(rows);
}

// The conditioning and noising of one text-to-image diffusion batch (train_unet, train_controlnet): the prompt row
// of each sample (template k of its class: labels * n_templates + k, or `uncond_row`, the empty prompt, with
// probability `dropout`: classifier-free guidance, Ho & Salimans 2022), a uniform timestep, the noise, and
// x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps (q(x_t | x_0), DDPM eq. 4). Draws in that order from `gen`.
struct NoisedBatch {
    torch::Tensor row, t, eps, xt;
};
inline NoisedBatch noised_batch(const torch::Tensor& x0, const torch::Tensor& labels, int64_t n_templates,
                                int64_t uncond_row, double dropout, const torch::Tensor& alphas_cumprod,
                                torch::Generator& gen) {
    const int64_t b = x0.size(0);
    NoisedBatch n;
    auto tmpl = torch::randint(n_templates, {b}, gen, torch::kLong);
    n.row = labels * n_templates + tmpl;
    auto drop = torch::rand({b}, gen, torch::kFloat) < dropout;
    n.row = torch::where(drop, torch::full_like(n.row, uncond_row), n.row);
    n.t = torch::randint(alphas_cumprod.size(0), {b}, gen, torch::kLong);
    n.eps = torch::randn(x0.sizes(), gen, torch::kFloat);
    const auto abar = alphas_cumprod.index_select(0, n.t).view({-1, 1, 1, 1});
    n.xt = abar.sqrt() * x0 + (1 - abar).sqrt() * n.eps;
    return n;
}

inline torch::optim::AdamW make_adamw(std::vector<torch::Tensor> params, const TrainOptions& o) {
    return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
}

inline void to_half_file(const std::string& path, const NamedTensors& t) {
    NamedTensors h;
    for (const auto& [n, v] : t) h.emplace_back(n, v.detach().to(torch::kHalf));
    save_safetensors(path, h);
}

// Copies named tensors (e.g. the EMA weights) into a fresh module through the checked loader.
inline void load_named(torch::nn::Module& m, const NamedTensors& t) {
    WeightMap w;
    for (const auto& [n, v] : t) w.insert(n, v);
    w.load_into(m);
}

inline void write_json(const std::filesystem::path& p, const nlohmann::json& j) {
    write_file_atomic(p.string(), j.dump(2) + "\n", true);
}

} // namespace anchor::unet::train
