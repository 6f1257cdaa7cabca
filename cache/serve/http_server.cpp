#include "cache/serve/http_server.h"

#include <httplib.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>

namespace anchor::serve {

namespace {

std::string type_name(const nlohmann::json& v) {
    if (v.is_null()) return "null";
    if (v.is_boolean()) return "a boolean";
    if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
    if (v.is_number()) return "a number";
    if (v.is_string()) return "a string";
    if (v.is_array()) return "an array";
    return "an object";
}

// The value as the message quotes it, cut short: the message stays one line.
std::string shown(const nlohmann::json& v) {
    std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (s.size() > 40) {
        // Cut on a character boundary: half a UTF-8 sequence would make the reply itself invalid JSON text.
        size_t n = 37;
        while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
        s = s.substr(0, n) + "...";
    }
    return s;
}

// Replies never fail to serialize: text that is not valid UTF-8 (cut short, or from a model) becomes U+FFFD.
std::string dump_reply(const nlohmann::json& j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

[[noreturn]] void bad_type(const std::string& name, const std::string& expected, const nlohmann::json& v) {
    throw HttpError(400, name, name + ": expected " + expected + ", got " + type_name(v) + " " + shown(v));
}

std::string num_str(double v) {
    std::ostringstream os;
    os << v;
    return os.str();
}

// Whether our end of the TCP connection (local_port, remote_port) is in CLOSE_WAIT: the client sent its FIN, i.e.
// it closed or went away. Read from /proc/net/tcp{,6} because cpp-httplib hands handlers no socket; a connection not
// found counts as open.
bool tcp_peer_closed(int local_port, int remote_port) {
    for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
        std::ifstream in(file);
        std::string line;
        std::getline(in, line); // header
        while (std::getline(in, line)) {
            std::istringstream ls(line);
            std::string sl, local, remote, state;
            if (!(ls >> sl >> local >> remote >> state)) continue;
            const auto port_of = [](const std::string& a) {
                const auto c = a.rfind(':');
                return c == std::string::npos ? -1 : int(std::stoul(a.substr(c + 1), nullptr, 16));
            };
            if (port_of(local) == local_port && port_of(remote) == remote_port)
                return state == "08" || state == "07" || state == "09"; // CLOSE_WAIT, CLOSE, LAST_ACK
        }
    }
    return false;
}

std::string utc_now() {
    const auto now = std::chrono::system_clock::now();
    const std::time_t t = std::chrono::system_clock::to_time_t(now);
    const int ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[40];
    std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                  tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
    return buf;
}

thread_local std::chrono::steady_clock::time_point t_request_start;

int g_signal_pipe[2] = {-1, -1};
std::atomic<bool> g_server_gone{false}; // the watcher thread's cue to end instead of draining

extern "C" void on_drain_signal(int) {
    const char c = 1;
    if (g_signal_pipe[1] >= 0) (void)!write(g_signal_pipe[1], &c, 1);
}

} // namespace

HttpError::HttpError(int status, std::string field, const std::string& message, int retry_after_s)
    : Error(message), status_(status), field_(std::move(field)), retry_after_s_(retry_after_s) {}

nlohmann::json error_body(int status, const std::string& message_in, const std::string& field) {
    // One line, whatever the library said: a multi-line message has its lines joined.
    std::string message;
    bool line_start = false;
    for (char c : message_in) {
        if (c == '\r' || (line_start && (c == ' ' || c == '\t'))) continue;
        line_start = c == '\n';
        if (!line_start)
            message += c;
        else if (!message.empty() && message.back() != ' ')
            message += "; ";
    }
    while (!message.empty() && (message.back() == ' ' || message.back() == ';')) message.pop_back();
    const char* type = status == 429   ? "rate_limit_error"
                       : status == 503 ? "server_unavailable"
                       : status < 500  ? "invalid_request_error"
                                       : "server_error";
    return {{"error",
             {{"message", message},
              {"type", type},
              {"param", field.empty() ? nlohmann::json(nullptr) : nlohmann::json(field)},
              {"code", status}}}};
}

// ---- RequestFields ------------------------------------------------------------------------------------------------

RequestFields RequestFields::parse(const std::string& text) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
        throw HttpError(400, "body",
                        "body: malformed JSON at byte " + std::to_string(e.byte) + " (expected a JSON object)");
    }
    return RequestFields(std::move(j));
}

