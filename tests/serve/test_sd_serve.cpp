// `anchor-sd serve` on the embedded demo model (assets/models/fashion-sd, 32x32 images), through real HTTP on
// loopback: the A1111 and OpenAI endpoints, bad input, the queue bound, interrupt, a client that goes away,
// concurrent requests against the same requests one after another, and the SIGTERM drain.
#include "cache/serve/http_server.h"
#include "serve_process.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <tuple>

using anchor::test::post_json;
using anchor::test::ServeProcess;
using nlohmann::json;

namespace {

std::string sd_bin() {
    return std::string(ANCHOR_BINARY_DIR) + "/anchor-sd";
}

// Base64 decoding of our own (the server's encoder is not used to check itself).
std::string unbase64(const std::string& s) {
    std::string out;
    int val = 0, bits = -8;
    for (unsigned char c : s) {
        const char* tbl = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        const char* p = std::strchr(tbl, c);
        if (c == '=' || !p || !c) break;
        val = (val << 6) + int(p - tbl);
        bits += 6;
        if (bits >= 0) {
            out.push_back(char((val >> bits) & 0xFF));
            bits -= 8;
        }
    }
    return out;
}

bool is_png(const std::string& b) {
    return b.size() > 8 && b.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0;
}

// The image data of a PNG (its IDAT chunks): the pixels, without the text chunks, whose records carry timings.
std::string idat(const std::string& png) {
    std::string out;
    for (size_t i = 8; i + 8 <= png.size();) {
        const uint32_t n = uint32_t(uint8_t(png[i])) << 24 | uint32_t(uint8_t(png[i + 1])) << 16 |
                           uint32_t(uint8_t(png[i + 2])) << 8 | uint8_t(png[i + 3]);
        if (png.compare(i + 4, 4, "IDAT") == 0) out += png.substr(i + 8, n);
        i += 12 + n;
    }
    return out;
}

std::vector<std::string> pixels(const json& reply) {
    std::vector<std::string> out;
    for (const auto& im : reply["images"]) out.push_back(idat(unbase64(im)));
    return out;
}

// The per-step decisions of a record, without the wall times.
json decisions(const json& reply) {
    json steps = json::parse(reply["info"].get<std::string>())["anchorcache"][0]["cache"]["steps"];
    for (auto& st : steps) st.erase("ms");
    return steps;
}

json txt2img(int seed, const std::string& cache, int steps = 4) {
    return {{"prompt", "a shirt"},    {"negative_prompt", ""}, {"steps", steps}, {"cfg_scale", 5},
            {"sampler_name", "DDIM"}, {"seed", seed},          {"cache", cache}};
}

// A job of several seconds here (64x64, 150 steps: ~50 ms a step on one core).
json long_txt2img(int seed) {
    auto j = txt2img(seed, "off", 150);
    j["width"] = 64;
    j["height"] = 64;
    return j;
}

ServeProcess& shared_server() {
    static ServeProcess s(sd_bin(), {"serve", "--port", "0", "--queue", "4"}, "sd_serve");
    return s;
}

void check_400(const json& body, int status, const std::string& field, const std::string& words) {
    INFO(body.dump());
    CHECK(status == 400);
    CHECK(body["error"]["param"] == field);
    CHECK(body["error"]["message"].get<std::string>().find(words) != std::string::npos);
    CHECK(body["error"]["message"].get<std::string>().find('\n') == std::string::npos);
}

} // namespace

TEST_CASE("sd serve: txt2img answers base64 PNGs with A1111 parameters and info", "[serve]") {
    auto c = shared_server().client();
    int status = 0;
    auto body = txt2img(7, "deepcache:2");
    body["batch_size"] = 2;
    const json r = post_json(c, "/sdapi/v1/txt2img", body, &status);
    REQUIRE(status == 200);
    REQUIRE(r["images"].size() == 2);
    const std::string png = unbase64(r["images"][0]);
    REQUIRE(is_png(png));
    CHECK(png.find(std::string("parameters\0", 11)) != std::string::npos);
    CHECK(png.find("Steps: 4") != std::string::npos);
    CHECK(png.find("Seed: 7") != std::string::npos);
    const json info = json::parse(r["info"].get<std::string>());
    CHECK(info["seed"] == 7);
    CHECK(info["sampler_name"] == "DDIM");
    CHECK(info["width"] == 32);
    CHECK(info["infotexts"].size() == 2);
    CHECK(info["anchorcache"][0]["cache"]["kind"] == "deepcache");
    CHECK(info["anchorcache"][0]["unet_full_steps"] == 2);
    CHECK(r["parameters"]["prompt"] == "a shirt");
    CHECK(r["images"][0] != r["images"][1]);
    CHECK(shared_server().log_has("POST /sdapi/v1/txt2img 200"));
    CHECK(shared_server().log_has("cache=deepcache:2"));
}

TEST_CASE("sd serve: sampler_name takes A1111's, ours and stable-diffusion.cpp's names", "[serve][schedulers]") {
    auto c = shared_server().client();
    const std::vector<std::pair<std::string, std::string>> names = {
        {"DPM2 a", "DPM2 a"}, {"Heun", "Heun"}, {"dpm++2m", "DPM++ 2M"}, {"lcm", "LCM"}, {"DDPM", "DDPM"}};
    for (const auto& [given, a1111] : names) {
        INFO(given);
        int status = 0;
        auto body = txt2img(3, "off", 3);
        body["sampler_name"] = given;
        const json r = post_json(c, "/sdapi/v1/txt2img", body, &status);
        REQUIRE(status == 200);
        CHECK(json::parse(r["info"].get<std::string>())["sampler_name"] == a1111);
    }
}

