// AutoencoderKL encoder/decoder with diffusers 0.27 semantics (tests/golden/sd/vae_tiny/README.md).
#include "unet/model/vae.h"
#include "unet/model/layers.h"

#include "cache/io/deferred_weights.h"

#include <algorithm>

#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/weight_map.h"
#include "cache/util/heap.h"
#include "kernels/linear.h"

#include <nlohmann/json.hpp>

#include <fstream>

namespace anchor::unet {

using torch::Tensor;

namespace {

constexpr double kEps = 1e-6; // every VAE norm (resnets, attention, conv_norm_out)

torch::nn::Conv2d conv1(int64_t in, int64_t out) {
    return make_conv2d(torch::nn::Conv2dOptions(in, out, 1));
}

// The coder's outer convolutions (conv_in, conv_out, quant_conv, post_quant_conv) take the plain module forward on
// LibTorch, as the reference does, and oneDNN's kernels with that backend like every other layer.
Tensor outer_conv(torch::nn::Conv2d& c, const Tensor& x, kernels::GemmBackend gemm) {
    perf::FastPaths how;
    how.fast = gemm != kernels::GemmBackend::Torch;
    how.gemm = gemm;
    return perf::conv2d(c, x, how);
}

// The fields from_json reads and to_json writes as they are.
std::vector<JsonField> json_fields(VaeConfig& c) {
    return {ANCHOR_JSON_FIELD(c, in_channels),     ANCHOR_JSON_FIELD(c, out_channels),
            ANCHOR_JSON_FIELD(c, latent_channels), ANCHOR_JSON_FIELD(c, layers_per_block),
            ANCHOR_JSON_FIELD(c, norm_num_groups), ANCHOR_JSON_FIELD(c, block_out_channels),
            ANCHOR_JSON_FIELD(c, scaling_factor)};
}

} // namespace

VaeConfig VaeConfig::from_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig f(j, source);
    VaeConfig c;
    f.read(json_fields(c));
    if (c.block_out_channels.empty())
        f.fail("block_out_channels", "must not be empty", f.json().at("block_out_channels"));
    for (const char* k : {"down_block_types", "up_block_types"})
        for (const auto& t : f.get_string_list(k, {}))
            if (t != "DownEncoderBlock2D" && t != "UpDecoderBlock2D") f.fail("block type '" + t + "' is not supported");
    if (f.has("force_upcast") && f.json().at("force_upcast").is_boolean())
        c.force_upcast = f.json().at("force_upcast").get<bool>();
    for (auto [key, v] : {std::pair{"latents_mean", &c.latents_mean}, std::pair{"latents_std", &c.latents_std}}) {
        if (!f.has(key) || f.json().at(key).is_null()) continue;
        const auto& a = f.json().at(key);
        if (!a.is_array() || a.size() != size_t(c.latent_channels))
            f.fail(key, "must be a list of " + std::to_string(c.latent_channels) + " numbers (latent_channels)", a);
        for (const auto& x : a) {
            if (!x.is_number()) f.fail(key, "must be a list of numbers", a);
            v->push_back(x.get<double>());
        }
    }
    if (c.latents_mean.empty() != c.latents_std.empty())
        f.fail("latents_mean and latents_std must be given together (diffusers uses them only as a pair)");
    if (f.has("shift_factor")) c.shift_factor = f.get_double("shift_factor", 0.0);
    c.use_quant_conv = f.get_bool("use_quant_conv", true);
    c.use_post_quant_conv = f.get_bool("use_post_quant_conv", true);
    return c;
}

nlohmann::json VaeConfig::to_json(int sample_size) const {
    VaeConfig c = *this;
    nlohmann::json j = json_of(json_fields(c));
    j["_class_name"] = "AutoencoderKL";
    j["act_fn"] = "silu";
    j["down_block_types"] = std::vector<std::string>(block_out_channels.size(), "DownEncoderBlock2D");
    j["up_block_types"] = std::vector<std::string>(block_out_channels.size(), "UpDecoderBlock2D");
    j["sample_size"] = sample_size;
    if (force_upcast) j["force_upcast"] = true;
    if (!latents_mean.empty()) j["latents_mean"] = latents_mean, j["latents_std"] = latents_std;
    if (shift_factor != 0.0) j["shift_factor"] = shift_factor;
    if (!use_quant_conv) j["use_quant_conv"] = false;
    if (!use_post_quant_conv) j["use_post_quant_conv"] = false;
    return j;
}

