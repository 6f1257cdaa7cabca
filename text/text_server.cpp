#include "text/text_server.h"

#include "text/gpt2_generate.h"
#include "text/mdlm_model.h"
#include "text/mdlm_run.h"
#include "text/params.h"
#include "text/text_job.h"

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <random>

namespace anchor::text {

namespace fs = std::filesystem;
using serve::HttpError;
using serve::HttpReply;
using serve::HttpRequest;
using serve::JobControl;
using serve::RequestFields;

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

namespace {

int64_t unix_now() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

std::string completion_id() {
    static std::atomic<uint64_t> n{0};
    std::random_device rd;
    char buf[48];
    std::snprintf(buf, sizeof buf, "cmpl-%08x%06llx", rd(), (unsigned long long)(++n));
    return buf;
}

// A library ParamError about a request field, as the 400 of that field.
template <class F> auto as_field(const std::string& field, F&& f) -> decltype(f()) {
    try {
        return f();
    } catch (const ParamError& e) {
        throw HttpError(400, field, field + ": " + e.detail());
    }
}

// A prompt within the byte bound, before it is tokenized: 413 naming the field.
void check_prompt_bytes(const std::string& text, int64_t max_bytes, const std::string& field) {
    if (int64_t(text.size()) > max_bytes)
        throw HttpError(413, field,
                        field + ": a prompt of " + std::to_string(text.size()) + " bytes, at most " +
                            std::to_string(max_bytes) + " are read");
}

// The earliest stop sequence in `text` from `from`: its offset, npos when none.
size_t find_stop(const std::string& text, const std::vector<std::string>& stops, size_t from) {
    size_t best = std::string::npos;
    for (const auto& s : stops) {
        const size_t start = from >= s.size() ? from - s.size() + 1 : 0;
        const size_t at = text.find(s, start);
        if (at != std::string::npos && at < best) best = at;
    }
    return best;
}

// Runs a completion with the stop sequences applied: the text up to the earliest stop comes back; `emit` (streaming;
// may be empty) gets every piece as soon as it can no longer be the start of a stop sequence. Ends early when a stop
// sequence appears or the client is gone (JobControl: the check throws at the next token).
std::string run_completion(StreamRunner& runner, const std::vector<std::string>& stops, JobControl& c,
                           const std::function<void(const std::string&)>& emit, GenerateReport& rep) {
    std::string text;
    size_t sent = 0, hold = 0;
    for (const auto& s : stops) hold = std::max(hold, s.size() - 1);
    bool stopped = false;
    rep = runner.run(
        [&](const std::string& piece) {
            c.check();
            if (stopped) return;
            const size_t from = text.size();
            text += piece;
            const size_t at = find_stop(text, stops, from);
            if (at != std::string::npos) text.resize(at), stopped = true;
            if (!emit) return;
            const size_t upto = stopped ? text.size() : text.size() > hold ? text.size() - hold : 0;
            if (upto > sent) emit(text.substr(sent, upto - sent));
            sent = std::max(sent, upto);
        },
        {}, [&] { return stopped || c.cancelled(); });
    c.check();
    if (emit && sent < text.size()) emit(text.substr(sent));
    return text;
}

} // namespace

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
    add_routes();
}

void TextServer::serve() {
    http_.drain_on_signals();
    http_.serve();
}

