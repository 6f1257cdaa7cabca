// `anchor-sd serve`: the option table of the HTTP server (unet/serve/sd_server.h); the server itself is library code.
#include "cache/io/assets.h"
#include "cli/common.h"
#include "cli/sd_commands.h"
#include "unet/cache/dit_cache_config.h"
#include "unet/cache/freq_cache.h"
#include "unet/pipeline/upscale.h"
#include "unet/pipeline/sd3_pipeline.h"
#include "unet/serve/sd3_server.h"
#include "unet/serve/sd_server.h"
#include "unet/serve/a1111_controlnet.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

namespace anchor::cli {

namespace {

struct ServeOptions {
    unet::SdServerParams server;
    bool no_web = false;
    std::string device = "cpu"; // --device (batch::DeviceSpec)
    unet::VaeDecoderChoice vae_decoder; // --vae-decoder: the TAESD loaded and made the requests' default
    std::string embedding_dir;          // --embedding-dir: SdServerParams::embeddings
    std::string control_net_dir;        // --control-net-dir: SdServerParams::controlnets
    std::string upscaler_dir;           // --upscaler-dir: SdServerParams::upscalers
    bool no_t5 = false;                 // --no-t5: an SD 3 model's text_encoder_3 left unloaded
};

// An SD 3 / 3.5 model (unet/serve/sd3_server.h): the options of the UNet server that its pipeline has no use for are
// refused by name.
int run_serve_sd3(ServeOptions& o) {
    auto& s = o.server;
    const std::pair<bool, const char*> unused[] = {{!o.embedding_dir.empty(), "--embedding-dir"},
                                                   {!o.control_net_dir.empty(), "--control-net-dir"},
                                                   {!o.upscaler_dir.empty(), "--upscaler-dir"},
                                                   {o.vae_decoder.kind != unet::VaeDecoder::Full, "--vae-decoder"}};
    for (const auto& [given, name] : unused)
        if (given) throw UsageError(std::string(name) + " is not available for SD 3 / 3.5 models ('" + s.model + "')");
    if (o.device != "cpu")
        throw UsageError("--device: SD 3 / 3.5 models are served on the CPU, got '" + o.device + "'");
    unet::check_dit_cache_config(s.default_cache, "cache"); // before the model loads
    const auto t0 = std::chrono::steady_clock::now();
    unet::SD3Models models = unet::load_sd3_models(s.model, torch::kFloat, !o.no_t5);
    std::fprintf(stderr, "loaded %s (SD 3 / 3.5, %zu joint blocks%s) in %.1fs\n", s.model.c_str(),
                 size_t(models.transformer->config().num_layers), models.text_encoder_3 ? ", T5" : ", no T5: zeros",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    s.facts = {{"program", "anchor-sd serve"}, {"model", s.model}, {"device", "cpu"}};
    unet::Sd3Server server(models, s);
    server.serve();
    std::fprintf(stderr, "anchor-sd serve: drained, exiting\n");
    return 0;
}

int run_serve(ServeOptions& o) {
    auto& s = o.server;
    if (s.model.empty()) s.model = default_sd_model();
    if (!o.no_web && s.http.web_dir.empty()) {
        const std::string index = find_asset_or_empty("web/index.html");
        if (!index.empty()) s.http.web_dir = std::filesystem::path(index).parent_path().string();
    }
    s.http.program = "anchor-sd serve";
    s.validate(); // before loading anything
    if (unet::is_sd3_model(s.model)) return run_serve_sd3(o);
    if (o.no_t5) throw UsageError("--no-t5 applies to SD 3 / 3.5 models only ('" + s.model + "')");
    unet::LoadOptions lo;
    // Replicas started by mpirun (or with OMPI_COMM_WORLD_LOCAL_RANK set) take the GPU of their local rank.
    lo.device = batch::select_device(batch::DeviceSpec::parse(o.device), batch::shard_from_env().local_rank);
    lo.validate();
    const auto t0 = std::chrono::steady_clock::now();
    if (!o.embedding_dir.empty()) { // a file that does not read stops the start, before the model loads
        s.embeddings = std::make_shared<const unet::EmbeddingDatabase>(
            unet::EmbeddingDatabase::load_dir(o.embedding_dir));
        std::fprintf(stderr, "embeddings: %zu from %s\n", s.embeddings->items().size(), o.embedding_dir.c_str());
    }
    if (!o.control_net_dir.empty()) {
        if (!std::filesystem::is_directory(o.control_net_dir))
            throw UsageError("--control-net-dir: '" + o.control_net_dir + "' is not a folder");
        s.controlnets = std::make_shared<unet::ControlNetLibrary>(o.control_net_dir);
    }
    if (!o.upscaler_dir.empty()) {
        if (!std::filesystem::is_directory(o.upscaler_dir))
            throw UsageError("--upscaler-dir: '" + o.upscaler_dir + "' is not a folder");
        s.upscalers = std::make_shared<unet::UpscalerLibrary>(o.upscaler_dir);
    }
    unet::SDModels models = unet::load_sd_models(s.model, lo);
    std::fprintf(stderr, "loaded %s in %.1fs\n", s.model.c_str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (o.vae_decoder.kind == unet::VaeDecoder::Taesd) {
        unet::attach_taesd(models, o.vae_decoder.file, s.model);
        s.default_vae_decoder = unet::VaeDecoder::Taesd;
    } else if (s.preview_every > 0 && !unet::find_taesd(s.model, models.family == unet::SdFamily::SDXL).empty()) {
        unet::attach_taesd(models, "", s.model); // previews by TAESD; requests may ask for it with vae_decoder
    }
    if (models.taesd) std::fprintf(stderr, "TAESD: %s\n", models.taesd->source.c_str());
    unet::Txt2ImgPipeline pipe(models);
    s.facts = {{"program", "anchor-sd serve"}, {"model", s.model}, {"device", lo.device.str()}};
    unet::SdServer server(pipe, s);
    server.serve();
    std::fprintf(stderr, "anchor-sd serve: drained, exiting\n");
    return 0;
}

} // namespace

void add_sd_serve_command(CLI::App& app, SdRunners& runners) {
    auto* cmd = app.add_subcommand(
        "serve", "HTTP server: the AUTOMATIC1111 API (/sdapi/v1/txt2img, img2img, samplers, progress, "
                 "...), OpenAI's /v1/images/generations, POST /anchor/v1/compare and the compare page "
                 "at /; SD 1.x / SDXL and SD 3 / 3.5 models");
    cmd->fallthrough();
    auto o = std::make_shared<ServeOptions>();
    auto& s = o->server;
    auto bind = [](CLI::Option* opt, const char* field) {
        bind_field(field, opt->get_name());
        return opt;
    };
    cmd->add_option("-m,--model", s.model, "model folder or single file (default: the embedded demo model)");
    bind(cmd->add_option("--host", s.http.host, "address to listen on")->capture_default_str(), "host");
    bind(cmd->add_option("--port", s.http.port, "port (0: any free port, printed)")->capture_default_str(), "port");
    bind(cmd->add_option("--queue", s.http.queue, "jobs waiting or running; one more gets 429 with Retry-After")
             ->capture_default_str(),
         "queue");
    bind(cmd->add_option("--http-threads", s.http.threads, "connection threads")->capture_default_str(), "threads");
    bind(cmd->add_option("--drain-timeout", s.http.drain_timeout_s,
                         "seconds SIGTERM's drain waits for the jobs in flight before it cancels them")
             ->capture_default_str(),
         "drain_timeout_s");
    bind(cmd->add_option_function<std::string>(
                 "--cache", [&s](const std::string& v) { s.default_cache = unet::parse_cache_config(v); },
                 "cache mode of requests without a `cache` field (default off; anchor-sd --cache help lists them):\n" +
                     unet::cache_mode_help()),
         "cache");
    bind(cmd->add_option("--max-steps", s.max_steps, "largest `steps` of a request")->capture_default_str(),
         "max_steps");
    bind(cmd->add_option("--max-pixels", s.max_pixels, "largest width x height of a request")->capture_default_str(),
         "max_pixels");
    bind(cmd->add_option("--max-images", s.max_images, "largest batch_size x n_iter of a request")
             ->capture_default_str(),
         "max_images");
    bind(cmd->add_option("--max-modes", s.max_modes, "most modes of one compare")->capture_default_str(), "max_modes");
    bind(cmd->add_option("--preview", s.preview_every,
                         "every N steps a preview of the running job (TAESD when one is loaded or next to the model, "
                         "else a latent-to-RGB projection) for /sdapi/v1/progress's current_image; 0 = none")
             ->capture_default_str(),
         "preview_every");
    bind(cmd->add_option_function<std::string>(
                 "--vae-decoder",
                 [o](const std::string& v) { o->vae_decoder = unet::VaeDecoderChoice::parse(v, "--vae-decoder"); },
                 "decoder of requests without a vae_decoder field: full, taesd (found next to the model) or "
                 "taesd:FILE; a TAESD loaded here also serves requests' \"vae_decoder\": \"taesd\"")
             ->type_name("full|taesd[:FILE]"),
         "vae_decoder");
    add_device_option(*cmd, o->device);
    bind(cmd->add_option("--embedding-dir", o->embedding_dir,
                         "folder of textual-inversion embeddings, read at start (/sdapi/v1/embeddings lists them)")
             ->type_name("DIR"),
         "embeddings");
    bind(cmd->add_option("--control-net-dir", o->control_net_dir,
                         "folder of ControlNets (files by stem, diffusers folders by name) for A1111 requests' "
                         "alwayson_scripts.controlnet units; GET /controlnet/model_list lists them")
             ->type_name("DIR"),
         "control_net_dir");
    bind(cmd->add_option("--upscaler-dir", o->upscaler_dir,
                         "folder of ESRGAN upscalers (.pth/.safetensors, by file stem) for "
                         "/sdapi/v1/extra-single-image's upscaler_1")
             ->type_name("DIR"),
         "upscaler_dir");
    bind(cmd->add_option("--web", s.http.web_dir, "folder served at / (default: assets/web)"), "web_dir");
    cmd->add_flag("--no-web", o->no_web, "serve no page at /");
    cmd->add_flag("--no-t5", o->no_t5,
                  "SD 3 / 3.5: leave text_encoder_3 (T5-XXL) unloaded; zeros stand in for its tokens, as diffusers "
                  "does without it");
    runners.emplace_back(cmd, [o]() { return run_serve(*o); });
}

} // namespace anchor::cli