RequestFields::RequestFields(nlohmann::json body) : body_(std::move(body)) {
    if (!body_.is_object()) bad_type("body", "a JSON object", body_);
}

const nlohmann::json* RequestFields::find(const std::string& name) const {
    const auto it = body_.find(name);
    return it == body_.end() || it->is_null() ? nullptr : &*it;
}

bool RequestFields::has(const std::string& name) const {
    return find(name) != nullptr;
}

int64_t RequestFields::integer(const std::string& name, int64_t dflt, int64_t lo, int64_t hi) const {
    const auto* v = find(name);
    if (!v) return dflt;
    int64_t x = 0;
    if (v->is_number_integer() || v->is_number_unsigned()) {
        if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
            throw HttpError(400, name, name + ": must be <= " + std::to_string(hi) + ", got " + shown(*v));
        x = v->get<int64_t>();
    } else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
               std::abs(v->get<double>()) < 9e15) {
        x = int64_t(v->get<double>()); // 20.0 from a client that writes every number as a float
    } else {
        bad_type(name, "an integer", *v);
    }
    if (x < lo || x > hi)
        throw HttpError(400, name,
                        name + ": must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                            std::to_string(x));
    return x;
}

double RequestFields::number(const std::string& name, double dflt, double lo, double hi) const {
    const auto* v = find(name);
    if (!v) return dflt;
    if (!v->is_number()) bad_type(name, "a number", *v);
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi))
        throw HttpError(400, name, name + ": must be in [" + num_str(lo) + ", " + num_str(hi) + "], got " + num_str(x));
    return x;
}

std::string RequestFields::string(const std::string& name, const std::string& dflt) const {
    const auto* v = find(name);
    if (!v) return dflt;
    if (!v->is_string()) bad_type(name, "a string", *v);
    return v->get<std::string>();
}

bool RequestFields::boolean(const std::string& name, bool dflt) const {
    const auto* v = find(name);
    if (!v) return dflt;
    if (!v->is_boolean()) bad_type(name, "a boolean", *v);
    return v->get<bool>();
}

std::vector<std::string> RequestFields::strings(const std::string& name) const {
    const auto* v = find(name);
    if (!v) return {};
    if (v->is_string()) return {v->get<std::string>()};
    if (!v->is_array()) bad_type(name, "a string or an array of strings", *v);
    std::vector<std::string> out;
    for (size_t i = 0; i < v->size(); ++i) {
        if (!(*v)[i].is_string()) bad_type(name + "[" + std::to_string(i) + "]", "a string", (*v)[i]);
        out.push_back((*v)[i].get<std::string>());
    }
    return out;
}

// ---- JobControl / JobQueue ----------------------------------------------------------------------------------------

void JobControl::cancel(const std::string& why) {
    std::lock_guard<std::mutex> lk(m_);
    if (!cancelled_) why_ = why;
    cancelled_ = true;
}

void JobControl::check() const {
    if (!cancelled_) return;
    std::lock_guard<std::mutex> lk(m_);
    throw Cancelled(why_);
}

void JobControl::set_progress(nlohmann::json p) {
    std::lock_guard<std::mutex> lk(m_);
    progress_ = std::move(p);
}

nlohmann::json JobControl::progress() const {
    std::lock_guard<std::mutex> lk(m_);
    return progress_;
}

bool JobQueue::Ticket::wait_for_ms(int ms) {
    std::unique_lock<std::mutex> lk(m);
    return cv.wait_for(lk, std::chrono::milliseconds(ms), [&] { return done; });
}

JobQueue::JobQueue(int capacity) : capacity_(capacity), worker_([this] { worker_loop(); }) {}