void TextServer::add_routes() {
    auto& http = http_;

    http.get("/v1/models", [this](const HttpRequest&) {
        nlohmann::json data = nlohmann::json::array();
        data.push_back({{"id", model_id_}, {"object", "model"}, {"created", 0}, {"owned_by", "anchorcache"}});
        if (!p_.diffusion_model.empty())
            data.push_back({{"id", fs::path(p_.diffusion_model).filename().string()},
                            {"object", "model"},
                            {"created", 0},
                            {"owned_by", "anchorcache"},
                            {"endpoint", "/anchor/v1/diffusion"}});
        return HttpReply::json({{"object", "list"}, {"data", data}});
    });

    http.post("/v1/completions", [this](const HttpRequest& req) {
        const auto f = RequestFields::parse(req.body);
        const std::string model = f.string("model", model_id_);
        if (model != model_id_)
            throw HttpError(404, "model", "model: this server serves '" + model_id_ + "', got '" + model + "'");
        const auto prompts = f.strings("prompt");
        if (prompts.size() != 1)
            throw HttpError(400, "prompt",
                            "prompt: expected one non-empty string, got " + std::to_string(prompts.size()) +
                                " prompts");
        check_prompt_bytes(prompts[0], p_.max_prompt_bytes, "prompt");
        GenerateParams g;
        g.prompt = prompts[0];
        g.max_new_tokens = f.integer("max_tokens", 16, 0, p_.max_tokens);
        g.sampling.temperature = f.number("temperature", 1.0, 0.0, 2.0);
        g.sampling.top_p = f.number("top_p", 1.0, 1e-9, 1.0);
        g.sampling.seed = uint64_t(f.integer("seed", int64_t(std::random_device{}()), 0, INT64_MAX));
        g.stop_at_eos = f.boolean("stop_at_eos", true);
        g.kv = as_field("kv", [&] { return KvSpec::parse(f.string("kv", p_.default_kv)); });
        const std::string positions = f.string("positions", g.kv.mode == KvMode::Full ? "wrap" : "reencode");
        g.positions = as_field("positions", [&] { return enum_from_string(position_mode_table(), positions, "x"); });
        auto stops = f.strings("stop");
        if (stops.size() > 4)
            throw HttpError(400, "stop", "stop: at most 4 sequences, got " + std::to_string(stops.size()));
        for (size_t i = 0; i < stops.size(); ++i)
            if (stops[i].empty()) throw HttpError(400, "stop", "stop[" + std::to_string(i) + "]: empty");
        const bool stream = f.boolean("stream", false);
        if (g.prompt.empty()) throw HttpError(400, "prompt", "prompt: expected a non-empty string, got \"\"");
        if (tok_->encode(g.prompt).size() > size_t(p_.max_prompt))
            throw HttpError(400, "prompt", "prompt: at most " + std::to_string(p_.max_prompt) + " tokens");
        // The runner checks the prompt against the KV mode (400 naming max_tokens when a full cache cannot hold it)
        // and the memory estimate of the stream (400 naming kv or prompt).
        std::shared_ptr<StreamRunner> runner;
        try {
            runner = std::make_shared<StreamRunner>(g, model_, tok_);
        } catch (const ParamError& e) { // the library's field names as OpenAI's
            const std::string field = e.field() == "max_new_tokens" ? "max_tokens" : e.field();
            throw HttpError(400, field, field + ": " + e.detail());
        }
        const std::string id = completion_id(), model_id = model_id_;
        const int64_t created = unix_now();
        auto chunk = [id, created, model_id](const std::string& text, const nlohmann::json& finish) {
            return nlohmann::json{
                {"id", id},
                {"object", "text_completion"},
                {"created", created},
                {"model", model_id},
                {"choices", {{{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}}}}};
        };
        const std::string note = "kv=" + g.kv.str();
        if (stream) {
            HttpReply r = http_.stream_job(req, [runner, stops, chunk, threads = threads_](
                                                    JobControl& c, const std::function<void(std::string)>& emit) {
                torch::NoGradGuard no_grad; // grad mode and the OpenMP thread count are per thread
                at::set_num_threads(threads);
                GenerateReport rep;
                (void)run_completion(
                    *runner, stops, c, [&](const std::string& piece) { emit(serve::sse_event(chunk(piece, nullptr))); },
                    rep);
                emit(serve::sse_event(chunk("", runner->finish_reason() == "length" ? "length" : "stop")));
            });
            r.note = note;
            return r;
        }
        auto out = http_.run_job(req, [this, runner, stops, chunk](JobControl& c) {
            torch::NoGradGuard no_grad;
            at::set_num_threads(threads_);
            GenerateReport rep;
            const std::string text = run_completion(*runner, stops, c, {}, rep);
            auto j = chunk(text, runner->finish_reason() == "length" ? "length" : "stop");
            j["usage"] = {{"prompt_tokens", rep.prompt_tokens},
                          {"completion_tokens", rep.generated},
                          {"total_tokens", rep.prompt_tokens + rep.generated}};
            j["anchor"] = {
                {"kv", rep.kv.str()},           {"positions", enum_name(position_mode_table(), rep.positions)},
                {"sampler", rep.sampler},       {"prefill_s", rep.prefill_s},
                {"generate_s", rep.generate_s}, {"kv_bytes", rep.kv_bytes}};
            return j;
        });
        HttpReply r = HttpReply::json(out);
        r.note = note;
        return r;
    });

    // Text diffusion (MDLM) with a cache mode; the prompt is text, the reply the generated text, the tokens and the
    // run's figures (cache reuse, forward passes, seconds).
    http.post("/anchor/v1/diffusion", [this](const HttpRequest& req) {
        if (p_.diffusion_model.empty())
            throw HttpError(404, "", "this server has no diffusion model (start it with --diffusion-model)");
        const auto f = RequestFields::parse(req.body);
        DiffusionGenerateParams d;
        d.model = p_.diffusion_model;
        auto& s = d.sampler;
        const std::string prompt = f.string("prompt", "");
        check_prompt_bytes(prompt, p_.max_prompt_bytes, "prompt");
        if (!prompt.empty()) s.prompt = tok_->encode(prompt);
        s.length = f.integer("length", 128, 2, p_.max_length);
        s.steps = f.integer("steps", 64, 1, p_.max_steps);
        s.temperature = f.number("temperature", 1.0, 0.0, 2.0);
        s.top_p = f.number("top_p", 1.0, 1e-9, 1.0);
        s.seed = uint64_t(f.integer("seed", 0, 0, INT64_MAX));
        s.block_length = f.integer("block_length", 0, 0, p_.max_length);
        const std::string cache = f.string("cache", "off");
        d.caches = {as_field("cache", [&] { return parse_decode_spec(cache); })};
        // One model serves every request: its linear layers are the server's choice (--diffusion-gemm).
        if (d.caches[0].gemm)
            throw HttpError(400, "cache", "cache: gemm= is the server's setting (--diffusion-gemm), not a request's");
        as_field("length", [&] { s.validate(); });
        // The memory a run of this length needs, before it is queued.
        as_field("length", [&] { check_sampling_memory(mdlm_->config(), s); });
        try {
            check_prompt_vocabulary(*mdlm_, s.prompt);
        } catch (const TokenOutsideVocabulary& e) {
            throw HttpError(400, "prompt", "prompt: " + e.describe(tok_->decode({e.id()})));
        }
        const int64_t P = int64_t(s.prompt.size());
        if (P >= s.length)
            throw HttpError(400, "length",
                            "length: must exceed the prompt's " + std::to_string(P) + " tokens, got " +
                                std::to_string(s.length));
        auto out = http_.run_job(req, [this, d, P](JobControl& c) {
            torch::NoGradGuard no_grad;
            at::set_num_threads(threads_);
            auto rep = generate_diffusion(mdlm_, d, [&](const StepInfo&) { c.check(); });
            auto j = rep.to_json();
            j["text"] = generated_text(rep.runs[0].result.tokens, P, *tok_);
            return j;
        });
        HttpReply r = HttpReply::json(out);
        r.note = "cache=" + cache;
        return r;
    });

    http.add_health(model_id_);
    http.add_openapi(openapi());
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
    if (!p_.diffusion_model.empty())
        paths["/anchor/v1/diffusion"] = openapi_post("text diffusion with a cache mode", diffusion);
    return serve::openapi_document("anchor-text serve", "OpenAI's completions API and text diffusion on AnchorCache",
                                   paths);
}

} // namespace anchor::text
