// Bad-input catalogue (issue 8): every case runs a program as a user would and checks the exit code (usage errors 2,
// runtime errors 1, never a crash), that the message starts with "error:" and names what is wrong (the file, the
// tensor, expected and actual shape, the valid choices), and that nothing was left in the output folder.
#include "cache/io/safetensors.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <fstream>
#include <iostream>
#include <limits>

using namespace anchor;
namespace fs = std::filesystem;

namespace {

using test::write_bytes;

struct Case {
    std::string name;
    std::string program; // "sd" | "text"
    std::vector<std::string> args;
    int exit_code;
    std::vector<std::string> must_contain; // substrings of the output (case-sensitive)
};

// Copies the tiny SD model and rewrites its UNet weights: `drop` tensors removed, `reshape` replaced by a [3, 3].
// A copy of the tiny SD model with tensors dropped, one reshaped to [3, 3], one filled with NaN (poison) and one
// stored as int32 (as_int).
std::string broken_model(const std::string& dir, const std::vector<std::string>& drop, const std::string& reshape,
                         const std::string& poison = "", const std::string& as_int = "") {
    fs::copy("assets/models/sd15-tiny-random", dir, fs::copy_options::recursive);
    const std::string w = dir + "/unet/diffusion_pytorch_model.safetensors";
    auto f = SafeTensorsFile::open(w);
    NamedTensors t;
    for (const auto& info : f->tensors()) {
        const std::string& n = info.name;
        if (std::find(drop.begin(), drop.end(), n) != drop.end()) continue;
        auto v = n == reshape ? torch::zeros({3, 3}) : f->tensor(n).clone();
        if (n == poison) v.fill_(std::numeric_limits<float>::quiet_NaN());
        if (n == as_int) v = v.to(torch::kInt32);
        t.emplace_back(n, v);
    }
    f.reset();
    save_safetensors(w, t);
    return dir;
}

void run_cases(const std::vector<Case>& cases, const std::string& out_dir) {
    for (const auto& c : cases) {
        DYNAMIC_SECTION(c.name) {
            const auto before = std::distance(fs::directory_iterator(out_dir), fs::directory_iterator{});
            auto r = test::run_program(c.program == "sd" ? test::sd_bin() : test::text_bin(), c.args);
            INFO("case: " << c.name << "\noutput:\n" << r.output);
            CHECK(r.signal == 0); // no crash
            CHECK(r.exit_code == c.exit_code);
            CHECK(r.output.find("error: ") != std::string::npos);
            for (const auto& s : c.must_contain) {
                INFO("expected in the message: " << s);
                CHECK(r.output.find(s) != std::string::npos);
            }
            // Nothing written, no temporary files left behind.
            CHECK(std::distance(fs::directory_iterator(out_dir), fs::directory_iterator{}) == before);
            std::cout << "catalogue | " << c.program << " | " << c.name << " | exit " << r.exit_code << "\n";
        }
    }
}

} // namespace