torch::Tensor VaeConfig::unscale_latents(const torch::Tensor& z) const {
    if (shift_factor != 0.0) return z / scaling_factor + shift_factor;
    if (latents_mean.empty()) return z / scaling_factor;
    const auto o = torch::TensorOptions().dtype(z.scalar_type()).device(z.device());
    auto mean = torch::tensor(latents_mean, torch::kDouble).to(o).view({1, -1, 1, 1});
    auto stdv = torch::tensor(latents_std, torch::kDouble).to(o).view({1, -1, 1, 1});
    return z * stdv / scaling_factor + mean;
}

VaeConfig VaeConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "VAE config").json(), path);
}

VaeConfig detect_vae_config(const WeightMap& w, const std::string& down, const std::string& resnets) {
    VaeConfig c;
    if (!w.has("encoder.conv_in.weight") || !w.has("decoder.conv_in.weight"))
        throw Error("VAE weights lack encoder.conv_in.weight / decoder.conv_in.weight");
    c.in_channels = int(w.shape("encoder.conv_in.weight")[1]);
    c.latent_channels = int(w.shape("decoder.conv_in.weight")[1]);
    c.use_quant_conv = w.has("quant_conv.weight");
    c.use_post_quant_conv = w.has("post_quant_conv.weight");
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
    to_q = register_module("to_q", make_linear(torch::nn::LinearOptions(ch, ch)));
    to_k = register_module("to_k", make_linear(torch::nn::LinearOptions(ch, ch)));
    to_v = register_module("to_v", make_linear(torch::nn::LinearOptions(ch, ch)));
    to_out = register_module("to_out", torch::nn::ModuleList());
    out_linear = make_linear(torch::nn::LinearOptions(ch, ch));
    to_out->push_back(out_linear);
}

