#include "unet/train/controlnet_train.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "kernels/attention.h"
#include "unet/model/checkpoint.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/pipeline/control.h"
#include "unet/pipeline/pipeline.h"
#include "unet/samplers/scheduler.h"
#include "unet/train/fashion_mnist.h"
#include "unet/train/train_loop.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>

namespace anchor::unet::train {

namespace fs = std::filesystem;
using torch::Tensor;

ControlPreprocessSpec fashion_canny_spec() {
    ControlPreprocessSpec s;
    s.kind = ControlPreprocess::Canny; // low 100, high 200: A1111's defaults
    return s;
}

Tensor fashion_control_edges(const Tensor& u8, const ControlPreprocessSpec& spec) {
    if (u8.dim() != 3 || u8.scalar_type() != torch::kUInt8)
        throw Error("fashion_control_edges: expected uint8 [N, 28, 28] images, got " + shape_str(u8.sizes().vec()));
    // The 32x32 frame of fashion_to_model_input: 2 pixels of black on every side.
    const Tensor rgb = torch::constant_pad_nd(u8, {2, 2, 2, 2}, 0).unsqueeze(-1).expand({-1, -1, -1, 3}).contiguous();
    return preprocess_control_image(rgb, spec, "canny");
}

ControlNetConfig controlnet_config_from_unet(const UNetConfig& unet, const std::vector<int>& hint_channels,
                                             int conditioning_channels) {
    if (hint_channels.empty()) throw ParamError("hint_channels", "at least one channel count is needed");
    for (int c : hint_channels)
        if (c < 1) throw ParamError("hint_channels", "channel counts must be >= 1, got " + std::to_string(c));
    ControlNetConfig c;
    c.unet = unet;
    c.conditioning_channels = conditioning_channels;
    c.embedding_channels = hint_channels;
    return c;
}

ControlNetModel controlnet_from_unet(UNet2DConditionModelImpl& unet, const std::vector<int>& hint_channels,
                                     int conditioning_channels) {
    ControlNetModel cn(controlnet_config_from_unet(unet.config(), hint_channels, conditioning_channels));
    torch::NoGradGuard ng;
    const auto src = unet.named_parameters();
    for (auto& p : cn->named_parameters()) {
        const std::string& name = p.key();
        if (name.rfind("controlnet_", 0) == 0) continue; // the ControlNet's own layers: hint encoder, zero convs
        const Tensor* s = src.find(name);
        if (!s) throw Error("controlnet_from_unet: the UNet has no tensor '" + name + "'");
        if (s->sizes() != p.value().sizes())
            throw Error("controlnet_from_unet: '" + name + "' is " + shape_str(s->sizes().vec()) + " in the UNet, " +
                        shape_str(p.value().sizes().vec()) + " in the ControlNet");
        p.value().copy_(*s);
    }
    // Zero convolutions (Zhang et al. 2023, sec. 3.1) and diffusers' zero_module(conv_out) of the hint encoder.
    auto zero = [](torch::nn::Conv2d& c) {
        c->weight.zero_();
        if (c->bias.defined()) c->bias.zero_();
    };
    for (auto& c : cn->zero_convs) zero(c);
    zero(cn->controlnet_mid_block);
    zero(cn->controlnet_cond_embedding->conv_out);
    return cn;
}

nlohmann::json controlnet_config_json(const ControlNetConfig& c) {
    // diffusers 0.27.2 ControlNetModel.__init__'s arguments (a UNet's sample_size, out_channels and up blocks are not).
    static const std::set<std::string> keys = {"in_channels",
                                               "flip_sin_to_cos",
                                               "freq_shift",
                                               "down_block_types",
                                               "mid_block_type",
                                               "only_cross_attention",
                                               "block_out_channels",
                                               "layers_per_block",
                                               "downsample_padding",
                                               "mid_block_scale_factor",
                                               "act_fn",
                                               "norm_num_groups",
                                               "norm_eps",
                                               "cross_attention_dim",
                                               "transformer_layers_per_block",
                                               "encoder_hid_dim",
                                               "encoder_hid_dim_type",
                                               "attention_head_dim",
                                               "num_attention_heads",
                                               "use_linear_projection",
                                               "class_embed_type",
                                               "addition_embed_type",
                                               "addition_time_embed_dim",
                                               "num_class_embeds",
                                               "upcast_attention",
                                               "resnet_time_scale_shift",
                                               "projection_class_embeddings_input_dim"};
    nlohmann::json j = {{"_class_name", "ControlNetModel"}};
    const nlohmann::json unet = c.unet.to_json();
    for (const auto& [k, v] : unet.items())
        if (keys.count(k)) j[k] = v;
    j["conditioning_channels"] = c.conditioning_channels;
    j["conditioning_embedding_out_channels"] = c.embedding_channels;
    j["controlnet_conditioning_channel_order"] = c.bgr ? "bgr" : "rgb";
    j["global_pool_conditions"] = c.global_pool_conditions;
    return j;
}

TrainResult train_controlnet(const ControlNetTrainOptions& co) {
    const TrainOptions& o = co.train;
    Loop loop(o, "controlnet");
    loop.time_budget = co.max_seconds;
    if (co.canny.kind != ControlPreprocess::Canny) throw ParamError("preprocess", "the ControlNet trains on Canny edges");
    torch::manual_seed(uint64_t(o.seed));
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(o.seed) + 53);
    const auto data = load_fashion_mnist(o.data_dir, "train");
    const fs::path root(co.model);
    for (const char* part : {"vae", "text_encoder", "unet"})
        if (!fs::exists(root / part / "config.json"))
            throw Error("train-controlnet: '" + (root / part).string() + "/config.json' is missing (the model must " +
                        "be a diffusers folder with vae/, text_encoder/ and unet/)");
    auto vae = load_vae_folder((root / "vae").string());
    auto text = load_text_encoder_folder((root / "text_encoder").string());
    auto unet = load_unet_folder((root / "unet").string());
    vae->eval();
    text->eval();
    const double sf = vae->config().scaling_factor;
    // The UNet is frozen but differentiable: the loss reaches the ControlNet through it (its run() keeps autograd in
    // train() mode; the fast paths and fused kernels are inference-only).
    unet->set_fast_paths(false);
    unet->set_attention_kernel(kernels::AttentionKernel::Exact);
    unet->train();
    for (auto& p : unet->parameters()) p.set_requires_grad(false);

