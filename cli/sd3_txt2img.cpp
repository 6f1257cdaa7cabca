// anchor-sd on SD 3 / 3.5 models: txt2img through unet/pipeline/sd3_pipeline.h (sd3_txt2img), the PNG with its
// infotext and JSON record, --cache and --compare with the modes that apply to the MMDiT (off, freq, fbcache, teacache,
// taylorseer; unet/cache/dit_cache.h). What the SD 1.x / SDXL table
// offers beyond that is refused by name (exit 2), never ignored.
#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cli/common.h"
#include "cli/sd_commands.h"
#include "unet/cache/compare.h"
#include "unet/cache/dit_cache_config.h"
#include "unet/model/lora_sd3.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/pipeline.h"
#include "unet/pipeline/sd3_compare.h"
#include "unet/pipeline/sd3_pipeline.h"
#include "unet/pipeline/sd3_record.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <set>

namespace anchor::cli {

namespace fs = std::filesystem;
using namespace anchor::unet;

void add_sd3_options(CLI::App& app, Sd3Options& o) {
    app.add_flag("--no-t5", o.no_t5,
                 "SD 3 / 3.5: leave text_encoder_3 (T5-XXL) unloaded; zeros stand in for its tokens, as diffusers "
                 "does without it");
    app.add_option("--shift", o.shift,
                   "SD 3 / 3.5: the flow-matching timestep shift (default: the scheduler config's, 3.0 for SD 3)")
        ->check(CLI::PositiveNumber);
    app.add_option("--max-sequence-length", o.max_sequence_length,
                   "SD 3 / 3.5: T5's token count (prompts are padded / truncated to it)")
        ->check(CLI::Range(1, 512))
        ->capture_default_str();
    app.add_option("--slg-layers", o.slg_layers,
                   "SD 3.5: skip-layer guidance over these transformer blocks (SD 3.5 Medium: 7,8,9); off by default")
        ->delimiter(',');
    app.add_option("--slg-scale", o.slg_scale, "SD 3.5: skip-layer guidance scale")->capture_default_str();
    app.add_option("--slg-start", o.slg_start, "SD 3.5: skip-layer guidance from this fraction of the steps (exclusive)")
        ->check(CLI::Range(0.0, 1.0))
        ->capture_default_str();
    app.add_option("--text-encoders", o.text_encoders,
                   "SD 3 / 3.5 single files: where the text encoders and tokenizers the file lacks come from (an SD 3 "
                   "diffusers folder, or Stability's text_encoders/ folder with clip_l, clip_g, t5xxl .safetensors; "
                   "T5's tokenizer: tokenizer_3/ or spiece.model)");
    app.add_option("--slg-end", o.slg_end, "SD 3.5: skip-layer guidance until this fraction of the steps (exclusive)")
        ->check(CLI::Range(0.0, 1.0))
        ->capture_default_str();
}

namespace {

// The options an SD 3 run understands; any other given on the command line is refused by name.
const std::set<std::string>& sd3_allowed_options() {
    static const std::set<std::string> s = {"--model", "--prompt", "--negative-prompt", "--output", "--steps",
                                            "--cfg-scale", "--seed", "--width", "--height", "--overwrite",
                                            "--compare", "--cache", "--init-img", "--strength", "--threads", "--dtype", "--no-t5", "--shift",
                                            "--max-sequence-length", "--slg-layers", "--slg-scale", "--slg-start",
                                            "--slg-end", "--lora", "--lora-model-dir", "--help", "--version", "--text-encoders"};
    return s;
}

// The modes of --compare / --cache, each checked against the transformer (exit 2 naming a mode that does not apply).
std::vector<CacheConfig> sd3_cache_modes(const std::vector<std::string>& compare, const std::string& cache) {
    std::vector<CacheConfig> modes;
    if (!compare.empty()) {
        if (cache != "off") throw UsageError("--cache and --compare are exclusive (--compare lists the modes to run)");
        modes = parse_cache_list(compare, "compare");
        for (const auto& m : modes) check_dit_cache_config(m, "compare");
    } else {
        modes.push_back(parse_cache_config(cache, "cache"));
        check_dit_cache_config(modes.back(), "cache");
    }
    return modes;
}

} // namespace

namespace {

// Every option given on the command line must be one an SD 3 run reads (exit 2 naming the first other one).
void check_sd3_options(const CLI::App& app, const std::string& model) {
    for (const auto* opt : app.get_options()) {
        if (opt->count() == 0) continue;
        std::string long_name;
        for (const auto& l : opt->get_lnames()) long_name = "--" + l;
        if (!long_name.empty() && !sd3_allowed_options().count(long_name))
            throw UsageError(long_name + " is not available for SD 3 / 3.5 models yet ('" + model +
                             "'); SD 3 runs take -m, -p, -n, -o, --steps, --cfg-scale, --seed, -W, -H, --no-t5, "
                             "--shift, --max-sequence-length, --slg-*, --dtype, --overwrite, --cache, --compare, -i, --strength, "
                             "--lora, --lora-model-dir");
    }
}

// The library's parameters from the command line (diffusers' SD 3 defaults where an option is not given).
SD3Txt2ImgParams sd3_params_from_args(const Sd3RunArgs& a, int64_t seed) {
    SD3Txt2ImgParams p;
    p.prompts = {a.prompt};
    if (a.negative_given) p.negative_prompts = {a.negative};
    p.steps = a.steps_given ? a.steps : 28;           // diffusers' default for SD 3
    p.guidance_scale = a.cfg_given ? a.cfg_scale : 7.0; // diffusers' default for SD 3
    p.seed = seed;
    p.width = a.width;
    p.height = a.height;
    p.shift = a.sd3.shift;
    p.max_sequence_length = a.sd3.max_sequence_length;
    p.init.init_images = a.init_images;
    p.init.strength = a.strength;
    p.slg.layers = a.sd3.slg_layers;
    p.slg.scale = a.sd3.slg_scale, p.slg.start = a.sd3.slg_start, p.slg.stop = a.sd3.slg_end;
    if (!p.slg.layers.empty() && p.guidance_scale <= 1.0)
        throw UsageError("--slg-layers needs classifier-free guidance (--cfg-scale > 1), as diffusers applies it");
    return p;
}

void print_sd3_compare(const nlohmann::json& rep, const std::string& base) {
    std::printf("%-28s %9s %8s %6s %9s\n", "mode", "denoise_s", "speed-up", "full", "PSNR dB");
    for (const auto& e : rep["modes"]) {
        const std::string psnr = e["psnr_vs_first_db"].is_null() ? std::string("(same)")
                                                                 : std::to_string(e["psnr_vs_first_db"].get<double>());
        std::printf("%-28s %9.3f %7.2fx %3d/%-3d %9s\n", e["mode"].get<std::string>().c_str(), e["wall_s"].get<double>(),
                    e["speedup_vs_first"].get<double>(), e["full_steps"].get<int>(), e["total_steps"].get<int>(),
                    psnr.c_str());
    }
    std::fprintf(stderr, "compare: grid %s, timeline %s, report %s\n", rep["grid_png"].get<std::string>().c_str(),
                 rep["timeline_png"].get<std::string>().c_str(), compare_output_paths(base)[2].c_str());
}

} // namespace

int run_sd3_txt2img(const CLI::App& app, const Sd3RunArgs& args) {
    check_sd3_options(app, args.model);
    const auto modes = sd3_cache_modes(args.compare, args.cache);
    if (args.prompt.empty()) throw UsageError("a prompt is required (-p/--prompt TEXT)");
    // --lora FILE[:MULTIPLIER] and the prompt's <lora:NAME[:MULTIPLIER]> tags (removed from the prompt), checked
    // before anything loads.
    Sd3RunArgs a = args;
    std::vector<std::string> prompts{a.prompt};
    const auto loras = run_loras(a.loras, a.lora_model_dir, prompts);
    a.prompt = prompts.front();
    for (const auto& l : loras)
        if (!fs::is_regular_file(l.path)) throw ParamError("loras", "LoRA file '" + l.path + "' does not exist");
    const std::string output = a.output.empty() ? "output.png" : a.output;
    if (output.back() == '/' || fs::is_directory(output))
        throw UsageError("-o/--output: SD 3 runs write one file; '" + output + "' is a folder");
    const std::string sidecar = output + ".json";
    const std::string base = (fs::path(output).parent_path() / fs::path(output).stem()).string();
    const auto outputs = a.compare.empty() ? std::vector<std::string>{output, sidecar} : compare_output_paths(base);
    for (const auto& f : outputs) check_output_path(f, a.overwrite);
    const torch::ScalarType dtype = parse_dtype(a.dtype, torch::Device(torch::kCPU));

    int64_t seed = a.seed;
    if (seed < 0) {
        std::random_device rd;
        seed = int64_t((uint64_t(rd()) << 31 ^ rd()) & 0x7fffffffffffLL);
    }
    std::fprintf(stderr, "seed: %lld\n", (long long)seed);
    const auto t0 = std::chrono::steady_clock::now();
    SD3Models m = load_sd3_models(a.model, dtype, !a.sd3.no_t5, a.sd3.text_encoders);
    apply_sd3_loras(m, loras);
    for (const auto& l : m.loras)
        std::fprintf(stderr, "LoRA %s x %g (%s): %d modules merged%s\n", l.path.c_str(), l.multiplier, l.format.c_str(),
                     l.modules,
                     l.skipped ? (", " + std::to_string(l.skipped) + " tensors of unloaded text encoders skipped").c_str()
                               : "");
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "loaded %s (SD 3 / 3.5, %zu joint blocks, text encoders: %s%s) in %.2f s\n", a.model.c_str(),
                 size_t(m.transformer->config().num_layers), m.text_encoder ? "CLIP-L, CLIP-G" : "none",
                 m.text_encoder_3 ? ", T5" : (a.sd3.no_t5 ? " (T5 off: --no-t5)" : " (no T5: zeros)"), load_s);
    SD3Txt2ImgParams p = sd3_params_from_args(a, seed);
    auto progress = [](int i, int n) {
        std::fprintf(stderr, "\rstep %d/%d", i + 1, n);
        if (i + 1 == n) std::fprintf(stderr, "\n");
    };
    if (a.compare.empty()) {
        p.cache = modes.front();
        const auto r = sd3_txt2img(m, p, progress);
        nlohmann::json rec = sd3_run_record(p, r, {a.model, a.dtype, output, a.threads, load_s, m.loras});
        if (p.cache.kind() != CacheKind::Off) rec["cache"] = r.cache_log;
        write_png(output, r.image_uint8[0], a.overwrite,
                  image_text_chunks(sd3_infotext(p, r, a.model, m.loras), rec));
        write_file_atomic(sidecar, rec.dump(2) + "\n", a.overwrite);
        std::fprintf(stderr, "saved %s (seed %lld, cache %s: %d/%zu full steps, encode %.2f s, denoise %.2f s, decode "
                     "%.2f s)\n",
                     output.c_str(), (long long)seed, p.cache.label.c_str(), r.cache_log.value("full_steps", 0),
                     r.cache_steps.size(), r.encode_s, r.denoise_s, r.decode_s);
        return 0;
    }
    print_sd3_compare(sd3_run_compare(m, p, modes, base, {a.model, a.dtype, output, a.threads, load_s, m.loras},
                                      a.overwrite,
                                      progress, [](const std::string& mode) {
                                          std::fprintf(stderr, "mode %s\n", mode.c_str());
                                      }),
                      base);
    return 0;
}

} // namespace anchor::cli