JobQueue::~JobQueue() {
    {
        std::lock_guard<std::mutex> lk(m_);
        closed_ = stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
}

std::shared_ptr<JobQueue::Ticket> JobQueue::submit(Work work) {
    auto t = std::make_shared<Ticket>();
    t->work = std::move(work);
    {
        std::lock_guard<std::mutex> lk(m_);
        if (closed_ || int(queue_.size()) + (running_ ? 1 : 0) >= capacity_) return nullptr;
        queue_.push_back(t);
    }
    cv_.notify_all();
    return t;
}

void JobQueue::close() {
    std::lock_guard<std::mutex> lk(m_);
    closed_ = true;
}

void JobQueue::wait_idle() {
    std::unique_lock<std::mutex> lk(m_);
    idle_cv_.wait(lk, [&] { return queue_.empty() && !running_; });
}

bool JobQueue::wait_idle_for_ms(int ms) {
    std::unique_lock<std::mutex> lk(m_);
    return idle_cv_.wait_for(lk, std::chrono::milliseconds(ms), [&] { return queue_.empty() && !running_; });
}

void JobQueue::cancel_all(const std::string& why) {
    std::lock_guard<std::mutex> lk(m_);
    for (auto& t : queue_) t->control.cancel(why);
    if (running_) running_->control.cancel(why);
}

std::shared_ptr<JobQueue::Ticket> JobQueue::running() const {
    std::lock_guard<std::mutex> lk(m_);
    return running_;
}

int JobQueue::pending() const {
    std::lock_guard<std::mutex> lk(m_);
    return int(queue_.size()) + (running_ ? 1 : 0);
}

int JobQueue::retry_after_s() const {
    std::lock_guard<std::mutex> lk(m_);
    const double mean = jobs_done_ ? job_s_sum_ / double(jobs_done_) : 1.0;
    return std::max(1, int(std::ceil(mean * double(queue_.size() + (running_ ? 1 : 0)))));
}

void JobQueue::worker_loop() {
    for (;;) {
        std::shared_ptr<Ticket> t;
        {
            std::unique_lock<std::mutex> lk(m_);
            cv_.wait(lk, [&] { return !queue_.empty() || stop_; });
            if (queue_.empty()) return; // stop_ and nothing left
            t = queue_.front();
            queue_.pop_front();
            running_ = t;
        }
        const auto t0 = std::chrono::steady_clock::now();
        // A job whose client left while it waited is skipped.
        if (!t->control.cancelled()) {
            t->started = true;
            try {
                t->work(t->control);
            } catch (...) {
                t->error = std::current_exception();
            }
        } else {
            try {
                t->control.check();
            } catch (...) {
                t->error = std::current_exception();
            }
        }
        t->work = nullptr; // the job's captures (its tensors) are freed before the next job starts
        {
            std::lock_guard<std::mutex> lk(m_);
            running_.reset();
            if (t->started) {
                job_s_sum_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                ++jobs_done_;
            }
        }
        {
            std::lock_guard<std::mutex> lk(t->m);
            t->done = true;
        }
        t->cv.notify_all();
        idle_cv_.notify_all();
    }
}

// ---- HttpServer ---------------------------------------------------------------------------------------------------

void ServerOptions::validate() const {
    if (host.empty()) throw ParamError("host", "no host to listen on");
    if (port < 0 || port > 65535) throw ParamError("port", "must be in [0, 65535], got " + std::to_string(port));
    if (queue < 1) throw ParamError("queue", "must be >= 1, got " + std::to_string(queue));
    if (threads < 2) throw ParamError("threads", "must be >= 2, got " + std::to_string(threads));
    if (drain_timeout_s < 0 || drain_timeout_s > 86400)
        throw ParamError("drain_timeout_s", "must be in [0, 86400] seconds, got " + std::to_string(drain_timeout_s));
    if (max_body < 1024) throw ParamError("max_body", "must be >= 1024 bytes, got " + std::to_string(max_body));
}

HttpReply HttpReply::json(const nlohmann::json& j, int status) {
    HttpReply r;
    r.status = status;
    r.body = dump_reply(j);
    return r;
}

std::string base64_encode(const std::string& in) {
    static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve((in.size() + 2) / 3 * 4);
    size_t i = 0;
    for (; i + 2 < in.size(); i += 3) {
        const uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8 | uint8_t(in[i + 2]);
        out += {a[v >> 18], a[(v >> 12) & 63], a[(v >> 6) & 63], a[v & 63]};
    }
    if (i + 1 == in.size()) {
        const uint32_t v = uint32_t(uint8_t(in[i])) << 16;
        out += {a[v >> 18], a[(v >> 12) & 63], '=', '='};
    } else if (i + 2 == in.size()) {
        const uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8;
        out += {a[v >> 18], a[(v >> 12) & 63], a[(v >> 6) & 63], '='};
    }
    return out;
}

std::string base64_decode(const std::string& text, const std::string& field) {
    size_t begin = 0;
    if (text.rfind("data:", 0) == 0) {
        const auto comma = text.find(',');
        if (comma == std::string::npos || text.substr(0, comma).find(";base64") == std::string::npos)
            throw HttpError(400, field, field + ": a data URL without ';base64,'");
        begin = comma + 1;
    }
    std::string out;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = begin; i < text.size(); ++i) {
        const char c = text[i];
        int v;
        if (c >= 'A' && c <= 'Z')
            v = c - 'A';
        else if (c >= 'a' && c <= 'z')
            v = c - 'a' + 26;
        else if (c >= '0' && c <= '9')
            v = c - '0' + 52;
        else if (c == '+' || c == '-')
            v = 62;
        else if (c == '/' || c == '_')
            v = 63;
        else if (c == '=' || c == ' ' || c == '\n' || c == '\r' || c == '\t')
            continue;
        else
            throw HttpError(400, field,
                            field + ": not base64 (character " + std::to_string(int(uint8_t(c))) + " at offset " +
                                std::to_string(i) + ")");
        acc = acc << 6 | uint32_t(v);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out += char((acc >> bits) & 0xff);
        }
    }
    if (out.empty()) throw HttpError(400, field, field + ": empty (expected a base64 image)");
    return out;
}