TEST_CASE("anchor-sd usage errors exit 2 and say what is wrong", "[cli][errors]") {
    const auto out = test::scratch_dir("errors_sd_usage");
    const std::string png = out + "/x.png", m = "assets/models/sd15-tiny-random";
    const std::vector<Case> cases = {
        {"no prompt", "sd", {"-m", m, "-o", png}, 2, {"--prompt"}},
        {"empty prompt", "sd", {"-m", m, "-p", "", "-o", png}, 2, {"prompt is required", "not empty"}},
        {"CFG NaN", "sd", {"-m", m, "-p", "a", "--cfg-scale", "nan", "-o", png}, 2, {"--cfg-scale", "got nan"}},
        {"prompt not UTF-8", "sd", {"-m", m, "-p", "caf\xe9", "-o", png}, 2, {"not valid UTF-8", "offset 3"}},
        {"prompts file missing", "sd", {"-m", m, "--prompts-file", out + "/nope.txt", "-o", png}, 1, {"nope.txt"}},
        {"prompt and prompts file together",
         "sd",
         {"-m", m, "-p", "a", "--prompts-file", png, "-o", png},
         2,
         {"--prompts-file", "excludes"}},
        {"unknown option", "sd", {"-p", "a", "--bogus", "-o", png}, 2, {"--bogus"}},
        {"free params with compare (the compare runs the models again)",
         "sd",
         {"-m", m, "-p", "a", "--free-params", "--compare", "off,deepcache:3", "-o", png},
         2,
         {"--free-params", "excludes"}},
        {"steps 0", "sd", {"-m", m, "-p", "a", "--steps", "0", "-o", png}, 2, {"--steps"}},
        {"unknown sampler lists the valid ones",
         "sd",
         {"-m", m, "-p", "a", "--sampler", "heun2", "-o", png},
         2,
         {"heun2", "ddim", "euler_a"}},
        {"unknown prompt syntax lists the valid ones",
         "sd",
         {"-m", m, "-p", "a", "--prompt-syntax", "bogus", "-o", png},
         2,
         {"--prompt-syntax", "bogus", "a1111", "plain"}},
        {"A1111 attention weight not a number",
         "sd",
         {"-m", m, "-p", "a (b:1.2.3)", "-o", png},
         2,
         {"--prompt: ", "1.2.3"}},
        {"width not a multiple of the VAE factor",
         "sd",
         {"-m", m, "-p", "a", "-W", "17", "-H", "16", "-o", png},
         2,
         {"17x16", "multiples of 2"}},
        {"negative width", "sd", {"-m", m, "-p", "a", "-W", "-8", "-o", png}, 2, {"width"}},
        {"unknown cache mode lists the forms",
         "sd",
         {"-m", m, "-p", "a", "--cache", "fast", "-o", png},
         2,
         {"fast", "deepcache:N"}},
        {"malformed deepcache interval",
         "sd",
         {"-m", m, "-p", "a", "--cache", "deepcache:x", "-o", png},
         2,
         {"deepcache:x"}},
        {"cache and deepcache together",
         "sd",
         {"-m", m, "-p", "a", "--cache", "freq", "--deepcache", "3", "-o", png},
         2,
         {"exclusive"}},
        {"f16 on the CPU", "sd", {"-m", m, "-p", "a", "--dtype", "f16", "-o", png}, 2, {"f16", "bf16"}},
        {"unknown dtype", "sd", {"-m", m, "-p", "a", "--dtype", "f8", "-o", png}, 2, {"f8"}},
        {"unknown weights dtype lists the valid ones",
         "sd",
         {"-m", m, "-p", "a", "--weights-dtype", "f8", "-o", png},
         2,
         {"--weights-dtype", "f8", "f32, f16, bf16"}},
        {"f16 weights under a bf16 compute",
         "sd",
         {"-m", m, "-p", "a", "--weights-dtype", "f16", "--dtype", "bf16", "-o", png},
         2,
         {"--weights-dtype", "float32 compute"}},
        {"unknown prediction lists the valid ones",
         "sd",
         {"-m", m, "-p", "a", "--prediction", "x0", "-o", png},
         2,
         {"--prediction", "x0", "auto, eps, v"}},
        {"clip skip out of range", "sd", {"-m", m, "-p", "a", "--clip-skip", "9", "-o", png}, 2, {"--clip-skip"}},
        {"bad compare list", "sd", {"-m", m, "-p", "a", "--compare", "off,warp:2", "-o", png}, 2, {"warp:2"}},
        {"batch count 0", "sd", {"-m", m, "-p", "a", "-b", "0", "-o", png}, 2, {"--batch-count"}},
        {"negative threads", "sd", {"-m", m, "-p", "a", "--threads", "-1", "-o", png}, 2, {"threads"}},
        {"bench-cache unknown device", "sd", {"bench-cache", "--device", "tpu"}, 2, {"tpu", "cuda"}},
        {"bench-cache unknown mode", "sd", {"bench-cache", "--modes", "off,bogus"}, 2, {"bogus"}},
        {"train without an output folder", "sd", {"train-vae"}, 2, {"--output"}},
    };
    run_cases(cases, out);
}

TEST_CASE("anchor-sd schedule and eta errors exit 2 and name the option and the choices", "[cli][errors][schedulers]") {
    const auto out = test::scratch_dir("errors_sd_schedule");
    const std::string png = out + "/x.png", m = "assets/models/sd15-tiny-random";
    const std::vector<Case> cases = {
        {"unknown schedule lists the valid ones",
         "sd",
         {"-m", m, "-p", "a", "--schedule", "bogus", "-o", png},
         2,
         {"--schedule", "bogus", "default, karras, exponential, sgm_uniform, simple"}},
        {"eta for a sampler without a noise term",
         "sd",
         {"-m", m, "-p", "a", "--sampler", "euler", "--eta", "0.5", "-o", png},
         2,
         {"--eta", "euler", "ddim and euler_a"}},
        {"negative eta",
         "sd",
         {"-m", m, "-p", "a", "--sampler", "ddim", "--eta", "-1", "-o", png},
         2,
         {"--eta", "must be in [0, 10], got -1"}},
        {"schedule contradicting dpmpp_2m_karras",
         "sd",
         {"-m", m, "-p", "a", "--sampler", "dpmpp_2m_karras", "--schedule", "exponential", "-o", png},
         2,
         {"--schedule", "exponential", "dpmpp_2m"}},
    };
    run_cases(cases, out);
}

