// The model-agnostic core of `anchor-sd serve` and `anchor-text serve`: an HTTP server (cpp-httplib, kept out of this
// header) whose handlers read JSON fields with their types and ranges checked, one worker thread that runs the model
// jobs one after another from a bounded queue (full: 429 with Retry-After), a job cancelled when its client goes
// away or on request, server-sent events for streamed replies, one log line per request, and a drain on SIGTERM
// (jobs in flight finish, new requests get 503).
//
// The model servers (unet/serve/sd_server.h, text/serve/text_server.h) register their endpoints on it; nothing here knows a model.
#pragma once

#include "cache/io/error.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace anchor::serve {

// A reply other than 200: the status and a one-line message; `field` names the request field when there is one.
class HttpError : public Error {
public:
    HttpError(int status, std::string field, const std::string& message, int retry_after_s = 0);
    int status() const { return status_; }
    const std::string& field() const { return field_; }
    int retry_after_s() const { return retry_after_s_; }

private:
    int status_;
    std::string field_;
    int retry_after_s_;
};

// A job stopped before its end (its client went away, an interrupt, ...); what() says why.
class Cancelled : public Error {
public:
    using Error::Error;
};

// The body of an error reply, OpenAI's shape (the npm client reads error.message; A1111 clients show the body):
// {"error": {"message": "steps: must be <= 150, got 1000", "type": "invalid_request_error", "param": "steps",
// "code": 400}}.
nlohmann::json error_body(int status, const std::string& message, const std::string& field = "");

// The fields of a JSON request body, read with their types and ranges checked: HttpError 400 naming the field, what
// was expected and what came. Fields that are absent or null take the default; unknown fields are left alone (A1111
// and OpenAI clients send many this engine has no use for).
class RequestFields {
public:
    // Malformed JSON: 400 naming "body" with the byte offset; a body that is not an object: 400 "body".
    static RequestFields parse(const std::string& text);
    explicit RequestFields(nlohmann::json body);
    bool has(const std::string& name) const; // present and not null
    int64_t integer(const std::string& name, int64_t dflt, int64_t lo, int64_t hi) const;
    double number(const std::string& name, double dflt, double lo, double hi) const;
    std::string string(const std::string& name, const std::string& dflt) const;
    bool boolean(const std::string& name, bool dflt) const;
    // A string or an array of strings (OpenAI's `stop`, `prompt`); empty when absent.
    std::vector<std::string> strings(const std::string& name) const;
    const nlohmann::json& json() const { return body_; }

private:
    const nlohmann::json* find(const std::string& name) const;
    nlohmann::json body_;
};

// What a running job tells the server (its progress) and hears from it (cancellation).
class JobControl {
public:
    void cancel(const std::string& why);
    bool cancelled() const { return cancelled_.load(); }
    void check() const; // throws Cancelled with the reason when cancelled
    void set_progress(nlohmann::json p);
    nlohmann::json progress() const;

private:
    mutable std::mutex m_;
    std::atomic<bool> cancelled_{false};
    std::string why_;
    nlohmann::json progress_ = nlohmann::json::object();
};

// One worker thread runs the jobs in submission order: one model in memory and no two jobs ever share its state
// (each job builds its own caches). At most `capacity` jobs wait or run; submit refuses more.
class JobQueue {
public:
    using Work = std::function<void(JobControl&)>;
    struct Ticket {
        JobControl control;
        bool wait_for_ms(int ms); // true when the job ended (done, failed or skipped as cancelled)
        std::exception_ptr error; // set when the job threw
        bool started = false;
        // private to the queue
        Work work;
        std::mutex m;
        std::condition_variable cv;
        bool done = false;
    };

    explicit JobQueue(int capacity);
    ~JobQueue(); // finishes the jobs already submitted
    JobQueue(const JobQueue&) = delete;
    JobQueue& operator=(const JobQueue&) = delete;

    // nullptr when `capacity` jobs are waiting or running, or after close().
    std::shared_ptr<Ticket> submit(Work work);
    // Refuses new jobs; the submitted ones still run.
    void close();
    // Blocks until no job waits or runs.
    void wait_idle();
    // The same for at most `ms` milliseconds; true when idle.
    bool wait_idle_for_ms(int ms);
    // Cancels every job waiting or running (each stops at its next cancellation point).
    void cancel_all(const std::string& why);
    std::shared_ptr<Ticket> running() const; // nullptr when idle
    int pending() const;                     // waiting or running
    int capacity() const { return capacity_; }
    // Seconds until a new job could start: the jobs pending times the mean job time so far (at least 1).
    int retry_after_s() const;

private:
    void worker_loop();
    const int capacity_;
    mutable std::mutex m_;
    std::condition_variable cv_, idle_cv_;
    std::deque<std::shared_ptr<Ticket>> queue_;
    std::shared_ptr<Ticket> running_;
    bool closed_ = false, stop_ = false;
    double job_s_sum_ = 0;
    int64_t jobs_done_ = 0;
    std::thread worker_;
};