TEST_CASE("sd serve: the same request gives the same image, concurrent or one after another", "[serve]") {
    auto c = shared_server().client();
    int s1 = 0, s2 = 0;
    const json a = post_json(c, "/sdapi/v1/txt2img", txt2img(11, "freq"), &s1);
    const json b = post_json(c, "/sdapi/v1/txt2img", txt2img(12, "deepcache:3"), &s2);
    REQUIRE(s1 == 200);
    REQUIRE(s2 == 200);
    // Both at once (and a third, uncached), each on its own connection.
    auto run = [](int seed, std::string cache) {
        auto cl = shared_server().client();
        int st = 0;
        json r = post_json(cl, "/sdapi/v1/txt2img", txt2img(seed, cache), &st);
        return std::make_pair(st, r);
    };
    auto fa = std::async(std::launch::async, run, 11, "freq");
    auto fb = std::async(std::launch::async, run, 12, "deepcache:3");
    auto fc = std::async(std::launch::async, run, 11, "off");
    const auto ra = fa.get(), rb = fb.get(), rc = fc.get();
    REQUIRE(ra.first == 200);
    REQUIRE(rb.first == 200);
    REQUIRE(rc.first == 200);
    CHECK(pixels(ra.second) == pixels(a));
    CHECK(pixels(rb.second) == pixels(b));
    // The per-request cache decisions and store statistics match too (no state carried between requests).
    CHECK(decisions(ra.second) == decisions(a));
    CHECK(decisions(rb.second) == decisions(b));
    const json ia = json::parse(a["info"].get<std::string>()), ja = json::parse(ra.second["info"].get<std::string>());
    CHECK(ia["anchorcache"][0]["cache"]["store"] == ja["anchorcache"][0]["cache"]["store"]);
}

TEST_CASE("sd serve: bad input is a one-line 400 naming the field", "[serve]") {
    auto c = shared_server().client();
    int status = 0;
    auto r = c.Post("/sdapi/v1/txt2img", "{\"prompt\": \"x\", ", "application/json");
    REQUIRE(r);
    check_400(json::parse(r->body), r->status, "body", "malformed JSON");
    r = c.Post("/sdapi/v1/txt2img", "[1, 2]", "application/json");
    REQUIRE(r);
    check_400(json::parse(r->body), r->status, "body", "expected a JSON object");

    auto bad = [&](const char* field, const json& value, const std::string& words) {
        auto body = txt2img(1, "off");
        body[field] = value;
        const json e = post_json(c, "/sdapi/v1/txt2img", body, &status);
        check_400(e, status, field, words);
    };
    bad("steps", "ten", "expected an integer, got a string \"ten\"");
    bad("steps", 100000, "must be in [1, 150], got 100000");
    bad("steps", 2.5, "expected an integer");
    bad("cfg_scale", "high", "expected a number");
    bad("sampler_name", "Heun2", "unknown sampler 'Heun2'");
    bad("cache", "deepcache:x", "cache");
    bad("width", 100000, "must be in");
    {
        auto body = txt2img(1, "off");
        body["width"] = 4096;
        body["height"] = 4096;
        check_400(post_json(c, "/sdapi/v1/txt2img", body, &status), status, "width", "width x height must be <=");
    }
    bad("batch_size", 100, "must be in [1, 8]");
    bad("prompt", 5, "expected a string");
    bad("width", 30, "multiples of 4");
    {
        auto body = txt2img(1, "off");
        body["batch_size"] = 4;
        body["n_iter"] = 4;
        check_400(post_json(c, "/sdapi/v1/txt2img", body, &status), status, "batch_size", "batch_size x n_iter");
    }
    // img2img without its image, and with one that is not base64
    check_400(post_json(c, "/sdapi/v1/img2img", txt2img(1, "off"), &status), status, "init_images", "got none");
    auto body = txt2img(1, "off");
    body["init_images"] = {"!!!"};
    check_400(post_json(c, "/sdapi/v1/img2img", body, &status), status, "init_images", "not base64");
    const json e = post_json(c, "/anchor/v1/compare", {{"modes", {"off", "bogus"}}}, &status);
    check_400(e, status, "modes", "modes[1]");
    const json ee = post_json(c, "/v1/images/generations", {{"prompt", "x"}, {"size", "big"}}, &status);
    check_400(ee, status, "size", "WIDTHxHEIGHT");
    // The server is still there.
    auto h = c.Get("/health");
    REQUIRE(h);
    CHECK(h->status == 200);
}