    // Prompt embeddings: [class][template] plus the empty prompt (dropout), as train_unet made them.
    const int64_t n_templates = int64_t(fashion_prompt_templates().size()), uncond_row = 10 * n_templates;
    Tensor contexts;
    {
        c10::InferenceMode im;
        contexts = text->encode(fashion_prompt_ids());
    }
    contexts = contexts.clone(); // a normal tensor: inference tensors cannot take part in autograd

    const auto ac = make_alphas_cumprod(SchedulerConfig{}); // SD 1.x training schedule, as the UNet's

    ControlNetModel cn = controlnet_from_unet(*unet, co.hint_channels);
    cn->set_fast_paths(false);
    cn->set_attention_kernel(kernels::AttentionKernel::Exact);
    cn->train();
    auto opt = make_adamw(cn->parameters(), o);
    Ema ema(*cn, o.ema);
    const int start = loop.begin(*cn, ema, opt);
    int64_t n_params = 0;
    for (const auto& p : cn->parameters()) n_params += p.numel();
    std::fprintf(stderr, "controlnet: %lld trainable parameters, hint encoder %s, Canny %.0f/%.0f\n",
                 (long long)n_params, shape_str({co.hint_channels.begin(), co.hint_channels.end()}).c_str(),
                 co.canny.low, co.canny.high);
    int step = start;
    for (; step < o.steps; ++step) {
        loop.set_lr(opt, step);
        auto idx = torch::randint(data.images.size(0), {o.batch}, gen, torch::kLong);
        const Tensor u8 = data.images.index_select(0, idx);
        Tensor x0, hint;
        {
            c10::InferenceMode im;
            const auto post = vae->encode(fashion_to_model_input(u8));
            x0 = (post.mean + post.std * torch::randn(post.mean.sizes(), gen, torch::kFloat)) * sf;
            hint = fashion_control_edges(u8, co.canny).permute({0, 3, 1, 2}).to(torch::kFloat) / 255.0;
        }
        x0 = x0.clone(), hint = hint.clone();
        const auto nb = noised_batch(x0, data.labels.index_select(0, idx), n_templates, uncond_row,
                                     o.caption_dropout, ac, gen);
        const Tensor ctx = contexts.index_select(0, nb.row), tf = nb.t.to(torch::kFloat);
        UNetCond cond(ctx);
        cond.residuals = cn->residuals(nb.xt, tf, UNetCond(ctx), hint, 1.0, /*guess_mode=*/false);
        auto loss = torch::mse_loss(unet->forward(nb.xt, tf, cond), nb.eps);
        opt.zero_grad();
        loss.backward();
        torch::nn::utils::clip_grad_norm_(cn->parameters(), o.grad_clip);
        opt.step();
        ema.update(*cn, step);
        const bool out_of_time = co.max_seconds > 0 && loop.elapsed() >= co.max_seconds;
        loop.record(step, loss.item<double>(), *cn, ema, opt, out_of_time);
        if (out_of_time) {
            ++step;
            if (!o.quiet) std::fprintf(stderr, "\ncontrolnet: time budget %.0f s reached", co.max_seconds);
            break;
        }
    }
    auto r = loop.finish(step);