TEST_CASE("anchor-sd file errors exit 1 and name the file, tensor and shapes", "[cli][errors]") {
    const auto out = test::scratch_dir("errors_sd_files");
    const auto work = test::scratch_dir("errors_sd_files_inputs");
    const std::string png = out + "/x.png";
    write_bytes(work + "/not_a_model.safetensors", "this is not a safetensors file at all");
    // A header that promises more data than the file holds.
    std::string hdr = R"({"w":{"dtype":"F32","shape":[1000],"data_offsets":[0,4000]}})";
    std::string trunc(8, '\0');
    for (int i = 0; i < 8; ++i) trunc[size_t(i)] = char((hdr.size() >> (8 * i)) & 0xff);
    write_bytes(work + "/truncated.safetensors", trunc + hdr + std::string(100, '\0'));
    const auto missing = broken_model(work + "/missing_tensors", {"conv_in.weight", "conv_out.bias"}, "");
    const auto wrong = broken_model(work + "/wrong_shape", {}, "conv_in.weight");
    const auto nan_model = broken_model(work + "/nan_weights", {}, "", "conv_out.bias");
    const auto int_model = broken_model(work + "/int_weights", {}, "", "", "conv_in.weight");
    // A UNet config whose block lists disagree, and one that is not an object.
    fs::copy("assets/models/sd15-tiny-random", work + "/bad_config", fs::copy_options::recursive);
    write_bytes(work + "/bad_config/unet/config.json",
                R"({"block_out_channels": [32, 64, 64, 64], "down_block_types": ["DownBlock2D"],
                    "up_block_types": ["UpBlock2D"]})");
    // A VAE whose decoder.conv_in.weight is [3, 3] (and nothing else).
    save_safetensors(work + "/vae_wrong.safetensors", {{"decoder.conv_in.weight", torch::zeros({3, 3})}});
    fs::create_directories(work + "/empty_folder");
    fs::create_directories(work + "/eval_done"); // an earlier eval-fashion report
    write_bytes(work + "/eval_done/cache_eval.json", "{}\n");
    fs::create_directories(work + "/eval_cut"); // a report whose cell lost its modes
    write_bytes(work + "/eval_cut/cache_eval.json",
                R"({"samplers": ["ddim"], "cells": [{"sampler": "ddim", "steps": 20}]})");
    const std::vector<Case> cases = {
        {"model path does not exist", "sd", {"-m", work + "/nowhere", "-p", "a", "-o", png}, 1, {"nowhere"}},
        {"model file is not safetensors",
         "sd",
         {"-m", work + "/not_a_model.safetensors", "-p", "a", "-o", png},
         1,
         {"not_a_model.safetensors"}},
        {"truncated safetensors",
         "sd",
         {"-m", work + "/truncated.safetensors", "-p", "a", "-o", png},
         1,
         {"truncated.safetensors"}},
        {"every missing tensor is listed",
         "sd",
         {"-m", missing, "-p", "a", "-o", png},
         1,
         {"conv_in.weight", "conv_out.bias", "missing"}},
        {"wrong shape names tensor, expected and actual",
         "sd",
         {"-m", wrong, "-p", "a", "-o", png},
         1,
         {"conv_in.weight", "[3, 3]", "[32, 4, 3, 3]"}},
        {"NaN in the latents is reported with the step, no image written",
         "sd",
         {"-m", nan_model, "-p", "a", "--steps", "3", "-o", png},
         1,
         {"NaN/Inf in the latents", "step 1 of 3"}},
        {"integer tensor where weights belong",
         "sd",
         {"-m", int_model, "-p", "a", "-o", png},
         1,
         {"conv_in.weight", "wrong dtype", "Int"}},
        {"config with contradictory block lists",
         "sd",
         {"-m", work + "/bad_config", "-p", "a", "-o", png},
         1,
         {"config.json", "4 block_out_channels but 1 down / 1 up block types"}},
        {"size too large for memory is refused before allocating",
         "sd",
         {"-m", "assets/models/sd15-tiny-random", "-p", "a", "-W", "16384", "-H", "16384", "-o", png},
         2,
         {"16384x16384 image needs about", "GiB available"}},
        {"output directory not writable",
         "sd",
         {"-m", "assets/models/sd15-tiny-random", "-p", "a", "-o", "/proc/x.png"},
         1,
         {"/proc", "not writable"}},
        {"folder without a model", "sd", {"-m", work + "/empty_folder", "-p", "a", "-o", png}, 1, {"empty_folder"}},
        {"VAE file does not exist",
         "sd",
         {"-m", "assets/models/sd15-tiny-random", "-p", "a", "--vae", work + "/missing.safetensors", "-o", png},
         1,
         {"missing.safetensors", "does not exist"}},
        {"VAE of the wrong shape names the file, the tensor and both shapes",
         "sd",
         {"-m", "assets/models/sd15-tiny-random", "-p", "a", "--vae", work + "/vae_wrong.safetensors", "-o", png},
         1,
         {"vae_wrong.safetensors", "decoder.conv_in.weight: expected [", "got [3, 3]", "missing tensor(s)"}},
        {"output folder does not exist",
         "sd",
         {"-m", "assets/models/sd15-tiny-random", "-p", "a", "-o", work + "/no/such/dir/x.png"},
         1,
         {"no/such/dir"}},
        {"eval-fashion without a classifier file",
         "sd",
         {"eval-fashion", "-m", "assets/models/sd15-tiny-random", "--classifier", work + "/none.safetensors"},
         1,
         {"none.safetensors"}},
        {"eval-fashion does not replace earlier results without --overwrite",
         "sd",
         {"eval-fashion", "-m", "assets/models/sd15-tiny-random", "--modes", "off,freq", "-o", work + "/eval_done"},
         2, // a usage error, as for anchor-sd's own outputs: the user must ask for --overwrite
         {"eval_done/cache_eval.json", "already exists", "--overwrite"}},
        {"eval-fashion with one mode listed twice",
         "sd",
         {"eval-fashion", "-m", "assets/models/sd15-tiny-random", "--modes", "off,freq,freq:thr=0.7", "-o", out},
         2,
         {"--modes: lists 'freq:thr=0.7' twice"}},
        {"eval-plot of a JSON file that is not an eval report",
         "sd",
         {"eval-plot", work + "/eval_done/cache_eval.json"},
         1,
         {"eval_done/cache_eval.json", "not an eval-cache report", "'samplers'"}},
        {"eval-plot of a report with a cell that has no modes",
         "sd",
         {"eval-plot", work + "/eval_cut/cache_eval.json"},
         1,
         {"eval_cut/cache_eval.json", "'modes'"}},
        {"eval-plot of a report that does not exist",
         "sd",
         {"eval-plot", work + "/no_report.json"},
         2,
         {"no_report.json"}},
        {"train-vae without the dataset",
         "sd",
         {"train-vae", "-o", out + "/m", "--data", work + "/no_data"},
         1,
         {"no_data", "dataset-fashion-mnist"}},
    };
    run_cases(cases, out);
}

