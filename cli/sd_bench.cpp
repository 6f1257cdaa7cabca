// `anchor-sd bench`: the option table of unet/bench/unet_bench.h, the report printed and optionally written.
#include "cli/sd_commands.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "unet/bench/mmdit_bench.h"
#include "unet/bench/random_checkpoint.h"
#include "unet/bench/unet_bench.h"
#include "unet/bench/vae_bench.h"
#include "unet/model/checkpoint.h"
#include "unet/model/unet_macs.h"

#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>
#include <sstream>

namespace anchor::cli {

namespace {

struct BenchOptions {
    unet::UNetBenchParams bench;
    unet::SdFamily family = unet::SdFamily::SD1;
    std::optional<unet::Sd3Variant> sd3; // --family sd3.5-medium / sd3.5-large: the MMDiT bench instead
    torch::ScalarType sd3_dtype = torch::kBFloat16;
    int image_steps = 0;
    bool no_t5 = false;
    std::string unet_config, output;
    bool macs_only = false, overwrite = false;
};

// --family of bench and random-model: a UNet family (sd_family_table) or an SD 3.5 transformer (sd3_variant_table).
CLI::Option* add_family_option(CLI::App& cmd, unet::SdFamily& family, std::optional<unet::Sd3Variant>& sd3,
                               const std::string& help) {
    auto* opt = cmd.add_option_function<std::string>(
        "--family",
        [&family, &sd3](const std::string& s) {
            for (const auto& [name, v] : unet::sd3_variant_table())
                if (s == name) {
                    sd3 = v;
                    return;
                }
            family = enum_from_string(unet::sd_family_table(), s, "--family");
        },
        help + " (sd1|sdxl|" + enum_choices(unet::sd3_variant_table(), "|") + ")");
    opt->type_name("NAME");
    return opt;
}

int run_sd3_bench(BenchOptions& o) {
    unet::MmditBenchParams p;
    p.variant = *o.sd3;
    p.width = o.bench.width, p.height = o.bench.height;
    p.repeat = o.bench.repeat, p.warmup = o.bench.warmup, p.batch = o.bench.batch;
    p.gemm_n = o.bench.gemm_n, p.gemm_repeat = o.bench.gemm_repeat, p.seed = o.bench.seed;
    p.dtype = o.sd3_dtype;
    p.image_steps = o.image_steps;
    p.t5 = !o.no_t5;
    if (o.macs_only) {
        p.validate();
        const auto m =
            unet::mmdit_macs(unet::sd3_transformer_config_of(p.variant), p.height / 8, p.width / 8, p.text_tokens);
        std::cout << unet::format_gmacs(m.total()) << " GMACs" << std::endl;
        return 0;
    }
    if (!o.output.empty()) check_output_path(o.output, o.overwrite);
    std::ostringstream out;
    unet::run_mmdit_bench(p, [&](const std::string& line) {
        std::cout << line << std::endl;
        out << line << "\n";
    });
    if (!o.output.empty()) write_file_atomic(o.output, out.str(), o.overwrite);
    return 0;
}

int run_bench(BenchOptions& o) {
    if (o.sd3) return run_sd3_bench(o);
    if (o.image_steps > 0 || o.no_t5)
        throw UsageError("--image-steps and --no-t5 are for --family sd3.5-medium / sd3.5-large");
    auto& b = o.bench;
    if (!o.unet_config.empty()) {
        b.unet = unet::UNetConfig::from_json_file(o.unet_config);
        b.unet_name = o.unet_config;
    } else if (o.family != unet::SdFamily::SD1) {
        b.unet = unet::unet_config_of_family(o.family);
        b.unet_name = "SDXL base UNet";
    }
    b.validate();
    if (o.macs_only) {
        std::cout << unet::format_gmacs(unet::unet_bench_macs(b)) << " GMACs" << std::endl;
        return 0;
    }
    // --profile writes a second trace, of one shallow step, when --deepcache gives it a cached feature.
    if (!b.profile.empty() && b.time_shallow && !b.deepcache.empty())
        b.profile_shallow = unet::sibling_profile_path(b.profile, "_shallow");
    const std::string vae_profile =
        !b.profile.empty() && b.vae_repeat > 0 ? unet::sibling_profile_path(b.profile, "_vae") : "";
    for (const auto& f : {o.output, b.profile, b.profile_shallow, vae_profile})
        if (!f.empty()) check_output_path(f, o.overwrite);
    std::ostringstream out;
    unet::run_unet_bench(b, [&](const std::string& line) {
        std::cout << line << std::endl;
        out << line << "\n";
    });
    if (!o.output.empty()) write_file_atomic(o.output, out.str(), o.overwrite);
    return 0;
}

void add_options(CLI::App& cmd, BenchOptions& opts) {
    auto& o = opts.bench;
    cmd.add_option("-W,--width", o.width, "image width in pixels (latent = width / 8)")->capture_default_str();
    cmd.add_option("-H,--height", o.height, "image height in pixels")->capture_default_str();
    cmd.add_option("--repeat", o.repeat, "timed UNet steps (min/median/max are reported)")->capture_default_str();
    cmd.add_option("--warmup", o.warmup, "untimed UNet steps first")->capture_default_str();
    cmd.add_option("--batch", o.batch, "UNet batch (2 = one classifier-free-guidance step)")->capture_default_str();
    cmd.add_flag("--baseline", o.baseline, "time the plain module forwards instead of the fast paths");
    cmd.add_flag("--fused-qkv", o.fused_qkv, "self-attention projects Q, K and V with one matrix product");
    cmd.add_flag("--ab", o.ab, "also time plain and fast forwards interleaved and report the speed-up");
    add_enum_option(cmd, "--attention", o.attention, kernels::attention_kernel_table(),
                    "attention arithmetic of the fast paths (kernels/attention.h)",
                    "fused for the published SD shapes, exact for narrow ones (unet::default_attention_kernel)");
    add_enum_option(cmd, "--gemm", o.gemm, kernels::gemm_backend_table(),
                    "library of the linear layers and convolutions on the fast paths (kernels/onednn.h; bf16: bfloat16 "
                    "operands summed in float32)",
                    "winograd with the fused/flash attention, torch with exact (unet::default_gemm_backend)");
    add_enum_option(cmd, "--weights-dtype", o.weights_dtype, unet::weights_dtype_table(),
                    "how the UNet's (and VAE's) Linear/Conv weights are kept: f16/bf16 halve them, upcast per layer");
    cmd.add_option("--vae", o.vae_repeat, "also time this many VAE decodes of one latent (SD's VAE, random weights)")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    cmd.add_flag("--taesd", o.taesd,
                 "with --vae: also time TAESD's decoder (published shape, random weights) on the same latent, "
                 "interleaved with the VAE's decodes");
    cmd.add_flag("--macs-only", opts.macs_only, "print only the analytic MAC count per sample (e.g. '338.6 GMACs')");
    cmd.add_option("--deepcache", o.deepcache, "DeepCache intervals N whose MACs (and cached-step times) are shown")
        ->capture_default_str();
    cmd.add_option("--deepcache-branch", o.branch, "DeepCache skip branch (0 = shallowest)")->capture_default_str();
    cmd.add_option("--unet-config", opts.unet_config, "diffusers UNet config.json instead of SD 1.5's shapes")
        ->excludes(add_family_option(cmd, opts.family, opts.sd3,
                                     "the real shapes of this family: sd1 = SD 1.5, sdxl = SDXL base 1.0 (2.57 G "
                                     "parameters; 1024x1024 is its size); sd3.5-medium / sd3.5-large: the SD 3.5 "
                                     "transformer (random weights in memory; -W/-H 1024 is its size)"));
    add_enum_option(cmd, "--dtype", opts.sd3_dtype, unet::weights_dtype_table(),
                    "sd3.5-*: the transformer's weights and compute dtype");
    cmd.add_option("--image-steps", opts.image_steps,
                   "sd3.5-*: instead of timing steps, the peak RSS of a whole image: the three text encoders, this "
                   "many CFG steps, the VAE decode (random weights in memory)")
        ->check(CLI::NonNegativeNumber);
    cmd.add_flag("--no-t5", opts.no_t5, "sd3.5-* --image-steps: without T5-XXL (zeros, as --no-t5 of a run)");
    cmd.add_option("--gemm-size", o.gemm_n, "n of the n x n x n reference GEMM")->capture_default_str();
    cmd.add_option("-s,--seed", o.seed, "seed for weights and inputs")->capture_default_str();
    cmd.add_option("-o,--output", opts.output, "also write the report to this file");
    cmd.add_option("--profile", o.profile,
                   "write a chrome trace of one extra UNet step (aten ops) to this file; with --deepcache also one "
                   "shallow step to <stem>_shallow<ext>; with --vae, one decode to <stem>_vae<ext>");
    cmd.add_option("--op-table", o.op_table,
                   "time every fast-kernel call (linear, convolution, Winograd, attention) of --repeat more UNet steps "
                   "and print a step's N slowest shapes with their FLOP rate against the GEMM rate, and totals per "
                   "kind (0 = none)")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    cmd.add_flag("--overwrite", opts.overwrite, "replace an existing --output file");
}

} // namespace

static void add_sd_random_taesd_command(CLI::App& app,
                                        std::vector<std::pair<CLI::App*, std::function<int()>>>& runners);

void add_sd_random_model_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto* cmd = app.add_subcommand("random-model", "write a single-file checkpoint of random weights with a family's "
                                                   "real shapes (memory and speed benchmarks of models not here)");
    cmd->fallthrough();
    auto p = std::make_shared<unet::RandomCheckpointParams>();
    add_family_option(*cmd, p->family, p->sd3,
                      "shapes: sd1 = SD 1.5, sdxl = SDXL base 1.0, sd3.5-medium / sd3.5-large = the SD 3.5 transformer "
                      "and VAE in Stability's single-file names (Medium 5 GB in bf16, Large 16 GB)");
    cmd->add_flag("--text-encoders", p->text_encoders,
                  "sd3.5-*: also CLIP-L, OpenCLIP bigG and T5-XXL inside the file (+11 GB in bf16)");
    add_enum_option(*cmd, "--dtype", p->dtype, unet::weights_dtype_table(), "tensor dtype in the file");
    cmd->add_option("-s,--seed", p->seed, "seed of the weights")->capture_default_str();
    cmd->add_option("-o,--output", p->output, "the .safetensors file to write")->required();
    cmd->add_flag("--overwrite", p->overwrite, "replace an existing file");
    runners.emplace_back(cmd, [p]() {
        const int64_t bytes =
            unet::write_random_checkpoint(*p, [](const std::string& l) { std::cout << l << std::endl; });
        std::cout << "wrote " << p->output << ": " << (bytes >> 20) << " MiB of tensors" << std::endl;
        return 0;
    });
    add_sd_random_taesd_command(app, runners);
}

