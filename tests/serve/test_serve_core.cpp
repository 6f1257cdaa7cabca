// The model-agnostic server core (cache/serve/http_server.h) in process: request fields, error bodies, base64, the
// bounded job queue.
#include "cache/serve/http_server.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <thread>

using namespace anchor::serve;
using nlohmann::json;

namespace {

// The HttpError `f` throws: status, field and message.
template <class F> std::tuple<int, std::string, std::string> error_of(F&& f) {
    try {
        f();
    } catch (const HttpError& e) {
        return {e.status(), e.field(), e.what()};
    }
    return {0, "", ""};
}

} // namespace

TEST_CASE("serve core: request fields are read with their types and ranges", "[serve]") {
    const auto f = RequestFields::parse(R"({"steps": 20, "cfg": 7.5, "whole": 20.0, "name": "x", "on": true,
                                           "stop": ["a", "b"], "one": "c", "nothing": null})");
    CHECK(f.integer("steps", 1, 1, 150) == 20);
    CHECK(f.integer("whole", 1, 1, 150) == 20); // a client that writes every number as a float
    CHECK(f.integer("absent", 5, 1, 150) == 5);
    CHECK(f.integer("nothing", 5, 1, 150) == 5); // null = absent
    CHECK(f.number("cfg", 1, 0, 30) == 7.5);
    CHECK(f.string("name", "") == "x");
    CHECK(f.boolean("on", false));
    CHECK(f.strings("stop") == std::vector<std::string>{"a", "b"});
    CHECK(f.strings("one") == std::vector<std::string>{"c"});
    CHECK(f.strings("absent").empty());

    auto [s1, f1, m1] = error_of([&] { (void)f.integer("steps", 1, 1, 10); });
    CHECK(s1 == 400);
    CHECK(f1 == "steps");
    CHECK(m1 == "steps: must be in [1, 10], got 20");
    auto [s2, f2, m2] = error_of([&] { (void)f.integer("name", 1, 1, 10); });
    CHECK(m2 == "name: expected an integer, got a string \"x\"");
    auto [s3, f3, m3] = error_of([&] { (void)f.integer("cfg", 1, 1, 10); });
    CHECK(m3 == "cfg: expected an integer, got a number 7.5");
    auto [s4, f4, m4] = error_of([&] { (void)f.strings("steps"); });
    CHECK(m4 == "steps: expected a string or an array of strings, got an integer 20");
    auto [s5, f5, m5] = error_of([] { (void)RequestFields::parse("{\"a\": "); });
    CHECK(f5 == "body");
    CHECK(m5.find("malformed JSON at byte") != std::string::npos);
    auto [s6, f6, m6] = error_of([] { (void)RequestFields::parse("[1, 2]"); });
    CHECK(m6 == "body: expected a JSON object, got an array [1,2]");
    auto [s7, f7, m7] = error_of([] { (void)RequestFields::parse(R"({"stop": ["a", 3]})").strings("stop"); });
    CHECK(f7 == "stop[1]");
}

TEST_CASE("serve core: error bodies are one line in OpenAI's shape", "[serve]") {
    const json e = error_body(400, "cache: bad\n  off\n  freq", "cache");
    CHECK(e["error"]["message"] == "cache: bad; off; freq");
    CHECK(e["error"]["param"] == "cache");
    CHECK(e["error"]["type"] == "invalid_request_error");
    CHECK(e["error"]["code"] == 400);
    CHECK(error_body(429, "full")["error"]["type"] == "rate_limit_error");
    CHECK(error_body(500, "x")["error"]["param"].is_null());
}

TEST_CASE("serve core: base64 both ways, data URLs, bad characters", "[serve]") {
    for (const std::string& s :
         std::vector<std::string>{"f", "fo", "foo", "foob", "fooba", "foobar", std::string("\0\xff\x10", 3)})
        CHECK(base64_decode(base64_encode(s), "x") == s);
    CHECK(base64_encode("foobar") == "Zm9vYmFy");
    CHECK(base64_encode("fo") == "Zm8=");
    CHECK(base64_decode("data:image/png;base64,Zm9v", "x") == "foo");
    CHECK(base64_decode("Zm9v\nYmFy", "x") == "foobar");
    auto [s, f, m] = error_of([] { (void)base64_decode("Zm9v!", "init_images"); });
    CHECK(f == "init_images");
    CHECK(m == "init_images: not base64 (character 33 at offset 4)");
}

TEST_CASE("serve core: the job queue runs jobs one at a time in order, bounded, skipping cancelled ones", "[serve]") {
    JobQueue q(2);
    std::atomic<bool> release{false};
    std::atomic<int> running{0}, most{0};
    std::vector<int> order;
    std::mutex m;
    auto job = [&](int id) {
        return [&, id](JobControl&) {
            most = std::max(most.load(), ++running);
            while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            {
                std::lock_guard<std::mutex> lk(m);
                order.push_back(id);
            }
            --running;
        };
    };
    auto a = q.submit(job(1));
    auto b = q.submit(job(2));
    REQUIRE(a);
    REQUIRE(b);
    CHECK(q.submit(job(3)) == nullptr); // full: the caller answers 429
    CHECK(q.pending() == 2);
    CHECK(q.retry_after_s() >= 1);
    b->control.cancel("gone");
    release = true;
    CHECK(a->wait_for_ms(5000));
    CHECK(b->wait_for_ms(5000));
    CHECK(!a->error);
    REQUIRE(b->error); // skipped: it never ran
    CHECK(!b->started);
    CHECK_THROWS_AS(std::rethrow_exception(b->error), Cancelled);
    q.wait_idle();
    CHECK(order == std::vector<int>{1});
    CHECK(most == 1);
    auto c = q.submit([](JobControl& ctl) {
        ctl.set_progress({{"step", 3}});
        throw std::runtime_error("boom");
    });
    REQUIRE(c);
    CHECK(c->wait_for_ms(5000));
    REQUIRE(c->error);
    CHECK_THROWS_WITH(std::rethrow_exception(c->error), "boom");
    q.close();
    CHECK(q.submit(job(4)) == nullptr); // draining: refused
}