    const fs::path out(o.out);
    fs::create_directories(out);
    to_half_file((out / "diffusion_pytorch_model.safetensors").string(), ema.weights(*cn));
    write_json(out / "config.json", controlnet_config_json(cn->control_config()));
    std::fprintf(stderr, "controlnet: %d steps in %.0f s, loss %.4f -> %.4f; wrote %s\n", r.steps_done, r.seconds,
                 r.first_loss, r.final_loss, out.c_str());
    return r;
}

// ---- evaluation ---------------------------------------------------------------------------------------------------

namespace {

// Edge pixels of RGB uint8 images [N, H, W, 3] (the detector's one channel repeated): bool [N, H, W].
Tensor cnt_edge_mask(const Tensor& rgb_u8, const ControlPreprocessSpec& spec) {
    return preprocess_control_image(rgb_u8, spec, "canny").select(3, 0).gt(0);
}

// Pixels within one pixel (3x3 neighbourhood) of a set pixel.
Tensor cnt_dilate(const Tensor& mask) {
    return torch::max_pool2d(mask.to(torch::kFloat).unsqueeze(1), 3, 1, 1).squeeze(1).gt(0.5);
}

double cnt_count(const Tensor& m) { return double(m.sum().item<int64_t>()); }

// F1 with a one-pixel tolerance and plain IoU of edge maps `gen` against `ctrl` ([H, W] bool each).
std::pair<double, double> cnt_edge_scores(const Tensor& gen, const Tensor& ctrl) {
    const double ne = cnt_count(gen), nc = cnt_count(ctrl);
    const double precision = ne > 0 ? cnt_count(gen & cnt_dilate(ctrl.unsqueeze(0))[0]) / ne : 0.0;
    const double recall = nc > 0 ? cnt_count(ctrl & cnt_dilate(gen.unsqueeze(0))[0]) / nc : 0.0;
    const double f1 = precision + recall > 0 ? 2 * precision * recall / (precision + recall) : 0.0;
    const double uni = cnt_count(gen | ctrl);
    return {f1, uni > 0 ? cnt_count(gen & ctrl) / uni : 1.0};
}

double cnt_mean(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / double(v.size());
}

} // namespace

Tensor fashion_test_edges(const std::string& data_dir, int label, int nth, const ControlPreprocessSpec& spec) {
    if (label < 0 || label > 9) throw ParamError("class", "Fashion-MNIST classes are 0..9, got " + std::to_string(label));
    if (nth < 0) throw ParamError("nth", "must be >= 0, got " + std::to_string(nth));
    const auto test = load_fashion_mnist(data_dir, "t10k");
    const auto lab = test.labels.accessor<int64_t, 1>();
    for (int64_t i = 0, seen = 0; i < lab.size(0); ++i)
        if (lab[i] == label && seen++ == nth) return fashion_control_edges(test.images.narrow(0, i, 1), spec)[0];
    throw ParamError("nth", "the test set has fewer than " + std::to_string(nth + 1) + " images of class " +
                                fashion_class_names()[size_t(label)]);
}

