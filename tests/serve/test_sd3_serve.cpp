// `anchor-sd serve -m <SD 3 model>` on the tiny SD 3 pipeline of tests/golden/sd/sd3_tiny_text (16x16 images, 3 joint
// blocks, no T5), through real HTTP on loopback: the served image is anchor-sd's own for the same settings (the PNG's
// image chunks byte for byte), txt2img / img2img / OpenAI / compare with the transformer's cache modes per request,
// no state carried between requests, and what SD 3 does not run refused as a one-line 400 naming the field.
#include "serve_process.h"
#include "tests/test_cli_util.h"

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

using anchor::test::post_json;
using anchor::test::ServeProcess;
using nlohmann::json;

namespace {

const char* const kSd3Model = "tests/golden/sd/sd3_tiny_text";

std::string sd3_serve_unbase64(const std::string& s) {
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

ServeProcess& sd3_server() {
    static ServeProcess s(std::string(ANCHOR_BINARY_DIR) + "/anchor-sd",
                          {"serve", "-m", kSd3Model, "--port", "0", "--queue", "4", "--no-web"}, "sd3_serve");
    return s;
}

std::string sd3_scratch(const std::string& name) {
    const std::string dir = std::string(ANCHOR_BINARY_DIR) + "/tests/serve/" + name;
    std::filesystem::create_directories(dir);
    return dir;
}

// The settings of the sd3_tiny_text golden (its first prompt), as a request and as anchor-sd's options.
json sd3_request(const std::string& cache) {
    return {{"prompt", "a photo of a cat on a red sofa"},
            {"negative_prompt", "blurry, low quality"},
            {"steps", 4},
            {"cfg_scale", 4.5},
            {"seed", 21},
            {"width", 16},
            {"height", 16},
            {"sampler_name", "Euler"},
            {"cache", cache}};
}

std::vector<std::string> sd3_cli_args(const std::string& png, const std::string& cache) {
    return {"-m",        kSd3Model, "-p",   "a photo of a cat on a red sofa",
            "-n",        "blurry, low quality", "--steps", "4", "--cfg-scale", "4.5", "-s", "21", "-W", "16", "-H", "16",
            "--cache",   cache,     "-o",   png,
            "--overwrite", "--threads", "1"};
}

std::string sd3_png_image(const json& reply, size_t i = 0) {
    return anchor::test::png_image_chunks(sd3_serve_unbase64(reply["images"][i].get<std::string>()));
}

void sd3_check_400(const json& body, int status, const std::string& field, const std::string& words) {
    INFO(body.dump());
    CHECK(status == 400);
    CHECK(body["error"]["param"] == field);
    CHECK_THAT(body["error"]["message"].get<std::string>(), Catch::Contains(words));
    CHECK(body["error"]["message"].get<std::string>().find('\n') == std::string::npos);
}

} // namespace

TEST_CASE("sd serve SD 3: txt2img is anchor-sd's image for the same settings, every cache mode", "[serve][sd3]") {
    auto c = sd3_server().client();
    const std::string dir = sd3_scratch("sd3_serve_cli");
    for (const std::string cache : {"off", "freq", "fbcache", "teacache", "taylorseer"}) {
        INFO(cache);
        const std::string png = dir + "/" + cache + ".png";
        const auto r = anchor::test::run_program(anchor::test::sd_bin(), sd3_cli_args(png, cache));
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        int status = 0;
        const json s = post_json(c, "/sdapi/v1/txt2img", sd3_request(cache), &status);
        INFO(s.dump().substr(0, 600));
        REQUIRE(status == 200);
        REQUIRE(s["images"].size() == 1);
        CHECK(sd3_png_image(s) == anchor::test::png_image_chunks(anchor::test::read_all(png)));
        const json info = json::parse(s["info"].get<std::string>());
        CHECK(info["sampler_name"] == "Euler");
        CHECK(info["family"] == "sd3");
        CHECK(info["cache"] == cache);
        CHECK(info["width"] == 16);
        const std::string text = info["infotexts"][0];
        CHECK_THAT(text, Catch::Contains("Sampler: Euler") && Catch::Contains("Seed: 21") &&
                             Catch::Contains("T5: off") && Catch::Contains("Shift: 3"));
        const json rec = info["anchorcache"][0];
        CHECK(rec["family"] == "sd3");
        CHECK(rec["cache_mode"] == cache);
        // The same per-step decisions as the CLI's record.
        const json cli = json::parse(anchor::test::read_all(png + ".json"));
        if (cache != "off") {
            REQUIRE(rec.contains("cache"));
            CHECK(rec["cache"]["full_steps"] == cli["cache"]["full_steps"]);
            CHECK(rec["cache"]["kind"] == cache);
        }
    }
}

TEST_CASE("sd serve SD 3: requests never share cache state, concurrent or one after another", "[serve][sd3]") {
    auto c = sd3_server().client();
    int s1 = 0, s2 = 0;
    const json a = post_json(c, "/sdapi/v1/txt2img", sd3_request("fbcache:thr=0.3"), &s1);
    const json b = post_json(c, "/sdapi/v1/txt2img", sd3_request("taylorseer"), &s2);
    REQUIRE(s1 == 200);
    REQUIRE(s2 == 200);
    auto run = [](std::string cache) {
        auto cl = sd3_server().client();
        int st = 0;
        json r = post_json(cl, "/sdapi/v1/txt2img", sd3_request(cache), &st);
        return std::make_pair(st, r);
    };
    auto fa = std::async(std::launch::async, run, "fbcache:thr=0.3");
    auto fb = std::async(std::launch::async, run, "taylorseer");
    const auto ra = fa.get(), rb = fb.get();
    REQUIRE(ra.first == 200);
    REQUIRE(rb.first == 200);
    CHECK(sd3_png_image(ra.second) == sd3_png_image(a));
    CHECK(sd3_png_image(rb.second) == sd3_png_image(b));
    auto steps = [](const json& reply) {
        json st = json::parse(reply["info"].get<std::string>())["anchorcache"][0]["cache"]["steps"];
        for (auto& s : st) s.erase("ms");
        return st;
    };
    CHECK(steps(ra.second) == steps(a));
    CHECK(steps(rb.second) == steps(b));
}

TEST_CASE("sd serve SD 3: img2img is anchor-sd -i's image; batches and n_iter", "[serve][sd3]") {
    auto c = sd3_server().client();
    int status = 0;
    const json t = post_json(c, "/sdapi/v1/txt2img", sd3_request("off"), &status);
    REQUIRE(status == 200);
    const std::string dir = sd3_scratch("sd3_serve_i2i"), init = dir + "/init.png", png = dir + "/out.png";
    {
        std::ofstream f(init, std::ios::binary);
        f << sd3_serve_unbase64(t["images"][0].get<std::string>());
    }
    auto args = sd3_cli_args(png, "off");
    for (const std::string& a : std::vector<std::string>{"-i", init, "--strength", "0.5"}) args.push_back(a);
    const auto r = anchor::test::run_program(anchor::test::sd_bin(), args);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    auto body = sd3_request("off");
    body["init_images"] = {t["images"][0]};
    body["denoising_strength"] = 0.5;
    const json s = post_json(c, "/sdapi/v1/img2img", body, &status);
    INFO(s.dump().substr(0, 600));
    REQUIRE(status == 200);
    CHECK(sd3_png_image(s) == anchor::test::png_image_chunks(anchor::test::read_all(png)));
    const json info = json::parse(s["info"].get<std::string>());
    CHECK(info["denoising_strength"] == 0.5);
    CHECK_THAT(info["infotexts"][0].get<std::string>(), Catch::Contains("Denoising strength: 0.5"));

    // batch_size 2 x n_iter 2: four images, batch k with seed + k (as the UNet server plans them).
    auto batch = sd3_request("fbcache");
    batch["batch_size"] = 2;
    batch["n_iter"] = 2;
    const json bb = post_json(c, "/sdapi/v1/txt2img", batch, &status);
    REQUIRE(status == 200);
    REQUIRE(bb["images"].size() == 4);
    const json binfo = json::parse(bb["info"].get<std::string>());
    CHECK(binfo["all_seeds"] == json({21, 21, 22, 22}));
    CHECK(sd3_png_image(bb, 0) != sd3_png_image(bb, 1));
    CHECK(binfo["anchorcache"][1]["index_in_batch"] == 1);
}

TEST_CASE("sd serve SD 3: OpenAI images, compare and the listing endpoints", "[serve][sd3]") {
    auto c = sd3_server().client();
    int status = 0;
    const json g = post_json(c, "/v1/images/generations",
                             {{"prompt", "a cat"}, {"n", 2}, {"size", "16x16"}, {"steps", 2}, {"seed", 5},
                              {"cache", "teacache"}},
                             &status);
    REQUIRE(status == 200);
    REQUIRE(g["data"].size() == 2);
    CHECK(g["data"][1]["seed"] == 5);

    const json cmp = post_json(c, "/anchor/v1/compare",
                               {{"prompt", "a cat"}, {"steps", 6}, {"seed", 9}, {"width", 16}, {"height", 16},
                                {"modes", {"off", "freq", "fbcache", "teacache", "taylorseer"}}},
                               &status);
    INFO(cmp.dump().substr(0, 600));
    REQUIRE(status == 200);
    REQUIRE(cmp["modes"].size() == 5);
    CHECK(cmp["modes"][0]["psnr_vs_first_db"].is_null());
    for (const auto& m : cmp["modes"]) {
        CHECK(m["image"].is_string());
        CHECK(m["total_steps"] == 6);
        CHECK(m["full_steps"].get<int>() >= 1);
        CHECK(m["speedup_vs_first"].is_number());
    }
    CHECK(cmp["modes"][0]["full_steps"] == 6);

    auto get = [&](const char* path) {
        auto r = c.Get(path);
        REQUIRE(r);
        CHECK(r->status == 200);
        return json::parse(r->body);
    };
    CHECK(get("/sdapi/v1/samplers")[0]["name"] == "Euler");
    CHECK(get("/sdapi/v1/sd-models")[0]["model_name"] == "sd3_tiny_text");
    const json opts = get("/sdapi/v1/options");
    CHECK(opts["anchor_family"] == "sd3");
    CHECK(opts["anchor_transformer_blocks"] == 3);
    CHECK(get("/health")["status"] == "ok");
    CHECK(get("/openapi.json")["paths"].contains("/sdapi/v1/txt2img"));
}

TEST_CASE("sd serve SD 3: what SD 3 does not run is a one-line 400 naming the field", "[serve][sd3]") {
    auto c = sd3_server().client();
    int status = 0;
    auto bad = [&](const std::string& path, const std::string& field, const json& value, const std::string& words) {
        auto body = sd3_request("off");
        body["steps"] = 1;
        if (field.find('.') == std::string::npos)
            body[field] = value;
        else
            body["alwayson_scripts"] = value;
        const json e = post_json(c, path, body, &status);
        sd3_check_400(e, status, field, words);
    };
    const std::string t2i = "/sdapi/v1/txt2img";
    bad(t2i, "sampler_name", "DDIM", "flow-matching Euler only");
    bad(t2i, "scheduler", "Karras", "scheduler");
    bad(t2i, "cache", "deepcache:3", "does not apply to SD 3");
    bad(t2i, "cache", "freq:attn=run", "freq on SD 3 / 3.5");
    bad(t2i, "cache", "fbcache:thr=x", "thr");
    bad(t2i, "enable_hr", true, "hires fix");
    json unit = json::object();
    unit["enabled"] = true;
    unit["module"] = "canny";
    unit["model"] = "x";
    json scripts = json::object();
    scripts["controlnet"]["args"] = json::array({unit});
    bad(t2i, "alwayson_scripts.controlnet.args", scripts, "ControlNet");
    bad(t2i, "prompt", "a cat <lora:style:0.8>", "<lora:");
    bad(t2i, "negative_prompt", "<LORA:x:1>", "<lora:");
    bad(t2i, "width", 18, "multiple of 4");
    bad(t2i, "width", 128, "position grid");
    bad(t2i, "vae_decoder", "taesd", "TAESD");
    bad(t2i, "vae_tiling", true, "VAE tiling");
    bad(t2i, "eta", 0.5, "eta");
    bad(t2i, "slg_layers", json::array({7}), "block indices in [0, 2]");
    bad(t2i, "steps", 1000, "must be in [1, 150]");
    bad(t2i, "batch_size", 100, "must be in [1, 8]");
    bad("/sdapi/v1/img2img", "init_images", json::array(), "got none");
    {
        auto body = sd3_request("off");
        const json t = post_json(c, t2i, body, &status);
        REQUIRE(status == 200);
        body["init_images"] = {t["images"][0]};
        body["mask"] = t["images"][0];
        const json masked = post_json(c, "/sdapi/v1/img2img", body, &status); // before `status` is read
        sd3_check_400(masked, status, "mask", "inpainting");
        body.erase("mask");
        body["width"] = 32;
        const json sized = post_json(c, "/sdapi/v1/img2img", body, &status);
        sd3_check_400(sized, status, "width", "init image's size");
    }
    const json e = post_json(c, "/anchor/v1/compare", {{"modes", {"off", "deepcache:3"}}}, &status);
    sd3_check_400(e, status, "modes", "modes[1]");
    // Off values of the UNet fields pass (A1111 clients send them).
    auto ok = sd3_request("off");
    ok["steps"] = 1;
    ok["enable_hr"] = false;
    ok["alwayson_scripts"] = json::object();
    ok["vae_decoder"] = "full";
    ok["eta"] = 0;
    ok["scheduler"] = "Automatic";
    post_json(c, t2i, ok, &status);
    CHECK(status == 200);
    auto h = c.Get("/health");
    REQUIRE(h);
    CHECK(h->status == 200);
}

TEST_CASE("sd serve SD 3: options an SD 3 model does not take are refused at start", "[serve][sd3]") {
    const auto r = anchor::test::run_program(anchor::test::sd_bin(),
                                             {"serve", "-m", kSd3Model, "--port", "0", "--cache", "deepcache:3"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("deepcache"));
    const auto e = anchor::test::run_program(
        anchor::test::sd_bin(), {"serve", "-m", kSd3Model, "--port", "0", "--embedding-dir", "tests"});
    CHECK(e.exit_code == 2);
    CHECK_THAT(e.output, Catch::Contains("--embedding-dir is not available for SD 3"));
}