struct ServerOptions {
    std::string host = "127.0.0.1";
    int port = 7860;                    // 0: any free port (HttpServer::bind returns it)
    int queue = 4;                      // jobs waiting or running; one more gets 429
    int threads = 32;                   // connection threads (each waiting client holds one)
    int drain_timeout_s = 60;           // a drain waits this long for the jobs in flight, then cancels them
    size_t max_body = size_t(64) << 20; // larger request bodies get 413 naming "body"
    std::string web_dir;                // static files served at / ("": none)
    std::string program;                // in the startup line
    void validate() const;              // ParamError naming the field
};

struct HttpRequest {
    std::string method, path, body;
    std::map<std::string, std::string> query;
    // Whether the client has closed its connection (polled while a job runs for it).
    std::function<bool()> client_gone;
};

struct HttpReply {
    int status = 200;
    std::string body;
    std::string content_type = "application/json";
    std::vector<std::pair<std::string, std::string>> headers;
    // What the request log line says after the path (e.g. "cache=freq"); sent as the X-Anchor-Note header too.
    std::string note;
    // Streamed replies (server-sent events): called once on the connection thread with a writer that returns false
    // when the client is gone; the body is what it writes.
    std::function<void(const std::function<bool(const std::string&)>& write)> stream;

    static HttpReply json(const nlohmann::json& j, int status = 200);
};

// Base64 (RFC 4648, with padding). decode accepts a data URL ("data:image/png;base64,...") and whitespace; HttpError
// 400 naming `field` on anything else.
std::string base64_encode(const std::string& bytes);
std::string base64_decode(const std::string& text, const std::string& field);

// Pieces of an OpenAPI 3.0 description (served at /openapi.json, read by clients and by the fuzz test
// tests/serve/openapi_fuzz.py). An operation answers 200 with JSON, or an error_body with 400, 404, 413, 429 or 503.
nlohmann::json openapi_document(const std::string& title, const std::string& description, nlohmann::json paths);
nlohmann::json openapi_get(const std::string& summary);
// A POST whose body is a JSON object with these properties (JSON Schema each); `required` names those it must have.
nlohmann::json openapi_post(const std::string& summary, nlohmann::json properties,
                            std::vector<std::string> required = {});

// One "data: ..." event of a server-sent event stream (and the OpenAI terminator "data: [DONE]").
std::string sse_event(const nlohmann::json& data);
std::string sse_done();

class HttpServer {
public:
    using Handler = std::function<HttpReply(const HttpRequest&)>;
    explicit HttpServer(ServerOptions o);
    ~HttpServer();
    HttpServer(const HttpServer&) = delete;
    HttpServer& operator=(const HttpServer&) = delete;

    // A handler's exceptions become replies: HttpError its status, ParamError 400 naming the field, Cancelled 503,
    // anything else 500; the server goes on. A POST without Content-Length or chunked encoding has no body (RFC 9112
    // section 6.3; curl -X POST sends one such) and reaches its handler with body "" at once.
    void get(const std::string& path, Handler h);
    void post(const std::string& path, Handler h);
    // GET /openapi.json: `spec` (an OpenAPI 3 description of the server's endpoints).
    void add_openapi(nlohmann::json spec);
    // GET /health: {"status": "ok" | "draining" (503), "model", "queue", "queue_capacity"}, what a load balancer or a
    // supervisor polls.
    void add_health(const std::string& model);

    JobQueue& jobs() { return jobs_; }
    const ServerOptions& options() const { return o_; }

    // Binds the port (ServerOptions::port, 0 = any free one) and returns it; throws anchor::Error when it cannot.
    int bind();
    // Serves until stop() or a drain ends (binds first when bind() was not called). Prints the startup line.
    void serve();
    // Drain: new requests get 503, the jobs submitted finish and their replies go out, then serve() returns. A job
    // still running after ServerOptions::drain_timeout_s is cancelled (its client gets 503), so a drain is bounded.
    void drain();
    // SIGTERM and SIGINT start drain() (a watcher thread; the handler itself only writes to a pipe).
    void drain_on_signals();
    bool draining() const { return draining_.load(); }

    // Runs `work` as a job and waits for it, cancelling it when the client goes away; a full queue is 429 with
    // Retry-After, a draining server 503. The job's exception is rethrown here.
    nlohmann::json run_job(const HttpRequest& req, const std::function<nlohmann::json(JobControl&)>& work);
    // The same for a streamed reply: `work` emits events (sse_event strings) while it runs; the reply writes them as
    // they come and cancels the job when the client is gone. An error after the stream started is sent as an event
    // {"error": {...}} before [DONE].
    HttpReply stream_job(const HttpRequest& req,
                         const std::function<void(JobControl&, const std::function<void(std::string)>& emit)>& work);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
    ServerOptions o_;
    JobQueue jobs_;
    std::atomic<bool> draining_{false};
    std::thread signal_watcher_, drainer_;
};

} // namespace anchor::serve