ControlFollowResult eval_control_following(const ControlFollowParams& p) {
    if (p.images < 1) throw ParamError("images", "must be >= 1, got " + std::to_string(p.images));
    if (p.controlnet.empty()) throw ParamError("control_net", "a ControlNet is required");
    if (!p.sheet.empty()) check_output_path(p.sheet, p.overwrite);
    const auto test = load_fashion_mnist(p.data_dir, "t10k");
    const int per_class = (p.images + 9) / 10;
    ControlFollowResult r;
    const auto lab = test.labels.accessor<int64_t, 1>();
    for (int c = 0; c < 10; ++c)
        for (int64_t i = 0, taken = 0; i < lab.size(0) && taken < per_class; ++i)
            if (lab[i] == c) r.test_index.push_back(int(i)), r.label.push_back(c), ++taken;
    r.test_index.resize(size_t(p.images)), r.label.resize(size_t(p.images));
    const Tensor ctrl = fashion_control_edges(
        test.images.index_select(0, torch::tensor(std::vector<int64_t>(r.test_index.begin(), r.test_index.end()))),
        p.canny);

    auto models = load_sd_models(p.model);
    Txt2ImgPipeline pipe(models);
    Txt2ImgParams tp;
    tp.prompts.clear();
    for (int c : r.label) tp.prompts.push_back(fashion_prompt(c, 0));
    tp.guidance_scale = p.cfg;
    tp.steps = p.steps;
    tp.seed = p.seed;
    tp.sampler = p.sampler;
    tp.width = int(ctrl.size(2)), tp.height = int(ctrl.size(1));
    const Tensor without = pipe.run(tp).image_uint8;
    ControlParams cp;
    cp.net = load_controlnet(p.controlnet);
    cp.source = p.controlnet;
    cp.pixels = ctrl;
    cp.scale = p.scale;
    tp.control = {cp};
    prepare_control(tp.control, models, "none", int64_t(tp.prompts.size()));
    const Tensor with = pipe.run(tp).image_uint8;

    const Tensor ec = cnt_edge_mask(ctrl, p.canny), ew = cnt_edge_mask(with, p.canny),
                 eo = cnt_edge_mask(without, p.canny);
    for (int i = 0; i < p.images; ++i) {
        const auto [fw, iw] = cnt_edge_scores(ew[i], ec[i]);
        const auto [fo, io] = cnt_edge_scores(eo[i], ec[i]);
        r.f1_with.push_back(fw), r.iou_with.push_back(iw);
        r.f1_without.push_back(fo), r.iou_without.push_back(io);
    }
    r.mean_f1_with = cnt_mean(r.f1_with), r.mean_f1_without = cnt_mean(r.f1_without);
    r.mean_iou_with = cnt_mean(r.iou_with), r.mean_iou_without = cnt_mean(r.iou_without);
    if (!p.sheet.empty()) {
        auto strip = [](const Tensor& nhwc) { return torch::cat(nhwc.unbind(0), 1); };
        write_png(p.sheet, torch::cat({strip(ctrl), strip(with), strip(without)}, 0), p.overwrite);
    }
    return r;
}

std::string ControlFollowResult::table() const {
    std::ostringstream os;
    char line[160];
    os << "test image  class             F1 with  F1 without  IoU with  IoU without\n";
    for (size_t i = 0; i < f1_with.size(); ++i) {
        std::snprintf(line, sizeof line, "%10d  %-16s %8.3f %11.3f %9.3f %12.3f\n", test_index[i],
                      fashion_class_names()[size_t(label[i])].c_str(), f1_with[i], f1_without[i], iou_with[i],
                      iou_without[i]);
        os << line;
    }
    std::snprintf(line, sizeof line, "%-28s %8.3f %11.3f %9.3f %12.3f\n", "mean", mean_f1_with, mean_f1_without,
                  mean_iou_with, mean_iou_without);
    os << line;
    return os.str();
}

} // namespace anchor::unet::train
