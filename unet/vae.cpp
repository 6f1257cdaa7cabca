// AutoencoderKL encoder/decoder with diffusers 0.27 semantics (tests/golden/sd/vae_tiny/README.md).
#include "unet/vae.h"

#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/weight_map.h"
#include "kernels/linear.h"

#include <nlohmann/json.hpp>

#include <fstream>

namespace anchor::unet {

using torch::Tensor;

namespace {

constexpr double kEps = 1e-6; // every VAE norm (resnets, attention, conv_norm_out)

torch::nn::Conv2d conv3(int64_t in, int64_t out) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}
torch::nn::Conv2d conv1(int64_t in, int64_t out) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1));
}

} // namespace

VaeConfig VaeConfig::from_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig f(j, source);
    VaeConfig c;
    c.in_channels = f.get_int("in_channels", c.in_channels);
    c.out_channels = f.get_int("out_channels", c.out_channels);
    c.latent_channels = f.get_int("latent_channels", c.latent_channels);
    c.layers_per_block = f.get_int("layers_per_block", c.layers_per_block);
    c.norm_num_groups = f.get_int("norm_num_groups", c.norm_num_groups);
    c.block_out_channels = f.get_int_list("block_out_channels", c.block_out_channels);
    c.scaling_factor = f.get_double("scaling_factor", c.scaling_factor);
    if (c.block_out_channels.empty())
        f.fail("block_out_channels", "must not be empty", f.json().at("block_out_channels"));
    for (const char* k : {"down_block_types", "up_block_types"})
        for (const auto& t : f.get_string_list(k, {}))
            if (t != "DownEncoderBlock2D" && t != "UpDecoderBlock2D") f.fail("block type '" + t + "' is not supported");
    f.reject("latents_mean", "latents_mean/latents_std normalisation");
    return c;
}

VaeConfig VaeConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "VAE config").json(), path);
}

VaeConfig detect_vae_config(const WeightMap& w, const std::string& down, const std::string& resnets) {
    VaeConfig c;
    if (!w.has("encoder.conv_in.weight") || !w.has("post_quant_conv.weight"))
        throw Error("VAE weights lack encoder.conv_in.weight / post_quant_conv.weight");
    c.in_channels = int(w.shape("encoder.conv_in.weight")[1]);
    c.latent_channels = int(w.shape("post_quant_conv.weight")[0]);
    if (w.has("decoder.conv_out.weight")) c.out_channels = int(w.shape("decoder.conv_out.weight")[0]);
    auto conv1 = [&](int level, int block) {
        return down + std::to_string(level) + resnets + std::to_string(block) + ".conv1.weight";
    };
    c.block_out_channels.clear();
    for (int i = 0; w.has(conv1(i, 0)); ++i) c.block_out_channels.push_back(int(w.shape(conv1(i, 0))[0]));
    if (c.block_out_channels.empty()) throw Error("VAE weights have no " + down + "0 tensors");
    c.layers_per_block = 0;
    while (w.has(conv1(0, c.layers_per_block))) ++c.layers_per_block;
    return c;
}

VaeConfig VaeConfig::detect_from_weights(const WeightMap& w) {
    return detect_vae_config(w, "encoder.down_blocks.", ".resnets.");
}

