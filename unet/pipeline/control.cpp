// ControlNet in the sampling loop (diffusers 0.27.2 StableDiffusionControlNetPipeline semantics).
#include "unet/pipeline/control.h"

#include "cache/io/error.h"
#include "cache/io/sha256.h"
#include "unet/model/unet_perf.h"
#include "unet/pipeline/control_preprocess.h"
#include "unet/pipeline/img2img.h"

#include <nlohmann/json.hpp>

#include <cmath>

namespace anchor::unet {

using torch::Tensor;

namespace {

// The ControlNets of one UNet call, rows as that call's batch.
class ControlResiduals : public ResidualSource {
public:
    struct Part {
        ControlNetModel net{nullptr};
        Tensor image; // [R, C, H, W]
        Tensor rows;  // bool [R]: the rows the ControlNet runs on (guess mode with CFG: the conditional ones);
                      // undefined: all
        double scale = 1.0;
        bool guess = false;
    };
    std::vector<Part> parts;

    SkipResiduals residuals(const Tensor& sample, const Tensor& timestep, const UNetCond& cond, int skips,
                            bool mid) const override {
        SkipResiduals total;
        for (const auto& p : parts) {
            // A 9-channel inpainting UNet's input: the ControlNet sees the latents (diffusers' control_model_input).
            const int64_t in = p.net->config().in_channels;
            const Tensor x = sample.size(1) > in ? sample.narrow(1, 0, in) : sample;
            if (!p.rows.defined()) {
                total = total.plus(p.net.ptr()->residuals(x, timestep, cond, p.image, p.scale, p.guess, skips, mid));
                continue;
            }
            const Tensor idx = p.rows.nonzero().flatten();
            if (idx.numel() == 0) continue; // zeros for every row: nothing to add
            const Tensor t = timestep.dim() == 1 && timestep.size(0) == x.size(0)
                                 ? timestep.index_select(0, idx.to(timestep.device()))
                                 : timestep;
            const auto r = p.net.ptr()->residuals(x.index_select(0, idx.to(x.device())), t, cond.index_select(idx),
                                                  p.image.index_select(0, idx), p.scale, p.guess, skips, mid);
            // diffusers: cat([zeros_like(d), d]) for the unconditional rows.
            auto spread = [&](const Tensor& v) {
                if (!v.defined()) return v;
                auto shape = v.sizes().vec();
                shape[0] = x.size(0);
                return torch::zeros(shape, v.options()).index_copy_(0, idx.to(v.device()), v);
            };
            SkipResiduals full;
            for (const auto& d : r.down) full.down.push_back(spread(d));
            full.mid = spread(r.mid);
            total = total.plus(full);
        }
        return total;
    }