namespace {
nlohmann::json openapi_responses() {
    const nlohmann::json error = {{"description", "error: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"},
                                  {"content",
                                   {{"application/json",
                                     {{"schema",
                                       {{"type", "object"},
                                        {"required", {"error"}},
                                        {"properties",
                                         {{"error",
                                           {{"type", "object"},
                                            {"required", {"message", "type", "code"}},
                                            {"properties",
                                             {{"message", {{"type", "string"}}},
                                              {"type", {{"type", "string"}}},
                                              {"param", {{"type", "string"}, {"nullable", true}}},
                                              {"code", {{"type", "integer"}}}}}}}}}}}}}}}};
    nlohmann::json r = {{"200", {{"description", "ok"}}}};
    for (const char* code : {"400", "404", "413", "429", "503"}) r[code] = error;
    return r;
}
} // namespace

nlohmann::json openapi_document(const std::string& title, const std::string& description, nlohmann::json paths) {
    return {{"openapi", "3.0.3"},
            {"info", {{"title", title}, {"version", "1"}, {"description", description}}},
            {"paths", std::move(paths)}};
}

nlohmann::json openapi_get(const std::string& summary) {
    return {{"get", {{"summary", summary}, {"responses", openapi_responses()}}}};
}

nlohmann::json openapi_post(const std::string& summary, nlohmann::json properties, std::vector<std::string> required) {
    nlohmann::json schema = {{"type", "object"}, {"properties", std::move(properties)}};
    if (!required.empty()) schema["required"] = required;
    return {
        {"post",
         {{"summary", summary},
          {"requestBody", {{"required", !required.empty()}, {"content", {{"application/json", {{"schema", schema}}}}}}},
          {"responses", openapi_responses()}}}};
}

std::string sse_event(const nlohmann::json& data) {
    return "data: " + dump_reply(data) + "\n\n";
}
std::string sse_done() {
    return "data: [DONE]\n\n";
}

