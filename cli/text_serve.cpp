// `anchor-text serve`: the option table of the HTTP server (text/serve/text_server.h); the server itself is library code.
#include "cache/io/assets.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "cli/text_commands.h"
#include "text/gpt2/gpt2_model.h"
#include "text/serve/text_server.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <memory>

namespace anchor::cli {

namespace {

int run_text_serve(text::TextServerParams& p, const PlacementArgs& place, bool no_diffusion) {
    p.gpt2.placement = resolve_placement(place); // both models run there
    if (p.gpt2.model.empty()) p.gpt2.model = default_gpt2_model();
    if (std::filesystem::path(p.gpt2.model).filename() == "config.json")
        p.gpt2.model = std::filesystem::path(p.gpt2.model).parent_path().string();
    if (p.diffusion_model.empty() && !no_diffusion) {
        const std::string cfg = find_asset_or_empty("models/kjv-mdlm/config.json");
        if (!cfg.empty()) p.diffusion_model = std::filesystem::path(cfg).parent_path().string();
    }
    p.http.program = "anchor-text serve";
    text::TextServer server(p);
    server.serve();
    std::fprintf(stderr, "anchor-text serve: drained, exiting\n");
    return 0;
}

} // namespace

void add_text_serve_command(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners) {
    auto* cmd =
        app.add_subcommand("serve", "HTTP server: OpenAI's /v1/completions (streaming as server-sent events) and "
                                    "/v1/models on a GPT-2, POST /anchor/v1/diffusion for text diffusion");
    cmd->fallthrough();
    auto p = std::make_shared<text::TextServerParams>();
    auto no_diffusion = std::make_shared<bool>(false);
    auto place = std::make_shared<PlacementArgs>();
    p->http.port = 8080;
    auto bind = [](CLI::Option* opt, const char* field) {
        bind_field(field, opt->get_name());
        return opt;
    };
    bind(cmd->add_option("-m,--model", p->gpt2.model, "GPT-2 folder or .safetensors (default: assets/models/kjv-gpt2)"),
         "model");
    bind(cmd->add_option("--diffusion-model", p->diffusion_model,
                         "MDLM folder for /anchor/v1/diffusion (default: assets/models/kjv-mdlm)"),
         "diffusion_model");
    cmd->add_flag("--no-diffusion", *no_diffusion, "no /anchor/v1/diffusion");
    bind(cmd->add_option("--dlm-model", p->dlm_model,
                         "LLaDA / Dream / DiffuGPT folder or GGUF for POST /v1/chat/completions"),
         "dlm_model");
    bind(cmd->add_option("--dlm-vocab", p->dlm_vocab, "its tokenizer folder (default: next to --dlm-model)"),
         "dlm_vocab");
    auto dlm_weights = std::make_shared<std::string>();
    bind(cmd->add_option("--dlm-weights-dtype", *dlm_weights,
                         "its weights in memory: " + enum_choices(kernels::qweight_type_table()) +
                             " (default: float32 for a folder, as stored for a GGUF)")
             ->check([](const std::string& v) {
                 for (const auto& [name, value] : kernels::qweight_type_table())
                     if (name == v) return std::string();
                 return "not one of " + enum_choices(kernels::qweight_type_table());
             }),
         "dlm_weights");
    add_placement_options(cmd, *place, "the GPT-2 (with every request's KV cache) and the MDLM");
    bind(add_enum_option(*cmd, "--diffusion-gemm", p->diffusion_gemm, kernels::gemm_backend_table(),
                         "the diffusion model's linear layers: torch (SEDD's bits), onednn (~1.5x faster) or bf16"),
         "diffusion_gemm");
    bind(cmd->add_option("--host", p->http.host, "address to listen on")->capture_default_str(), "host");
    bind(cmd->add_option("--port", p->http.port, "port (0: any free port, printed)")->capture_default_str(), "port");
    bind(cmd->add_option("--queue", p->http.queue, "jobs waiting or running; one more gets 429 with Retry-After")
             ->capture_default_str(),
         "queue");
    bind(cmd->add_option("--http-threads", p->http.threads, "connection threads")->capture_default_str(), "threads");
    bind(cmd->add_option("--drain-timeout", p->http.drain_timeout_s,
                         "seconds SIGTERM's drain waits for the jobs in flight before it cancels them")
             ->capture_default_str(),
         "drain_timeout_s");
    bind(cmd->add_option("--kv", p->default_kv,
                         "KV mode of requests without a `kv` field: " + text::KvSpec::syntax_help())
             ->capture_default_str(),
         "default_kv");
    bind(cmd->add_option("--max-tokens", p->max_tokens, "largest max_tokens of a request")->capture_default_str(),
         "max_tokens");
    bind(cmd->add_option("--max-prompt", p->max_prompt, "largest prompt in tokens")->capture_default_str(),
         "max_prompt");
    bind(cmd->add_option("--max-length", p->max_length, "largest diffusion length of a request")->capture_default_str(),
         "max_length");
    bind(cmd->add_option("--max-steps", p->max_steps, "largest diffusion steps of a request")->capture_default_str(),
         "max_steps");
    bind(cmd->add_option("--max-prompt-bytes", p->max_prompt_bytes,
                         "largest prompt in bytes (checked before tokenizing)")
             ->capture_default_str(),
         "max_prompt_bytes");
    runners.emplace_back(cmd, [p, place, no_diffusion, dlm_weights]() {
        if (!dlm_weights->empty())
            p->dlm_weights = enum_from_string(kernels::qweight_type_table(), *dlm_weights, "dlm_weights");
        return run_text_serve(*p, *place, *no_diffusion);
    });
}

} // namespace anchor::cli