    std::shared_ptr<const ResidualSource> index_select(const Tensor& idx) const override {
        auto out = std::make_shared<ControlResiduals>();
        for (auto p : parts) {
            p.image = p.image.index_select(0, idx.to(p.image.device()));
            if (p.rows.defined()) p.rows = p.rows.index_select(0, idx.to(p.rows.device()));
            out->parts.push_back(std::move(p));
        }
        return out;
    }
};

} // namespace

Tensor control_image_rgb(const ControlParams& c) {
    if (c.pixels.defined()) {
        if (c.pixels.scalar_type() != torch::kUInt8 || (c.pixels.dim() != 3 && c.pixels.dim() != 4) ||
            c.pixels.size(-1) != 3)
            throw ParamError("control_image", "pixels must be uint8 [H, W, 3] or [N, H, W, 3], got " +
                                                  shape_str(c.pixels.sizes().vec()));
        return c.pixels.dim() == 3 ? c.pixels.unsqueeze(0) : c.pixels;
    }
    if (c.image.empty()) throw ParamError("control_image", "a ControlNet needs a control image");
    return read_image_rgb(c.image, "control_image").unsqueeze(0);
}

std::pair<int, int> control_image_size(const ControlParams& c) {
    if (c.pixels.defined()) return {int(c.pixels.size(-2)), int(c.pixels.size(-3))};
    if (c.image.empty()) throw ParamError("control_image", "a ControlNet needs a control image");
    return image_file_size(c.image, "control_image");
}

Tensor prepare_control_image(const Tensor& rgb_u8, int width, int height, int64_t batch, int images_per_prompt) {
    std::vector<Tensor> rows;
    for (int64_t k = 0; k < rgb_u8.size(0); ++k) {
        // control_image_processor: VaeImageProcessor(do_convert_rgb=True, do_normalize=False): PIL resize, / 255.
        auto r = resize_lanczos(rgb_u8[k], width, height);
        rows.push_back(r.to(torch::kFloat).div(255.0).permute({2, 0, 1}).unsqueeze(0).contiguous());
    }
    auto image = torch::cat(rows, 0);
    // One image: repeated for the whole batch; one per prompt: each repeated num_images_per_prompt times.
    return image.repeat_interleave(image.size(0) == 1 ? batch : int64_t(images_per_prompt), 0);
}

double control_keep(int i, int n, double start, double end) {
    return 1.0 - double(double(i) / n < start || double(i + 1) / n > end);
}

void validate_control(const std::vector<ControlParams>& control, const UNetConfig& unet, int64_t prompts) {
    for (const auto& c : control) {
        if (!c.net) throw ParamError("control_net", "no ControlNet model loaded for control image '" + c.image + "'");
        const std::string what = "ControlNet '" + c.source + "'";
        if (const auto why = controlnet_mismatch(*c.net, unet); !why.empty())
            throw ParamError("control_net", what + " does not fit this UNet: " + why);
        const auto rgb_n = c.pixels.defined() ? (c.pixels.dim() == 4 ? c.pixels.size(0) : 1) : 1;
        (void)control_image_size(c); // readable (ParamError naming the file)
        if (rgb_n != 1 && rgb_n != prompts)
            throw ParamError("control_image", std::to_string(rgb_n) + " control images for " + std::to_string(prompts) +
                                                  " prompts (give one, or one per prompt)");
        if (!std::isfinite(c.scale))
            throw ParamError("control_scale", "must be a finite number, got " + std::to_string(c.scale));
        if (!(c.start >= 0.0 && c.start < c.end && c.end <= 1.0))
            throw ParamError(c.start < 0.0 || c.start >= 1.0 ? "control_start" : "control_end",
                             "need 0 <= start < end <= 1, got start " + std::to_string(c.start) + ", end " +
                                 std::to_string(c.end));
        if (c.net->control_config().conditioning_channels != 3)
            throw ParamError("control_net", what + " takes " +
                                                std::to_string(c.net->control_config().conditioning_channels) +
                                                "-channel control images; only RGB (3) images are read");
    }
}

std::vector<ControlParams> make_control_params(const std::vector<std::string>& nets,
                                               const std::vector<std::string>& images,
                                               const std::vector<double>& scales, const std::vector<double>& starts,
                                               const std::vector<double>& ends, bool guess_mode,
                                               torch::ScalarType dtype) {
    const size_t n = nets.size();
    if (images.size() != n)
        throw ParamError(n == 0 ? "control_net" : "control_image",
                         std::to_string(images.size()) + " control images for " + std::to_string(n) +
                             " ControlNets (give one --control-image per --control-net)");
    auto pick = [&](const std::vector<double>& v, const char* field, double def, size_t k) {
        if (v.empty()) return def;
        if (v.size() != 1 && v.size() != n)
            throw ParamError(field, std::to_string(v.size()) + " values for " + std::to_string(n) +
                                        " ControlNets (give one for all, or one per ControlNet)");
        return v.size() == 1 ? v[0] : v[k];
    };
    std::vector<ControlParams> out;
    for (size_t k = 0; k < n; ++k) {
        ControlParams c;
        c.source = nets[k];
        c.image = images[k];
        c.scale = pick(scales, "control_scale", 1.0, k);
        c.start = pick(starts, "control_start", 0.0, k);
        c.end = pick(ends, "control_end", 1.0, k);
        c.guess_mode = guess_mode;
        (void)control_image_size(c); // an unreadable image before any model loads
        try {
            c.net = load_controlnet(nets[k], dtype);
        } catch (const ParamError&) {
            throw;
        } catch (const Error& e) {
            throw ParamError("control_net", e.what());
        }
        out.push_back(std::move(c));
    }
    return out;
}

nlohmann::json control_records_json(const std::vector<ControlParams>& control) {
    auto out = nlohmann::json::array();
    for (const auto& c : control) {
        std::string sha;
        if (c.pixels.defined()) {
            const auto px = c.pixels.to(torch::kUInt8).contiguous();
            sha = sha256_hex(std::string(reinterpret_cast<const char*>(px.data_ptr<uint8_t>()), size_t(px.numel())));
        } else if (!c.image.empty()) {
            sha = sha256_file(c.image);
        }
        out.push_back({{"model", c.source},
                       {"image", c.image.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.image)},
                       {"image_sha256", sha},
                       {"scale", c.scale},
                       {"start", c.start},
                       {"end", c.end},
                       {"guess_mode", c.guess_mode}});
    }
    return out;
}

