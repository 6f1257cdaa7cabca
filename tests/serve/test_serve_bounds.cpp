// Issue 56 on both servers, through real HTTP on loopback: every request bounded before work starts (a 5 MB prompt
// is refused in well under a second, 413 naming the field; too many CLIP tokens and too deep brackets are 400 naming
// it), POSTs without a body (A1111's own curl for /interrupt and /skip) answered at once, the 413/400 of the HTTP
// layer as JSON naming "body", /health answering while a job runs, a drain past its deadline cancelling the running
// job, and /openapi.json describing every endpoint.
#include "serve_process.h"

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <future>

using anchor::test::post_json;
using anchor::test::ServeProcess;
using nlohmann::json;

namespace {

std::string bin(const char* name) {
    return std::string(ANCHOR_BINARY_DIR) + "/" + name;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A raw HTTP exchange: `request` as bytes, the write side then shut (the client sends nothing more), the reply read
// until the server closes or `timeout_s` passes. What a client other than cpp-httplib's sends (curl -X POST without
// a body has no Content-Length).
std::string raw_http(int port, const std::string& request, int timeout_s = 10) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    timeval tv{timeout_s, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (size_t sent = 0; sent < request.size();) {
        const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += size_t(n);
    }
    std::string reply;
    char buf[4096];
    for (;;) {
        const ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        reply.append(buf, size_t(n));
        // One reply is enough: stop at the end of its body (Content-Length).
        const auto head_end = reply.find("\r\n\r\n");
        const auto cl = reply.find("Content-Length: ");
        if (head_end != std::string::npos && cl != std::string::npos && cl < head_end &&
            reply.size() >= head_end + 4 + std::stoul(reply.substr(cl + 16)))
            break;
    }
    close(fd);
    return reply;
}

int status_of(const std::string& reply) {
    return reply.size() > 12 ? std::stoi(reply.substr(9, 3)) : 0;
}

json body_of(const std::string& reply) {
    const auto at = reply.find("\r\n\r\n");
    return at == std::string::npos ? json() : json::parse(reply.substr(at + 4), nullptr, false);
}

void check_error(const json& body, int code, const std::string& field, const std::string& words) {
    INFO(body.dump());
    REQUIRE(body.is_object());
    CHECK(body["error"]["code"] == code);
    CHECK(body["error"]["param"] == field);
    const std::string m = body["error"]["message"].get<std::string>();
    CHECK(m.find(words) != std::string::npos);
    CHECK(m.find('\n') == std::string::npos);
}

json small_txt2img(int steps = 2) {
    return {{"prompt", "a shirt"}, {"steps", steps}, {"cfg_scale", 5}, {"sampler_name", "DDIM"}, {"seed", 1}};
}

ServeProcess& sd_server() {
    static ServeProcess s(bin("anchor-sd"), {"serve", "--port", "0", "--no-web", "--queue", "2"}, "sd_bounds");
    return s;
}

} // namespace

TEST_CASE("sd serve: a 5 MB prompt is refused in under a second, 413 naming the field", "[serve][bounds]") {
    auto& s = sd_server();
    auto c = s.client();
    for (const char* field : {"prompt", "negative_prompt"}) {
        auto body = small_txt2img();
        body[field] = std::string(5 << 20, 'a');
        const auto t0 = std::chrono::steady_clock::now();
        int st = 0;
        const json r = post_json(c, "/sdapi/v1/txt2img", body, &st);
        const double dt = seconds_since(t0);
        INFO(field << ": " << dt << " s");
        CHECK(dt < 1.0);
        CHECK(st == 413);
        check_error(r, 413, field, "65536");
    }
    // The same on the OpenAI endpoint and the compare.
    int st = 0;
    json r = post_json(c, "/v1/images/generations", {{"prompt", std::string(5 << 20, 'x')}}, &st);
    CHECK(st == 413);
    check_error(r, 413, "prompt", "bytes");
    r = post_json(c, "/anchor/v1/compare", {{"prompt", std::string(5 << 20, 'x')}, {"modes", "off"}}, &st);
    CHECK(st == 413);
    check_error(r, 413, "prompt", "bytes");
}

TEST_CASE("sd serve: too many CLIP tokens or brackets too deep are 400 naming the field, before any job",
          "[serve][bounds]") {
    auto& s = sd_server();
    auto c = s.client();
    std::string many;
    for (int i = 0; i < 2000; ++i) many += "red, ";
    auto body = small_txt2img();
    body["prompt"] = many;
    int st = 0;
    auto t0 = std::chrono::steady_clock::now();
    json r = post_json(c, "/sdapi/v1/txt2img", body, &st);
    CHECK(seconds_since(t0) < 1.0);
    CHECK(st == 400);
    check_error(r, 400, "prompt", "CLIP tokens");
    body = small_txt2img();
    body["negative_prompt"] = std::string(300, '(') + "a";
    r = post_json(c, "/sdapi/v1/txt2img", body, &st);
    CHECK(st == 400);
    check_error(r, 400, "negative_prompt", "nested");
    // One long word: the BPE of a 60 KB run of letters stays fast (the merge is O(n log n)).
    body = small_txt2img();
    body["prompt"] = std::string(60000, 'q');
    t0 = std::chrono::steady_clock::now();
    r = post_json(c, "/sdapi/v1/txt2img", body, &st);
    CHECK(seconds_since(t0) < 2.0);
    CHECK(st == 400);
    check_error(r, 400, "prompt", "CLIP tokens");
}

TEST_CASE("sd serve: POST without a body answers at once; the HTTP layer's 413 and 400 are JSON naming body",
          "[serve][bounds]") {
    auto& s = sd_server();
    for (const std::string path : {"/sdapi/v1/interrupt", "/sdapi/v1/skip"}) {
        const auto t0 = std::chrono::steady_clock::now();
        const std::string reply = raw_http(s.port(), "POST " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n");
        INFO(path << ":\n" << reply);
        CHECK(seconds_since(t0) < 1.0);
        CHECK(status_of(reply) == 200);
        CHECK(body_of(reply).is_object());
    }
    // A POST to no endpoint, without a body: 404 at once.
    std::string reply = raw_http(s.port(), "POST /sdapi/v1/nothing HTTP/1.1\r\nHost: localhost\r\n\r\n");
    CHECK(status_of(reply) == 404);
    // A body past the server's limit (64 MiB) is 413 naming body, without the server reading it.
    reply = raw_http(s.port(), "POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                               "application/json\r\nContent-Length: 100000000\r\n\r\n{");
    INFO(reply);
    CHECK(status_of(reply) == 413);
    check_error(body_of(reply), 413, "body", "limit");
}

TEST_CASE("sd serve: /openapi.json describes every endpoint", "[serve][bounds]") {
    auto& s = sd_server();
    auto c = s.client();
    auto r = c.Get("/openapi.json");
    REQUIRE(r);
    CHECK(r->status == 200);
    const json spec = json::parse(r->body);
    CHECK(spec["openapi"].get<std::string>().rfind("3.", 0) == 0);
    for (const char* p : {"/sdapi/v1/txt2img", "/sdapi/v1/img2img", "/v1/images/generations", "/anchor/v1/compare",
                          "/sdapi/v1/samplers", "/sdapi/v1/sd-models", "/sdapi/v1/embeddings", "/sdapi/v1/options",
                          "/sdapi/v1/progress", "/sdapi/v1/interrupt", "/sdapi/v1/skip", "/health", "/openapi.json"}) {
        INFO(p);
        CHECK(spec["paths"].contains(p));
    }
    CHECK(spec["paths"]["/sdapi/v1/txt2img"]["post"]["requestBody"]["content"]["application/json"]["schema"]
              ["properties"]["steps"]["maximum"] == 150);
}

TEST_CASE("sd serve: /health answers within a second while a job runs; a drain past its deadline cancels the job",
          "[serve][bounds]") {
    ServeProcess s(bin("anchor-sd"), {"serve", "--port", "0", "--no-web", "--drain-timeout", "1"}, "sd_drain_deadline");
    auto job = std::async(std::launch::async, [&] {
        auto c = s.client();
        int st = 0;
        auto body = small_txt2img(150);
        body["width"] = 64, body["height"] = 64;
        json r = post_json(c, "/sdapi/v1/txt2img", body, &st);
        return std::make_pair(st, r);
    });
    auto c = s.client();
    bool running = false;
    for (int i = 0; i < 400 && !running; ++i) {
        auto r = c.Get("/sdapi/v1/progress");
        running = r && json::parse(r->body)["state"]["sampling_step"].get<int>() > 0;
        if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    REQUIRE(running);
    double worst = 0;
    for (int i = 0; i < 5; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        auto h = c.Get("/health");
        worst = std::max(worst, seconds_since(t0));
        REQUIRE(h);
        CHECK(h->status == 200);
    }
    CHECK(worst < 1.0);
    const auto t0 = std::chrono::steady_clock::now();
    kill(s.pid(), SIGTERM);
    const auto done = job.get();
    INFO(done.second.dump());
    CHECK(done.first == 503);
    CHECK(done.second["error"]["message"].get<std::string>().find("drain deadline") != std::string::npos);
    CHECK(s.wait_exit(30) == 0);
    CHECK(seconds_since(t0) < 10.0);
    CHECK(s.log_has("the drain deadline (1 s) passed"));
}

TEST_CASE("text serve: a 5 MB prompt is refused in under a second; diffusion names a piece outside the vocabulary",
          "[serve][bounds]") {
    ServeProcess s(bin("anchor-text"), {"serve", "--port", "0"}, "text_bounds");
    auto c = s.client();
    const std::string huge(5 << 20, 'a');
    for (const char* path : {"/v1/completions", "/anchor/v1/diffusion"}) {
        const auto t0 = std::chrono::steady_clock::now();
        int st = 0;
        const json r = post_json(c, path, {{"prompt", huge}, {"max_tokens", 4}}, &st);
        INFO(path);
        CHECK(seconds_since(t0) < 1.0);
        CHECK(st == 413);
        check_error(r, 413, "prompt", "bytes");
    }
    int st = 0;
    json r = post_json(c, "/anchor/v1/diffusion", {{"prompt", "In the beginning \xe6\xbc\xa2"}, {"length", 32}}, &st);
    CHECK(st == 400);
    check_error(r, 400, "prompt", "text piece");
    r = post_json(c, "/anchor/v1/diffusion", {{"prompt", "In the beginning"}, {"length", 1000}}, &st);
    CHECK(st == 400);
    check_error(r, 400, "length", "max_seq_len");
    auto o = c.Get("/openapi.json");
    REQUIRE(o);
    const json spec = json::parse(o->body);
    for (const char* p : {"/v1/completions", "/v1/models", "/anchor/v1/diffusion", "/health", "/openapi.json"}) {
        INFO(p);
        CHECK(spec["paths"].contains(p));
    }
    // A body of the wrong type whose quoted value would be cut inside a UTF-8 sequence (found by the fuzz): 400.
    for (const char* path : {"/v1/completions", "/anchor/v1/diffusion"}) {
        auto w = c.Post(path, "[\"" + std::string(34, 'a') + "\xc3\xa9\xc3\xa9\xc3\xa9\"]", "application/json");
        REQUIRE(w);
        CHECK(w->status == 400);
        check_error(json::parse(w->body), 400, "body", "expected a JSON object");
    }
    const std::string reply = raw_http(s.port(), "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n\r\n");
    CHECK(status_of(reply) == 400);
    check_error(body_of(reply), 400, "body", "malformed JSON");
}