TEST_CASE("sd serve: vae_tiling decodes in tiles; bad tile values are a 400 naming the field", "[serve][vae_tiling]") {
    auto c = shared_server().client();
    int status = 0;
    // 64x64 is 16x16 latents on this model (VAE factor 4): tiles of 32 px (8 latents) make a 3x3 grid.
    auto body = txt2img(3, "off", 2);
    body["width"] = 64;
    body["height"] = 64;
    body["vae_tiling"] = true;
    body["vae_tile_size"] = 32;
    const json r = post_json(c, "/sdapi/v1/txt2img", body, &status);
    INFO(r.dump().substr(0, 400));
    REQUIRE(status == 200);
    CHECK(is_png(unbase64(r["images"][0])));
    auto bad = [&](const char* field, const json& value, const std::string& words) {
        auto b = txt2img(1, "off", 1);
        b[field] = value;
        const json e = post_json(c, "/sdapi/v1/txt2img", b, &status); // before `status` is read
        check_400(e, status, field, words);
    };
    bad("vae_tile_size", 30, "multiple of 4");
    bad("vae_tile_overlap", 1, "[0, 1)");
    bad("vae_tiling", "yes", "expected a boolean");
}

TEST_CASE("sd serve: img2img from a PNG of the server's own", "[serve]") {
    auto c = shared_server().client();
    int status = 0;
    const json t = post_json(c, "/sdapi/v1/txt2img", txt2img(3, "off"), &status);
    REQUIRE(status == 200);
    auto body = txt2img(3, "off", 8);
    body["init_images"] = {"data:image/png;base64," + t["images"][0].get<std::string>()};
    body["denoising_strength"] = 0.5;
    const json r = post_json(c, "/sdapi/v1/img2img", body, &status);
    REQUIRE(status == 200);
    const json info = json::parse(r["info"].get<std::string>());
    CHECK(info["anchorcache"][0]["mode"] == "img2img");
    CHECK(info["anchorcache"][0]["unet_steps"] == 4); // half of 8 steps
    CHECK(info["denoising_strength"] == 0.5);
    CHECK(is_png(unbase64(r["images"][0])));

    // init_images is a list: one per image of the batch (diffusers' image=[...]), each image's record naming its own.
    const json t2 = post_json(c, "/sdapi/v1/txt2img", txt2img(4, "off"), &status);
    REQUIRE(status == 200);
    body["init_images"] = {t["images"][0], t2["images"][0]};
    body["batch_size"] = 2;
    const json r2 = post_json(c, "/sdapi/v1/img2img", body, &status);
    REQUIRE(status == 200);
    REQUIRE(r2["images"].size() == 2);
    const json info2 = json::parse(r2["info"].get<std::string>());
    CHECK(info2["anchorcache"][0]["init_image"]["sha256"] != info2["anchorcache"][1]["init_image"]["sha256"]);
    // A count that does not divide the batch is a 400 naming the field.
    body["init_images"] = {t["images"][0], t2["images"][0], t["images"][0]};
    const json bad = post_json(c, "/sdapi/v1/img2img", body, &status);
    CHECK(status == 400);
    CHECK_THAT(bad.dump(), Catch::Contains("init_images") && Catch::Contains("3 init images"));
}

TEST_CASE("sd serve: OpenAI images, compare, and the listing endpoints", "[serve]") {
    auto c = shared_server().client();
    int status = 0;
    const json g = post_json(c, "/v1/images/generations",
                             {{"prompt", "a shoe"}, {"n", 2}, {"size", "32x32"}, {"steps", 3}, {"seed", 5}}, &status);
    REQUIRE(status == 200);
    REQUIRE(g["data"].size() == 2);
    CHECK(is_png(unbase64(g["data"][0]["b64_json"])));
    CHECK(g["created"].is_number());

    const json cmp = post_json(c, "/anchor/v1/compare",
                               {{"prompt", "a bag"},
                                {"steps", 8},
                                {"seed", 9},
                                {"sampler_name", "DDIM"},
                                {"modes", {"off", "deepcache:2", "freq"}}},
                               &status);
    REQUIRE(status == 200);
    REQUIRE(cmp["modes"].size() == 3);
    CHECK(cmp["reference_mode"] == "off");
    // The first mode against itself: no finite PSNR, a JSON null (not the string "inf") and the flag.
    CHECK(cmp["modes"][0]["psnr_vs_first_db"].is_null());
    CHECK(cmp["modes"][0]["identical_to_first"] == true);
    CHECK(cmp["modes"][1]["psnr_vs_first_db"].is_number());
    CHECK(cmp["modes"][1]["full_steps"] == 4);
    CHECK(cmp["modes"][1]["total_steps"] == 8);
    for (const auto& m : cmp["modes"]) {
        CHECK(is_png(unbase64(m["image"])));
        CHECK(m["wall_s"].is_number());
        CHECK(m["speedup_vs_first"].is_number());
        CHECK(m["ssim_vs_first"].is_number());
        CHECK(m["steps"].size() == 8);
        CHECK(m["steps"][1].contains("energy_change"));
    }

    auto get = [&](const char* path) {
        auto r = c.Get(path);
        REQUIRE(r);
        CHECK(r->status == 200);
        return json::parse(r->body);
    };
    const json samplers = get("/sdapi/v1/samplers");
    bool has_ddim = false;
    for (const auto& s : samplers) has_ddim |= s["name"] == "DDIM";
    CHECK(has_ddim);
    CHECK(get("/sdapi/v1/sd-models")[0]["model_name"] == "fashion-sd");
    CHECK(get("/sdapi/v1/options")["sd_model_checkpoint"] == "fashion-sd");
    CHECK(get("/sdapi/v1/progress").contains("progress"));
    CHECK(get("/health")["status"] == "ok");
    auto nf = c.Get("/sdapi/v1/nothing");
    REQUIRE(nf);
    CHECK(nf->status == 404);
    CHECK(json::parse(nf->body)["error"]["message"] == "no such endpoint: GET /sdapi/v1/nothing");
}

