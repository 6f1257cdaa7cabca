// `anchor-text serve`: OpenAI's completions API (POST /v1/completions, streamed as server-sent events in OpenAI's
// chunk format ending with [DONE]; GET /v1/models) on one GPT-2 loaded once, with our `kv` field (a sink-rolling KV
// buffer so a stream can run past the context window) and `positions`; and POST /anchor/v1/diffusion for text
// diffusion with a `cache` mode. Over the shared server core (cache/serve/): one job at a time, each with its own KV
// cache and sampler.
// This header's TextServer is the core (lifecycle, queue, /health, /openapi.json); the routes of each API dialect are
// registered by a file of their own (text/serve/text_server_routes.h).
#pragma once

#include "cache/serve/http_server.h"
#include "text/gpt2/gpt2_load.h"
#include "text/diffusion/mdlm_model.h"
#include "text/diffusion/families/dlm_chat.h"

#include <memory>
#include <optional>
#include <string>

namespace anchor::text {

struct TextServerParams {
    serve::ServerOptions http;
    Gpt2ModelParams gpt2;        // the completions model
    std::string diffusion_model; // MDLM folder for /anchor/v1/diffusion ("": the endpoint answers 404)
    // Its linear layers' library (MdlmBlockImpl::gemm; torch: SEDD's bits).
    kernels::GemmBackend diffusion_gemm = kernels::GemmBackend::Torch;
    std::string default_kv = "full";
    int64_t max_tokens = 4096; // largest max_tokens of a request
    int64_t max_prompt = 4096; // largest prompt in tokens
    // Largest prompt in UTF-8 bytes, checked before tokenizing (a GPT-2 token is at most a few dozen bytes, so this
    // only refuses what could not pass max_prompt anyway, without tokenizing it).
    int64_t max_prompt_bytes = int64_t(1) << 18;
    int64_t max_length = 1024; // largest diffusion length
    int64_t max_steps = 1024;  // largest diffusion steps
    // A published diffusion LM (LLaDA / Dream / DiffuGPT folder or GGUF) for /v1/chat/completions ("": 404), its
    // weights' storage (kernels/qgemm.h; unset: load_dlm's default) and tokenizer folder ("": next to the model).
    std::string dlm_model, dlm_vocab;
    std::optional<kernels::QWeightType> dlm_weights;
    void validate() const;     // ParamError naming the field
};

class TextServer {
public:
    explicit TextServer(TextServerParams p); // loads the GPT-2
    void serve();
    serve::HttpServer& http() { return http_; }

private:
    // Each dialect's routes (text/routes_*.cpp) read the model, the tokenizer and the limits below.
    friend void register_openai_routes(TextServer& srv, serve::HttpServer& http);
    friend void register_anchor_routes(TextServer& srv, serve::HttpServer& http);
    friend void register_dlm_chat_routes(TextServer& srv, serve::HttpServer& http);
    void add_routes();
    nlohmann::json openapi() const; // the OpenAPI description served at /openapi.json
    TextServerParams p_;
    LoadedGpt2 model_;
    MdlmModel mdlm_{nullptr}; // the diffusion model (null without --diffusion-model)
    std::shared_ptr<const Gpt2Tokenizer> tok_;
    std::string model_id_;
    std::shared_ptr<DlmModel> dlm_; // the chat model (null without dlm_model), read-only: each request has its caches
    std::shared_ptr<DlmTokenizer> dlm_tok_;
    ChatTemplate dlm_template_ = ChatTemplate::None;
    std::string dlm_id_;
    int threads_; // the program's intra-op threads, set again on the job thread
    serve::HttpServer http_;
};

} // namespace anchor::text
