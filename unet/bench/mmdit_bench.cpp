// The SD 3.5 transformer benchmark and whole-image memory run (unet/bench/mmdit_bench.h).
#include "unet/bench/mmdit_bench.h"

#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/util/bench.h"
#include "cache/util/heap.h"
#include "unet/bench/unet_bench.h"
#include "unet/model/unet_macs.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <cmath>

namespace anchor::unet {

const EnumTable<Sd3Variant>& sd3_variant_table() {
    static const EnumTable<Sd3Variant> t = {{"sd3.5-medium", Sd3Variant::Medium35},
                                            {"sd3.5-large", Sd3Variant::Large35}};
    return t;
}

SD3TransformerConfig sd3_transformer_config_of(Sd3Variant v) {
    SD3TransformerConfig c;
    c.sample_size = 128;
    c.patch_size = 2;
    c.in_channels = c.out_channels = 16;
    c.attention_head_dim = 64;
    c.joint_attention_dim = 4096;
    c.pooled_projection_dim = 2048;
    c.qk_norm = QkNorm::RmsNorm;
    if (v == Sd3Variant::Medium35) {
        c.num_layers = 24;
        c.num_attention_heads = 24;
        c.pos_embed_max_size = 384;
        for (int i = 0; i <= 12; ++i) c.dual_attention_layers.push_back(i);
    } else {
        c.num_layers = 38;
        c.num_attention_heads = 38;
        c.pos_embed_max_size = 192;
    }
    c.caption_projection_dim = c.inner_dim();
    return c;
}

ClipTextConfig sd3_clip_l_config() {
    ClipTextConfig c; // CLIP ViT-L/14's text tower
    c.projection_dim = 768;
    return c;
}

ClipTextConfig sd3_clip_g_config() {
    ClipTextConfig c;
    c.hidden_size = 1280;
    c.intermediate_size = 5120;
    c.num_hidden_layers = 32;
    c.num_attention_heads = 20;
    c.hidden_act = "gelu";
    c.projection_dim = 1280;
    return c;
}

T5EncoderConfig sd3_t5xxl_config() {
    return T5EncoderConfig{}; // the defaults are T5 v1.1 XXL's encoder
}

VaeConfig sd3_vae_config() {
    VaeConfig c;
    c.latent_channels = 16;
    c.scaling_factor = 1.5305;
    c.shift_factor = 0.0609;
    c.use_quant_conv = c.use_post_quant_conv = false;
    return c;
}

MmditMacs mmdit_macs(const SD3TransformerConfig& c, int64_t latent_h, int64_t latent_w, int64_t text_tokens) {
    const double p = c.patch_size, N = double(latent_h / c.patch_size) * double(latent_w / c.patch_size);
    const double T = double(text_tokens), D = c.inner_dim();
    MmditMacs m;
    m.conv = N * (c.in_channels * p * p) * D;                                    // patch embedding
    m.linear += T * c.joint_attention_dim * c.caption_projection_dim;            // context_embedder
    m.linear += 256.0 * D + D * D + double(c.pooled_projection_dim) * D + D * D; // timestep and pooled MLPs
    for (int i = 0; i < c.num_layers; ++i) {
        const bool last = i == c.num_layers - 1, dual = c.dual_attention(i);
        m.linear += D * D * (dual ? 9 : 6) + D * D * (last ? 2 : 6);    // adaLN modulations (one row per sample)
        m.linear += N * D * D * (3 + 1 + 8);                            // x: q, k, v, out, 4x MLP
        m.linear += T * D * D * 3 + (last ? 0.0 : T * D * D * (1 + 8)); // context: q, k, v (+ out and MLP)
        m.attention += 2.0 * (N + T) * (N + T) * D;                     // joint q k^T and p v
        if (dual) {
            m.linear += N * D * D * 4; // MMDiT-X: q, k, v, out
            m.attention += 2.0 * N * N * D;
        }
    }
    m.linear += D * 2 * D + N * D * (p * p * c.out_channels); // norm_out modulation, proj_out
    return m;
}

void MmditBenchParams::validate() const {
    const SD3TransformerConfig c = sd3_transformer_config_of(variant);
    const int unit = 8 * c.patch_size;
    if (width <= 0 || height <= 0 || width % unit || height % unit)
        throw ParamError("width", "width and height must be positive multiples of " + std::to_string(unit) + ", got " +
                                      std::to_string(width) + "x" + std::to_string(height));
    if (std::max(width, height) / unit > c.pos_embed_max_size)
        throw ParamError("width",
                         "larger than the position grid (" + std::to_string(c.pos_embed_max_size * unit) + " pixels)");
    if (repeat < 1 || warmup < 0 || batch < 1) throw ParamError("repeat", "repeat >= 1, warmup >= 0, batch >= 1");
    if (text_tokens < 1) throw ParamError("text_tokens", "must be >= 1");
    if (dtype != torch::kFloat && dtype != torch::kBFloat16 && dtype != torch::kHalf)
        throw ParamError("dtype", "must be f32, bf16 or f16");
    if (image_steps < 0) throw ParamError("image_steps", "must be >= 0");
}

void fill_random_weights(torch::nn::Module& m, double stddev) {
    torch::NoGradGuard ng;
    for (auto& np : m.named_parameters(true)) {
        auto& t = np.value();
        const auto& key = np.key();
        const bool bias = key.size() > 5 && key.compare(key.size() - 5, 5, ".bias") == 0;
        const bool norm =
            t.dim() == 1 && (key.find("norm") != std::string::npos || key.find("ln_") != std::string::npos);
        if (bias)
            t.zero_();
        else if (norm)
            t.fill_(1.0);
        else
            t.copy_(torch::randn(t.sizes()) * stddev);
    }
}

namespace {

std::string mmdit_mib(double bytes) {
    return util::fmt("%.0f", bytes / 1048576.0) + " MiB";
}

int64_t mmdit_bytes(const torch::nn::Module& m) {
    int64_t b = 0;
    for (const auto& t : m.parameters()) b += t.numel() * int64_t(t.element_size());
    for (const auto& t : m.buffers()) b += t.numel() * int64_t(t.element_size());
    return b;
}

// A module of `Args` built with its Linear weights allocated directly in `dtype` (DeferredWeights: no float32 copy
// of a multi-GB model), then filled and converted.
template <typename M, typename... Args> M mmdit_build(torch::ScalarType dtype, Args&&... args) {
    M m{nullptr};
    {
        const DeferredWeights deferred(dtype);
        m = M(std::forward<Args>(args)...);
    }
    m->to(dtype);
    fill_random_weights(*m);
    m->eval();
    for (auto& p : m->parameters()) p.set_requires_grad(false);
    return m;
}

double mmdit_gemm_rate(int64_t n, int repeat, torch::ScalarType dtype) {
    const auto a = torch::randn({n, n}).to(dtype), b = torch::randn({n, n}).to(dtype);
    double best = 1e30;
    torch::mm(a, b); // warm-up
    for (int i = 0; i < repeat; ++i) {
        const double t0 = util::now_s();
        torch::mm(a, b);
        best = std::min(best, util::now_s() - t0);
    }
    return 2.0 * double(n) * n * n / best / 1e9;
}

// The whole-image memory run (MmditBenchParams::image_steps).
void mmdit_image_memory(const MmditBenchParams& p, const std::function<void(const std::string&)>& emit) {
    const auto rss = [] { return util::fmt("%.0f", util::peak_rss_mib()) + " MiB"; };
    SD3Models m;
    m.source = "random " + enum_name(sd3_variant_table(), p.variant);
    torch::manual_seed(uint64_t(p.seed));
    m.transformer = mmdit_build<SD3Transformer2DModel>(p.dtype, sd3_transformer_config_of(p.variant));
    m.vae = mmdit_build<AutoencoderKL>(p.dtype, sd3_vae_config());
    m.text_encoder = mmdit_build<ClipTextModel>(p.dtype, sd3_clip_l_config());
    m.text_encoder_2 = mmdit_build<ClipTextModel>(p.dtype, sd3_clip_g_config());
    if (p.t5) m.text_encoder_3 = mmdit_build<T5EncoderModel>(p.dtype, sd3_t5xxl_config());
    int64_t bytes = mmdit_bytes(*m.transformer) + mmdit_bytes(*m.vae) + mmdit_bytes(*m.text_encoder) +
                    mmdit_bytes(*m.text_encoder_2) + (m.text_encoder_3 ? mmdit_bytes(*m.text_encoder_3) : 0);
    emit("models (" + std::string(c10::toString(p.dtype)) + "): transformer " + mmdit_mib(mmdit_bytes(*m.transformer)) +
         ", VAE " + mmdit_mib(mmdit_bytes(*m.vae)) + ", CLIP-L " + mmdit_mib(mmdit_bytes(*m.text_encoder)) +
         ", CLIP-G " + mmdit_mib(mmdit_bytes(*m.text_encoder_2)) +
         (m.text_encoder_3 ? ", T5-XXL " + mmdit_mib(mmdit_bytes(*m.text_encoder_3)) : ", no T5") + "; total " +
         mmdit_mib(double(bytes)) + "; peak RSS after building " + rss());
    torch::NoGradGuard ng;
    const int64_t B = 2; // one prompt and its negative (classifier-free guidance)
    double t0 = util::now_s();
    // Random token ids in place of the tokenizers' (the encoders' cost and memory do not depend on the ids).
    const auto ids_l = torch::randint(0, 49408, {B, 77}, torch::kLong);
    const auto a = m.text_encoder->encode_penultimate(ids_l), b = m.text_encoder_2->encode_penultimate(ids_l);
    auto clip = torch::cat({a.hidden, b.hidden}, -1).to(torch::kFloat);
    const int64_t joint = m.transformer->config().joint_attention_dim;
    clip = torch::constant_pad_nd(clip, {0, joint - clip.size(-1)});
    torch::Tensor t5 = torch::zeros({B, 77, joint});
    if (m.text_encoder_3)
        t5 = m.text_encoder_3->forward(torch::randint(0, 32128, {B, p.text_tokens - 77}, torch::kLong))
                 .to(torch::kFloat);
    const auto embeds = torch::cat({clip, t5}, 1).to(p.dtype);
    const auto pooled = torch::cat({a.pooled, b.pooled}, -1).to(p.dtype);
    SD3Conditioning cond{embeds.narrow(0, 1, 1), pooled.narrow(0, 1, 1), embeds.narrow(0, 0, 1),
                         pooled.narrow(0, 0, 1)};
    emit("encode (" + std::to_string(embeds.size(1)) + " text tokens): " + util::fmt("%.1f", util::now_s() - t0) +
         " s; peak RSS " + rss());
    const int64_t f = m.vae_scale_factor(), lh = p.height / f, lw = p.width / f;
    auto scheduler = sd3_make_scheduler(m, p.image_steps, lh, lw);
    auto latents = torch::randn({1, 16, lh, lw}).to(p.dtype);
    t0 = util::now_s();
    {
        util::HeapScope heap;
        latents = sd3_denoise(*m.transformer, *scheduler, latents, cond, 7.0,
                              [&](int i, const torch::Tensor&, const torch::Tensor&) {
                                  emit("  step " + std::to_string(i + 1) + "/" + std::to_string(p.image_steps) + ": " +
                                       util::fmt("%.1f", util::now_s() - t0) + " s, peak RSS " + rss());
                              });
    }
    t0 = util::now_s();
    torch::Tensor image;
    {
        util::HeapScope heap;
        image = sd3_decode(*m.vae, latents);
    }
    emit("VAE decode " + std::to_string(p.width) + "x" + std::to_string(p.height) + ": " +
         util::fmt("%.1f", util::now_s() - t0) +
         " s; finite: " + (torch::isfinite(image).all().item<bool>() ? "yes" : "no"));
    emit("peak RSS (VmHWM) of the whole image: " + rss() +
         " (every model resident; the peak does not depend on the "
         "step count)");
}

} // namespace

void run_mmdit_bench(const MmditBenchParams& p, const std::function<void(const std::string&)>& emit) {
    p.validate();
    const SD3TransformerConfig c = sd3_transformer_config_of(p.variant);
    const int64_t lh = p.height / 8, lw = p.width / 8;
    const MmditMacs macs = mmdit_macs(c, lh, lw, p.text_tokens);
    emit("SD 3.5 transformer (" + enum_name(sd3_variant_table(), p.variant) + ": " + std::to_string(c.num_layers) +
         " joint blocks, " + std::to_string(c.inner_dim()) + " wide, MMDiT-X blocks " +
         std::to_string(c.dual_attention_layers.size()) + ", QK RMSNorm) at " + std::to_string(p.width) + "x" +
         std::to_string(p.height) + ": " + std::to_string((lh / 2) * (lw / 2)) + " image tokens + " +
         std::to_string(p.text_tokens) + " text tokens, " + std::to_string(torch::get_num_threads()) + " threads");
    emit("MACs per sample: linear " + format_gmacs(macs.linear, 1) + " G + patch conv " + format_gmacs(macs.conv, 3) +
         " G = " + format_gmacs(macs.total(), 1) + " G; attention matmuls (not counted above) " +
         format_gmacs(macs.attention, 1) + " G");
    emit("load average at start: " + util::load_average());
    if (p.image_steps > 0) {
        mmdit_image_memory(p, emit);
        emit("load average at end: " + util::load_average());
        return;
    }
    torch::manual_seed(uint64_t(p.seed));
    double t0 = util::now_s();
    auto model = mmdit_build<SD3Transformer2DModel>(p.dtype, c);
    emit("model: " +
         util::fmt("%.1f", double([&] {
                               int64_t n = 0;
                               for (const auto& t : model->parameters()) n += t.numel();
                               return n;
                           }()) /
                               1e6) +
         " M parameters, " + mmdit_mib(double(mmdit_bytes(*model))) + " (" + c10::toString(p.dtype) + "), built in " +
         util::fmt("%.1f", util::now_s() - t0) + " s");
    const double build_peak = util::peak_rss_mib();
    const bool peak_reset = util::reset_peak_rss();
    const auto x = torch::randn({p.batch, c.in_channels, lh, lw}).to(p.dtype);
    const auto ctx = torch::randn({p.batch, p.text_tokens, c.joint_attention_dim}).to(p.dtype);
    const auto pooled = torch::randn({p.batch, c.pooled_projection_dim}).to(p.dtype);
    const auto t = torch::full({p.batch}, 500.0).to(p.dtype);
    torch::NoGradGuard ng;
    util::HeapScope heap;
    torch::Tensor y;
    for (int i = 0; i < p.warmup; ++i) y = model->forward(x, ctx, pooled, t);
    std::vector<double> times;
    for (int i = 0; i < p.repeat; ++i) {
        t0 = util::now_s();
        y = model->forward(x, ctx, pooled, t);
        times.push_back(util::now_s() - t0);
    }
    const util::Stats st = util::stats_of(times);
    emit("transformer step (batch " + std::to_string(p.batch) + "): min " + util::fmt("%.3f", st.min) + " s, median " +
         util::fmt("%.3f", st.median) + " s, max " + util::fmt("%.3f", st.max) + " s over " + std::to_string(p.repeat) +
         " runs after " + std::to_string(p.warmup) +
         " warm-up; output finite: " + (torch::isfinite(y).all().item<bool>() ? "yes" : "no"));
    const double flops = 2.0 * macs.total() * p.batch, flops_attn = 2.0 * (macs.total() + macs.attention) * p.batch;
    const double gemm = mmdit_gemm_rate(p.gemm_n, p.gemm_repeat, p.dtype);
    const double gemm32 = p.dtype == torch::kFloat ? gemm : gemm_gflops(p.gemm_n, p.gemm_repeat);
    emit("achieved: " + util::fmt("%.1f", flops / st.min / 1e9) + " GFLOP/s (2 x MACs x batch / min time; median " +
         util::fmt("%.1f", flops / st.median / 1e9) + "), with attention matmuls " +
         util::fmt("%.1f", flops_attn / st.min / 1e9) + " GFLOP/s");
    emit("GEMM " + std::to_string(p.gemm_n) + "^3 (torch::mm, min of " + std::to_string(p.gemm_repeat) +
         "): " + c10::toString(p.dtype) + " " + util::fmt("%.1f", gemm) + " GFLOP/s, float32 " +
         util::fmt("%.1f", gemm32) + " GFLOP/s");
    emit("ratio: " + util::fmt("%.1f", 100.0 * flops / st.min / 1e9 / gemm) + " % of the " + c10::toString(p.dtype) +
         " GEMM rate (with attention matmuls " + util::fmt("%.1f", 100.0 * flops_attn / st.min / 1e9 / gemm) + " %), " +
         util::fmt("%.1f", 100.0 * flops / st.min / 1e9 / gemm32) + " % of the float32 one");
    if (peak_reset)
        emit("peak RSS (VmHWM) of the steps: " + util::fmt("%.0f", util::peak_rss_mib()) + " MiB (weights " +
             mmdit_mib(double(mmdit_bytes(*model))) + "); while building: " + util::fmt("%.0f", build_peak) + " MiB");
    else
        emit("peak RSS (VmHWM): " + util::fmt("%.0f", util::peak_rss_mib()) + " MiB (building included)");
    emit("load average at end: " + util::load_average());
}

} // namespace anchor::unet
