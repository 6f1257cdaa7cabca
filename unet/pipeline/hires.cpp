// AUTOMATIC1111's hires fix over two Txt2ImgPipeline runs (see hires.h).
#include "unet/pipeline/hires.h"

#include "cache/io/error.h"
#include "cache/util/strings.h"

#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>

namespace anchor::unet {

using torch::Tensor;

namespace {

std::string hires_num(double v) { return infotext_number(v); }

// The hires fix's errors name the option; the img2img strength rule's own ParamError("strength") becomes one of
// hires_denoise.
StrengthSchedule hires_strength(int steps, double denoise) {
    try {
        return strength_schedule(steps, denoise);
    } catch (const ParamError& e) {
        throw ParamError("hires_denoise", e.detail());
    }
}

// A1111's latent_upscale_modes: torch's interpolate with its mode and antialias, align_corners unset (false).
Tensor hires_interpolate_latents(const Tensor& latents, HiresUpscaler u, int64_t h, int64_t w) {
    namespace F = torch::nn::functional;
    auto o = F::InterpolateFuncOptions().size(std::vector<int64_t>{h, w});
    switch (u) {
    case HiresUpscaler::Latent: o.mode(torch::kBilinear).align_corners(false); break;
    case HiresUpscaler::LatentAntialiased: o.mode(torch::kBilinear).align_corners(false).antialias(true); break;
    case HiresUpscaler::LatentBicubic: o.mode(torch::kBicubic).align_corners(false); break;
    case HiresUpscaler::LatentBicubicAntialiased: o.mode(torch::kBicubic).align_corners(false).antialias(true); break;
    case HiresUpscaler::LatentNearest: o.mode(torch::kNearest); break;
    case HiresUpscaler::LatentNearestExact: o.mode(torch::kNearestExact); break;
    default: throw Error("hires: not a latent upscaler");
    }
    return F::interpolate(latents, o);
}

bool hires_is_latent(HiresUpscaler u) { return u != HiresUpscaler::Lanczos && u != HiresUpscaler::Model; }

// images.resize_image(0, im, w, h, upscaler_name) of one uint8 [H, W, 3] image: the upscaler through A1111's
// Upscaler.upscale (up to three passes until the image covers the target rounded down to a multiple of f, where
// A1111 has 8; then a Lanczos resize to that), then a Lanczos resize to (w, h) when the size still differs. `step`:
// one pass of the upscaler at `scale`.
Tensor hires_resize_image(Tensor im, int w, int h, int f, const std::function<Tensor(const Tensor&, double)>& step) {
    const double scale = std::max(double(w) / double(im.size(1)), double(h) / double(im.size(0)));
    if (scale > 1.0) {
        const int dest_w = int(std::floor(double(im.size(1)) * scale / f) * f);
        const int dest_h = int(std::floor(double(im.size(0)) * scale / f) * f);
        for (int pass = 0; pass < 3; ++pass) {
            const auto shape = im.sizes().vec();
            im = step(im, scale);
            if (im.sizes().vec() == shape) break;
            if (im.size(1) >= dest_w && im.size(0) >= dest_h) break;
        }
        if (im.size(1) != dest_w || im.size(0) != dest_h) im = resize_lanczos(im, dest_w, dest_h);
    }
    if (im.size(1) != w || im.size(0) != h) im = resize_lanczos(im, w, h);
    return im;
}

// The pixel upscalers on the first pass's images (A1111: 255 * clamp((x + 1) / 2, 0, 1) truncated to uint8 - the
// same value as our image in [0, 1] times 255, truncated) to the plan's upscale size, then the crop in pixels.
Tensor hires_upscale_pixels(const HiresParams& hp, const HiresPlan& plan, const Tensor& u8, int f) {
    std::function<Tensor(const Tensor&, double)> step;
    if (hp.upscaler == HiresUpscaler::Lanczos) {
        // UpscalerLanczos.do_upscale: int(size * scale) on each side.
        step = [](const Tensor& im, double s) {
            return resize_lanczos(im, int(double(im.size(1)) * s), int(double(im.size(0)) * s));
        };
    } else {
        // An ESRGAN model: its own factor; its output to uint8 rounded (A1111's torch_bgr_to_pil_image).
        step = [&hp](const Tensor& im, double) {
            const Tensor x = im.permute({2, 0, 1}).unsqueeze(0).to(torch::kFloat).div(255.0);
            const Tensor y = hires_model_upscale(hp.model, x);
            return y[0].clamp(0, 1).mul(255.0).round().to(torch::kUInt8).permute({1, 2, 0}).contiguous();
        };
    }
    std::vector<Tensor> rows;
    for (int64_t b = 0; b < u8.size(0); ++b) {
        Tensor im = hires_resize_image(u8[b], plan.upscale_width, plan.upscale_height, f, step);
        // hr_resize_x and _y of another aspect: A1111 crops the encoded latents; here the image, by the same cells.
        if (plan.crop_x > 0) im = im.narrow(1, int64_t(plan.crop_x / 2) * f, plan.width);
        if (plan.crop_y > 0) im = im.narrow(0, int64_t(plan.crop_y / 2) * f, plan.height);
        rows.push_back(im.contiguous());
    }
    return torch::stack(rows, 0);
}

} // namespace

HiresPlan hires_plan(const HiresParams& h, int width, int height, int steps, int f) {
    HiresPlan plan;
    if (h.steps < 0) throw ParamError("hires_steps", "must be >= 0 (0 = the first pass's steps), got " +
                                                         std::to_string(h.steps));
    plan.steps = h.steps > 0 ? h.steps : steps;
    if (!(h.denoise > 0.0 && h.denoise <= 1.0))
        throw ParamError("hires_denoise", "must be in (0, 1], got " + hires_num(h.denoise));
    (void)hires_strength(plan.steps, h.denoise);
    if (h.width == 0 && h.height == 0) {
        if (!(std::isfinite(h.scale) && h.scale > 0.0))
            throw ParamError("hires_scale", "must be a number > 0, got " + hires_num(h.scale));
        // int() truncates the product, as A1111; the VAE factor's multiple below it is what A1111's latents give.
        const int tw = int(double(width) * h.scale), th = int(double(height) * h.scale);
        plan.width = plan.upscale_width = tw - tw % f;
        plan.height = plan.upscale_height = th - th % f;
        if (plan.width < f || plan.height < f)
            throw ParamError("hires_scale", "scale " + hires_num(h.scale) + " makes " + wxh(width, height) + " into " +
                                                wxh(tw, th) + ", smaller than the VAE factor " + std::to_string(f));
        return plan;
    }
    for (const auto& [field, v] : {std::pair<const char*, int>{"hires_width", h.width}, {"hires_height", h.height}})
        if (v < 0 || v % f != 0)
            throw ParamError(field, "must be a multiple of the VAE factor " + std::to_string(f) + ", got " +
                                        std::to_string(v));
    // calculate_target_resolution: one side given, the other keeps the base aspect (floor division); both, the
    // upscale covers the target and the excess is cut.
    if (h.height == 0) {
        plan.upscale_width = h.width;
        plan.upscale_height = h.width * height / width;
    } else if (h.width == 0) {
        plan.upscale_width = h.height * width / height;
        plan.upscale_height = h.height;
    } else {
        const double src_ratio = double(width) / height, dst_ratio = double(h.width) / h.height;
        if (src_ratio < dst_ratio) {
            plan.upscale_width = h.width;
            plan.upscale_height = h.width * height / width;
        } else {
            plan.upscale_width = h.height * width / height;
            plan.upscale_height = h.height;
        }
        plan.crop_x = (plan.upscale_width - h.width) / f;
        plan.crop_y = (plan.upscale_height - h.height) / f;
    }
    plan.width = plan.upscale_width / f * f - plan.crop_x * f;
    plan.height = plan.upscale_height / f * f - plan.crop_y * f;
    if (h.width > 0 && h.height > 0) plan.width = h.width, plan.height = h.height;
    if (plan.width < f || plan.height < f)
        throw ParamError(h.width > 0 ? "hires_width" : "hires_height",
                         "the hires target " + wxh(plan.width, plan.height) + " is smaller than the VAE factor " +
                             std::to_string(f));
    return plan;
}

void validate_hires(const Txt2ImgParams& p, int f) {
    if (!p.hires.enabled) return;
    if (p.init.enabled())
        throw ParamError("init_image", "the hires fix (hires_*) is txt2img's; an img2img / inpaint run has none");
    (void)hires_plan(p.hires, p.width, p.height, p.steps, f);
    if (p.hires.upscaler == HiresUpscaler::Model) {
        std::error_code ec;
        if (p.hires.model.empty() || !std::filesystem::is_regular_file(p.hires.model, ec))
            throw ParamError("hires_upscaler", "'" + p.hires.model + "' is neither an upscaler (" +
                                                   enum_choices(hires_upscaler_table()) +
                                                   ") nor a readable ESRGAN model file");
    }
}

Txt2ImgResult run_hires(Txt2ImgPipeline& pipe, const Txt2ImgParams& p_in, DenoiseController* ctl,
                        const Txt2ImgPipeline::ProgressFn& progress, const Txt2ImgPipeline::StepFn& on_step,
                        const SchedulerConfig* sched_cfg, HiresStages* stages) {
    const Txt2ImgParams p = pipe.resolved(p_in);
    const int f = pipe.models().vae_scale_factor();
    validate_hires(p, f);
    const HiresParams& hp = p.hires;
    const HiresPlan plan = hires_plan(hp, p.width, p.height, p.steps, f);
    // First pass: txt2img at the base size (the models stay loaded for the second pass).
    Txt2ImgParams p1 = p;
    p1.hires.enabled = false;
    p1.free_params = false;
    p1.decode = !hires_is_latent(hp.upscaler);
    const Txt2ImgResult r1 = pipe.run(p1, ctl, progress, on_step, sched_cfg);
    // Second pass: img2img at the target size from the same seed, the upscaled result its init.
    Txt2ImgParams p2 = p;
    p2.hires.enabled = false;
    p2.width = plan.width;
    p2.height = plan.height;
    p2.steps = plan.steps;
    p2.init = Img2ImgParams{};
    p2.init.strength = hp.denoise;
    HiresStages st;
    st.plan = plan;
    st.base_latents = r1.final_latents;
    st.first_pass_full_steps = r1.full_steps;
    st.first_pass_steps = r1.total_steps;
    if (hires_is_latent(hp.upscaler)) {
        const Tensor up = hires_interpolate_latents(r1.final_latents, hp.upscaler, plan.upscale_height / f,
                                                    plan.upscale_width / f);
        // truncate_x / truncate_y: crop // 2 cells before, the rest after (A1111's samples[..., a:n - b]).
        p2.init.init_latents = up.narrow(2, plan.crop_y / 2, plan.height / f).narrow(3, plan.crop_x / 2, plan.width / f);
        st.upscaled_latents = p2.init.init_latents;
    } else {
        st.base_image_uint8 = r1.image.to(torch::kCPU).mul(255.0).to(torch::kUInt8).permute({0, 2, 3, 1}).contiguous();
        p2.init.init_pixels = hires_upscale_pixels(hp, plan, st.base_image_uint8, f);
        st.upscaled_image_uint8 = p2.init.init_pixels;
    }
    Txt2ImgResult r = pipe.run(p2, ctl, progress, on_step, sched_cfg);
    r.full_steps += r1.full_steps;
    r.total_steps += r1.total_steps;
    r.text_s += r1.text_s;
    r.denoise_s += r1.denoise_s;
    r.decode_s += r1.decode_s;
    if (stages) *stages = std::move(st);
    return r;
}

const EnumTable<HiresUpscaler>& hires_upscaler_table() {
    static const EnumTable<HiresUpscaler> table = {
        {"latent", HiresUpscaler::Latent},
        {"latent-antialiased", HiresUpscaler::LatentAntialiased},
        {"latent-bicubic", HiresUpscaler::LatentBicubic},
        {"latent-bicubic-antialiased", HiresUpscaler::LatentBicubicAntialiased},
        {"latent-nearest", HiresUpscaler::LatentNearest},
        {"latent-nearest-exact", HiresUpscaler::LatentNearestExact},
        {"lanczos", HiresUpscaler::Lanczos},
    };
    return table;
}

namespace {
const EnumTable<HiresUpscaler>& hires_a1111_names() {
    static const EnumTable<HiresUpscaler> table = {
        {"Latent", HiresUpscaler::Latent},
        {"Latent (antialiased)", HiresUpscaler::LatentAntialiased},
        {"Latent (bicubic)", HiresUpscaler::LatentBicubic},
        {"Latent (bicubic antialiased)", HiresUpscaler::LatentBicubicAntialiased},
        {"Latent (nearest)", HiresUpscaler::LatentNearest},
        {"Latent (nearest-exact)", HiresUpscaler::LatentNearestExact},
        {"Lanczos", HiresUpscaler::Lanczos},
    };
    return table;
}
} // namespace

void parse_hires_upscaler(const std::string& s, HiresParams& h) {
    for (const auto* table : {&hires_upscaler_table(), &hires_a1111_names()})
        for (const auto& [name, u] : *table)
            if (name == s) {
                h.upscaler = u;
                h.model.clear();
                return;
            }
    h.upscaler = HiresUpscaler::Model;
    h.model = s;
}

std::string hires_upscaler_a1111_name(const HiresParams& h) {
    if (h.upscaler == HiresUpscaler::Model) return std::filesystem::path(h.model).stem().string();
    return enum_name(hires_a1111_names(), h.upscaler);
}

void add_hires_infotext(const HiresParams& h, Infotext& t) {
    if (!h.enabled) return;
    if (h.width == 0 && h.height == 0)
        t.set("Hires upscale", hires_num(h.scale));
    else
        t.set("Hires resize", std::to_string(h.width) + "x" + std::to_string(h.height));
    if (h.steps > 0) t.set("Hires steps", std::to_string(h.steps));
    t.set("Hires upscaler", hires_upscaler_a1111_name(h));
}

std::optional<HiresParams> hires_from_infotext(const Infotext& t, std::vector<std::string>& notes) {
    const std::string* scale = t.get("Hires upscale");
    const std::string* resize = t.get("Hires resize");
    if (!scale && !resize) return std::nullopt;
    HiresParams h;
    h.enabled = true;
    auto number = [](const std::string& s, double& out) {
        char* end = nullptr;
        out = std::strtod(s.c_str(), &end);
        return !s.empty() && end && *end == '\0';
    };
    if (resize) {
        const size_t x = resize->find('x');
        double w = 0, hh = 0;
        if (x == std::string::npos || !number(resize->substr(0, x), w) || !number(resize->substr(x + 1), hh))
            throw Error("infotext field 'Hires resize' is '" + *resize + "', expected WIDTHxHEIGHT");
        h.width = int(w), h.height = int(hh);
    } else if (!number(*scale, h.scale)) {
        throw Error("infotext field 'Hires upscale' is '" + *scale + "', expected a number");
    }
    if (const std::string* s = t.get("Hires steps")) {
        double v = 0;
        if (!number(*s, v)) throw Error("infotext field 'Hires steps' is '" + *s + "', expected an integer");
        h.steps = int(v);
    }
    if (const std::string* s = t.get("Denoising strength")) {
        if (!number(*s, h.denoise))
            throw Error("infotext field 'Denoising strength' is '" + *s + "', expected a number");
    }
    if (const std::string* s = t.get("Hires upscaler")) {
        parse_hires_upscaler(*s, h);
        if (h.upscaler == HiresUpscaler::Model)
            notes.push_back("Hires upscaler '" + *s + "' is an upscaler model: give its file as --hires-upscaler FILE");
    } else {
        // A1111 with hr_upscaler None: shared.latent_upscale_default_mode, "Latent" unless changed.
        h.upscaler = HiresUpscaler::Latent;
    }
    return h;
}

nlohmann::json hires_record(const HiresParams& h, const HiresPlan& plan) {
    nlohmann::json j = {{"scale", h.scale},
                        {"resize_width", h.width},
                        {"resize_height", h.height},
                        {"steps", h.steps},
                        {"denoise", h.denoise},
                        {"upscaler", h.upscaler == HiresUpscaler::Model ? std::string("model")
                                                                        : enum_name(hires_upscaler_table(), h.upscaler)},
                        {"width", plan.width},
                        {"height", plan.height},
                        {"second_pass_steps", plan.steps}};
    if (h.upscaler == HiresUpscaler::Model) j["model"] = h.model;
    return j;
}

HiresParams hires_from_record(const nlohmann::json& j) {
    HiresParams h;
    h.enabled = true;
    h.scale = j.value("scale", h.scale);
    h.width = j.value("resize_width", 0);
    h.height = j.value("resize_height", 0);
    h.steps = j.value("steps", 0);
    h.denoise = j.value("denoise", h.denoise);
    const std::string u = j.value("upscaler", std::string("latent"));
    if (u == "model")
        h.upscaler = HiresUpscaler::Model, h.model = j.value("model", std::string());
    else
        h.upscaler = enum_from_string(hires_upscaler_table(), u, "hires.upscaler");
    return h;
}

} // namespace anchor::unet