Tensor VaeAttentionImpl::forward(const Tensor& x) {
    const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    auto h = group_norm->forward(x).view({B, C, H * W}).transpose(1, 2);
    auto o = multi_head_attention(perf::linear(to_q, h, *this), perf::linear(to_k, h, *this),
                                  perf::linear(to_v, h, *this), 1, kernel, fast, perf::bf16_operands(*this));
    o = perf::linear(out_linear, o, *this).transpose(1, 2).reshape({B, C, H, W});
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

VaeBlockImpl::VaeBlockImpl(int64_t in, int64_t out, int n, int64_t groups, Sampler sampler) {
    resnets = register_module("resnets", torch::nn::ModuleList());
    for (int j = 0; j < n; ++j) {
        res.emplace_back(j == 0 ? in : out, out, 0, groups, kEps);
        resnets->push_back(res.back());
    }
    if (sampler == Sampler::None) return;
    samplers = register_module(sampler == Sampler::Down ? "downsamplers" : "upsamplers", torch::nn::ModuleList());
    if (sampler == Sampler::Down) {
        down = Downsample2D(out, 0);
        samplers->push_back(down);
    } else {
        up = Upsample2D(out);
        samplers->push_back(up);
    }
}

Tensor VaeBlockImpl::forward(Tensor h) {
    for (auto& r : res) h = r->forward(std::move(h), Tensor());
    if (down) h = down->forward(h);
    if (up) h = up->forward(h);
    return h;
}

VaeCoderImpl::VaeCoderImpl(const VaeConfig& c, bool decoder_) : decoder(decoder_) {
    std::vector<int> ch = c.block_out_channels;
    if (decoder) std::reverse(ch.begin(), ch.end());
    const int64_t g = c.norm_num_groups;
    conv_in = register_module("conv_in", conv3x3(decoder ? c.latent_channels : c.in_channels, ch[0]));
    if (decoder) mid_block = register_module("mid_block", VaeMidBlock(ch[0], g));
    block_list = register_module(decoder ? "up_blocks" : "down_blocks", torch::nn::ModuleList());
    const auto sampler = decoder ? VaeBlockImpl::Sampler::Up : VaeBlockImpl::Sampler::Down;
    for (size_t i = 0; i < ch.size(); ++i) {
        blocks.push_back(VaeBlock(i == 0 ? ch[0] : ch[i - 1], ch[i], c.layers_per_block + (decoder ? 1 : 0), g,
                                  i + 1 < ch.size() ? sampler : VaeBlockImpl::Sampler::None));
        block_list->push_back(blocks.back());
    }
    if (!decoder) mid_block = register_module("mid_block", VaeMidBlock(ch.back(), g));
    conv_norm_out =
        register_module("conv_norm_out", torch::nn::GroupNorm(torch::nn::GroupNormOptions(g, ch.back()).eps(kEps)));
    conv_out = register_module("conv_out", conv3x3(ch.back(), decoder ? c.out_channels : 2 * c.latent_channels));
}

Tensor VaeCoderImpl::forward(const Tensor& x, FeatureMap* f, const std::string& p) {
    auto h = outer_conv(conv_in, x, gemm);
    if (f) (*f)[p + "conv_in"] = h;
    auto mid = [&] {
        h = mid_block->forward(h);
        if (f) (*f)[p + "mid_block"] = h;
    };
    if (decoder) mid();
    for (size_t i = 0; i < blocks.size(); ++i) {
        h = blocks[i]->forward(std::move(h)); // moved: its first resnet may normalise it in place
        if (f) (*f)[p + (decoder ? "up_blocks." : "down_blocks.") + std::to_string(i)] = h;
    }
    if (!decoder) mid();
    if (f) {
        h = conv_norm_out->forward(h);
        (*f)[p + "conv_norm_out"] = h;
        h = torch::silu(h);
    } else {
        h = perf::group_norm_silu(conv_norm_out, std::move(h), *this);
    }
    h = outer_conv(conv_out, h, gemm);
    if (f) (*f)[p + "conv_out"] = h;
    return h;
}

Tensor LatentDistribution::sample(torch::Generator* gen) const {
    auto noise = gen ? torch::randn(mean.sizes(), *gen, mean.options()) : torch::randn(mean.sizes(), mean.options());
    return mean + std * noise;
}

AutoencoderKLImpl::AutoencoderKLImpl(const VaeConfig& c) : cfg_(c) {
    encoder = register_module("encoder", VaeCoder(c, false));
    decoder = register_module("decoder", VaeCoder(c, true));
    if (c.use_quant_conv)
        quant_conv = register_module("quant_conv", conv1(2 * c.latent_channels, 2 * c.latent_channels));
    if (c.use_post_quant_conv)
        post_quant_conv = register_module("post_quant_conv", conv1(c.latent_channels, c.latent_channels));
}

Tensor AutoencoderKLImpl::decode(const Tensor& z, FeatureMap* f, const std::string& prefix) {
    c10::InferenceMode guard(!is_training()); // train() mode keeps autograd (unet/train/)
    util::HeapScope heap;                     // reuse the decode's freed blocks (cache/util/heap.h)
    // The compute dtype is the biases' (weights may be stored in reduced precision, unet/model/checkpoint.h weights_dtype).
    const auto& b = decoder->conv_in->bias;
    auto h = in_layout(z.to(b.device(), b.scalar_type()));
    if (post_quant_conv) {
        h = outer_conv(post_quant_conv, h, gemm);
        if (f) (*f)[prefix + "post_quant_conv"] = h;
    }
    return decoder->forward(h, f, prefix + "decoder.").contiguous();
}

Tensor AutoencoderKLImpl::in_layout(const Tensor& x) const {
    // On oneDNN the coder runs channels-last: its convolutions read and write NHWC as it is (kernels/onednn.h), with
    // no blocked copy of each input and output (at 512x512, 128 MiB each per layer), and GroupNorm, SiLU, the
    // upsampling and the residual adds keep the layout.
    return perf::use_onednn(*this) && x.dim() == 4 ? x.contiguous(torch::MemoryFormat::ChannelsLast) : x;
}

LatentDistribution AutoencoderKLImpl::encode(const Tensor& image, FeatureMap* f, const std::string& prefix) {
    c10::InferenceMode guard(!is_training());
    util::HeapScope heap;
    const auto& b = encoder->conv_in->bias;
    auto h = encoder->forward(in_layout(image.to(b.device(), b.scalar_type())), f, prefix + "encoder.");
    if (!quant_conv) return latent_distribution(h.contiguous());
    auto moments = outer_conv(quant_conv, h, gemm).contiguous();
    if (f) (*f)[prefix + "quant_conv"] = moments;
    return latent_distribution(moments);
}

LatentDistribution latent_distribution(const Tensor& moments) {
    LatentDistribution d;
    d.moments = moments;
    auto mv = moments.chunk(2, 1);
    d.mean = mv[0];
    d.logvar = mv[1].clamp(-30.0, 20.0);
    d.std = torch::exp(0.5 * d.logvar);
    return d;
}

void AutoencoderKLImpl::load(const WeightMap& w) {
    w.load_into(*this);
}

void AutoencoderKLImpl::set_fast_paths(bool on) {
    for (const auto& m : modules(true))
        if (auto* f = dynamic_cast<perf::FastPaths*>(m.get())) f->fast = on;
}

void AutoencoderKLImpl::set_attention_kernel(kernels::AttentionKernel k) {
    for (const auto& m : modules(false))
        if (auto* a = dynamic_cast<VaeAttentionImpl*>(m.get())) a->kernel = k;
}

} // namespace anchor::unet
