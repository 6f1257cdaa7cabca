// Optimiser pieces shared by the project's trainers (text/gpt2_train, text/mdlm_train, unet/train): AdamW with
// decoupled weight decay on matrices only (Loshchilov & Hutter 2019; norms and biases are not decayed), its state
// kept by parameter name so checkpoints store it as "m.<name>" / "v.<name>", and the warm-up + cosine schedule.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace anchor::cache {

struct AdamWConfig {
    double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

class NamedAdamW {
public:
    std::vector<std::pair<std::string, torch::Tensor>> params;
    std::map<std::string, torch::Tensor> m, v; // first and second moments by parameter name
    int64_t t = 0;                             // steps taken (bias correction)

    void init(torch::nn::Module& model) {
        for (auto& p : model.named_parameters(true)) {
            params.emplace_back(p.key(), p.value());
            m[p.key()] = torch::zeros_like(p.value());
            v[p.key()] = torch::zeros_like(p.value());
        }
    }
    void step(double lr, const AdamWConfig& c) {
        torch::NoGradGuard ng;
        ++t;
        const double bc1 = 1.0 - std::pow(c.beta1, double(t)), bc2 = 1.0 - std::pow(c.beta2, double(t));
        for (auto& [n, p] : params) {
            if (!p.grad().defined()) continue;
            const auto& g = p.grad();
            auto& mm = m[n];
            auto& vv = v[n];
            mm.mul_(c.beta1).add_(g, 1.0 - c.beta1);
            vv.mul_(c.beta2).addcmul_(g, g, 1.0 - c.beta2);
            if (p.dim() >= 2 && c.weight_decay > 0) p.mul_(1.0 - lr * c.weight_decay);
            auto denom = (vv / bc2).sqrt_().add_(c.eps);
            p.addcdiv_(mm, denom, -lr / bc1);
        }
    }
};

// Linear warm-up over `warmup` steps to `lr`, then cosine decay to min_ratio * lr at `steps` (SGDR, Loshchilov &
// Hutter 2017, one cycle).
inline double warmup_cosine_lr(double lr, int64_t step, int64_t warmup, int64_t steps, double min_ratio) {
    if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
    double prog = steps > warmup ? double(step - warmup) / double(steps - warmup) : 1.0;
    prog = std::min(1.0, std::max(0.0, prog));
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * prog)));
}

} // namespace anchor::cache