TEST_CASE("anchor-text usage and file errors", "[cli][errors]") {
    const auto out = test::scratch_dir("errors_text");
    const auto work = test::scratch_dir("errors_text_inputs");
    const std::string g = "tests/golden/text/gpt2_tiny", txt = "tests/golden/text/eval/kjv_text.txt";
    write_bytes(work + "/bad.safetensors", "garbage");
    // A LLaDA checkpoint whose config.json has no sizes (its model_type and one of its tensor names).
    fs::create_directories(work + "/llada");
    save_safetensors(work + "/llada/model.safetensors",
                     NamedTensors{{"model.transformer.blocks.0.q_proj.weight", torch::zeros({2, 2})}});
    write_bytes(work + "/llada/config.json", R"({"model_type": "llada", "architectures": ["LLaDAModelLM"]})");
    fs::copy(g, work + "/bad_model", fs::copy_options::recursive);
    write_bytes(work + "/bad_model/config.json", "{ not json");
    // NaN in the final layer norm: every logit is NaN from the first token on.
    fs::create_directories(work + "/nan_model");
    fs::copy(g + "/config.json", work + "/nan_model/config.json");
    {
        auto f = SafeTensorsFile::open(g + "/model.safetensors");
        NamedTensors t;
        for (const auto& info : f->tensors()) {
            auto v = f->tensor(info.name).clone();
            if (info.name == "ln_f.bias") v.fill_(std::numeric_limits<float>::quiet_NaN());
            t.emplace_back(info.name, v);
        }
        save_safetensors(work + "/nan_model/model.safetensors", t);
    }
    const std::vector<Case> cases = {
        {"no subcommand", "text", {}, 2, {"subcommand"}},
        {"unknown kv mode",
         "text",
         {"gpt2", "ppl", "-m", g, "--file", txt, "--kv", "ring:4"},
         2,
         {"ring:4", "sink:S,W"}},
        {"malformed sink S,W", "text", {"gpt2", "ppl", "-m", g, "--file", txt, "--kv", "sink:4"}, 2, {"sink:4"}},
        {"sink larger than positions with absolute",
         "text",
         {"gpt2", "ppl", "-m", g, "--file", txt, "--kv", "sink:4,200", "--positions", "absolute"},
         2,
         {"absolute"}},
        {"unknown positions policy",
         "text",
         {"gpt2", "ppl", "-m", g, "--file", txt, "--positions", "rope"},
         2,
         {"rope"}},
        {"text file missing", "text", {"gpt2", "ppl", "-m", g, "--file", work + "/missing.txt"}, 1, {"missing.txt"}},
        {"model missing", "text", {"gpt2", "ppl", "-m", work + "/nope", "--file", txt}, 1, {"nope"}},
        {"model file corrupt",
         "text",
         {"gpt2", "ppl", "-m", work + "/bad.safetensors", "--file", txt},
         1,
         {"bad.safetensors"}},
        {"config.json not JSON", "text", {"gpt2", "ppl", "-m", work + "/bad_model", "--file", txt}, 1, {"config.json"}},
        {"empty prompt", "text", {"gpt2", "generate", "-m", g, "-p", "", "--max-new", "4"}, 2, {"prompt"}},
        {"NaN in the logits is reported with the token",
         "text",
         {"gpt2", "generate", "-m", work + "/nan_model", "--vocab", "tests/golden/text/vocab/gpt2", "-p", "In the",
          "--max-new", "4"},
         1,
         {"NaN/Inf in the logits at stream token 1"}},
        {"soak JSON without --report-every",
         "text",
         {"gpt2", "generate", "-m", g, "-p", "a", "--max-new", "4", "--report-json", work + "/soak.json"},
         2,
         {"--report-json needs --report-every"}},
        {"diffusion model missing", "text", {"diffusion", "generate", "-m", work + "/nope", "-p", "a"}, 1, {"nope"}},
        {"diffusion Dream alg-temp with origin (which commits each mask by its own draw)",
         "text",
         {"diffusion", "generate", "-m", "tests/golden/text/dlm/dream_tiny", "--prompt-ids", "4,5", "--gen-length", "4",
          "--remask", "origin", "--alg-temp", "0.5"},
         2,
         {"--alg-temp", "'origin'"}},
        {"diffusion unknown cache mode",
         "text",
         {"diffusion", "generate", "-m", "assets/models/kjv-mdlm", "-p", "a", "--cache", "bogus"},
         2,
         {"bogus"}},
        {"diffusion threshold out of range",
         "text",
         {"diffusion", "generate", "-p", "a", "--unmask", "confidence", "--threshold", "1.5"},
         2,
         {"--threshold", "[0, 1]"}},
        {"diffusion threshold with ancestral unmasking",
         "text",
         {"diffusion", "generate", "-p", "a", "--threshold", "0.9"},
         2,
         {"--threshold", "ancestral"}},
        {"diffusion block cache key",
         "text",
         {"diffusion", "generate", "-p", "a", "--cache", "dual:rho=0.1"},
         2,
         {"'rho' is unknown for dual", "refresh, drift, decoded, masked, stale"}},
        {"diffusion decoding key",
         "text",
         {"diffusion", "generate", "-p", "a", "--cache", "off+bogus=1"},
         2,
         {"bogus", "threshold"}},
        {"diffusion train on an unknown device",
         "text",
         {"diffusion", "train", "--tokens", work + "/none.bin", "-o", work + "/run_dev", "--device", "tpu"},
         2,
         {"--device", "cpu, cuda or cuda:N", "tpu"}},
        {"diffusion train with a negative time budget",
         "text",
         {"diffusion", "train", "--tokens", work + "/none.bin", "-o", work + "/run_tb", "--time-budget", "-5"},
         2,
         {"--time-budget", ">= 0"}},
        {"diffusion LLaDA checkpoint",
         "text",
         {"diffusion", "generate", "-m", work + "/llada", "-p", "a"},
         1,
         {"LLaDA", "'d_model' is missing"}},
    };
    run_cases(cases, out);
}

