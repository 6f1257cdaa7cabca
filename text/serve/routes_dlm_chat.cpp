// OpenAI's chat-completions API on `anchor-text serve` for a published diffusion LM (LLaDA / Dream / DiffuGPT,
// text/diffusion/families): POST /v1/chat/completions renders `messages` through the model's chat template, runs the
// family's sampler and answers as OpenAI does (chat.completion, or chat.completion.chunk events ending with [DONE]
// when `stream` is set: one event per committed block, since a diffusion LM fixes a block at a time). The diffusion
// settings are request extensions: `steps`, `block_length`, `cache`, `remask`, `alg_temp`, `top_k`, `eps`;
// `max_tokens` is the generated length.
#include "cache/util/threads.h"
#include "text/serve/text_server_routes.h"

#include "text/diffusion/families/dlm_chat.h"
#include "text/diffusion/families/dlm_sampler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <random>

namespace anchor::text {

namespace {

std::string dlm_chat_id() {
    static std::atomic<uint64_t> n{0};
    std::random_device rd;
    char buf[48];
    std::snprintf(buf, sizeof buf, "chatcmpl-%08x%06llx", rd(), (unsigned long long)(++n));
    return buf;
}

// The request's messages: an array of {role: system|user|assistant, content: string}, at least one.
std::vector<ChatMessage> dlm_chat_messages(const RequestFields& f, int64_t max_bytes) {
    const auto& body = f.json();
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
        throw HttpError(400, "messages", "messages: expected a non-empty array of {role, content}");
    std::vector<ChatMessage> out;
    int64_t bytes = 0;
    for (size_t i = 0; i < body["messages"].size(); ++i) {
        const auto& m = body["messages"][i];
        const std::string where = "messages[" + std::to_string(i) + "]";
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
            !m["content"].is_string())
            throw HttpError(400, "messages", where + ": expected {\"role\": string, \"content\": string}");
        const std::string role = m["role"].get<std::string>();
        if (role != "system" && role != "user" && role != "assistant")
            throw HttpError(400, "messages", where + ".role: expected system, user or assistant, got '" + role + "'");
        out.push_back({role, m["content"].get<std::string>()});
        bytes += int64_t(out.back().content.size());
    }
    if (out.back().role != "user")
        throw HttpError(400, "messages", "messages: the last message must be the user's, got " + out.back().role);
    if (bytes > max_bytes)
        throw HttpError(413, "messages",
                        "messages: " + std::to_string(bytes) + " bytes of content, at most " + std::to_string(max_bytes) +
                            " are read");
    return out;
}

// The library's option names as the request's.
std::string dlm_chat_field(const std::string& library_field) {
    return library_field == "gen_length" ? "max_tokens" : library_field;
}

// Text of the answer so far: up to the first end-of-sequence token (with stop_at_eos), masks left out.
std::vector<int64_t> dlm_chat_answer(const std::vector<int64_t>& committed, const DlmConfig& c, bool stop_at_eos,
                                     bool* ended) {
    std::vector<int64_t> out;
    for (auto t : committed) {
        if (stop_at_eos && std::count(c.eos_token_ids.begin(), c.eos_token_ids.end(), t)) {
            if (ended) *ended = true;
            break;
        }
        if (t != c.mask_token_id) out.push_back(t);
    }
    return out;
}

} // namespace