VaeAttentionImpl::VaeAttentionImpl(int64_t ch, int64_t groups) {
    group_norm = register_module("group_norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, ch).eps(kEps)));
    to_q = register_module("to_q", torch::nn::Linear(ch, ch));
    to_k = register_module("to_k", torch::nn::Linear(ch, ch));
    to_v = register_module("to_v", torch::nn::Linear(ch, ch));
    to_out = register_module("to_out", torch::nn::ModuleList());
    out_linear = torch::nn::Linear(ch, ch);
    to_out->push_back(out_linear);
}

Tensor VaeAttentionImpl::forward(const Tensor& x) {
    const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    auto h = group_norm->forward(x).view({B, C, H * W}).transpose(1, 2);
    auto o = multi_head_attention(kernels::linear(to_q, h), kernels::linear(to_k, h), kernels::linear(to_v, h), 1,
                                  kernel, fast);
    o = kernels::linear(out_linear, o).transpose(1, 2).reshape({B, C, H, W});
    return o + x;
}

VaeMidBlockImpl::VaeMidBlockImpl(int64_t ch, int64_t groups) {
    resnets = register_module("resnets", torch::nn::ModuleList());
    attentions = register_module("attentions", torch::nn::ModuleList());
    for (int j = 0; j < 2; ++j) {
        res.emplace_back(ch, ch, 0, groups, kEps);
        resnets->push_back(res.back());
    }
    attn = VaeAttention(ch, groups);
    attentions->push_back(attn);
}

Tensor VaeMidBlockImpl::forward(const Tensor& x) {
    auto h = res[0]->forward(x, Tensor());
    h = attn->forward(h);
    return res[1]->forward(h, Tensor());
}

VaeEncoderImpl::VaeEncoderImpl(const VaeConfig& c) {
    const auto& boc = c.block_out_channels;
    const int64_t g = c.norm_num_groups;
    conv_in = register_module("conv_in", conv3(c.in_channels, boc[0]));
    down_blocks = register_module("down_blocks", torch::nn::ModuleList());
    int64_t out = boc[0];
    for (size_t i = 0; i < boc.size(); ++i) {
        const int64_t in = out;
        out = boc[i];
        auto b = VaeBlock();
        b->resnets = b->register_module("resnets", torch::nn::ModuleList());
        for (int j = 0; j < c.layers_per_block; ++j) {
            b->res.emplace_back(j == 0 ? in : out, out, 0, g, kEps);
            b->resnets->push_back(b->res.back());
        }
        if (i + 1 < boc.size()) {
            b->samplers = b->register_module("downsamplers", torch::nn::ModuleList());
            b->down = Downsample2D(out, 0);
            b->samplers->push_back(b->down);
        }
        blocks.push_back(b);
        down_blocks->push_back(b);
    }
    mid_block = register_module("mid_block", VaeMidBlock(boc.back(), g));
    conv_norm_out =
        register_module("conv_norm_out", torch::nn::GroupNorm(torch::nn::GroupNormOptions(g, boc.back()).eps(kEps)));
    conv_out = register_module("conv_out", conv3(boc.back(), 2 * c.latent_channels));
}

Tensor VaeEncoderImpl::forward(const Tensor& x, FeatureMap* f, const std::string& p) {
    auto h = perf::conv2d(conv_in, x, false);
    if (f) (*f)[p + "conv_in"] = h;
    for (size_t i = 0; i < blocks.size(); ++i) {
        for (auto& r : blocks[i]->res) h = r->forward(h, Tensor());
        if (blocks[i]->down) h = blocks[i]->down->forward(h);
        if (f) (*f)[p + "down_blocks." + std::to_string(i)] = h;
    }
    h = mid_block->forward(h);
    if (f) (*f)[p + "mid_block"] = h;
    h = conv_norm_out->forward(h);
    if (f) (*f)[p + "conv_norm_out"] = h;
    h = perf::conv2d(conv_out, torch::silu(h), false);
    if (f) (*f)[p + "conv_out"] = h;
    return h;
}

VaeDecoderImpl::VaeDecoderImpl(const VaeConfig& c) {
    std::vector<int> rev(c.block_out_channels.rbegin(), c.block_out_channels.rend());
    const int64_t g = c.norm_num_groups;
    conv_in = register_module("conv_in", conv3(c.latent_channels, rev[0]));
    mid_block = register_module("mid_block", VaeMidBlock(rev[0], g));
    up_blocks = register_module("up_blocks", torch::nn::ModuleList());
    int64_t out = rev[0];
    for (size_t i = 0; i < rev.size(); ++i) {
        const int64_t in = out;
        out = rev[i];
        auto b = VaeBlock();
        b->resnets = b->register_module("resnets", torch::nn::ModuleList());
        for (int j = 0; j < c.layers_per_block + 1; ++j) {
            b->res.emplace_back(j == 0 ? in : out, out, 0, g, kEps);
            b->resnets->push_back(b->res.back());
        }
        if (i + 1 < rev.size()) {
            b->samplers = b->register_module("upsamplers", torch::nn::ModuleList());
            b->up = Upsample2D(out);
            b->samplers->push_back(b->up);
        }
        blocks.push_back(b);
        up_blocks->push_back(b);
    }
    conv_norm_out =
        register_module("conv_norm_out", torch::nn::GroupNorm(torch::nn::GroupNormOptions(g, rev.back()).eps(kEps)));
    conv_out = register_module("conv_out", conv3(rev.back(), c.out_channels));
}

Tensor VaeDecoderImpl::forward(const Tensor& z, FeatureMap* f, const std::string& p) {
    auto h = perf::conv2d(conv_in, z, false);
    if (f) (*f)[p + "conv_in"] = h;
    h = mid_block->forward(h);
    if (f) (*f)[p + "mid_block"] = h;
    for (size_t i = 0; i < blocks.size(); ++i) {
        for (auto& r : blocks[i]->res) h = r->forward(h, Tensor());
        if (blocks[i]->up) h = blocks[i]->up->forward(h);
        if (f) (*f)[p + "up_blocks." + std::to_string(i)] = h;
    }
    h = conv_norm_out->forward(h);
    if (f) (*f)[p + "conv_norm_out"] = h;
    h = perf::conv2d(conv_out, torch::silu(h), false);
    if (f) (*f)[p + "conv_out"] = h;
    return h;
}

Tensor LatentDistribution::sample(torch::Generator* gen) const {
    auto noise = gen ? torch::randn(mean.sizes(), *gen, mean.options()) : torch::randn(mean.sizes(), mean.options());
    return mean + std * noise;
}

AutoencoderKLImpl::AutoencoderKLImpl(const VaeConfig& c) : cfg_(c) {
    encoder = register_module("encoder", VaeEncoder(c));
    decoder = register_module("decoder", VaeDecoder(c));
    quant_conv = register_module("quant_conv", conv1(2 * c.latent_channels, 2 * c.latent_channels));
    post_quant_conv = register_module("post_quant_conv", conv1(c.latent_channels, c.latent_channels));
}

Tensor AutoencoderKLImpl::decode(const Tensor& z, FeatureMap* f, const std::string& prefix) {
    c10::InferenceMode guard(!is_training()); // train() mode keeps autograd (unet/train/)
    // The compute dtype is the biases' (weights may be stored in reduced precision, unet/checkpoint.h weights_dtype).
    auto h = perf::conv2d(post_quant_conv, z.to(post_quant_conv->bias.scalar_type()), false);
    if (f) (*f)[prefix + "post_quant_conv"] = h;
    return decoder->forward(h, f, prefix + "decoder.");
}

LatentDistribution AutoencoderKLImpl::encode(const Tensor& image, FeatureMap* f, const std::string& prefix) {
    c10::InferenceMode guard(!is_training());
    auto h = encoder->forward(image.to(quant_conv->bias.scalar_type()), f, prefix + "encoder.");
    LatentDistribution d;
    d.moments = perf::conv2d(quant_conv, h, false);
    if (f) (*f)[prefix + "quant_conv"] = d.moments;
    auto mv = d.moments.chunk(2, 1);
    d.mean = mv[0];
    d.logvar = mv[1].clamp(-30.0, 20.0);
    d.std = torch::exp(0.5 * d.logvar);
    return d;
}

void AutoencoderKLImpl::load(const WeightMap& w) {
    w.load_into(*this);
}

void AutoencoderKLImpl::set_fast_paths(bool on) {
    for (const auto& m : modules(false))
        if (auto* a = dynamic_cast<VaeAttentionImpl*>(m.get())) a->fast = on;
}

void AutoencoderKLImpl::set_attention_kernel(kernels::AttentionKernel k) {
    for (const auto& m : modules(false))
        if (auto* a = dynamic_cast<VaeAttentionImpl*>(m.get())) a->kernel = k;
}

} // namespace anchor::unet
