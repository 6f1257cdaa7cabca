// OpenAI's completions API on `anchor-text serve`: GET /v1/models and POST /v1/completions (streamed as server-sent
// events in OpenAI's chunk format ending with [DONE]), with our `kv` and `positions` fields.
#include "cache/util/threads.h"
#include "text/serve/text_server_routes.h"

#include "text/gpt2/gpt2_generate.h"
#include "text/params.h"

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <random>

namespace anchor::text {

using text_routes::as_field;
using text_routes::check_prompt_bytes;

namespace {

namespace fs = std::filesystem;

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

void register_openai_routes(TextServer& srv, serve::HttpServer& http) {
    http.get("/v1/models", [&srv](const HttpRequest&) {
        nlohmann::json data = nlohmann::json::array();
        data.push_back({{"id", srv.model_id_}, {"object", "model"}, {"created", 0}, {"owned_by", "anchorcache"}});
        if (!srv.p_.diffusion_model.empty())
            data.push_back({{"id", fs::path(srv.p_.diffusion_model).filename().string()},
                            {"object", "model"},
                            {"created", 0},
                            {"owned_by", "anchorcache"},
                            {"endpoint", "/anchor/v1/diffusion"}});
        return HttpReply::json({{"object", "list"}, {"data", data}});
    });

    http.post("/v1/completions", [&srv](const HttpRequest& req) {
        const auto f = RequestFields::parse(req.body);
        const std::string model = f.string("model", srv.model_id_);
        if (model != srv.model_id_)
            throw HttpError(404, "model", "model: this server serves '" + srv.model_id_ + "', got '" + model + "'");
        const auto prompts = f.strings("prompt");
        if (prompts.size() != 1)
            throw HttpError(400, "prompt",
                            "prompt: expected one non-empty string, got " + std::to_string(prompts.size()) +
                                " prompts");
        check_prompt_bytes(prompts[0], srv.p_.max_prompt_bytes, "prompt");
        GenerateParams g;
        g.prompt = prompts[0];
        g.max_new_tokens = f.integer("max_tokens", 16, 0, srv.p_.max_tokens);
        g.sampling.temperature = f.number("temperature", 1.0, 0.0, 2.0);
        g.sampling.top_p = f.number("top_p", 1.0, 1e-9, 1.0);
        g.sampling.seed = uint64_t(f.integer("seed", int64_t(std::random_device{}()), 0, INT64_MAX));
        g.stop_at_eos = f.boolean("stop_at_eos", true);
        g.kv = as_field("kv", [&] { return KvSpec::parse(f.string("kv", srv.p_.default_kv)); });
        const std::string positions = f.string("positions", g.kv.mode == KvMode::Full ? "wrap" : "reencode");
        g.positions = as_field("positions", [&] { return enum_from_string(position_mode_table(), positions, "x"); });
        auto stops = f.strings("stop");
        if (stops.size() > 4)
            throw HttpError(400, "stop", "stop: at most 4 sequences, got " + std::to_string(stops.size()));
        for (size_t i = 0; i < stops.size(); ++i)
            if (stops[i].empty()) throw HttpError(400, "stop", "stop[" + std::to_string(i) + "]: empty");
        const bool stream = f.boolean("stream", false);
        if (g.prompt.empty()) throw HttpError(400, "prompt", "prompt: expected a non-empty string, got \"\"");
        if (srv.tok_->encode(g.prompt).size() > size_t(srv.p_.max_prompt))
            throw HttpError(400, "prompt", "prompt: at most " + std::to_string(srv.p_.max_prompt) + " tokens");
        // The runner checks the prompt against the KV mode (400 naming max_tokens when a full cache cannot hold it)
        // and the memory estimate of the stream (400 naming kv or prompt).
        std::shared_ptr<StreamRunner> runner;
        try {
            runner = std::make_shared<StreamRunner>(g, srv.model_, srv.tok_);
        } catch (const ParamError& e) { // the library's field names as OpenAI's
            const std::string field = e.field() == "max_new_tokens" ? "max_tokens" : e.field();
            throw HttpError(400, field, field + ": " + e.detail());
        }
        const std::string id = completion_id(), model_id = srv.model_id_;
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
            HttpReply r = srv.http_.stream_job(req, [runner, stops, chunk, threads = srv.threads_](
                                                        JobControl& c, const std::function<void(std::string)>& emit) {
                torch::NoGradGuard no_grad; // grad mode and the OpenMP thread count are per thread
                anchor::util::configure_threads(threads);
                GenerateReport rep;
                (void)run_completion(
                    *runner, stops, c, [&](const std::string& piece) { emit(serve::sse_event(chunk(piece, nullptr))); },
                    rep);
                emit(serve::sse_event(chunk("", runner->finish_reason() == "length" ? "length" : "stop")));
            });
            r.note = note;
            return r;
        }
        auto out = srv.http_.run_job(req, [&srv, runner, stops, chunk](JobControl& c) {
            torch::NoGradGuard no_grad;
            anchor::util::configure_threads(srv.threads_);
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
}

} // namespace anchor::text