struct HttpServer::Impl {
    httplib::Server svr;
    int port = -1;
    std::map<std::string, Handler> posts; // for the POSTs without a body, answered before httplib reads one
};

namespace {

HttpReply error_reply(int status, const std::string& message, const std::string& field, int retry_after = 0) {
    HttpReply r = HttpReply::json(error_body(status, message, field), status);
    // The log line says why (one line, printable ASCII: it travels as a header too).
    for (char c : message.substr(0, 200)) r.note += c >= 32 && c < 127 ? c : ' ';
    if (retry_after > 0) r.headers.emplace_back("Retry-After", std::to_string(retry_after));
    return r;
}

// The handler's reply, its exceptions turned into replies: the server never stops on a request.
HttpReply guarded(const HttpServer::Handler& h, const HttpRequest& req) {
    try {
        return h(req);
    } catch (const HttpError& e) {
        return error_reply(e.status(), e.what(), e.field(), e.retry_after_s());
    } catch (const ParamError& e) {
        return error_reply(400, e.what(), e.field());
    } catch (const Cancelled& e) {
        return error_reply(503, std::string("cancelled: ") + e.what(), "");
    } catch (const std::exception& e) {
        return error_reply(500, e.what(), "");
    }
}

void send(const HttpReply& r, httplib::Response& res) {
    res.status = r.status;
    for (const auto& [k, v] : r.headers) res.set_header(k.c_str(), v);
    if (!r.note.empty()) { // printable ASCII only: request text must not end the header
        std::string note;
        for (char c : r.note.substr(0, 200)) note += c >= 32 && c < 127 ? c : ' ';
        res.set_header("X-Anchor-Note", note);
    }
    if (!r.stream) {
        res.set_content(r.body, r.content_type.c_str());
        return;
    }
    auto stream = r.stream;
    res.set_chunked_content_provider(r.content_type.c_str(), [stream](size_t, httplib::DataSink& sink) {
        stream([&sink](const std::string& s) { return sink.write(s.data(), s.size()); });
        sink.done();
        return true;
    });
}

HttpRequest to_request(const httplib::Request& r) {
    HttpRequest q;
    q.method = r.method;
    q.path = r.path;
    q.body = r.body;
    for (const auto& [k, v] : r.params) q.query[k] = v;
    const int local = r.local_port, remote = r.remote_port;
    q.client_gone = [local, remote] { return tcp_peer_closed(local, remote); };
    return q;
}

} // namespace

HttpServer::HttpServer(ServerOptions o) : impl_(std::make_unique<Impl>()), o_((o.validate(), o)), jobs_(o.queue) {
    auto& svr = impl_->svr;
    const int threads = o_.threads;
    svr.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    svr.set_payload_max_length(o_.max_body);
    // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, with which a second server on a port in use
    // would share it silently instead of failing.
    svr.set_socket_options([](socket_t sock) {
        int yes = 1;
        setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
    });
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
        t_request_start = std::chrono::steady_clock::now();
        if (draining_ && req.path != "/health") {
            send(error_reply(503, "the server is shutting down (draining): retry on another replica", ""), res);
            res.set_header("Connection", "close");
            return httplib::Server::HandlerResponse::Handled;
        }
        // cpp-httplib reads a POST's body until the connection closes when it has neither Content-Length nor
        // chunked encoding: the client waits for the reply, so both wait out the read timeout and the reply is 400.
        // Such a request has no body (RFC 9112 section 6.3): its handler runs now with an empty one.
        if (req.method == "POST" && !req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) {
            const auto it = impl_->posts.find(req.path);
            if (it == impl_->posts.end())
                send(error_reply(404, "no such endpoint: POST " + req.path, ""), res);
            else
                send(guarded(it->second, to_request(req)), res);
            return httplib::Server::HandlerResponse::Handled;
        }
        return httplib::Server::HandlerResponse::Unhandled;
    });
    svr.set_logger([](const httplib::Request& req, const httplib::Response& res) {
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_request_start).count();
        const std::string note = res.get_header_value("X-Anchor-Note");
        std::fprintf(stderr, "%s %s %s %d %.1fms%s%s\n", utc_now().c_str(), req.method.c_str(), req.path.c_str(),
                     res.status, ms, note.empty() ? "" : " ", note.c_str());
        std::fflush(stderr);
    });
    const size_t max_body = o_.max_body;
    svr.set_error_handler([max_body](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return;
        std::string msg, field;
        if (res.status == 404) {
            msg = "no such endpoint: " + req.method + " " + req.path;
        } else if (res.status == 413) {
            field = "body";
            msg = "body: larger than this server's limit of " + std::to_string(max_body) + " bytes";
        } else if (res.status == 400) {
            field = "body";
            msg = "body: the request could not be read (malformed HTTP, or fewer body bytes than its "
                  "Content-Length before the read timeout)";
        } else if (res.status == 405) {
            msg = "method " + req.method + " is not served on " + req.path;
        } else {
            msg = "HTTP " + std::to_string(res.status) + " on " + req.method + " " + req.path;
        }
        res.set_content(dump_reply(error_body(res.status, msg, field)), "application/json");
    });
    if (!o_.web_dir.empty() && !svr.set_mount_point("/", o_.web_dir))
        throw Error("serve: web folder '" + o_.web_dir + "' does not exist");
}