TEST_CASE("Ctrl-C during a txt2img run exits 130 and leaves no output or temporary file", "[cli][errors]") {
    const auto out = test::scratch_dir("errors_sigint");
    const std::string log = test::scratch_dir("errors_sigint_log") + "/stderr.txt";
    // SIGINT goes in once the denoising loop runs (its progress line is on stderr): a background job of a
    // non-interactive shell starts with SIGINT ignored until the program installs its handler, and a slow start
    // (sanitizer builds) must not turn the test into a 400-step run.
    const std::string cmd = "cd " + test::shell_quote(ANCHOR_SOURCE_DIR) + " && (OMP_NUM_THREADS=1 " +
                            test::shell_quote(test::sd_bin()) +
                            " -m assets/models/sd15-tiny-random -p 'a cat' --steps 400 -W 64 -H 64 --threads 1 -o " +
                            test::shell_quote(out + "/cat.png") + " >/dev/null 2>" + test::shell_quote(log) +
                            " & pid=$!; for i in $(seq 1 600); do grep -q ' 1/400' " + test::shell_quote(log) +
                            " 2>/dev/null && break; sleep 0.2; done; kill -INT $pid; wait $pid; echo rc=$?)";
    FILE* p = popen(cmd.c_str(), "r");
    REQUIRE(p);
    char buf[256] = {0};
    std::string res;
    while (fgets(buf, sizeof buf, p)) res += buf;
    pclose(p);
    INFO(res);
    CHECK(res.find("rc=130") != std::string::npos);
    CHECK(fs::is_empty(out));
}