// `random-taesd`: the TAESD of the speed goals (tests/bench/results/), random weights at the published shapes.
static void add_sd_random_taesd_command(CLI::App& app,
                                        std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto* cmd = app.add_subcommand("random-taesd", "write a TAESD (AutoencoderTiny, encoder and decoder) of random "
                                                   "weights with the published shapes, for --vae-decoder taesd:FILE "
                                                   "benchmarks");
    cmd->fallthrough();
    struct Opts {
        std::string output;
        int64_t seed = 0;
        torch::ScalarType dtype = torch::kFloat;
        bool overwrite = false;
    };
    auto o = std::make_shared<Opts>();
    add_enum_option(*cmd, "--dtype", o->dtype, unet::weights_dtype_table(), "tensor dtype in the file");
    cmd->add_option("-s,--seed", o->seed, "seed of the weights")->capture_default_str();
    cmd->add_option("-o,--output", o->output, "the .safetensors file to write")->required();
    cmd->add_flag("--overwrite", o->overwrite, "replace an existing file");
    runners.emplace_back(cmd, [o]() {
        const int64_t bytes = unet::write_random_taesd(o->output, o->seed, o->dtype, o->overwrite);
        std::cout << "wrote " << o->output << ": " << (bytes >> 10) << " KiB of tensors" << std::endl;
        return 0;
    });
}