TEST_CASE("sd serve: a full queue is 429 with Retry-After, interrupt and a client gone stop their jobs", "[serve]") {
    ServeProcess s(sd_bin(), {"serve", "--port", "0", "--queue", "1", "--no-web"}, "sd_serve_queue");
    auto wait_running = [&] {
        auto c = s.client();
        for (int i = 0; i < 400; ++i) {
            auto r = c.Get("/sdapi/v1/progress");
            if (r && json::parse(r->body)["state"]["sampling_step"].get<int>() > 0) return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(25));
        }
        return false;
    };
    auto long_job = std::async(std::launch::async, [&] {
        auto c = s.client();
        int st = 0;
        json r = post_json(c, "/sdapi/v1/txt2img", long_txt2img(1), &st);
        return std::make_pair(st, r);
    });
    REQUIRE(wait_running());
    auto c = s.client();
    auto r = c.Post("/sdapi/v1/txt2img", txt2img(2, "off").dump(), "application/json");
    REQUIRE(r);
    CHECK(r->status == 429);
    CHECK(r->has_header("Retry-After"));
    CHECK(std::stoi(r->get_header_value("Retry-After")) >= 1);
    CHECK(json::parse(r->body)["error"]["message"].get<std::string>().find("queue is full") != std::string::npos);

    auto ir = c.Post("/sdapi/v1/interrupt", "", "application/json");
    REQUIRE(ir);
    CHECK(json::parse(ir->body)["interrupted"] == true);
    const auto done = long_job.get();
    CHECK(done.first == 503);
    CHECK(done.second["error"]["message"].get<std::string>().find("interrupted") != std::string::npos);

    // A client that gives up: its job stops at a following step and the queue is free again.
    {
        httplib::Client impatient("127.0.0.1", s.port());
        impatient.set_read_timeout(1, 0);
        auto gone = impatient.Post("/sdapi/v1/txt2img", long_txt2img(3).dump(), "application/json");
        CHECK(!gone);
    }
    bool freed = false;
    for (int i = 0; i < 100 && !freed; ++i) {
        auto h = c.Get("/health");
        freed = h && json::parse(h->body)["queue"] == 0;
        if (!freed) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    CHECK(freed);
    CHECK(s.log_has("the client closed the connection"));
    int st = 0;
    CHECK(post_json(c, "/sdapi/v1/txt2img", txt2img(4, "off"), &st)["images"].size() == 1);
    CHECK(st == 200);
}