HttpServer::~HttpServer() {
    if (signal_watcher_.joinable()) {
        g_server_gone = true;
        on_drain_signal(0); // wakes the watcher, which ends
        signal_watcher_.join();
    }
    impl_->svr.stop();
    if (drainer_.joinable()) drainer_.join();
}

void HttpServer::get(const std::string& path, Handler h) {
    impl_->svr.Get(
        path, [h](const httplib::Request& req, httplib::Response& res) { send(guarded(h, to_request(req)), res); });
}

void HttpServer::add_health(const std::string& model) {
    get("/health", [this, model](const HttpRequest&) {
        const bool d = draining();
        return HttpReply::json({{"status", d ? "draining" : "ok"},
                                {"model", model},
                                {"queue", jobs_.pending()},
                                {"queue_capacity", jobs_.capacity()}},
                               d ? 503 : 200);
    });
}

void HttpServer::add_openapi(nlohmann::json spec) {
    const auto body = std::make_shared<const std::string>(spec.dump(1));
    get("/openapi.json", [body](const HttpRequest&) {
        HttpReply r;
        r.body = *body;
        return r;
    });
}

void HttpServer::post(const std::string& path, Handler h) {
    impl_->posts[path] = h;
    impl_->svr.Post(
        path, [h](const httplib::Request& req, httplib::Response& res) { send(guarded(h, to_request(req)), res); });
}

int HttpServer::bind() {
    if (impl_->port >= 0) return impl_->port;
    auto& svr = impl_->svr;
    const int port = o_.port == 0 ? svr.bind_to_any_port(o_.host) : (svr.bind_to_port(o_.host, o_.port) ? o_.port : -1);
    if (port < 0)
        throw Error("serve: cannot listen on " + o_.host + ":" + std::to_string(o_.port) +
                    " (in use, or not an address of this machine)");
    return impl_->port = port;
}

void HttpServer::serve() {
    const int port = bind();
    std::fprintf(stderr, "%s: listening on http://%s:%d (queue %d)\n",
                 o_.program.empty() ? "serve" : o_.program.c_str(), o_.host.c_str(), port, o_.queue);
    std::fflush(stderr);
    impl_->svr.listen_after_bind();
    if (drainer_.joinable()) drainer_.join();
}

void HttpServer::drain() {
    if (draining_.exchange(true)) return;
    jobs_.close();
    std::fprintf(stderr, "serve: draining: %d job(s) to finish, new requests get 503\n", jobs_.pending());
    std::fflush(stderr);
    drainer_ = std::thread([this] {
        if (!jobs_.wait_idle_for_ms(o_.drain_timeout_s * 1000)) {
            std::fprintf(stderr, "serve: the drain deadline (%d s) passed: cancelling the jobs in flight\n",
                         o_.drain_timeout_s);
            std::fflush(stderr);
            jobs_.cancel_all("the server is shutting down and its drain deadline (" +
                             std::to_string(o_.drain_timeout_s) + " s) passed");
            jobs_.wait_idle();
        }
        // The replies of the last jobs are written by their connection threads: give them a moment, then stop
        // (stop joins the connection threads, which finish the responses they are writing).
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        impl_->svr.stop();
    });
}

