// Live previews (unet/pipeline/preview.h).
#include "unet/pipeline/preview.h"

#include "cache/io/error.h"

#include <filesystem>

namespace anchor::unet {

using torch::Tensor;

const EnumTable<PreviewMethod>& preview_method_table() {
    static const EnumTable<PreviewMethod> t{{"taesd", PreviewMethod::Taesd},
                                            {"latent-projection", PreviewMethod::LatentProjection}};
    return t;
}

Tensor latent_rgb_projection(const Tensor& latents, SdFamily family) {
    // Linear fits of RGB to the four latent channels (rows: latent channel, columns: R, G, B): the factors ComfyUI
    // publishes in comfy/latent_formats.py (SD15 and SDXL latent_rgb_factors), after Keturn's fit for SD 1.x
    // ("Decoding latents to RGB without upscaling", Hugging Face forum). The result is an image in about [-1, 1].
    static const float sd1[4][3] = {
        {0.3512f, 0.2297f, 0.3227f}, {0.3250f, 0.4974f, 0.2350f}, {-0.2829f, 0.1762f, 0.2721f}, {-0.2120f, -0.2616f, -0.7177f}};
    static const float sdxl[4][3] = {
        {0.3920f, 0.4054f, 0.4549f}, {-0.2634f, -0.0196f, 0.0653f}, {0.0568f, 0.1687f, -0.0755f}, {-0.3112f, -0.2359f, -0.2076f}};
    if (latents.dim() != 4 || latents.size(1) != 4)
        throw Error("latent preview: expected latents [B, 4, h, w], got " + c10::str(latents.sizes()));
    const bool xl = family == SdFamily::SDXL || family == SdFamily::SDXLRefiner;
    const auto f = torch::from_blob(const_cast<float*>(&(xl ? sdxl : sd1)[0][0]), {4, 3}, torch::kFloat).clone();
    const auto z = latents.to(torch::kCPU, torch::kFloat);
    const auto rgb = torch::einsum("bchw,cr->brhw", {z, f});
    return ((rgb + 1) / 2).clamp(0, 1);
}

PreviewMethod preview_method(const SDModels& m) {
    return m.taesd && m.taesd->has_decoder() ? PreviewMethod::Taesd : PreviewMethod::LatentProjection;
}

Tensor preview_image(SDModels& m, const Tensor& latents) {
    c10::InferenceMode guard;
    const auto z = latents.slice(0, 0, 1);
    Tensor image;
    if (preview_method(m) == PreviewMethod::Taesd) {
        const auto w = m.taesd->decoder->layers->parameters().front();
        const auto d = m.taesd->decode_latents(z.to(w.device(), w.scalar_type())).to(torch::kCPU, torch::kFloat);
        image = (d / 2 + 0.5).clamp(0, 1);
    } else {
        image = latent_rgb_projection(z, m.family);
    }
    return (image[0].permute({1, 2, 0}) * 255).round().to(torch::kUInt8).contiguous();
}

PreviewHook::PreviewHook(SDModels& m, int every, Sink sink) : m_(m), every_(every), sink_(std::move(sink)) {}

void PreviewHook::operator()(const ProgressInfo& p) {
    if (every_ <= 0 || p.phase != ProgressPhase::Step || !p.latents.defined() || !sink_) return;
    if (p.step % every_ != 0 && p.step != p.total) return;
    sink_(encode_png(preview_image(m_, p.latents), {}, "preview"), p.step, p.total);
    ++count_;
}

std::string preview_path(const std::string& output) {
    namespace fs = std::filesystem;
    if (!output.empty() && output.back() == '/') return output + "preview.png";
    const fs::path o(output);
    return (o.parent_path() / (o.stem().string() + "_preview.png")).string();
}

} // namespace anchor::unet