TEST_CASE("sd serve: SIGTERM finishes the job in flight, refuses new ones and exits 0", "[serve]") {
    ServeProcess s(sd_bin(), {"serve", "--port", "0", "--no-web"}, "sd_serve_drain");
    auto job = std::async(std::launch::async, [&] {
        auto c = s.client();
        int st = 0;
        json r = post_json(c, "/sdapi/v1/txt2img", txt2img(1, "off", 150), &st);
        return std::make_pair(st, r);
    });
    auto c = s.client();
    for (int i = 0; i < 400; ++i) {
        auto r = c.Get("/sdapi/v1/progress");
        if (r && json::parse(r->body)["state"]["sampling_step"].get<int>() > 0) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    kill(s.pid(), SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto refused = c.Post("/sdapi/v1/txt2img", txt2img(2, "off").dump(), "application/json");
    CHECK((!refused || refused->status == 503));
    const auto done = job.get();
    CHECK(done.first == 200);
    CHECK(done.second["images"].size() == 1);
    CHECK(s.wait_exit(30) == 0);
    CHECK(s.log_has("draining"));
}

TEST_CASE("sd serve: every cache key out of its range is a one-line 400 naming the field", "[serve][cache]") {
    auto c = shared_server().client();
    int status = 0;
    // The server publishes its key tables (unet/cache/cache_config.h): the sweep covers every key it has.
    auto opts = c.Get("/sdapi/v1/options");
    REQUIRE(opts);
    const json keys = json::parse(opts->body)["anchor_cache_keys"];
    REQUIRE(keys.size() >= 20);
    for (const auto& k : keys) {
        const std::string mode = k["mode"], key = k["key"];
        if (key == "profile") continue; // a file: a missing one is its own error
        for (const std::string v : {"-1e9", "x", "999999999999"}) {
            if (v == "999999999999" && k["values"].get<std::string>().rfind("an integer", 0) != 0) continue;
            const std::string cache = mode == "freq" ? "freq:" + key + "=" + v
                                      : key == "interval" ? "deepcache:" + v
                                                          : "deepcache:3," + key + "=" + v;
            INFO(cache);
            const json e = post_json(c, "/sdapi/v1/txt2img", txt2img(1, cache), &status); // status set before the check
            check_400(e, status, "cache", key);
        }
    }
    // A branch past this model's skip connections, a key given twice, lists with an empty mode.
    check_400(post_json(c, "/sdapi/v1/txt2img", txt2img(1, "deepcache:3,branch=99"), &status), status, "cache",
              "branch");
    check_400(post_json(c, "/sdapi/v1/txt2img", txt2img(1, "freq:thr=1,thr=2"), &status), status, "cache",
              "given twice");
    check_400(post_json(c, "/anchor/v1/compare", {{"prompt", "x"}, {"modes", "off,,freq"}}, &status), status, "modes",
              "empty cache mode");
    check_400(post_json(c, "/anchor/v1/compare", {{"prompt", "x"}, {"modes", ""}}, &status), status, "modes",
              "at least one cache mode");
    CHECK(c.Get("/health")->status == 200);
}

TEST_CASE("sd serve: /sdapi/v1/progress shows the running job's preview as current_image", "[serve][taesd]") {
    ServeProcess s(sd_bin(), {"serve", "--port", "0", "--no-web", "--preview", "2"}, "sd_serve_preview");
    auto c = s.client();
    // Before any job: no image. A request for TAESD where the server has none: a 400 naming the field.
    CHECK(json::parse(c.Get("/sdapi/v1/progress")->body)["current_image"].is_null());
    int status = 0;
    auto bad = txt2img(1, "off", 2);
    bad["vae_decoder"] = "taesd";
    json reply = post_json(c, "/sdapi/v1/txt2img", bad, &status);
    check_400(reply, status, "vae_decoder", "no TAESD");
    bad["vae_decoder"] = "tiny";
    reply = post_json(c, "/sdapi/v1/txt2img", bad, &status);
    check_400(reply, status, "vae_decoder", "expected full, taesd");

    auto job = std::async(std::launch::async, [&] {
        auto jc = s.client();
        int st = 0;
        json r = post_json(jc, "/sdapi/v1/txt2img", long_txt2img(9), &st);
        return st;
    });
    std::string image;
    for (int i = 0; i < 800 && image.empty(); ++i) {
        auto r = c.Get("/sdapi/v1/progress");
        if (r) {
            const auto pj = json::parse(r->body);
            if (pj["current_image"].is_string()) image = pj["current_image"].get<std::string>();
        }
        if (image.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    c.Post("/sdapi/v1/interrupt", "", "application/json");
    CHECK(job.get() == 503);
    REQUIRE(!image.empty());
    CHECK(is_png(unbase64(image)));
    // The job is over: its preview is gone with it (the next job starts without one).
    CHECK(json::parse(c.Get("/sdapi/v1/progress")->body)["current_image"].is_null());
}

TEST_CASE("sd serve --embedding-dir: /sdapi/v1/embeddings lists them, txt2img writes TI hashes, a misfit is 400",
          "[serve][embeddings]") {
    const std::string ti = "tests/golden/sd/anchorcache_cases/textual_inversion_sd15/embeddings";
    ServeProcess s(sd_bin(), {"serve", "--port", "0", "-m", "assets/models/sd15-tiny-random", "--embedding-dir", ti},
                   "sd_serve_ti");
    auto c = s.client();
    auto listing = c.Get("/sdapi/v1/embeddings");
    REQUIRE(listing);
    REQUIRE(listing->status == 200);
    const json l = json::parse(listing->body);
    CHECK(l["loaded"]["EasyNegative"]["vectors"] == 2);
    CHECK(l["loaded"]["EasyNegative"]["shape"] == 32);
    CHECK(l["loaded"]["bad_hands"]["vectors"] == 3);
    CHECK(l["skipped"].empty());
    int status = 0;
    json body = {{"prompt", "a (watercolor:1.2) house"}, {"negative_prompt", "EasyNegative"}, {"steps", 2},
                 {"width", 16}, {"height", 16}, {"seed", 5}};
    const json r = post_json(c, "/sdapi/v1/txt2img", body, &status);
    REQUIRE(status == 200);
    const std::string infotext = json::parse(r["info"].get<std::string>())["infotexts"][0];
    CHECK(infotext.find("TI hashes: \"watercolor: ") != std::string::npos);
    CHECK(infotext.find(", EasyNegative: ") != std::string::npos);
    // An SDXL embedding in a folder of its own is refused only when a prompt names it: not on an SD 1.x model.
    const std::string xl = "tests/golden/sd/anchorcache_cases/textual_inversion_sdxl/embeddings";
    ServeProcess sx(sd_bin(), {"serve", "--port", "0", "-m", "assets/models/sd15-tiny-random", "--embedding-dir", xl},
                    "sd_serve_ti_xl");
    auto cx = sx.client();
    body["negative_prompt"] = "xl_negative";
    const json bad = post_json(cx, "/sdapi/v1/txt2img", body, &status);
    check_400(bad, status, "negative_prompt", "expected [2, 32], the file has clip_l [2, 16], clip_g [2, 32]");
    body["negative_prompt"] = "";
    post_json(cx, "/sdapi/v1/txt2img", body, &status);
    CHECK(status == 200);
}

namespace {
std::string cn_base64(const std::string& bytes) {
    static const char* tbl = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    size_t i = 0;
    for (; i + 2 < bytes.size(); i += 3) {
        const uint32_t v = uint32_t(uint8_t(bytes[i])) << 16 | uint32_t(uint8_t(bytes[i + 1])) << 8 | uint8_t(bytes[i + 2]);
        for (int k = 3; k >= 0; --k) out += tbl[(v >> (6 * k)) & 63];
    }
    if (i < bytes.size()) {
        uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
        if (i + 1 < bytes.size()) v |= uint32_t(uint8_t(bytes[i + 1])) << 8;
        out += tbl[(v >> 18) & 63];
        out += tbl[(v >> 12) & 63];
        out += i + 1 < bytes.size() ? tbl[(v >> 6) & 63] : '=';
        out += '=';
    }
    return out;
}
} // namespace

TEST_CASE("sd serve --control-net-dir: alwayson_scripts.controlnet units run and are written as the extension "
          "writes them; a bad unit is 422 naming its field",
          "[serve][controlnet]") {
    const std::string dir = "../shared/golden/sd/controlnet_tiny"; // its ControlNet fits the tiny SD 1.x UNet
    if (!std::filesystem::exists(dir + "/controlnet/config.json")) {
        WARN("no " << dir << ": skipped");
        return;
    }
    std::ifstream png(dir + "/control_image.png", std::ios::binary);
    const std::string image = cn_base64({std::istreambuf_iterator<char>(png), std::istreambuf_iterator<char>()});
    // A folder of ControlNets: the golden one, linked under the name a client sends.
    const auto nets = std::filesystem::temp_directory_path() / ("anchor_cn_dir_" + std::to_string(::getpid()));
    std::filesystem::remove_all(nets);
    std::filesystem::create_directories(nets);
    std::filesystem::create_directory_symlink(std::filesystem::absolute(dir + "/controlnet"), nets / "controlnet");
    ServeProcess s(sd_bin(),
                   {"serve", "--port", "0", "-m", "assets/models/sd15-tiny-random", "--control-net-dir", nets.string()},
                   "sd_serve_controlnet");
    auto c = s.client();
    auto list = c.Get("/controlnet/model_list");
    REQUIRE(list);
    CHECK(json::parse(list->body)["model_list"] == json::array({"controlnet"}));
    json unit = {{"enabled", true},        {"module", "none"},     {"model", "controlnet"}, {"weight", 0.8},
                 {"image", image},         {"guidance_start", 0.0}, {"guidance_end", 0.5}, {"control_mode", 0},
                 {"processor_res", 512}};
    json body = {{"prompt", "a cat"}, {"steps", 2}, {"width", 16}, {"height", 16}, {"seed", 3}, {"cfg_scale", 5}};
    int status = 0;
    const json plain = post_json(c, "/sdapi/v1/txt2img", body, &status);
    REQUIRE(status == 200);
    body["alwayson_scripts"] = {{"controlnet", {{"args", json::array({unit})}}}};
    const json with = post_json(c, "/sdapi/v1/txt2img", body, &status);
    INFO(with.dump().substr(0, 400));
    REQUIRE(status == 200);
    CHECK(pixels(with) != pixels(plain));
    const std::string infotext = json::parse(with["info"].get<std::string>())["infotexts"][0];
    CHECK(infotext.find("ControlNet 0: \"Module: none, Model: controlnet, Weight: 0.8, Resize Mode: Just Resize, "
                        "Low Vram: False, Guidance Start: 0, Guidance End: 0.5, Pixel Perfect: False, Control Mode: "
                        "Balanced\"") != std::string::npos);
    // {"image": ..., "mask": null} reads the same; a disabled unit is no unit.
    auto nested = body;
    nested["alwayson_scripts"]["controlnet"]["args"][0]["image"] = {{"image", image}, {"mask", nullptr}};
    CHECK(pixels(post_json(c, "/sdapi/v1/txt2img", nested, &status)) == pixels(with));
    auto canny = body; // the extension's canny annotator on the image (thresholds 100 / 200 by default)
    canny["alwayson_scripts"]["controlnet"]["args"][0]["module"] = "canny";
    CHECK(post_json(c, "/sdapi/v1/txt2img", canny, &status)["images"].size() == 1);
    CHECK(status == 200);
    auto off = body;
    off["alwayson_scripts"]["controlnet"]["args"][0]["enabled"] = false;
    CHECK(pixels(post_json(c, "/sdapi/v1/txt2img", off, &status)) == pixels(plain));

    const std::string f = "alwayson_scripts.controlnet.args[0].";
    for (const auto& [key, value, field, words] :
         std::vector<std::tuple<std::string, json, std::string, std::string>>{
             {"weight", 5, "weight", "must be in [0, 2], got 5"},
             {"model", "nope [12345678]", "model", "'nope [12345678]' is not in --control-net-dir (controlnet)"},
             {"model", "vae", "model", "'vae' is not in --control-net-dir"},
             {"control_mode", 1, "control_mode", "is not run by this server"},
             {"module", "depth_midas", "module", "'depth_midas' is not run by this server (none or canny)"},
             {"threshold_a", 300, "threshold_a", "must be <= threshold_b"},
             {"image", "", "image", "expected the control image"},
             {"guidance_start", 0.6, "guidance_start", "must be below guidance_end"}}) {
        auto bad = body;
        bad["alwayson_scripts"]["controlnet"]["args"][0][key] = value;
        if (key == "threshold_a") bad["alwayson_scripts"]["controlnet"]["args"][0]["module"] = "canny";
        const json r = post_json(c, "/sdapi/v1/txt2img", bad, &status);
        INFO(r.dump());
        CHECK(status == 422);
        CHECK(r["error"]["param"] == f + field);
        CHECK(r["error"]["message"].get<std::string>().find(words) != std::string::npos);
    }
    std::filesystem::remove_all(nets);
}

TEST_CASE("sd serve: img2img and inpaint with alwayson_scripts.controlnet units; a unit without an image takes the "
          "init image; a control image of another size is resized",
          "[serve][controlnet][img2img]") {
    // The tiny ControlNet of tests/golden/sd/controlnet_img2img_tiny (it fits the tiny SD 1.x UNet) and its images.
    const std::string dir = "tests/golden/sd/controlnet_img2img_tiny";
    auto b64_file = [](const std::string& path) {
        std::ifstream in(path, std::ios::binary);
        REQUIRE(in);
        return cn_base64({std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()});
    };
    const auto nets = std::filesystem::temp_directory_path() / ("anchor_cn_i2i_dir_" + std::to_string(::getpid()));
    std::filesystem::remove_all(nets);
    std::filesystem::create_directories(nets);
    std::filesystem::create_directory_symlink(std::filesystem::absolute(dir + "/controlnet"), nets / "tiny_cn");
    ServeProcess s(sd_bin(),
                   {"serve", "--port", "0", "-m", "assets/models/sd15-tiny-random", "--control-net-dir", nets.string()},
                   "sd_serve_controlnet_img2img");
    auto c = s.client();
    const std::string init = b64_file(dir + "/init_16x16.png");
    json unit = {{"enabled", true},
                 {"module", "none"},
                 {"model", "tiny_cn"},
                 {"weight", 1.5},
                 {"image", b64_file(dir + "/control_16x16.png")}};
    json body = {{"prompt", "a cat"},
                 {"steps", 4},
                 {"seed", 5},
                 {"cfg_scale", 5},
                 {"init_images", {init}},
                 {"denoising_strength", 0.75},
                 {"sampler_name", "DDIM"}};
    int status = 0;
    const json plain = post_json(c, "/sdapi/v1/img2img", body, &status);
    REQUIRE(status == 200);
    body["alwayson_scripts"] = {{"controlnet", {{"args", json::array({unit})}}}};
    const json with = post_json(c, "/sdapi/v1/img2img", body, &status);
    INFO(with.dump().substr(0, 400));
    REQUIRE(status == 200);
    CHECK(pixels(with) != pixels(plain));
    const json info = json::parse(with["info"].get<std::string>());
    CHECK(info["anchorcache"][0]["mode"] == "img2img");
    CHECK(info["infotexts"][0].get<std::string>().find("ControlNet 0: \"Module: none, Model: tiny_cn, Weight: 1.5") !=
          std::string::npos);
    // No image in the unit: the init image is the control image (sd-webui-controlnet's img2img fallback).
    auto fallback = body, explicit_init = body;
    fallback["alwayson_scripts"]["controlnet"]["args"][0].erase("image");
    explicit_init["alwayson_scripts"]["controlnet"]["args"][0]["image"] = init;
    const json a = post_json(c, "/sdapi/v1/img2img", fallback, &status);
    REQUIRE(status == 200);
    const json b = post_json(c, "/sdapi/v1/img2img", explicit_init, &status);
    REQUIRE(status == 200);
    CHECK(pixels(a) == pixels(b));
    CHECK(pixels(a) != pixels(with));
    // A control image of another size than the init image: resized to the output size (Just Resize), no error.
    auto other = body;
    other["alwayson_scripts"]["controlnet"]["args"][0]["image"] = b64_file(dir + "/control_20x20.png");
    const json r20 = post_json(c, "/sdapi/v1/img2img", other, &status);
    INFO(r20.dump().substr(0, 400));
    CHECK(status == 200);
    // Inpaint: the img2img request's mask with the unit.
    auto inpaint = body;
    inpaint["mask"] = b64_file(dir + "/mask_16x16.png");
    const json ri = post_json(c, "/sdapi/v1/img2img", inpaint, &status);
    INFO(ri.dump().substr(0, 400));
    REQUIRE(status == 200);
    inpaint.erase("alwayson_scripts");
    const json ri_plain = post_json(c, "/sdapi/v1/img2img", inpaint, &status);
    REQUIRE(status == 200);
    CHECK(pixels(ri) != pixels(ri_plain));
    CHECK(pixels(ri) != pixels(with));
    // txt2img has no init image to fall back to: a unit without an image is 422 naming it.
    json t = {{"prompt", "a cat"}, {"steps", 2}, {"width", 16}, {"height", 16}};
    t["alwayson_scripts"] = fallback["alwayson_scripts"];
    const json rt = post_json(c, "/sdapi/v1/txt2img", t, &status);
    CHECK(status == 422);
    CHECK(rt["error"]["param"] == "alwayson_scripts.controlnet.args[0].image");
    std::filesystem::remove_all(nets);
}

namespace {
// Width and height from a PNG's IHDR.
std::pair<int, int> esr_png_size(const std::string& png) {
    REQUIRE(png.size() > 24);
    auto be32 = [&](size_t o) {
        return int(uint8_t(png[o])) << 24 | int(uint8_t(png[o + 1])) << 16 | int(uint8_t(png[o + 2])) << 8 |
               int(uint8_t(png[o + 3]));
    };
    return {be32(16), be32(20)};
}
} // namespace

TEST_CASE("sd serve --upscaler-dir: /sdapi/v1/extra-single-image upscales as A1111's Extras, bad fields are 400",
          "[serve][esrgan]") {
    ServeProcess s(sd_bin(),
                   {"serve", "--port", "0", "-m", "assets/models/sd15-tiny-random", "--upscaler-dir",
                    "tests/golden/sd/esrgan_tiny"},
                   "sd_serve_esrgan");
    auto c = s.client();
    std::ifstream in("tests/golden/sd/pil_lanczos/init_24x20.png", std::ios::binary);
    const std::string png((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    int status = 0;
    // A 4x model asked for 4x: the network's own output size (24x20 -> 96x80, floor(side * 4 / 8) * 8).
    json body = {{"image", cn_base64(png)}, {"upscaler_1", "old_x4"}, {"upscaling_resize", 4}};
    json r = post_json(c, "/sdapi/v1/extra-single-image", body, &status);
    INFO(r.dump().substr(0, 400));
    REQUIRE(status == 200);
    CHECK(r["html_info"] == "<p>Postprocess upscale by: 4.0, Postprocess upscaler: old_x4</p>");
    const std::string out = anchor::serve::base64_decode(r["image"].get<std::string>(), "image");
    CHECK(esr_png_size(out) == std::pair<int, int>{96, 80});
    CHECK(out.find("postprocessing") != std::string::npos);
    // 1.5x with a 2x model: the network once (48x40), then Lanczos down to 32x24 (A1111 rounds down to 8).
    body = {{"image", cn_base64(png)}, {"upscaler_1", "new_x2_unshuffle"}, {"upscaling_resize", 1.5}};
    r = post_json(c, "/sdapi/v1/extra-single-image", body, &status);
    REQUIRE(status == 200);
    CHECK(esr_png_size(anchor::serve::base64_decode(r["image"].get<std::string>(), "image")) ==
          std::pair<int, int>{32, 24});
    CHECK(r["html_info"] == "<p>Postprocess upscale by: 1.5, Postprocess upscaler: new_x2_unshuffle</p>");
    json esr_refused;
    body["upscaler_1"] = "nope";
    esr_refused = post_json(c, "/sdapi/v1/extra-single-image", body, &status);
    check_400(esr_refused, status, "upscaler_1",
              "'nope' is not an upscaler of the upscaler folder (it has: golden, new_x2_unshuffle, new_x4, old_x4)");
    body["upscaler_1"] = "golden"; // golden.safetensors: a file of the folder that is not an RRDBNet
    esr_refused = post_json(c, "/sdapi/v1/extra-single-image", body, &status);
    check_400(esr_refused, status, "upscaler_1", "is not an RRDBNet");
    body["upscaler_1"] = "old_x4";
    body["resize_mode"] = 1;
    esr_refused = post_json(c, "/sdapi/v1/extra-single-image", body, &status);
    check_400(esr_refused, status, "resize_mode", "only 0");
    body.erase("resize_mode");
    body["image"] = "bm90IGFuIGltYWdl";
    esr_refused = post_json(c, "/sdapi/v1/extra-single-image", body, &status);
    check_400(esr_refused, status, "image", "not a PNG/JPEG");
    // The server still answers after the refusals.
    body["image"] = cn_base64(png);
    post_json(c, "/sdapi/v1/extra-single-image", body, &status);
    CHECK(status == 200);
}

TEST_CASE("sd serve: GET /sdapi/v1/upscalers lists None, Lanczos and the --upscaler-dir files as A1111; "
          "/sdapi/v1/latent-upscale-modes the hires fix's latent modes",
          "[serve][esrgan]") {
    ServeProcess s(sd_bin(),
                   {"serve", "--port", "0", "-m", "assets/models/sd15-tiny-random", "--upscaler-dir",
                    "tests/golden/sd/esrgan_tiny"},
                   "sd_serve_upscalers");
    auto c = s.client();
    auto r = c.Get("/sdapi/v1/upscalers");
    REQUIRE(r);
    REQUIRE(r->status == 200);
    const json list = json::parse(r->body);
    REQUIRE(list.size() == 6);
    std::vector<std::string> names;
    for (const auto& u : list) {
        names.push_back(u["name"]);
        for (const char* k : {"model_name", "model_path", "model_url", "scale"}) CHECK(u.contains(k));
    }
    CHECK(names == std::vector<std::string>{"None", "Lanczos", "golden", "new_x2_unshuffle", "new_x4", "old_x4"});
    CHECK(list[1]["scale"] == 4);
    CHECK(list[1]["model_path"].is_null());
    CHECK(list[2]["scale"].is_null()); // golden.safetensors is not an RRDBNet
    CHECK(list[3]["scale"] == 2);      // the network's own scale
    CHECK(list[3]["model_name"] == "ESRGAN");
    CHECK(list[3]["model_path"].get<std::string>().find("new_x2_unshuffle") != std::string::npos);
    CHECK(list[5]["scale"] == 4);
    auto m = c.Get("/sdapi/v1/latent-upscale-modes");
    REQUIRE(m);
    const json modes = json::parse(m->body);
    REQUIRE(modes.size() == 6);
    CHECK(modes[0]["name"] == "Latent");
    CHECK(m->body.find("Latent (nearest-exact)") != std::string::npos);
    // Without --upscaler-dir: the built-in ones only.
    auto plain = shared_server().client().Get("/sdapi/v1/upscalers");
    REQUIRE(plain);
    CHECK(json::parse(plain->body).size() == 2);
}