void register_dlm_chat_routes(TextServer& srv, serve::HttpServer& http) {
    http.post("/v1/chat/completions", [&srv](const HttpRequest& req) {
        if (!srv.dlm_)
            throw HttpError(404, "", "this server has no chat model (start it with --dlm-model)");
        const auto f = RequestFields::parse(req.body);
        const std::string model = f.string("model", srv.dlm_id_);
        if (model != srv.dlm_id_)
            throw HttpError(404, "model", "model: this server chats with '" + srv.dlm_id_ + "', got '" + model + "'");
        const DlmConfig& c = srv.dlm_->config();
        const auto messages = dlm_chat_messages(f, srv.p_.max_prompt_bytes);

        DlmSampleOptions o;
        o.gen_length = f.integer("max_tokens", 128, 1, srv.p_.max_length);
        o.steps = f.integer("steps", o.gen_length, 1, srv.p_.max_steps);
        o.block_length = f.integer("block_length", 0, 0, srv.p_.max_length);
        if (f.has("temperature")) o.temperature = f.number("temperature", 0.0, 0.0, 2.0);
        if (f.has("top_p")) o.top_p = f.number("top_p", 1.0, 1e-9, 1.0);
        if (f.has("top_k")) o.top_k = f.integer("top_k", 1, 1, INT64_MAX);
        if (f.has("alg_temp")) o.alg_temp = f.number("alg_temp", 0.0, 0.0, 1e6);
        o.eps = f.number("eps", 1e-3, 0.0, 1.0);
        o.stop_at_eos = f.boolean("stop_at_eos", true);
        const uint64_t seed = uint64_t(f.integer("seed", int64_t(std::random_device{}()), 0, INT64_MAX));
        const bool stream = f.boolean("stream", false);
        try {
            if (f.has("remask")) o.remask = enum_from_string(dlm_remask_table(), f.string("remask", ""), "remask");
            o.cache = enum_from_string(dlm_cache_table(), f.string("cache", "off"), "cache");
            o.validate(c);
        } catch (const ParamError& e) {
            const std::string field = dlm_chat_field(e.field());
            throw HttpError(400, field, field + ": " + e.detail());
        }
        const auto prompt = srv.dlm_tok_->encode_with_specials(render_chat(srv.dlm_template_, messages));
        if (int64_t(prompt.size()) > srv.p_.max_prompt)
            throw HttpError(400, "messages",
                            "messages: " + std::to_string(prompt.size()) + " tokens, at most " +
                                std::to_string(srv.p_.max_prompt));
        for (auto id : prompt)
            if (id < 0 || id >= c.vocab_size)
                throw HttpError(400, "messages",
                                "messages: token id " + std::to_string(id) + " outside the model's vocabulary of " +
                                    std::to_string(c.vocab_size) + " (a tokenizer of another model?)");
        if (c.max_positions > 0 && int64_t(prompt.size()) + o.gen_length > c.max_positions)
            throw HttpError(400, "max_tokens",
                            "max_tokens: " + std::to_string(prompt.size()) + " prompt tokens + " +
                                std::to_string(o.gen_length) + " exceed the model's " +
                                std::to_string(c.max_positions) + " positions");

        const std::string id = dlm_chat_id(), model_id = srv.dlm_id_;
        const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count();
        auto finish_of = [o](const DlmSampleResult& r) { return int64_t(r.generated.size()) < o.gen_length ? "stop" : "length"; };
        const std::string note = "cache=" + enum_name(dlm_cache_table(), o.cache);
        if (stream) {
            auto chunk = [id, created, model_id](const nlohmann::json& delta, const nlohmann::json& finish) {
                return nlohmann::json{{"id", id},
                                      {"object", "chat.completion.chunk"},
                                      {"created", created},
                                      {"model", model_id},
                                      {"choices", {{{"index", 0}, {"delta", delta}, {"finish_reason", finish}}}}};
            };
            HttpReply r = srv.http_.stream_job(
                req, [&srv, prompt, o, seed, chunk, finish_of](JobControl& jc,
                                                               const std::function<void(std::string)>& emit) {
                    torch::NoGradGuard no_grad; // grad mode and the OpenMP thread count are per thread
                    anchor::util::configure_threads(srv.threads_);
                    const DlmConfig& cfg = srv.dlm_->config();
                    emit(serve::sse_event(chunk({{"role", "assistant"}, {"content", ""}}, nullptr)));
                    std::string sent;
                    bool ended = false;
                    // Each committed block: the text past what was sent. A multi-byte character cut at the block's
                    // end decodes as U+FFFD; it is held back until the next block completes it.
                    auto on_block = [&](const std::vector<int64_t>& committed) {
                        jc.check();
                        if (ended) return;
                        std::string text = srv.dlm_tok_->decode(dlm_chat_answer(committed, cfg, o.stop_at_eos, &ended));
                        static const std::string kReplacement = "\xEF\xBF\xBD";
                        if (!ended)
                            while (text.size() >= 3 && text.compare(text.size() - 3, 3, kReplacement) == 0)
                                text.resize(text.size() - 3);
                        if (text.size() > sent.size() && text.compare(0, sent.size(), sent) == 0) {
                            emit(serve::sse_event(chunk({{"content", text.substr(sent.size())}}, nullptr)));
                            sent = text;
                        }
                    };
                    const auto res = dlm_generate(*srv.dlm_, prompt, o, dlm_seeded_draws(seed), on_block);
                    const std::string full = srv.dlm_tok_->decode(res.generated);
                    if (full.size() > sent.size() && full.compare(0, sent.size(), sent) == 0)
                        emit(serve::sse_event(chunk({{"content", full.substr(sent.size())}}, nullptr)));
                    emit(serve::sse_event(chunk(nlohmann::json::object(), finish_of(res))));
                });
            r.note = note;
            return r;
        }
        auto out = srv.http_.run_job(req, [&srv, prompt, o, seed, id, created, model_id, finish_of](JobControl& jc) {
            torch::NoGradGuard no_grad;
            anchor::util::configure_threads(srv.threads_);
            const auto t0 = std::chrono::steady_clock::now();
            const auto res = dlm_generate(*srv.dlm_, prompt, o, dlm_seeded_draws(seed),
                                          [&](const std::vector<int64_t>&) { jc.check(); });
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const int64_t P = int64_t(prompt.size()), G = int64_t(res.generated.size());
            nlohmann::json j = {
                {"id", id},
                {"object", "chat.completion"},
                {"created", created},
                {"model", model_id},
                {"choices",
                 {{{"index", 0},
                   {"message", {{"role", "assistant"}, {"content", srv.dlm_tok_->decode(res.generated)}}},
                   {"finish_reason", finish_of(res)}}}},
                {"usage", {{"prompt_tokens", P}, {"completion_tokens", G}, {"total_tokens", P + G}}},
                {"anchor",
                 {{"cache", enum_name(dlm_cache_table(), o.cache)},
                  {"steps", res.steps_run},
                  {"positions_computed", res.positions_computed},
                  {"generate_s", s}}}};
            return j;
        });
        HttpReply r = HttpReply::json(out);
        r.note = note;
        return r;
    });
}

} // namespace anchor::text
