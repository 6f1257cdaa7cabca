#include "cache/io/deferred_weights.h"

namespace anchor {

namespace {
thread_local bool g_active = false;
thread_local torch::ScalarType g_dtype = torch::kFloat;
} // namespace

DeferredWeights::DeferredWeights(torch::ScalarType weight_dtype) : prev_active_(g_active), prev_dtype_(g_dtype) {
    g_active = true;
    g_dtype = weight_dtype;
}

DeferredWeights::~DeferredWeights() {
    g_active = prev_active_;
    g_dtype = prev_dtype_;
}

// Built with one input and one output feature (channel per group): the random init touches a few bytes. The real
// shapes then replace the data, and the options are set to the real ones (Linear's forward reads none of them;
// Conv2d's reads stride, padding, dilation and groups, which the placeholder already had).
torch::nn::Linear make_linear(const torch::nn::LinearOptions& opts) {
    if (!g_active) return torch::nn::Linear(opts);
    torch::nn::Linear l(torch::nn::LinearOptions(1, 1).bias(opts.bias()));
    torch::NoGradGuard ng;
    l->weight.set_data(torch::empty({opts.out_features(), opts.in_features()}, torch::dtype(g_dtype)));
    if (opts.bias()) l->bias.set_data(torch::empty({opts.out_features()}));
    l->options = opts;
    return l;
}

torch::nn::Conv2d make_conv2d(const torch::nn::Conv2dOptions& opts) {
    if (!g_active) return torch::nn::Conv2d(opts);
    const int64_t groups = opts.groups();
    auto small = opts;
    small.in_channels(groups).out_channels(groups);
    torch::nn::Conv2d c(small);
    torch::NoGradGuard ng;
    const auto& k = *opts.kernel_size();
    c->weight.set_data(
        torch::empty({opts.out_channels(), opts.in_channels() / groups, k[0], k[1]}, torch::dtype(g_dtype)));
    if (opts.bias()) c->bias.set_data(torch::empty({opts.out_channels()}));
    c->options.in_channels(opts.in_channels()).out_channels(opts.out_channels());
    return c;
}

} // namespace anchor