ControlRun::ControlRun(const std::vector<ControlParams>& control, int width, int height, int64_t batch,
                       int images_per_prompt, bool cfg, int steps)
    : batch_(batch), cfg_(cfg), steps_(steps) {
    for (const auto& c : control) {
        Unit u;
        u.net = c.net;
        u.image = prepare_control_image(control_image_rgb(c), width, height, batch, images_per_prompt);
        // Rows as the UNet batch: [uncond; cond] with guidance (guess mode runs the ControlNet on the cond rows only).
        if (cfg) u.image = torch::cat({u.image, u.image}, 0);
        u.scale = c.scale, u.start = c.start, u.end = c.end;
        u.guess = c.guess_mode || c.net->control_config().global_pool_conditions;
        units_.push_back(std::move(u));
    }
}

UNetCond ControlRun::at(const UNetCond& base, int k) const {
    if (units_.empty()) return base;
    auto src = std::make_shared<ControlResiduals>();
    for (const auto& u : units_) {
        // diffusers: cond_scale = controlnet_conditioning_scale * controlnet_keep[i]; a zero scale adds exact zeros,
        // so that ControlNet is not run at all.
        const double s = u.scale * control_keep(k, steps_, u.start, u.end);
        if (s == 0.0) continue;
        ControlResiduals::Part p;
        p.net = u.net, p.image = u.image, p.scale = s, p.guess = u.guess;
        if (u.guess && cfg_)
            p.rows = torch::cat({torch::zeros({batch_}, torch::kBool), torch::ones({batch_}, torch::kBool)});
        src->parts.push_back(std::move(p));
    }
    UNetCond out = base;
    if (!src->parts.empty()) out.control = src;
    return out;
}

void match_controlnet_to_unet(ControlNetModel& net, const SDModels& models) {
    net->set_attention_kernel(models.attention);
    perf::set_gemm_backend(*net, models.gemm);
    net->to(models.unet->conv_in->weight.device());
    net->eval();
}

void prepare_control(std::vector<ControlParams>& control, const SDModels& models, const std::string& preprocess,
                     int64_t prompts) {
    if (control.empty()) return;
    const auto spec = ControlPreprocessSpec::parse(preprocess, "control_preprocess");
    if (spec.kind != ControlPreprocess::None)
        for (auto& c : control) c.pixels = preprocess_control_image(control_image_rgb(c), spec);
    validate_control(control, models.unet->config(), prompts);
    for (auto& c : control) match_controlnet_to_unet(c.net, models);
}

} // namespace anchor::unet