void HttpServer::drain_on_signals() {
    if (g_signal_pipe[0] < 0 && pipe(g_signal_pipe) != 0) throw Error("serve: cannot create the signal pipe");
    struct sigaction sa {};
    sa.sa_handler = on_drain_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN); // a client gone mid-write is an error return, not the end of the server
    signal_watcher_ = std::thread([this] {
        char c;
        while (read(g_signal_pipe[0], &c, 1) != 1) {
        }
        if (!g_server_gone) drain();
    });
}

nlohmann::json HttpServer::run_job(const HttpRequest& req, const std::function<nlohmann::json(JobControl&)>& work) {
    auto result = std::make_shared<nlohmann::json>();
    if (draining_) throw HttpError(503, "", "the server is shutting down (draining): retry on another replica");
    auto ticket = jobs_.submit([result, work](JobControl& c) { *result = work(c); });
    if (!ticket)
        throw HttpError(429, "",
                        "the request queue is full (" + std::to_string(jobs_.capacity()) +
                            " jobs waiting or running): retry later",
                        jobs_.retry_after_s());
    while (!ticket->wait_for_ms(250))
        if (req.client_gone && !ticket->control.cancelled() && req.client_gone())
            ticket->control.cancel("the client closed the connection");
    if (ticket->error) std::rethrow_exception(ticket->error);
    return std::move(*result);
}

namespace {

// Events from the job thread to the connection thread.
struct Channel {
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::string> items;
    bool closed = false;
    void push(std::string s) {
        {
            std::lock_guard<std::mutex> lk(m);
            items.push_back(std::move(s));
        }
        cv.notify_all();
    }
    void close() {
        {
            std::lock_guard<std::mutex> lk(m);
            closed = true;
        }
        cv.notify_all();
    }
};

} // namespace

HttpReply
HttpServer::stream_job(const HttpRequest&,
                       const std::function<void(JobControl&, const std::function<void(std::string)>&)>& work) {
    if (draining_) throw HttpError(503, "", "the server is shutting down (draining): retry on another replica");
    auto ch = std::make_shared<Channel>();
    auto ticket = jobs_.submit([ch, work](JobControl& c) {
        try {
            work(c, [ch](std::string s) { ch->push(std::move(s)); });
        } catch (const Cancelled&) {
            // the client is gone: nobody reads the rest
        } catch (const HttpError& e) {
            ch->push(sse_event(error_body(e.status(), e.what(), e.field())));
        } catch (const ParamError& e) {
            ch->push(sse_event(error_body(400, e.what(), e.field())));
        } catch (const std::exception& e) {
            ch->push(sse_event(error_body(500, e.what())));
        }
        ch->push(sse_done());
        ch->close();
    });
    if (!ticket)
        throw HttpError(429, "",
                        "the request queue is full (" + std::to_string(jobs_.capacity()) +
                            " jobs waiting or running): retry later",
                        jobs_.retry_after_s());
    HttpReply r;
    r.content_type = "text/event-stream";
    r.headers.emplace_back("Cache-Control", "no-cache");
    r.stream = [ch, ticket](const std::function<bool(const std::string&)>& write) {
        for (;;) {
            std::unique_lock<std::mutex> lk(ch->m);
            ch->cv.wait_for(lk, std::chrono::milliseconds(250), [&] { return !ch->items.empty() || ch->closed; });
            while (!ch->items.empty()) {
                std::string s = std::move(ch->items.front());
                ch->items.pop_front();
                lk.unlock();
                if (!write(s)) {
                    ticket->control.cancel("the client closed the connection");
                    ticket->wait_for_ms(60000);
                    return;
                }
                lk.lock();
            }
            if (ch->closed) return;
        }
    };
    return r;
}

} // namespace anchor::serve
