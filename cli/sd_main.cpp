// anchor-sd: Stable Diffusion txt2img with anchor caches. Flags follow stable-diffusion.cpp's names.
#include "cache/io/atomic_file.h"
#include "cache/io/enum_table.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cli/bench_util.h"
#include "cli/common.h"
#include "cli/sd_bench.h"
#include "cli/sd_compare.h"
#include "text/gpt2_tokenizer.h" // UTF-8 validation
#include "unet/freq_cache.h"
#include "unet/pipeline.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>
#include <unistd.h>

namespace fs = std::filesystem;
using namespace anchor;
using namespace anchor::unet;

namespace {

struct Options {
    std::string model, prompt, negative, output = "output.png", sampler = "euler_a", dtype = "f32";
    double cfg_scale = 7.5;
    int steps = 20, width = 0, height = 0, batch_count = 1, batch_size = 1, clip_skip = -1, threads = 0;
    int64_t seed = 42;
    bool overwrite = false;
    std::optional<kernels::AttentionKernel> attention; // unset: the model's own (anchorcache.json), else exact
    int deepcache = 0, deepcache_branch = 0;
    std::string cache_mode, compare; // --cache MODE, --compare MODE,MODE,...
    std::string save_latents;
    std::string prompts_file; // one prompt per line; every line runs --batch-count images
};

std::string output_path(const std::string& base, int k) {
    if (k == 0) return base;
    fs::path p(base);
    return (p.parent_path() / (p.stem().string() + "_" + std::to_string(k) + p.extension().string())).string();
}

std::string fmt_s(double s) {
    char buf[32];
    if (s < 60)
        std::snprintf(buf, sizeof(buf), "%.1fs", s);
    else
        std::snprintf(buf, sizeof(buf), "%dm%02ds", int(s) / 60, int(s) % 60);
    return buf;
}

void progress_bar(const ProgressInfo& p, const std::string& label) {
    const int width = 30;
    const int filled = p.total ? p.step * width / p.total : width;
    const double eta = p.step ? p.elapsed_s / p.step * (p.total - p.step) : 0.0;
    std::string bar(size_t(filled), '#');
    bar += std::string(size_t(width - filled), '.');
    std::fprintf(stderr, "\r%s[%s] %d/%d  %s elapsed, ETA %s   ", label.c_str(), bar.c_str(), p.step, p.total,
                 fmt_s(p.elapsed_s).c_str(), fmt_s(eta).c_str());
    if (p.step == p.total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
}

// The rows of image i in a batch of n images: [uncond i; cond i] with guidance (2n rows), else row i.
torch::Tensor image_rows(const torch::Tensor& t, int i, int n) {
    if (t.size(0) == 2 * int64_t(n)) return torch::cat({t.narrow(0, i, 1), t.narrow(0, n + i, 1)}, 0);
    return t.narrow(0, i, 1);
}

torch::ScalarType parse_dtype(const std::string& s) {
    if (s == "f32") return torch::kFloat;
    // The pipeline runs on the CPU, where LibTorch has no float16 convolutions: say so instead of failing mid-run.
    if (s == "f16")
        throw UsageError("--dtype f16 is not available on the CPU (LibTorch has no float16 CPU "
                         "convolutions); use f32 or bf16 (f16 checkpoints are converted at load)");
    if (s == "bf16") return torch::kBFloat16;
    throw UsageError("--dtype must be f32, f16 or bf16, got '" + s + "'");
}

int run(const Options& o) {
    // Cross-field checks that need no model first.
    const SamplerKind sampler = sampler_from_string(o.sampler);
    const auto dtype = parse_dtype(o.dtype);
    if (o.steps < 1) throw UsageError("--steps must be >= 1, got " + std::to_string(o.steps));
    if (o.batch_count < 1) throw UsageError("--batch-count must be >= 1, got " + std::to_string(o.batch_count));
    if (o.batch_size < 1) throw UsageError("--batch-size must be >= 1, got " + std::to_string(o.batch_size));
    if (o.batch_size > 1 && !o.compare.empty()) throw UsageError("--batch-size and --compare are exclusive");
    if (o.width < 0 || o.height < 0)
        throw UsageError("--width/--height must be positive (0 = the model's size), got " + std::to_string(o.width) +
                         "x" + std::to_string(o.height));
    if (!std::isfinite(o.cfg_scale) || o.cfg_scale < 0)
        throw UsageError("--cfg-scale must be a finite number >= 0, got " + std::to_string(o.cfg_scale));
    if (o.deepcache < 0) throw UsageError("--deepcache must be >= 0 (0 disables it)");
    if (!o.cache_mode.empty() && o.deepcache > 0) throw UsageError("--cache and --deepcache are exclusive");
    if (!o.cache_mode.empty()) parse_cache_mode(o.cache_mode); // validate before loading models
    if (!o.compare.empty())
        for (const auto& m : split_mode_list(o.compare)) parse_cache_mode(m);
    if (!o.prompts_file.empty() && !o.compare.empty()) throw UsageError("--prompts-file and --compare are exclusive");
    const std::vector<std::string> prompts =
        o.prompts_file.empty() ? std::vector<std::string>{o.prompt} : cli::read_prompts_file(o.prompts_file);
    // A prompt goes into the tokenizer and the JSON sidecar: reject invalid UTF-8 before anything runs.
    for (size_t i = 0; i < prompts.size(); ++i)
        if (const auto bad = text::utf8_first_invalid(prompts[i]); bad >= 0)
            throw UsageError((o.prompts_file.empty()
                                  ? std::string("the prompt")
                                  : "prompt " + std::to_string(i + 1) + " of '" + o.prompts_file + "'") +
                             " is not valid UTF-8 (first invalid byte at offset " + std::to_string(bad) + ")");
    if (const auto bad = text::utf8_first_invalid(o.negative); bad >= 0)
        throw UsageError("the negative prompt is not valid UTF-8 (first invalid byte at offset " + std::to_string(bad) +
                         ")");
    int64_t seed = o.seed;
    if (seed < 0) {
        std::random_device rd;
        seed = int64_t((uint64_t(rd()) << 31 ^ rd()) & 0x7fffffffffffLL);
    }
    const auto jobs = plan_batches(prompts, o.batch_size, o.batch_count, seed);
    const int n_images = jobs.back().first_image + jobs.back().images();
    std::vector<std::string> outputs, latents_out;
    for (int k = 0; k < n_images; ++k) {
        const std::string png = output_path(o.output, k);
        for (const auto& p : {png, png + ".json"}) {
            if (fs::exists(p) && !o.overwrite && o.compare.empty())
                throw UsageError("output '" + p + "' exists (use --overwrite to replace it)");
            check_output_path(p, true);
        }
        outputs.push_back(png);
        if (!o.save_latents.empty()) {
            const std::string lat = output_path(o.save_latents, k);
            if (fs::exists(lat) && !o.overwrite)
                throw UsageError("output '" + lat + "' exists (use --overwrite to replace it)");
            check_output_path(lat, true);
            latents_out.push_back(lat);
        }
    }
    std::fprintf(stderr, "seed: %lld\n", (long long)seed);

    auto t0 = std::chrono::steady_clock::now();
    LoadOptions lo;
    lo.dtype = dtype;
    lo.attention = o.attention;
    SDModels models = load_sd_models(o.model, lo);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "loaded %s (%s, %s, %s attention) in %s; %s\n", o.model.c_str(), models.layout.c_str(),
                 enum_name(sd_family_table(), models.family).c_str(), enum_name(kernels::attention_kernel_table(), models.attention).c_str(),
                 fmt_s(load_s).c_str(), models.unet->config().describe().c_str());

    Txt2ImgPipeline pipe(models);
    Txt2ImgParams p;
    p.prompts = {prompts[0]};
    p.negative_prompts = {o.negative};
    p.guidance_scale = o.cfg_scale;
    p.steps = o.steps;
    p.width = o.width;
    p.height = o.height;
    p = pipe.resolved(p);
    p.sampler = sampler;
    // stable-diffusion.cpp semantics: N-th last layer (1 = last, 2 = penultimate); <= 0 = the model's default.
    p.clip_skip = o.clip_skip <= 0 ? 0 : o.clip_skip - 1;
    pipe.validate(p);

    if (!o.compare.empty()) {
        p.seed = seed;
        const fs::path out(o.output);
        const std::string base = (out.parent_path() / out.stem()).string();
        cli::run_compare(pipe, p, o.compare, base,
                         {{"program", "anchor-sd"},
                          {"model", o.model},
                          {"prompt", o.prompt},
                          {"seed", seed},
                          {"steps", o.steps},
                          {"sampler", sampler_name(sampler)},
                          {"cfg_scale", o.cfg_scale},
                          {"width", p.width},
                          {"height", p.height},
                          {"threads", o.threads}},
                         o.overwrite);
        return 0;
    }
    // Memory of back-to-back runs in one process (issue 8's soak): RSS after every image, growth from the first.
    int64_t rss_first = -1, rss_max = -1;
    for (const auto& job : jobs) {
        p.prompts = job.prompts;
        p.images_per_prompt = job.images_per_prompt;
        p.seed = job.seed;
        std::unique_ptr<DenoiseController> ctl;
        if (o.deepcache > 0) ctl = std::make_unique<DeepCacheDenoiser>(o.deepcache, o.deepcache_branch);
        if (!o.cache_mode.empty()) ctl = parse_cache_mode(o.cache_mode);
        const int nb = job.images(), k0 = job.first_image;
        const std::string label = n_images > 1
                                      ? (nb > 1 ? "images " + std::to_string(k0 + 1) + "-" + std::to_string(k0 + nb)
                                                : "image " + std::to_string(k0 + 1)) +
                                            "/" + std::to_string(n_images) + " "
                                      : "";
        auto r = pipe.run(p, ctl.get(), [&](const ProgressInfo& pi) { progress_bar(pi, label); });
        if (k0 == 0)
            for (const auto& w : r.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
        for (int i = 0; i < nb; ++i) {
            const int k = k0 + i;
            write_png(outputs[size_t(k)], r.image_uint8[i], o.overwrite);
            if (!latents_out.empty())
                save_safetensors(
                    latents_out[size_t(k)],
                    {{"initial_noise", r.initial_noise.narrow(0, i, 1)},
                     {"initial_latents", r.initial_latents.narrow(0, i, 1)},
                     {"final_latents", r.final_latents.narrow(0, i, 1)},
                     {"prompt_embeds", image_rows(r.prompt_embeds, i, nb)},
                     {"decoded", r.decoded.narrow(0, i, 1)},
                     {"image", r.image.narrow(0, i, 1)},
                     {"image_uint8", r.image_uint8.narrow(0, i, 1)}},
                    {{"program", "anchor-sd"}, {"seed", std::to_string(p.seed)}, {"index_in_batch", std::to_string(i)}},
                    o.overwrite);
            nlohmann::json j;
            j["program"] = "anchor-sd";
            j["version"] = ANCHOR_VERSION;
            j["model"] = o.model;
            j["model_layout"] = models.layout;
            j["model_family"] = enum_name(sd_family_table(), models.family);
            j["prompt"] = p.prompts[size_t(i / p.images_per_prompt)];
            j["negative_prompt"] = o.negative;
            j["cfg_scale"] = o.cfg_scale;
            j["steps"] = o.steps;
            j["sampler"] = sampler_name(sampler);
            j["seed"] = p.seed;
            j["base_seed"] = seed;
            j["batch_index"] = job.repeat;
            j["batch_size"] = nb;
            j["index_in_batch"] = i;
            j["image_index"] = k;
            j["width"] = p.width;
            j["height"] = p.height;
            j["clip_skip"] = o.clip_skip;
            j["dtype"] = o.dtype;
            j["attention"] = enum_name(kernels::attention_kernel_table(), models.attention);
            j["threads"] = o.threads;
            j["cache"] =
                o.deepcache > 0
                    ? nlohmann::json{{"kind", "deepcache"}, {"interval", o.deepcache}, {"branch", o.deepcache_branch}}
                    : nlohmann::json{{"kind", "none"}};
            if (auto* cc = dynamic_cast<CacheController*>(ctl.get())) j["cache"] = cache_log_json(*cc);
            j["unet_full_steps"] = r.full_steps;
            j["unet_steps"] = r.total_steps;
            j["warnings"] = r.warnings;
            j["timings_s"] = {{"load", k == 0 ? load_s : 0.0},
                              {"text_encoder", r.text_s},
                              {"denoise", r.denoise_s},
                              {"vae_decode", r.decode_s},
                              {"per_step", r.total_steps ? r.denoise_s / r.total_steps : 0.0}};
            j["output"] = outputs[size_t(k)];
            write_file_atomic(outputs[size_t(k)] + ".json", j.dump(2) + "\n", o.overwrite);
        }
        const int64_t rss = cli::bench::rss_now_bytes();
        if (k0 == 0) rss_first = rss;
        rss_max = std::max(rss_max, rss);
        std::fprintf(stderr, "saved %s%s (seed %lld, denoise %s, decode %s, RSS %.1f MiB)\n",
                     outputs[size_t(k0)].c_str(), nb > 1 ? (" .. " + outputs[size_t(k0 + nb - 1)]).c_str() : "",
                     (long long)p.seed, fmt_s(r.denoise_s).c_str(), fmt_s(r.decode_s).c_str(), double(rss) / 1048576.0);
    }
    if (n_images > 1 && rss_first > 0)
        std::fprintf(stderr, "%d images: RSS %.1f MiB after the first, max %.1f MiB (growth %.2f %%)\n", n_images,
                     double(rss_first) / 1048576.0, double(rss_max) / 1048576.0,
                     100.0 * double(rss_max - rss_first) / double(rss_first));
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    // Subcommands with their own option sets (the top level is txt2img, as in stable-diffusion.cpp).
    if (argc > 1) {
        const std::string sub = argv[1];
        for (const char* s : {"bench", "bench-cache", "train-vae", "train-unet", "train-classifier", "eval-fashion",
                              "plot-loss", "calibrate"})
            if (sub == s) return anchor::cli::sd_bench_main(argc, argv);
    }
    return anchor::run_program([&]() -> int {
        CLI::App app{"anchor-sd: Stable Diffusion txt2img with anchor caches (AnchorCache)"};
        Options o;
        anchor::add_common_options(app, o.threads, "anchor-sd");
        const std::string samplers = anchor::enum_choices(sampler_table());
        app.add_option("-m,--model", o.model,
                       "model: diffusers folder or single-file .safetensors checkpoint (default: the embedded demo "
                       "model, assets/models/fashion-sd, else assets/models/sd15-tiny-random)");
        auto* prompt_opt = app.add_option("-p,--prompt", o.prompt, "the prompt");
        app.add_option("--prompts-file", o.prompts_file,
                       "one prompt per line, run --batch-size lines at a time, each batch --batch-count times, in this "
                       "process (outputs get _k suffixes)")
            ->excludes(prompt_opt);
        app.add_option("-n,--negative-prompt", o.negative, "the negative prompt (default: empty)");
        app.add_option("--cfg-scale", o.cfg_scale, "classifier-free guidance scale; <= 1 disables guidance")
            ->capture_default_str();
        app.add_option("--steps", o.steps, "number of sampling steps")->capture_default_str();
        app.add_option("-s,--seed", o.seed, "RNG seed; negative = random (printed)")->capture_default_str();
        app.add_option("--sampler", o.sampler, "sampler: " + samplers)->capture_default_str();
        app.add_option("-W,--width", o.width,
                       "image width, a multiple of the VAE factor (8 for SD); default: the model's size "
                       "(UNet sample_size x VAE factor: 512 for SD 1.x)");
        app.add_option("-H,--height", o.height, "image height; default: the model's size");
        app.add_option("-b,--batch-count", o.batch_count, "number of batches; batch k uses seed + k")
            ->capture_default_str();
        app.add_option("--batch-size", o.batch_size,
                       "images per UNet batch: N images of the prompt, or N lines of --prompts-file at a time; a "
                       "batch draws its initial noise from one generator seeded with the seed, as diffusers does for "
                       "prompt=[...] / num_images_per_prompt (image i of a batch is not the image of seed + i)")
            ->capture_default_str();
        app.add_option("-o,--output", o.output,
                       "output PNG; a JSON sidecar <output>.json is written next to it, "
                       "image k > 0 gets a _k suffix")
            ->capture_default_str();
        app.add_option("--clip-skip", o.clip_skip,
                       "use the N-th last CLIP layer (1 = last, 2 = penultimate); <= 0: the model's default")
            ->capture_default_str();
        app.add_option("--dtype", o.dtype, "compute dtype: f32 or bf16 (f16 is rejected on CPU)")
            ->capture_default_str();
        app.add_flag("--overwrite", o.overwrite, "replace existing output files");
        app.add_option("--save-latents", o.save_latents,
                       "also write initial_noise, initial_latents, final_latents, prompt_embeds, decoded and image "
                       "(diffusers' names) to this .safetensors file; image k > 0 gets a _k suffix");
        app.add_option("--deepcache", o.deepcache,
                       "DeepCache interval N: full UNet every N steps, shallow steps in between (0 = off)")
            ->capture_default_str();
        app.add_option("--deepcache-branch", o.deepcache_branch, "DeepCache skip branch (0 = shallowest)")
            ->capture_default_str();
        app.add_option("--cache", o.cache_mode, "cache mode:\n" + cache_mode_help());
        app.add_option_function<std::string>(
               "--attention",
               [&o](const std::string& s) {
                   o.attention = enum_from_string(anchor::kernels::attention_kernel_table(), s, "--attention");
               },
               "attention arithmetic (" + enum_choices(anchor::kernels::attention_kernel_table(), "|") +
                   "): exact = the reference's bits (diffusers on this LibTorch), fused = one fused kernel for many "
                   "small heads with another summation order (within 2e-6 relative), faster for small models; "
                   "default: the model folder's anchorcache.json, else exact")
            ->type_name("NAME");
        app.add_option("--compare", o.compare,
                       "run each listed mode (e.g. off,deepcache:3,freq) with the same seed and write "
                       "the labelled grid to <output> itself, plus <stem>_timeline.png and <stem>_report.json");
        if (const int rc = anchor::parse_command_line(app, argc, argv); rc >= 0) return rc;
        anchor::configure_threads(o.threads);
        if (o.prompt.empty() && o.prompts_file.empty())
            throw UsageError("a prompt is required (-p/--prompt TEXT, not empty, or --prompts-file FILE)");
        if (o.model.empty()) o.model = anchor::cli::default_sd_model();
        return run(o);
    });
}
