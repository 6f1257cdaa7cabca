#include "text/serve/text_server.h"

#include "text/diffusion/mdlm_model.h"
#include "text/serve/text_server_routes.h"

#include <climits>
#include <filesystem>

namespace anchor::text {

namespace fs = std::filesystem;

void TextServerParams::validate() const {
    http.validate();
    gpt2.validate();
    (void)KvSpec::parse(default_kv);
    if (max_tokens < 1) throw ParamError("max_tokens", "must be >= 1, got " + std::to_string(max_tokens));
    if (max_prompt < 1) throw ParamError("max_prompt", "must be >= 1, got " + std::to_string(max_prompt));
    if (max_prompt_bytes < 1)
        throw ParamError("max_prompt_bytes", "must be >= 1, got " + std::to_string(max_prompt_bytes));
    if (max_length < 2) throw ParamError("max_length", "must be >= 2, got " + std::to_string(max_length));
    if (max_steps < 1) throw ParamError("max_steps", "must be >= 1, got " + std::to_string(max_steps));
}

namespace text_routes {

// A prompt within the byte bound, before it is tokenized: 413 naming the field.
void check_prompt_bytes(const std::string& text, int64_t max_bytes, const std::string& field) {
    if (int64_t(text.size()) > max_bytes)
        throw HttpError(413, field,
                        field + ": a prompt of " + std::to_string(text.size()) + " bytes, at most " +
                            std::to_string(max_bytes) + " are read");
}

} // namespace text_routes

TextServer::TextServer(TextServerParams p)
    : p_((p.validate(), std::move(p))), model_(load_gpt2_model(p_.gpt2)),
      tok_(std::make_shared<const Gpt2Tokenizer>(load_gpt2_tokenizer(p_.gpt2, model_))),
      model_id_(fs::path(p_.gpt2.model).filename().string()), threads_(at::get_num_threads()), http_(p_.http) {
    // One diffusion model in memory for every request (each run has its own denoiser and caches).
    if (!p_.diffusion_model.empty()) {
        mdlm_ = load_mdlm(p_.diffusion_model);
        configure_mdlm(mdlm_, kernels::AttentionKernel::Exact, p_.gpt2.placement, p_.diffusion_gemm);
    }
    if (model_id_.empty()) model_id_ = fs::path(p_.gpt2.model).parent_path().filename().string();
    if (!p_.dlm_model.empty()) {
        LoadedDlm l = load_dlm(p_.dlm_model, {}, -1, p_.dlm_weights);
        dlm_ = l.model;
        dlm_tok_ = load_dlm_tokenizer(l, p_.dlm_vocab);
        dlm_template_ = detect_chat_template(p_.dlm_vocab.empty() ? l.folder : p_.dlm_vocab);
        dlm_id_ = fs::path(p_.dlm_model).filename().string();
    }
    add_routes();
}

void TextServer::serve() {
    http_.drain_on_signals();
    http_.serve();
}

void TextServer::add_routes() {
    register_openai_routes(*this, http_);
    register_anchor_routes(*this, http_);
    register_dlm_chat_routes(*this, http_);
    http_.add_health(model_id_);
    http_.add_openapi(openapi());
}

nlohmann::json TextServer::openapi() const {
    using nlohmann::json;
    using serve::openapi_post;
    const json str = {{"type", "string"}};
    auto integer = [](int64_t lo, int64_t hi) { return json{{"type", "integer"}, {"minimum", lo}, {"maximum", hi}}; };
    auto number = [](double lo, double hi) { return json{{"type", "number"}, {"minimum", lo}, {"maximum", hi}}; };
    const json prompt = {{"type", "string"}, {"maxLength", p_.max_prompt_bytes}};
    const json completions = {
        {"model", str},
        {"prompt", {{"oneOf", {prompt, {{"type", "array"}, {"items", prompt}, {"minItems", 1}, {"maxItems", 1}}}}}},
        {"max_tokens", integer(0, p_.max_tokens)},
        {"temperature", number(0, 2)},
        {"top_p", number(1e-9, 1)},
        {"seed", integer(0, INT64_MAX)},
        {"stop_at_eos", {{"type", "boolean"}}},
        {"kv", str},
        {"positions", str},
        {"stop", {{"oneOf", {str, {{"type", "array"}, {"items", str}, {"maxItems", 4}}}}}},
        {"stream", {{"type", "boolean"}}}};
    const json diffusion = {{"prompt", prompt},
                            {"length", integer(2, p_.max_length)},
                            {"steps", integer(1, p_.max_steps)},
                            {"temperature", number(0, 2)},
                            {"top_p", number(1e-9, 1)},
                            {"seed", integer(0, INT64_MAX)},
                            {"block_length", integer(0, p_.max_length)},
                            {"cache", str}};
    json paths = {
        {"/v1/completions", openapi_post("OpenAI completions (stream: server-sent events)", completions, {"prompt"})},
        {"/v1/models", serve::openapi_get("the models served")},
        {"/health", serve::openapi_get("status, model and queue (503 while draining)")},
        {"/openapi.json", serve::openapi_get("this description")}};
    if (dlm_)
        paths["/v1/chat/completions"] = openapi_post(
            "OpenAI chat completions on a diffusion LM (stream: one event per committed block)",
            {{"model", str},
             {"messages", {{"type", "array"}, {"minItems", 1}}},
             {"max_tokens", integer(1, p_.max_length)},
             {"steps", integer(1, p_.max_steps)},
             {"block_length", integer(0, p_.max_length)},
             {"temperature", number(0, 2)},
             {"top_p", number(1e-9, 1)},
             {"top_k", integer(1, INT64_MAX)},
             {"remask", str},
             {"alg_temp", number(0, 1e6)},
             {"eps", number(0, 1)},
             {"cache", str},
             {"seed", integer(0, INT64_MAX)},
             {"stop_at_eos", {{"type", "boolean"}}},
             {"stream", {{"type", "boolean"}}}},
            {"messages"});
    if (!p_.diffusion_model.empty())
        paths["/anchor/v1/diffusion"] = openapi_post("text diffusion with a cache mode", diffusion);
    return serve::openapi_document("anchor-text serve", "OpenAI's completions API and text diffusion on AnchorCache",
                                   paths);
}

} // namespace anchor::text