void add_sd_bench_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto* cmd = app.add_subcommand("bench", "UNet step speed (random SD 1.5 weights) vs analytic MACs and GEMM rate");
    cmd->fallthrough(); // --threads of the parent app may follow `bench`
    auto o = std::make_shared<BenchOptions>();
    add_options(*cmd, *o);
    runners.emplace_back(cmd, [o]() { return run_bench(*o); });
}

void add_sd_bench_vae_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto* cmd =
        app.add_subcommand("bench-vae", "time and peak memory of a VAE decode (SDXL VAE shapes, random "
                                        "weights), plain or tiled; run once per setting, each in its own process");
    cmd->fallthrough();
    struct Opts {
        unet::VaeBenchParams p;
        std::string output;
        bool overwrite = false;
    };
    auto o = std::make_shared<Opts>();
    auto& p = o->p;
    cmd->add_option("-W,--width", p.width, "image width in pixels")->capture_default_str();
    cmd->add_option("-H,--height", p.height, "image height in pixels")->capture_default_str();
    cmd->add_option("--repeat", p.repeat, "timed decodes")->capture_default_str();
    cmd->add_option("--warmup", p.warmup, "untimed decodes first")->capture_default_str();
    cmd->add_flag("--vae-tiling", p.tiling.enabled, "decode in tiles (unet/model/vae_tiling.h)");
    const auto on = [&p](const std::string&) { p.tiling.enabled = true; };
    cmd->add_option("--vae-tile-size", p.tiling.tile_sample_size, "tile side in pixels (implies --vae-tiling)")
        ->each(on)
        ->capture_default_str();
    cmd->add_option("--vae-tile-overlap", p.tiling.overlap, "tile overlap in [0, 1) (implies --vae-tiling)")
        ->each(on)
        ->capture_default_str();
    add_enum_option(*cmd, "--attention", p.attention, kernels::attention_kernel_table(), "attention arithmetic",
                    "what anchor-sd gives an SDXL checkpoint");
    add_enum_option(*cmd, "--gemm", p.gemm, kernels::gemm_backend_table(), "convolution / linear library",
                    "the default of the attention");
    cmd->add_option("-s,--seed", p.seed, "seed of the weights and the latents")->capture_default_str();
    cmd->add_flag("--taesd", p.taesd,
                  "also time a TAESD decode of the same latent after each VAE decode (published shapes, random "
                  "weights) and report the VAE / TAESD ratio");
    cmd->add_option("--taesd-file", p.taesd_file,
                    "the TAESD to time instead (a diffusers folder or a taesd file; "
                    "implies --taesd)")
        ->each([&p](const std::string&) { p.taesd = true; });
    cmd->add_flag("--taesd-only", p.taesd_only, "time the TAESD decodes alone (no VAE decode; for profiling)");
    cmd->add_option("-o,--output", o->output, "also write the report to this file");
    cmd->add_flag("--overwrite", o->overwrite, "replace an existing --output file");
    runners.emplace_back(cmd, [o]() {
        if (!o->output.empty()) check_output_path(o->output, o->overwrite);
        std::ostringstream out;
        unet::run_vae_bench(o->p, [&](const std::string& line) {
            std::cout << line << std::endl;
            out << line << "\n";
        });
        if (!o->output.empty()) write_file_atomic(o->output, out.str(), o->overwrite);
        return 0;
    });
}

} // namespace anchor::cli