// Issue 56: every numeric option bounded at the edge, settings past the model refused, messages naming the option
// the user typed and its value, and nothing run before the refusal.
TEST_CASE("anchor-sd refuses out-of-range numbers and settings past the model, naming the option and value",
          "[cli][errors]") {
    const auto out = test::scratch_dir("errors_sd_bounds");
    const std::string png = out + "/x.png", m = "assets/models/sd15-tiny-random";
    const auto work = test::scratch_dir("errors_sd_bounds_work");
    const std::string folder = work + "/a_folder", nocfg = work + "/no_unet_config";
    fs::create_directories(folder);
    fs::remove_all(nocfg);
    fs::copy(m, nocfg, fs::copy_options::recursive);
    fs::remove(nocfg + "/unet/config.json");
    std::string many_tokens, deep(300, '(');
    for (int i = 0; i < 1000; ++i) many_tokens += "red, ";
    // A PNG cut short: the golden init image's first 100 bytes (its header and part of the IDAT chunk).
    const std::string cut = work + "/cut.png";
    {
        std::ifstream in(test::golden("sd/img2img_tiny/init_image.png"), std::ios::binary);
        std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        REQUIRE(bytes.size() > 100);
        std::ofstream(cut, std::ios::binary) << bytes.substr(0, 100);
    }
    const std::vector<Case> cases = {
        {"CFG 1e30",
         "sd",
         {"-m", m, "-p", "a", "--cfg-scale", "1e30", "-o", png},
         2,
         {"--cfg-scale", "[0, 100]", "1e30"}},
        {"threads 10000",
         "sd",
         {"-m", m, "-p", "a", "--threads", "10000", "-o", png},
         2,
         {"--threads", "cores", "10000"}},
        {"eta 1e9", "sd", {"-m", m, "-p", "a", "--sampler", "ddim", "--eta", "1e9", "-o", png}, 2, {"--eta", "1e9"}},
        {"steps 1e6", "sd", {"-m", m, "-p", "a", "--steps", "1000000", "-o", png}, 2, {"--steps", "1000000"}},
        {"batch size 100000 blames --batch-size",
         "sd",
         {"-m", m, "-p", "a", "--batch-size", "100000", "-o", png},
         2,
         {"--batch-size", "100000"}},
        {"width 1e6", "sd", {"-m", m, "-p", "a", "-W", "1000000", "-o", png}, 2, {"--width", "1000000"}},
        {"strength without an init image",
         "sd",
         {"-m", m, "-p", "a", "--strength", "0.5", "-o", png},
         2,
         {"--strength 0.5", "-i/--init-img"}},
        {"clip skip 3 on a 2-layer encoder names the typed value",
         "sd",
         {"-m", m, "-p", "a", "--clip-skip", "3", "-o", png},
         2,
         {"--clip-skip", "[1, 2]", "got 3"}},
        {"model folder without unet/config.json",
         "sd",
         {"-m", nocfg, "-p", "a", "-o", png},
         2,
         {"unet/config.json", "missing"}},
        {"output is an existing folder, even with --overwrite",
         "sd",
         {"-m", m, "-p", "a", "-o", folder, "--overwrite"},
         2,
         {"a_folder", "is a folder"}},
        {"an init image that is a folder", "sd", {"-m", m, "-p", "a", "-i", folder, "-o", png}, 2,
         {"--init-img", "a_folder", "is a folder, not an image file"}},
        {"a truncated init PNG says why",
         "sd",
         {"-m", m, "-p", "a", "-i", cut, "-o", png},
         2,
         {"--init-img", "cut.png", "truncated or corrupt"}},
        {"prompts file is a folder",
         "sd",
         {"-m", m, "--prompts-file", folder, "-o", png},
         2,
         {"a_folder", "is a folder"}},
        {"prompt over 64 KiB", "sd", {"-m", m, "-p", std::string(70000, 'a'), "-o", png}, 2, {"--prompt", "65536"}},
        {"prompt over 1500 CLIP tokens",
         "sd",
         {"-m", m, "-p", many_tokens, "-o", png},
         2,
         {"--prompt", "1500 CLIP tokens"}},
        {"brackets nested 300 deep", "sd", {"-m", m, "-p", deep + "a", "-o", png}, 2, {"--prompt", "nested"}},
        {"anchor-text: an unknown cache mode says --cache help once",
         "text",
         {"diffusion", "generate", "--cache", "bogus"},
         2,
         {"; --cache help lists them"}},
        {"anchor-text: --kv sink past n_positions under --positions reencode",
         "text",
         {"gpt2", "generate", "-p", "In the beginning", "--max-new", "4", "--kv", "sink:4,1020", "--positions",
          "reencode"},
         2,
         {"--kv", "sink:4,1020", "n_positions 256"}},
        {"anchor-text: a huge --max-new blames --max-new",
         "text",
         {"gpt2", "generate", "-p", "In the beginning", "--max-new", "100000000000", "--kv", "sink:4,60", "--positions",
          "reencode"},
         2,
         {"error: --max-new", "fewer new tokens"}},
        {"anchor-text: diffusion --length past the model's context",
         "text",
         {"diffusion", "generate", "--length", "1000", "--steps", "2"},
         2,
         {"--length", "max_seq_len", "1000"}},
        {"anchor-text: a diffusion prompt outside the vocabulary names the text piece",
         "text",
         {"diffusion", "generate", "-p", "In the beginning \xe6\xbc\xa2", "--length", "32", "--steps", "2"},
         2,
         {"--prompt", "text piece"}},
    };
    run_cases(cases, out);
    // A flag already written as one is not rewritten again ("----cache").
    const auto r = test::run_program(test::text_bin(), {"diffusion", "generate", "--cache", "bogus"});
    CHECK(r.output.find("----") == std::string::npos);
}

TEST_CASE("anchor-sd and anchor-text warn where a setting goes past the model but can still run", "[cli][errors]") {
    const auto out = test::scratch_dir("warn_past_model");
    // The demo model makes 32x32 images: 64x64 runs, with a warning naming the option.
    auto r = test::run_program(
        test::sd_bin(), {"-p", "a shirt", "-W", "64", "-H", "64", "--steps", "1", "-o", out + "/w.png", "--overwrite"});
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("warning: 64x64 is larger than the 32x32") != std::string::npos);
    // --positions wrap folds positions past n_positions back: it runs, with a warning.
    r = test::run_program(test::text_bin(),
                          {"gpt2", "generate", "-p", "In the beginning", "--max-new", "4", "--kv", "sink:4,1020"});
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("warning: --kv sink:4,1020 holds 1024 tokens") != std::string::npos);
}
