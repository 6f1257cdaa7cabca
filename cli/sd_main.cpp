// anchor-sd: Stable Diffusion txt2img with anchor caches. Flags follow stable-diffusion.cpp's names. The top level is
// txt2img (a library call, unet/pipeline/txt2img_job.h); bench, bench-cache, calibrate, train-* and eval-fashion are
// subcommands registered beside it, and --threads / --version work before or after any of them.
#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/util/heap.h"
#include "cache/util/threads.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "cli/sd_commands.h"
#include "text/gpt2/gpt2_tokenizer.h" // UTF-8 validation
#include "unet/cache/compare.h"
#include "unet/cache/freq_cache.h"
#include "unet/pipeline/control.h"
#include "unet/pipeline/control_preprocess.h"
#include "unet/pipeline/hires.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/preview.h"
#include "unet/pipeline/sd3_pipeline.h"
#include "unet/pipeline/txt2img_job.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>

namespace fs = std::filesystem;
using namespace anchor;
using namespace anchor::unet;

namespace {

// What the command line sets beyond the job: the model, the dtype, a compare instead of a job.
struct Options {
    Txt2ImgJob job;
    std::string model, prompt, negative, prompts_file, dtype = "auto", lora_model_dir, prompt_from;
    std::string cache = "off";                // --cache as typed; parsed once into job.cache
    std::vector<std::string> compare;         // --compare lists (repeatable); parsed once into compare_modes
    std::vector<CacheConfig> compare_modes;
    bool negative_given = false;    // -n given (even empty): SDXL's zero negative conditioning is for none at all
    std::vector<std::string> loras; // FILE[:MULTIPLIER]
    std::string embedding_dir;      // --embedding-dir: textual-inversion embeddings
    std::vector<std::pair<std::string, std::string>> ti_from_image; // --prompt-from: the image's TI hashes
    int clip_skip = -1, threads = 0, deepcache = 0, deepcache_branch = 0;
    std::optional<kernels::AttentionKernel> attention;
    std::optional<kernels::GemmBackend> gemm;
    std::optional<PredictionType> prediction; // unset: auto
    std::string vae;
    VaeDecoderChoice vae_decoder; // --vae-decoder; its kind goes to job.params.vae_decoder once the TAESD is loaded
    int preview = 0;              // --preview N: every N steps (0 = off)
    torch::ScalarType weights_dtype = torch::kFloat;
    std::string device = "cpu"; // --device (batch::DeviceSpec)
    bool channels_last = false, cudnn_benchmark = false, fused_qkv = false;
    // --control-net / --control-image (repeatable, paired in order) and their settings (make_control_params).
    std::vector<std::string> control_nets, control_images;
    std::vector<double> control_scales, control_starts, control_ends;
    bool guess_mode = false;
    std::string control_preprocess = "none"; // --control-preprocess: every control image through it
    batch::Shard shard;         // this process's place under mpirun
    cli::Sd3Options sd3;        // --no-t5, --shift, --max-sequence-length (SD 3 / 3.5 models)
    std::string upscale_model;  // --upscale-model: an ESRGAN upscale of every image before it is written
};

std::string fmt_s(double s) {
    char buf[32];
    if (s < 60)
        std::snprintf(buf, sizeof(buf), "%.1fs", s);
    else
        std::snprintf(buf, sizeof(buf), "%dm%02ds", int(s) / 60, int(s) % 60);
    return buf;
}

void progress_bar(const ProgressInfo& p, const std::string& label) {
    if (p.phase != anchor::unet::ProgressPhase::Step) return;
    const int width = 30, filled = p.total ? p.step * width / p.total : width;
    const double eta = p.step ? p.elapsed_s / p.step * (p.total - p.step) : 0.0;
    const std::string bar = std::string(size_t(filled), '#') + std::string(size_t(width - filled), '.');
    std::fprintf(stderr, "\r%s[%s] %d/%d  %s elapsed, ETA %s   ", label.c_str(), bar.c_str(), p.step, p.total,
                 fmt_s(p.elapsed_s).c_str(), fmt_s(eta).c_str());
    if (p.step == p.total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
}

// The prompts, checked as text: they go into the tokenizer and the JSON sidecar.
std::vector<std::string> read_prompts(const Options& o) {
    auto prompts = o.prompts_file.empty() ? std::vector<std::string>{o.prompt} : cli::read_prompts_file(o.prompts_file);
    for (size_t i = 0; i < prompts.size(); ++i)
        if (const auto bad = text::utf8_first_invalid(prompts[i]); bad >= 0)
            throw UsageError((o.prompts_file.empty()
                                  ? std::string("the prompt")
                                  : "prompt " + std::to_string(i + 1) + " of '" + o.prompts_file + "'") +
                             " is not valid UTF-8 (first invalid byte at offset " + std::to_string(bad) + ")");
    if (const auto bad = text::utf8_first_invalid(o.negative); bad >= 0)
        throw UsageError("the negative prompt is not valid UTF-8 (first invalid byte at offset " + std::to_string(bad) +
                         ")");
    return prompts;
}

void print_compare_table(const nlohmann::json& rep) {
    size_t width = 4;
    for (const auto& m : rep["modes"]) width = std::max(width, m["mode"].get<std::string>().size());
    std::fprintf(stderr, "  %-*s %8s %8s %8s %10s %7s\n", int(width), "mode", "wall", "speed-up", "full", "PSNR",
                 "SSIM");
    for (const auto& m : rep["modes"]) {
        const auto& psnr = m["psnr_vs_first_db"];
        char db[32] = "inf";
        if (psnr.is_number()) std::snprintf(db, sizeof db, "%.2f dB", psnr.get<double>());
        // SSIM needs an 11x11 window: null for smaller images.
        const auto& ssim = m["ssim_vs_first"];
        char ss[32] = "-";
        if (ssim.is_number()) std::snprintf(ss, sizeof ss, "%.4f", ssim.get<double>());
        const std::string full =
            std::to_string(m["full_steps"].get<int>()) + "/" + std::to_string(m["total_steps"].get<int>());
        std::fprintf(stderr, "  %-*s %7.2fs %7.2fx %8s %10s %7s\n", int(width), m["mode"].get<std::string>().c_str(),
                     m["wall_s"].get<double>(), m["speedup_vs_first"].get<double>(), full.c_str(), db, ss);
    }
}

// --prompt-from's ControlNet units: with --control-net given for each, their weights and guidance ranges (unless given
// here); without, the record's own model and image files when they exist; else a note (an A1111 infotext has no
// control image).
void apply_control_from(const CLI::App& app, Options& o, const ImageParameters& ip) {
    if (ip.control.empty()) return;
    auto given = [&](const char* opt) { return app.get_option(opt)->count() > 0; };
    const size_t n = ip.control.size();
    bool files = true;
    for (const auto& u : ip.control) files = files && fs::exists(u.model) && !u.image.empty() && fs::exists(u.image);
    if (o.control_nets.empty() && files) {
        for (const auto& u : ip.control) o.control_nets.push_back(u.model), o.control_images.push_back(u.image);
    } else if (o.control_nets.size() != n) {
        for (size_t i = 0; i < n; ++i)
            std::fprintf(stderr,
                         "note: the image was made with ControlNet %zu (%s, weight %s, guidance %s..%s): give "
                         "--control-net and --control-image to run it again\n",
                         i, ip.control[i].model.c_str(), infotext_number(ip.control[i].weight).c_str(),
                         infotext_number(ip.control[i].start).c_str(), infotext_number(ip.control[i].end).c_str());
        return;
    }
    if (!given("--control-scale"))
        for (size_t i = 0; i < n; ++i) o.control_scales.push_back(ip.control[i].weight);
    if (!given("--control-start"))
        for (size_t i = 0; i < n; ++i) o.control_starts.push_back(ip.control[i].start);
    if (!given("--control-end"))
        for (size_t i = 0; i < n; ++i) o.control_ends.push_back(ip.control[i].end);
    if (!given("--guess-mode")) o.guess_mode = ip.control[0].guess_mode;
}

// --prompt-from: the parameters an image was made with (its JSON record, else its A1111 infotext), each one unless its
// option was given: the command line wins.
void apply_prompt_from(const CLI::App& app, Options& o) {
    const ImageParameters ip = read_image_parameters(o.prompt_from);
    auto given = [&](const char* opt) { return app.get_option(opt)->count() > 0; };
    auto take = [&](const char* opt, const auto& from, auto& to) {
        if (from && !given(opt)) to = *from;
    };
    auto& p = o.job.params;
    take("--prompt", ip.prompt, o.prompt);
    take("--negative-prompt", ip.negative_prompt, o.negative);
    take("--steps", ip.steps, p.steps);
    take("--seed", ip.seed, p.seed);
    take("--sampler", ip.sampler, p.sampler);
    take("--schedule", ip.schedule, p.schedule);
    take("--prompt-syntax", ip.prompt_syntax, p.prompt_syntax);
    take("--cfg-scale", ip.cfg_scale, p.guidance_scale);
    take("--eta", ip.eta, p.eta);
    take("--width", ip.width, p.width);
    take("--height", ip.height, p.height);
    take("--clip-skip", ip.clip_skip, o.clip_skip);
    if (ip.init_image && !given("--init-img")) p.init.init_images = {*ip.init_image};
    if (ip.mask && !given("--mask")) p.init.masks = {*ip.mask};
    take("--strength", ip.strength, p.init.strength);
    if (ip.hires) { // the image's hires fix, each setting unless given here
        HiresParams h = *ip.hires;
        if (given("--hires-scale") || given("--hires-width") || given("--hires-height"))
            h.scale = p.hires.scale, h.width = p.hires.width, h.height = p.hires.height;
        if (given("--hires-steps")) h.steps = p.hires.steps;
        if (given("--hires-denoise")) h.denoise = p.hires.denoise;
        if (given("--hires-upscaler")) h.upscaler = p.hires.upscaler, h.model = p.hires.model;
        p.hires = h;
    }
    if (ip.prompt && !given("--prompt")) o.ti_from_image = ip.ti_hashes;
    apply_control_from(app, o, ip);
    if (!given("--deepcache")) take("--cache", ip.cache_mode, o.cache);
    if (ip.timestep_spacing && !given("--timestep-spacing")) p.timestep_spacing = *ip.timestep_spacing;
    if (ip.vae_decoder && !given("--vae-decoder")) o.vae_decoder = VaeDecoderChoice{*ip.vae_decoder, ""};
    if (ip.vae_tiling && !given("--vae-tiling") && !given("--vae-tile-size") && !given("--vae-tile-overlap"))
        p.vae_tiling = *ip.vae_tiling;
    std::fprintf(stderr, "parameters of %s from its '%s' chunk (options given here win)\n", o.prompt_from.c_str(),
                 ip.source.c_str());
    for (const auto& n : ip.notes) std::fprintf(stderr, "note: %s\n", n.c_str());
}

// --embedding-dir: the folder read once (a file that does not read stops here, before any model is loaded); the
// embeddings an image given to --prompt-from names, compared with it.
void load_embeddings(Options& o) {
    if (!o.embedding_dir.empty()) {
        o.job.params.embeddings =
            std::make_shared<const EmbeddingDatabase>(EmbeddingDatabase::load_dir(o.embedding_dir));
        std::fprintf(stderr, "embeddings: %zu from %s\n", o.job.params.embeddings->items().size(),
                     o.embedding_dir.c_str());
    }
    for (const auto& [name, hash] : o.ti_from_image) {
        const auto* e = o.job.params.embeddings ? o.job.params.embeddings->find(name) : nullptr;
        if (!e)
            std::fprintf(stderr, "note: the image was made with the embedding '%s' (%s), which %s: its name is read "
                                 "as words\n",
                         name.c_str(), hash.c_str(),
                         o.embedding_dir.empty() ? "needs --embedding-dir" : "is not in --embedding-dir");
        else if (e->short_hash() != hash)
            std::fprintf(stderr, "note: the embedding '%s' here (%s) is another file than the image's (%s)\n",
                         name.c_str(), e->short_hash().c_str(), hash.c_str());
    }
}

// The job from the options: --deepcache sugar, prompts (and their <lora:...> tags), checks before loading anything.
std::vector<LoraSpec> prepare_job(Options& o) {
    auto& job = o.job;
    if (o.deepcache < 0)
        throw UsageError("--deepcache: expected an interval >= 1 (0 = off), got " + std::to_string(o.deepcache));
    if (o.deepcache > 0) { // --deepcache N is sugar for --cache deepcache:N
        if (o.cache != "off") throw UsageError("--cache and --deepcache are exclusive");
        o.cache = "deepcache:" + std::to_string(o.deepcache) + ",branch=" + std::to_string(o.deepcache_branch);
    }
    if (!o.prompts_file.empty() && !o.compare.empty()) throw UsageError("--prompts-file and --compare are exclusive");
    // An existing folder named as the output file fails at the first write, after the whole run: say so now.
    if (!job.output.empty() && job.output.back() != '/' && fs::is_directory(job.output))
        throw UsageError("-o/--output: '" + job.output + "' is a folder (" +
                         (o.compare.empty() ? "end it with / for a folder of images, or name a file"
                                            : "--compare writes one grid: name a file") +
                         "); --overwrite replaces files, never folders");
    if (job.batch_size > 1 && !o.compare.empty()) throw UsageError("--batch-size and --compare are exclusive");
    job.prompts = read_prompts(o);
    const auto loras = run_loras(o.loras, o.lora_model_dir, job.prompts); // <lora:...> tags leave the prompts
    // No -n: diffusers' negative_prompt=None ("" for SD 1.x/2.x, zeros for SDXL's force_zeros_for_empty_prompt).
    job.params.negative_prompts =
        o.negative_given || !o.negative.empty() ? std::vector<std::string>{o.negative} : std::vector<std::string>{};
    // stable-diffusion.cpp semantics: N-th last layer (1 = last, 2 = penultimate); <= 0 = the model's default.
    job.params.clip_skip = o.clip_skip <= 0 ? 0 : o.clip_skip - 1;
    // The modes, parsed here once (one-line errors under --cache / --compare), before any model is loaded.
    if (o.compare.empty()) {
        job.cache = parse_cache_config(o.cache);
        job.validate();
    } else {
        o.compare_modes = parse_cache_list(o.compare, "compare");
    }
    if (job.params.seed < 0) {
        std::random_device rd;
        job.params.seed = int64_t((uint64_t(rd()) << 31 ^ rd()) & 0x7fffffffffffLL);
    }
    std::fprintf(stderr, "seed: %lld\n", (long long)job.params.seed);
    return loras;
}

LoadOptions load_options(const Options& o, const std::vector<LoraSpec>& loras) {
    LoadOptions lo;
    lo.attention = o.attention;
    lo.gemm = o.gemm;
    lo.loras = loras;
    lo.prediction = o.prediction;
    lo.vae_file = o.vae;
    lo.weights_dtype = o.weights_dtype;
    // Under mpirun each process of a machine takes the GPU of its local rank (with cuda or auto).
    lo.device = batch::select_device(batch::DeviceSpec::parse(o.device), o.shard.local_rank);
    lo.dtype = cli::parse_dtype(o.dtype, lo.device);
    lo.channels_last = o.channels_last;
    lo.cudnn_benchmark = o.cudnn_benchmark;
    lo.fused_qkv = o.fused_qkv;
    lo.validate(); // before loading anything
    return lo;
}

SDModels load_models(const Options& o, const std::vector<LoraSpec>& loras, double& load_s) {
    const auto t0 = std::chrono::steady_clock::now();
    SDModels models = load_sd_models(o.model, load_options(o, loras));
    load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "loaded %s (%s, %s, %s attention, %s gemm) in %s; %s\n", o.model.c_str(),
                 models.layout.c_str(), enum_name(sd_family_table(), models.family).c_str(),
                 enum_name(kernels::attention_kernel_table(), models.attention).c_str(),
                 enum_name(kernels::gemm_backend_table(), models.gemm).c_str(), fmt_s(load_s).c_str(),
                 models.unet->config().describe().c_str());
    for (const auto& l : models.loras)
        std::fprintf(stderr, "LoRA %s x %g: %d modules merged\n", l.path.c_str(), l.multiplier, l.modules);
    if (models.prediction.test_mean)
        std::fprintf(stderr, "prediction: %s (v-prediction test mean %.3f; v below -1)\n",
                     enum_name(prediction_source_table(), models.prediction.source).c_str(),
                     *models.prediction.test_mean);
    if (!models.vae_file.empty()) std::fprintf(stderr, "VAE: %s\n", models.vae_file.c_str());
    return models;
}

// What only the loaded model can bound, said in the options' own terms: --clip-skip against the text encoder's
// depth (the library's clip_skip counts from 0), and a warning for a size past the one the model was made for.
void check_against_model(const Options& o, const SDModels& m) {
    if (m.text_encoder && !m.unet->config().text_time() && o.clip_skip > 0) {
        const int layers = m.text_encoder->config().num_hidden_layers;
        if (o.clip_skip > layers)
            throw UsageError("--clip-skip: must be in [1, " + std::to_string(layers) + "] for this model's " +
                             std::to_string(layers) + "-layer text encoder (or <= 0 for its default), got " +
                             std::to_string(o.clip_skip));
    }
    const auto& p = o.job.params;
    const int native = m.unet->config().sample_size * m.vae_scale_factor();
    if (p.width > native || p.height > native)
        std::fprintf(stderr,
                     "warning: %dx%d is larger than the %dx%d this model was made for (%s): expect repeated or "
                     "broken subjects\n",
                     p.width > 0 ? p.width : native, p.height > 0 ? p.height : native, native, native,
                     p.width > native ? "-W" : "-H");
}

// --vae-decoder taesd[:FILE] loads the TAESD (an error when there is none); --preview uses one found next to the
// model when there is one, else the latent projection.
void attach_decoders(Options& o, SDModels& models) {
    if (o.vae_decoder.kind == VaeDecoder::Taesd) {
        attach_taesd(models, o.vae_decoder.file, o.model);
        o.job.params.vae_decoder = VaeDecoder::Taesd;
    } else if (o.preview > 0 && !find_taesd(o.model, models.family == SdFamily::SDXL).empty()) {
        attach_taesd(models, "", o.model);
    }
    if (models.taesd) std::fprintf(stderr, "TAESD: %s\n", models.taesd->source.c_str());
}

int run_compare_modes(Txt2ImgPipeline& pipe, const Options& o) {
    const auto& job = o.job;
    auto p = pipe.resolved(job.params);
    p.prompts = job.prompts;
    pipe.validate(p);
    const fs::path out(job.output);
    auto rep = run_compare(pipe, p, o.compare_modes, (out.parent_path() / out.stem()).string(), job.facts, job.overwrite,
                           [](const std::string& m) { std::fprintf(stderr, "compare: %s\n", m.c_str()); });
    print_compare_table(rep);
    return 0;
}

// What a finished job prints: its warnings, rank 0's manifest of every image, and the memory of back-to-back runs.
void report_job(const Txt2ImgJobResult& r, const Txt2ImgJob& job) {
    for (const auto& w : r.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
    // Rank 0 writes one manifest of every image (all shards') once their sidecars are there.
    if (job.shard_rank == 0 && (job.shard_count > 1 || job.output.back() == '/')) {
        write_file_atomic(manifest_path(job), job_manifest(job, 3600).dump(2) + "\n", true);
        std::fprintf(stderr, "manifest: %s (%d images)\n", manifest_path(job).c_str(), job.image_count());
    }
    // Memory of back-to-back runs in one process (the soak check): RSS after every batch, growth from the first.
    if (r.images.size() > 1 && r.rss_first > 0)
        std::fprintf(stderr, "%zu images: RSS %.1f MiB after the first batch, max %.1f MiB (growth %.2f %%)\n",
                     r.images.size(), double(r.rss_first) / 1048576.0, double(r.rss_max) / 1048576.0,
                     100.0 * double(r.rss_max - r.rss_first) / double(r.rss_first));
}

int run(Options& o) {
    auto& job = o.job;
    o.shard = batch::shard_from_env();
    // --dtype / --weights-dtype / --device before loading anything; the sidecars record the dtype in effect.
    o.dtype = enum_name(weights_dtype_table(), load_options(o, {}).dtype);
    const auto loras = prepare_job(o);
    load_embeddings(o);
    if (!o.upscale_model.empty()) job.upscale.model = std::make_shared<const EsrganModel>(load_esrgan(o.upscale_model));
    double load_s = 0;
    SDModels models = load_models(o, loras, load_s);
    check_against_model(o, models);
    job.params.control = make_control_params(o.control_nets, o.control_images, o.control_scales, o.control_starts,
                                             o.control_ends, o.guess_mode, load_options(o, {}).dtype);
    prepare_control(job.params.control, models, o.control_preprocess, int64_t(job.prompts.size()));
    for (const auto& c : job.params.control)
        std::fprintf(stderr, "ControlNet %s x %g (steps %g..%g of the loop%s), image %s\n", c.source.c_str(), c.scale,
                     c.start, c.end, c.guess_mode ? ", guess mode" : "", c.image.c_str());
    attach_decoders(o, models);
    Txt2ImgPipeline pipe(models);
    if (job.params.embeddings) { // every prompt of the job, before the first image is written
        auto all = job.params;
        all.prompts = job.prompts;
        pipe.check_embeddings(all);
    }
    job.facts = {{"program", "anchor-sd"}, {"model", o.model},     {"clip_skip", o.clip_skip},
                 {"dtype", o.dtype},       {"threads", o.threads}, {"load_s", load_s}};
    if (!o.compare.empty()) return run_compare_modes(pipe, o);
    // Under mpirun each rank runs its share of the batches; outputs keep the job's global numbering.
    job.shard_rank = o.shard.rank;
    job.shard_count = o.shard.size;
    if (o.shard.size > 1)
        std::fprintf(stderr, "MPI rank %d of %d (local rank %d, %s)\n", o.shard.rank, o.shard.size, o.shard.local_rank,
                     pipe.resolved(job.params).device.str().c_str());
    if (job.output.back() == '/') fs::create_directories(job.output);
    Txt2ImgJobCallbacks cb;
    const std::string preview_file = preview_path(job.output);
    if (o.preview > 0 && fs::exists(preview_file) && !job.overwrite)
        throw UsageError("--preview: '" + preview_file + "' exists; add --overwrite to replace it");
    PreviewHook preview(models, o.preview, [&preview_file](const std::string& png, int, int) {
        write_file_atomic(preview_file, png, true);
    });
    if (o.preview > 0)
        std::fprintf(stderr, "preview: %s every %d steps (%s)\n", preview_file.c_str(), o.preview,
                     enum_name(preview_method_table(), preview.method()).c_str());
    cb.progress = [&preview](const ProgressInfo& p, const std::string& label) {
        progress_bar(p, label);
        preview(p);
    };
    cb.batch_done = [&](const std::vector<Txt2ImgJobImage>& imgs, double denoise_s, double decode_s, int64_t rss) {
        std::fprintf(stderr, "saved %s%s (seed %lld, denoise %s, decode %s, RSS %.1f MiB)\n", imgs.front().png.c_str(),
                     imgs.size() > 1 ? (" .. " + imgs.back().png).c_str() : "",
                     (long long)imgs.front().record["seed"].get<int64_t>(), fmt_s(denoise_s).c_str(),
                     fmt_s(decode_s).c_str(), double(rss) / 1048576.0);
    };
    report_job(run_txt2img_job(pipe, job, cb), job);
    return 0;
}

// The option table: each option fills a field of the job or of the options, and names the field it sets so a
// library error about that field reads as this option.
// "A,B" -> {B, A}: the command line takes sizes as W,H and crops as X,Y; diffusers (and so Txt2ImgParams) orders
// them (height, width) and (top, left).
std::array<int, 2> swapped_pair(const std::string& text, const std::string& option) {
    const auto comma = text.find(',');
    try {
        size_t a = 0, b = 0;
        const int x = std::stoi(text.substr(0, comma), &a), y = std::stoi(text.substr(comma + 1), &b);
        if (comma != std::string::npos && a == comma && b == text.size() - comma - 1) return {y, x};
    } catch (const std::exception&) {
    }
    throw UsageError(option + ": expected two integers A,B, got '" + text + "'");
}

// SDXL's conditioning (Txt2ImgParams: prompts_2, micro-conditioning) and the timestep spacing few-step models need.
void add_sdxl_options(CLI::App& app, Options& o) {
    auto& p = o.job.params;
    auto pair_option = [&](const char* name, const char* field, std::function<void(std::array<int, 2>)> set,
                           const std::string& help, const char* type) {
        const std::string opt = std::string("--") + name;
        bind_field(field, opt);
        return app
            .add_option_function<std::string>(
                opt, [set, opt](const std::string& v) { set(swapped_pair(v, opt)); }, help)
            ->type_name(type);
    };
    bind_field("prompts_2", "--prompt-2");
    app.add_option_function<std::string>(
        "--prompt-2", [&p](const std::string& v) { p.prompts_2 = {v}; },
        "SDXL: the prompt of the second text encoder (default: the prompt)");
    bind_field("negative_prompts_2", "--negative-prompt-2");
    app.add_option_function<std::string>(
        "--negative-prompt-2", [&p](const std::string& v) { p.negative_prompts_2 = {v}; },
        "SDXL: the negative prompt of the second text encoder (default: the negative prompt)");
    pair_option(
        "original-size", "original_size", [&p](auto v) { p.original_size = v; },
        "SDXL micro-conditioning: the size the training image had (default: the output size)", "W,H");
    pair_option(
        "crop", "crop", [&p](auto v) { p.crop = v; }, "SDXL micro-conditioning: crop top-left corner (default 0,0)",
        "X,Y");
    pair_option(
        "target-size", "target_size", [&p](auto v) { p.target_size = v; },
        "SDXL micro-conditioning: the target size (default: the output size)", "W,H");
    pair_option(
        "negative-original-size", "negative_original_size", [&p](auto v) { p.negative_original_size = v; },
        "SDXL: original size of the unconditional rows (used with --negative-target-size, as diffusers)", "W,H");
    pair_option(
        "negative-crop", "negative_crop", [&p](auto v) { p.negative_crop = v; },
        "SDXL: crop of the unconditional rows (default 0,0)", "X,Y");
    pair_option(
        "negative-target-size", "negative_target_size", [&p](auto v) { p.negative_target_size = v; },
        "SDXL: target size of the unconditional rows (used with --negative-original-size)", "W,H");
    bind_field("timestep_spacing", "--timestep-spacing");
    cli::add_enum_option(app, "--timestep-spacing", p.timestep_spacing, timestep_spacing_table(),
                         "where the sampler's timesteps lie (diffusers' timestep_spacing): trailing for few-step "
                         "models (SDXL-Turbo/Lightning-style: 4 steps, euler_a, --cfg-scale 1)",
                         "the model's scheduler_config.json, else leading");
}

// ControlNet (unet/pipeline/control.h): repeatable, the k-th --control-image goes with the k-th --control-net.
void add_control_options(CLI::App& app, Options& o) {
    const std::pair<const char*, const char*> fields[] = {{"control_net", "--control-net"},
                                                          {"control_image", "--control-image"},
                                                          {"control_scale", "--control-scale"},
                                                          {"control_start", "--control-start"},
                                                          {"control_end", "--control-end"},
                                                          {"control_preprocess", "--control-preprocess"}};
    for (const auto& [field, opt] : fields) bind_field(field, opt);
    app.add_option("--control-net", o.control_nets,
                   "ControlNet: a diffusers folder, or a .safetensors / .pth file (diffusers or original "
                   "control_model.* names); repeat it for several (their residuals add)")
        ->check(CLI::ExistingPath)
        ->allow_extra_args(false);
    app.add_option("--control-image", o.control_images,
                   "the control image (PNG) of the --control-net in the same position, resized to the output size; "
                   "without -W/-H the output takes its size")
        ->allow_extra_args(false);
    app.add_option("--control-scale", o.control_scales,
                   "ControlNet conditioning scale (default 1): one for all, or one per --control-net")
        ->allow_extra_args(false);
    app.add_option("--control-start", o.control_starts,
                   "share of the steps before the ControlNet acts, in [0, 1) (default 0); one, or one per ControlNet")
        ->allow_extra_args(false);
    app.add_option("--control-end", o.control_ends,
                   "share of the steps after which the ControlNet stops, in (0, 1] (default 1)")
        ->allow_extra_args(false);
    app.add_option("--control-preprocess", o.control_preprocess,
                   "preprocessor of every --control-image: none, canny (OpenCV's, thresholds 100/200 as A1111) or "
                   "canny:LOW:HIGH")
        ->type_name("none|canny[:LOW:HIGH]");
    app.add_flag("--guess-mode", o.guess_mode,
                 "ControlNet guess mode: residuals scaled 0.1..1 from the shallowest skip to the mid block, the "
                 "ControlNet on the conditional rows only");
}

void add_txt2img_options(CLI::App& app, Options& o) {
    auto& j = o.job;
    auto& p = j.params;
    auto bind = [](CLI::Option* opt, const char* field) {
        bind_field(field, opt->get_name());
        return opt;
    };
    bind_field("model", "-m/--model");
    app.add_option("-m,--model", o.model,
                   "model: diffusers folder or single-file .safetensors checkpoint (default: the embedded demo model, "
                   "assets/models/fashion-sd, else assets/models/sd15-tiny-random)");
    auto* prompt = bind(app.add_option("-p,--prompt", o.prompt, "the prompt"), "prompts");
    auto* prompts_file = app.add_option("--prompts-file", o.prompts_file,
                                        "one prompt per line, run --batch-size lines at a time, each batch "
                                        "--batch-count times, in this process (outputs get _k suffixes); batch j of "
                                        "the job uses seed + j, so with --batch-size 1 prompt k uses seed + k")
                             ->excludes(prompt);
    app.add_option("--prompt-from", o.prompt_from,
                   "run an image's parameters again: prompt, negative prompt, steps, sampler, CFG scale, seed, size, "
                   "clip skip, strength, hires fix (and init image, cache mode, timestep spacing, TAESD decoder, VAE "
                   "tiling) from a "
                   "PNG's anchorcache JSON chunk, else its "
                   "A1111 'parameters' text; options given on the command line win")
        ->type_name("PNG")
        ->excludes(prompts_file);
    bind(app.add_option_function<std::string>(
             "-n,--negative-prompt", [&o](const std::string& v) { o.negative = v, o.negative_given = true; },
             "the negative prompt (default: none: empty for SD 1.x/2.x, zero conditioning for SDXL)"),
         "negative_prompts");
    bind(app.add_option("--cfg-scale", p.guidance_scale,
                        "classifier-free guidance scale in [0, 100]; <= 1 disables guidance")
             ->check(cli::in_range(0, 100))
             ->capture_default_str(),
         "guidance_scale");
    bind(app.add_option("--steps", p.steps, "number of sampling steps, in [1, 10000]")
             ->check(cli::in_range(1, 10000))
             ->capture_default_str(),
         "steps");
    p.seed = 42;
    app.add_option("-s,--seed", p.seed, "RNG seed; negative = random (printed)")->capture_default_str();
    p.sampler = SamplerKind::EulerAncestral;
    bind(app.add_option_function<std::string>(
                "--sampler", [&p](const std::string& s) { p.sampler = parse_sampler_name(s, "--sampler"); },
                "sampler (" + enum_choices(sampler_table(), "|") +
                    ", or an A1111 / stable-diffusion.cpp / ComfyUI name: 'DPM++ 2M Karras', 'DPM2 a', dpm++2m, ...; "
                    "default euler_a)")
             ->type_name("NAME"),
         "sampler");
    p.prompt_syntax = PromptSyntax::A1111;
    bind(cli::add_enum_option(app, "--prompt-syntax", p.prompt_syntax, prompt_syntax_table(),
                              "how the prompts are read: a1111 = AUTOMATIC1111's (text) / [text] / (text:1.3) "
                              "emphasis, \\( for a literal bracket, BREAK, and prompts past 75 tokens as more 77-token "
                              "chunks; plain = diffusers (the text as is, truncated to 75 tokens)"),
         "prompt_syntax");
    bind(cli::add_enum_option(app, "--schedule", p.schedule, noise_schedule_table(),
                              "noise schedule of every sampler: default = diffusers' timestep spacing, karras = Karras "
                              "et al. 2022 (rho 7), exponential = log-linear sigmas, sgm_uniform / simple = ComfyUI's",
                              "karras when the model's scheduler_config.json sets use_karras_sigmas, else default"),
         "schedule");
    bind(app.add_option_function<double>(
                "--eta", [&p](double v) { p.eta = v; },
                "noise of the samplers that have a noise term, in [0, 10]: ddim (default 0 = deterministic) and "
                "euler_a (default 1; 0 = the Euler step); refused for the others")
             ->check(cli::in_range(0, 10))
             ->type_name("FLOAT"),
         "eta");
    bind(app.add_option("-W,--width", p.width,
                        "image width, a multiple of the VAE factor (8 for SD); default: the model's size (UNet "
                        "sample_size x VAE factor: 512 for SD 1.x, 768 for SD 2.x v-prediction single files); at "
                        "most 16384")
             ->check(cli::in_range(0, 16384)),
         "width");
    bind(app.add_option("-H,--height", p.height, "image height; default: the model's size; at most 16384")
             ->check(cli::in_range(0, 16384)),
         "height");
    bind(app.add_option("-i,--init-img", p.init.init_images,
                        "img2img: the init image (PNG); output size = its size rounded down to a multiple of the VAE "
                        "factor, or -W/-H (the images are resized to them). Repeat it for a batch: one per line of "
                        "--prompts-file, or one per image of --batch-size (diffusers' image=[...])")
             ->allow_extra_args(false),
         "init_image");
    bind(app.add_option("--strength", p.init.strength,
                        "img2img / inpaint: how far the init image is noised, in (0, 1]; runs the last "
                        "int(steps * strength) steps")
             ->capture_default_str(),
         "strength");
    // A1111's hires fix (unet/pipeline/hires.h): any of these turns it on.
    const auto hires_on = [&p](const std::string&) { p.hires.enabled = true; };
    bind(app.add_option("--hires-scale", p.hires.scale,
                        "hires fix: txt2img at -W x -H, then img2img at int(size * S) rounded down to the VAE factor "
                        "(A1111's Hires upscale; default 2 when another --hires-* option is given)")
             ->each(hires_on),
         "hires_scale");
    bind(app.add_option("--hires-width", p.hires.width,
                        "hires fix target width instead of --hires-scale (A1111's hr_resize_x; 0 = from the height "
                        "and the aspect), a multiple of the VAE factor")
             ->each(hires_on),
         "hires_width");
    bind(app.add_option("--hires-height", p.hires.height,
                        "hires fix target height (hr_resize_y); with both, the upscale covers the target and is cropped")
             ->each(hires_on),
         "hires_height");
    bind(app.add_option("--hires-steps", p.hires.steps,
                        "hires fix second pass steps (0 = --steps); it runs int(N * D) of them, D = --hires-denoise")
             ->each(hires_on),
         "hires_steps");
    bind(app.add_option("--hires-denoise", p.hires.denoise,
                        "hires fix denoising strength of the second pass, in (0, 1] (default 0.7)")
             ->each(hires_on),
         "hires_denoise");
    bind(app.add_option_function<std::string>(
                "--hires-upscaler", [&p](const std::string& s) { parse_hires_upscaler(s, p.hires), p.hires.enabled = true; },
                "hires fix upscaler: " + enum_choices(hires_upscaler_table(), ", ") +
                    " (A1111's Latent, Latent (nearest), Lanczos, ...), or an ESRGAN model FILE; default latent")
             ->type_name("NAME|FILE"),
         "hires_upscaler");
    bind(app.add_option("--mask", p.init.masks,
                        "inpaint: mask image of the init image's size, white = repaint, black = keep (needs -i); "
                        "repeat it as -i (one, or one per init image)")
             ->allow_extra_args(false),
         "mask");
    bind(app.add_option("-b,--batch-count", j.batch_count, "number of batches, in [1, 100000]; batch k uses seed + k")
             ->check(cli::in_range(1, 100000))
             ->capture_default_str(),
         "batch_count");
    bind(
        app.add_option("--batch-size", j.batch_size,
                       "images per UNet batch: N images of the prompt, or N lines of --prompts-file at a time; a batch "
                       "draws its initial noise from one generator seeded with the seed, as diffusers does for "
                       "prompt=[...] / num_images_per_prompt (image i of a batch is not the image of seed + i); in "
                       "[1, 1024]")
            ->check(cli::in_range(1, 1024))
            ->capture_default_str(),
        "batch_size");
    bind_field("images_per_prompt", "--batch-size"); // the pipeline's name of the batch's images
    bind(app.add_option(
                "-o,--output", j.output,
                "output PNG; a JSON sidecar <output>.json is written next to it, image k > 0 gets a _k suffix; a "
                "folder DIR/ gets DIR/00000.png, ... and DIR/manifest.json")
             ->capture_default_str(),
         "output");
    bind(app.add_option("--clip-skip", o.clip_skip,
                        "use the N-th last CLIP layer (1 = last, 2 = penultimate); <= 0: the model's default")
             ->capture_default_str(),
         "clip_skip");
    bind(app.add_option("--lora", o.loras,
                        "LoRA FILE[:MULTIPLIER] (kohya or diffusers/PEFT .safetensors, multiplier default 1) merged "
                        "into the UNet and text encoder at load; repeatable")
             ->type_name("FILE[:M]")
             ->allow_extra_args(false),
         "loras");
    bind(
        app.add_option("--lora-model-dir", o.lora_model_dir,
                       "folder of the prompt's A1111 tags <lora:NAME> / <lora:NAME:MULTIPLIER> (DIR/NAME.safetensors); "
                       "the tags are removed from the prompt"),
        "lora_model_dir");
    bind(app.add_option("--embedding-dir", o.embedding_dir,
                        "folder of textual-inversion embeddings (A1111 .pt, .safetensors, diffusers .bin; SDXL "
                        "clip_l/clip_g): the file name without its extension, in a prompt, stands for its vectors")
             ->type_name("DIR"),
         "embeddings");
    app.add_option("--dtype", o.dtype,
                   "compute dtype: f32, f16 or bf16; auto: f16 on CUDA, f32 on the CPU (f16 is rejected on the CPU)")
        ->capture_default_str();
    bind(cli::add_enum_option(app, "--weights-dtype", o.weights_dtype, weights_dtype_table(),
                              "how Linear/Conv weights are kept in memory; f16/bf16 halve them, the compute stays f32 "
                              "(needs --dtype f32)"),
         "weights_dtype");
    cli::add_device_option(app, o.device);
    bind(app.add_flag("--channels-last", o.channels_last,
                      "CUDA: keep the UNet's and VAE's convolution weights in NHWC order (cuDNN's tensor-core layout)"),
         "channels_last");
    bind(app.add_flag("--cudnn-benchmark", o.cudnn_benchmark,
                      "CUDA: let cuDNN time its convolution algorithms per shape and keep the fastest"),
         "cudnn_benchmark");
    bind(app.add_flag("--fused-qkv", o.fused_qkv,
                      "self-attention projects Q, K and V with one matrix product (one GEMM instead of three)"),
         "fused_qkv");
    bind(cli::add_enum_option(app, "--prediction", o.prediction, prediction_option_table(),
                              "what the UNet predicts: auto = the model's scheduler config, epsilon for SD 1.x single "
                              "files, the v-prediction test for SD 2.x single files"),
         "prediction");
    bind(app.add_option("--vae", o.vae,
                        "replace the model's VAE: a single-file VAE (.safetensors/.ckpt, original or diffusers names), "
                        "a diffusers VAE folder or its weights file"),
         "vae_file");
    bind(app.add_option_function<std::string>(
                "--vae-decoder",
                [&o](const std::string& s) { o.vae_decoder = VaeDecoderChoice::parse(s, "--vae-decoder"); },
                "decoder of the final image: full (the model's VAE), taesd (the tiny TAESD/TAESDXL decoder found next "
                "to the model: a taesd/ or taesdxl/ folder or taesd_decoder.safetensors) or taesd:FILE (a diffusers "
                "AutoencoderTiny folder or madebyollin's taesd*_decoder.safetensors)")
             ->type_name("full|taesd[:FILE]"),
         "vae_decoder");
    bind(app.add_option("--preview", o.preview,
                        "every N steps write a preview PNG of the first image to <output stem>_preview.png (TAESD "
                        "when one is loaded or next to the model, else a latent-to-RGB projection); 0 = off")
             ->check(cli::in_range(0, 10000))
             ->capture_default_str(),
         "preview");
    app.add_flag("--overwrite", j.overwrite, "replace existing output files");
    app.add_flag("--skip-existing", j.skip_existing,
                 "do not run again the batches whose PNGs and sidecars exist (a failed --prompts-file job resumes)");
    app.add_option("--save-latents", j.save_latents,
                   "also write initial_noise, initial_latents, final_latents, prompt_embeds, decoded and image "
                   "(diffusers' names) to this .safetensors file; image k > 0 gets a _k suffix");
    app.add_option("--deepcache", o.deepcache, "DeepCache interval N: the same as --cache deepcache:N (0 = off)")
        ->capture_default_str();
    app.add_option("--deepcache-branch", o.deepcache_branch, "DeepCache skip branch (0 = shallowest)")
        ->capture_default_str();
    bind(app.add_option("--cache", o.cache, "cache mode (`--cache help`: the modes, presets and keys):\n" +
                                                 cache_mode_help())
             ->capture_default_str(),
         "cache");
    auto* compare = bind(cli::add_mode_list_option(app, "--compare", o.compare,
                                                   "run each listed mode (e.g. 'off;deepcache:3;freq', or "
                                                   "off,deepcache:3,freq; repeatable) with the same seed and write the "
                                                   "labelled grid to <output> itself, plus <stem>_timeline.png and "
                                                   "<stem>_report.json"),
                         "compare");
    bind(app.add_flag("--free-params", p.free_params,
                      "release the text encoder's weights once the prompts are encoded and the UNet's before the VAE "
                      "decode of the last batch: a lower peak memory for one-shot runs")
             ->excludes(compare),
         "free_params");
    bind(app.add_option("--upscale-model", o.upscale_model,
                        "upscale every generated image with this ESRGAN model (RRDBNet .pth/.safetensors: ESRGAN, "
                        "Real-ESRGAN, 4x-UltraSharp) before it is written; the PNG records it as A1111's Extras do")
             ->type_name("FILE")
             ->excludes(compare),
         "upscale_model");
    app.add_option("--upscale-tile", j.upscale.tiling.tile,
                   "--upscale-model: input pixels per tile side (0: the whole image at once)")
        ->check(cli::in_range(0, 65536))
        ->capture_default_str();
    app.add_option("--upscale-tile-overlap", j.upscale.tiling.overlap,
                   "--upscale-model: input pixels of context around each tile")
        ->check(cli::in_range(0, 65536))
        ->capture_default_str();
    bind(app.add_flag("--cuda-graphs", p.cuda_graphs,
                      "on a CUDA device the un-cached UNet steps replay a captured CUDA graph (LibTorch >= 2 with "
                      "CUDA); cached steps run eagerly"),
         "cuda_graphs");
    bind(app.add_flag("--vae-tiling", p.vae_tiling.enabled,
                      "VAE decode (and the init image's encode) in overlapping tiles with diffusers' enable_tiling "
                      "blending when the image is larger than a tile: memory follows the tile size, not the image"),
         "vae_tiling");
    const auto tiling_on = [&p](const std::string&) { p.vae_tiling.enabled = true; };
    bind(app.add_option("--vae-tile-size", p.vae_tiling.tile_sample_size,
                        "VAE tile side in image pixels, a multiple of the VAE factor (diffusers' tile_sample_min_size; "
                        "implies --vae-tiling)")
             ->each(tiling_on)
             ->capture_default_str(),
         "vae_tile_size");
    bind(app.add_option("--vae-tile-overlap", p.vae_tiling.overlap,
                        "share of a VAE tile overlapping its neighbour, in [0, 1) (diffusers' tile_overlap_factor; "
                        "implies --vae-tiling)")
             ->each(tiling_on)
             ->capture_default_str(),
         "vae_tile_overlap");
    app.add_option_function<std::string>(
           "--attention",
           [&o](const std::string& s) {
               o.attention = enum_from_string(kernels::attention_kernel_table(), s, "--attention");
           },
           "attention arithmetic (" + enum_choices(kernels::attention_kernel_table(), "|") +
               "): exact = the reference's bits (diffusers on this LibTorch); fused = the fused kernel for many "
               "small heads and the tiled online-softmax kernel for long sequences (no N x N buffer; within 2e-6 "
               "relative); flash = the tiled kernel wherever it applies; default: the model folder's "
               "anchorcache.json, else fused for the published SD shapes and exact for narrow (tiny) models")
        ->type_name("NAME");
    app.add_option_function<std::string>(
           "--gemm",
           [&o](const std::string& s) { o.gemm = enum_from_string(kernels::gemm_backend_table(), s, "--gemm"); },
           "library of the UNet's and VAE's linear layers and convolutions (" +
               enum_choices(kernels::gemm_backend_table(), "|") +
               "): torch = LibTorch's BLAS and convolution (the reference's bits); onednn = oneDNN's inference kernels "
               "(about 2x faster on AVX-512 machines, a different summation order: ~1e-7 relative); winograd = onednn "
               "with "
               "the wide 3x3 convolutions in Winograd F(4x4,3x3) form (fewer multiplies, ~1e-6 relative); bf16 = onednn "
               "with bfloat16 operands summed in float32 (CPUs with AVX512-BF16/AMX: ~1.8x faster than winograd on SD "
               "1.5, images ~45 dB from float32; keeps a packed bf16 copy of the weights: add --weights-dtype bf16); "
               "default: winograd with the fused/flash attention, torch with exact")
        ->type_name("NAME");
}

} // namespace

int main(int argc, char** argv) {
    anchor::util::select_blas_core(argv);
    anchor::util::configure_heap();
    return anchor::run_program([&]() -> int {
        CLI::App app{"anchor-sd: Stable Diffusion txt2img with anchor caches (AnchorCache)"};
        app.fallthrough(); // global options (--threads, --version) after a subcommand reach this level
        Options o;
        anchor::add_common_options(app, o.threads, "anchor-sd");
        add_txt2img_options(app, o);
        add_sdxl_options(app, o);
        add_control_options(app, o);
        cli::add_sd3_options(app, o.sd3);
        std::vector<std::pair<CLI::App*, std::function<int()>>> subcommands;
        cli::add_sd_bench_command(app, subcommands);
        cli::add_sd_bench_vae_command(app, subcommands);
        cli::add_sd_random_model_command(app, subcommands);
        cli::add_sd_bench_cache_command(app, subcommands);
        cli::add_sd_train_commands(app, subcommands);
        cli::add_sd_info_command(app, subcommands);
        cli::add_sd_serve_command(app, subcommands);
        cli::add_sd_upscale_command(app, subcommands);
        app.require_subcommand(0, 1);
        if (const int rc = anchor::parse_command_line(app, argc, argv); rc >= 0) return rc;
        anchor::util::configure_threads(o.threads);
        for (auto& [sub, body] : subcommands)
            if (sub->parsed()) return body();
        if (o.cache == "help" || (o.compare.size() == 1 && o.compare[0] == "help")) {
            std::printf("%s", anchor::unet::cache_help().c_str());
            return 0;
        }
        if (!o.prompt_from.empty()) apply_prompt_from(app, o);
        if (o.prompt.empty() && o.prompts_file.empty())
            throw UsageError("a prompt is required (-p/--prompt TEXT, not empty, or --prompts-file FILE)");
        if (app.get_option("--strength")->count() > 0 && o.job.params.init.init_images.empty())
            throw UsageError("--strength " + app.get_option("--strength")->as<std::string>() +
                             " needs an init image (-i/--init-img): without one the run is txt2img");
        if (o.model.empty()) o.model = anchor::cli::default_sd_model();
        if (anchor::unet::is_sd3_model(o.model)) { // SD 3 / 3.5: cli/sd3_txt2img.cpp
            anchor::cli::Sd3RunArgs a;
            a.model = o.model, a.prompt = o.prompt, a.negative = o.negative, a.negative_given = o.negative_given;
            a.output = o.job.output, a.dtype = o.dtype, a.overwrite = o.job.overwrite, a.compare = o.compare;
            a.steps = o.job.params.steps, a.steps_given = app.get_option("--steps")->count() > 0;
            a.cfg_scale = o.job.params.guidance_scale, a.cfg_given = app.get_option("--cfg-scale")->count() > 0;
            a.seed = o.job.params.seed, a.width = o.job.params.width, a.height = o.job.params.height;
            a.threads = o.threads, a.sd3 = o.sd3, a.cache = o.cache, a.init_images = o.job.params.init.init_images;
            if (app.get_option("--strength")->count() > 0) a.strength = o.job.params.init.strength;
            a.loras = o.loras, a.lora_model_dir = o.lora_model_dir;
            return anchor::cli::run_sd3_txt2img(app, a);
        }
        return run(o);
    });
}
