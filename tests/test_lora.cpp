// LoRA loading (unet/model/lora.h) against tests/golden/sd/lora_sd15_tiny (diffusers 0.27.2 + PEFT merges of kohya and PEFT
// files on the tiny SD 1.x model): merge deltas, merged-model outputs, the txt2img run with two LoRAs, the kohya name
// table for SDXL's original-layout spellings, A1111 prompt tags, and the errors for files and specs that do not fit.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/sha256.h"
#include "cache/io/weight_map.h"
#include "tests/sd_lora_golden.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"
#include "unet/model/lora.h"
#include "unet/model/name_conversion.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

const std::string kCase = "sd/lora_sd15_tiny";

std::string lora_path(const std::string& file) {
    return test::golden(kCase + "/" + file);
}

SDModels tiny_models() {
    SDModels m;
    m.unet = load_unet_folder(test::golden("sd/unet_sd15_tiny"));
    m.text_encoder = load_text_encoder_folder(test::golden("sd/clip_tiny"));
    return m;
}

nlohmann::json case_json(const std::string& name) {
    return sdgolden::read_json_file(test::golden(kCase + "/" + name));
}

// Every module's (alpha/rank) * (up @ down) against merge_deltas, and every stored delta produced.
void check_deltas(const std::string& lora, const std::string& file, const std::string& format, bool alpha_stored) {
    SDModels m = tiny_models();
    const LoraFile f = read_lora(lora_path(file), lora_targets(m));
    CHECK(f.format == format);
    auto deltas = WeightMap::load(lora_path("merge_deltas.safetensors"));
    size_t stored = 0;
    for (const auto& n : deltas.names()) stored += n.rfind(lora + ".", 0) == 0;
    CHECK(f.modules.size() == stored);
    double worst = 0;
    for (const auto& mod : f.modules) {
        const std::string key = lora + "." + enum_name(lora_component_table(), mod.component) + "." + mod.weight;
        INFO(key);
        REQUIRE(deltas.has(key));
        CHECK(mod.alpha_stored == alpha_stored);
        const auto g = deltas.get(key);
        worst = std::max(worst, test::max_abs_diff(lora_delta(mod, g.sizes().vec()), g));
    }
    INFO(lora << ": worst delta error " << worst);
    CHECK(worst <= 1e-6);
}

// The model with `lora` alone at golden.json's single_multiplier on the stored UNet and text-encoder inputs.
void check_outputs(const std::string& lora, const std::string& file) {
    const double mult = case_json("golden.json").at("single_multiplier").get<double>();
    SDModels m = tiny_models();
    const auto applied = apply_loras(m, {{lora_path(file), mult}});
    REQUIRE(applied.size() == 1);
    CHECK(applied[0].multiplier == mult);
    CHECK(applied[0].sha256 == sha256_file(lora_path(file)));
    CHECK(m.loras.size() == 1);
    auto out = WeightMap::load(lora_path("golden_outputs.safetensors"));
    auto uin = WeightMap::load(test::golden("sd/unet_sd15_tiny/golden_inputs.safetensors"));
    auto tin = WeightMap::load(test::golden("sd/clip_tiny/golden_inputs.safetensors"));
    c10::InferenceMode guard;
    const auto u = m.unet->forward(uin.get("sample"), uin.get("timesteps_a"), uin.get("encoder_hidden_states"));
    const auto t = m.text_encoder->forward(tin.get("input_ids")).last_hidden_state;
    const double ue = test::max_abs_diff(u, out.get(lora + ".unet.out"));
    const double te = test::max_abs_diff(t, out.get(lora + ".text_encoder.last_hidden_state"));
    INFO(lora << ": UNet output max|a-b| " << ue << ", text encoder " << te);
    CHECK(ue <= 1e-4);
    CHECK(te <= 1e-4);
}

using test::error_of;

} // namespace

TEST_CASE("LoRA: kohya files with and without alpha and a PEFT file merge as the reference", "[lora]") {
    SECTION("kohya, float16, with .alpha") {
        check_deltas("kohya_a", "lora_kohya_a.safetensors", "kohya", true);
        check_outputs("kohya_a", "lora_kohya_a.safetensors");
    }
    SECTION("kohya, no .alpha (alpha = rank)") {
        check_deltas("kohya_b_noalpha", "lora_kohya_b_noalpha.safetensors", "kohya", false);
        check_outputs("kohya_b_noalpha", "lora_kohya_b_noalpha.safetensors");
    }
    SECTION("diffusers/PEFT lora_A/lora_B") {
        check_deltas("peft_c", "lora_peft_c.safetensors", "peft", false);
        check_outputs("peft_c", "lora_peft_c.safetensors");
    }
}

TEST_CASE("LoRA: kohya names match the names targets.json records, LoCon conv modules included", "[lora]") {
    SDModels m = tiny_models();
    const auto targets = case_json("targets.json");
    for (const auto& item : targets.items()) {
        const LoraFile f = read_lora(lora_path(item.value().at("file").get<std::string>()), lora_targets(m));
        std::map<std::string, std::string> got;
        for (const auto& mod : f.modules)
            got[mod.key] = enum_name(lora_component_table(), mod.component) + "." + mod.weight;
        for (const auto& t : item.value().at("targets")) {
            const std::string down = t.at("down_key").get<std::string>();
            const std::string stem = down.substr(0, down.rfind(".lora_"));
            INFO(item.key() << ": " << stem);
            CHECK(got[stem] == t.at("diffusers_weight_name").get<std::string>());
        }
    }
}

TEST_CASE("LoRA: two LoRAs at 0.8 and -0.5 reproduce the golden txt2img run", "[lora][sd]") {
    const fs::path dir = test::golden(kCase);
    const auto golden = case_json("golden.json");
    const auto pair = sdgolden::lora_pair(dir, golden, case_json("targets.json"));
    REQUIRE(pair.size() == 2);
    LoadOptions lo;
    lo.loras = pair; // merged at load, as anchor-sd does
    SDModels m = load_sd_models(std::string(ANCHOR_SOURCE_DIR) + "/assets/models/sd15-tiny-random", lo);
    REQUIRE(m.loras.size() == 2);
    const auto spec = sdgolden::lora_pair_run(dir, golden);
    for (const auto& c : sdgolden::compare_run(m, dir, spec.config, spec.run, "")) {
        INFO(c.what);
        if (c.kind == sdgolden::Comparison::Exact) {
            CHECK(torch::equal(c.actual.to(torch::kFloat64), c.golden.to(torch::kFloat64)));
        } else {
            const double err = test::max_abs_diff(c.actual, c.golden);
            const double gmax = c.golden.abs().max().item<double>();
            INFO("max|a-b| " << err << " (golden max " << gmax << ")");
            if (c.kind == sdgolden::Comparison::RelMax)
                CHECK(err <= c.atol * gmax);
            else
                CHECK(((c.actual.to(torch::kFloat64) - c.golden.to(torch::kFloat64)).abs() <=
                       c.atol + c.rtol * c.golden.to(torch::kFloat64).abs())
                          .all()
                          .item<bool>());
        }
    }
}

TEST_CASE("LoRA: SDXL kohya names in the original layout go through the name conversion", "[lora]") {
    // SDXL base layout: 3 levels, 2 resnets per level, cross attention in levels 1 and 2 (names only: no SDXL UNet
    // can be built yet). diffusers' _maybe_map_sgm_blocks_to_diffusers: input block i -> down block (i-1) / 3,
    // layer (i-1) % 3; middle_block.1 -> mid_block.attentions.0; output block i -> up block i / 3.
    UNetConfig c;
    c.block_out_channels = {320, 640, 1280};
    c.layers_per_block = {2, 2, 2};
    c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
    c.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
    LoraTargets::Part unet{LoraComponent::Unet, {}, &c};
    const auto lin = torch::zeros({1, 1}), conv = torch::zeros({1, 1, 3, 3});
    for (const char* n :
         {"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",
          "down_blocks.2.attentions.1.transformer_blocks.3.ff.net.2.weight",
          "mid_block.attentions.0.transformer_blocks.0.attn2.to_k.weight", "up_blocks.0.attentions.2.proj_out.weight",
          "up_blocks.1.attentions.0.proj_in.weight", "add_embedding.linear_1.weight"})
        unet.weights[n] = lin;
    for (const char* n : {"down_blocks.0.resnets.1.conv1.weight", "up_blocks.2.resnets.0.conv2.weight",
                          "up_blocks.0.upsamplers.0.conv.weight", "down_blocks.1.downsamplers.0.conv.weight"})
        unet.weights[n] = conv;
    const auto k = kohya_names(unet, "te");
    auto at = [&](const std::string& n) { return k.count(n) ? k.at(n) : "<none>"; };
    CHECK(at("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q") ==
          "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight");
    CHECK(at("lora_unet_input_blocks_8_1_transformer_blocks_3_ff_net_2") ==
          "down_blocks.2.attentions.1.transformer_blocks.3.ff.net.2.weight");
    CHECK(at("lora_unet_middle_block_1_transformer_blocks_0_attn2_to_k") ==
          "mid_block.attentions.0.transformer_blocks.0.attn2.to_k.weight");
    CHECK(at("lora_unet_output_blocks_2_1_proj_out") == "up_blocks.0.attentions.2.proj_out.weight");
    CHECK(at("lora_unet_output_blocks_3_1_proj_in") == "up_blocks.1.attentions.0.proj_in.weight");
    CHECK(at("lora_unet_input_blocks_2_0_in_layers_2") == "down_blocks.0.resnets.1.conv1.weight");
    CHECK(at("lora_unet_output_blocks_6_0_out_layers_3") == "up_blocks.2.resnets.0.conv2.weight");
    CHECK(at("lora_unet_output_blocks_2_2_conv") == "up_blocks.0.upsamplers.0.conv.weight");
    CHECK(at("lora_unet_input_blocks_6_0_op") == "down_blocks.1.downsamplers.0.conv.weight");
    // The diffusers spelling stays valid beside the original one.
    CHECK(at("lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q") ==
          "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight");
    CHECK(at("lora_unet_add_embedding_linear_1") == "add_embedding.linear_1.weight");
    // SDXL's two text encoders: lora_te1_ / lora_te2_.
    LoraTargets::Part te2{LoraComponent::TextEncoder2, {{"text_model.encoder.layers.1.self_attn.q_proj.weight", lin}}};
    CHECK(kohya_names(te2, "te2").count("lora_te2_text_model_encoder_layers_1_self_attn_q_proj") == 1);
}

TEST_CASE("LoRA: tensors that match no weight are all reported, naming the file", "[lora]") {
    const auto dir = test::scratch_dir("lora_unmatched");
    const std::string file = dir + "/bad.safetensors";
    const auto d = torch::ones({2, 32}), u = torch::ones({32, 2});
    save_safetensors(file,
                     {{"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight", d},
                      {"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight", u},
                      {"lora_unet_down_blocks_9_attentions_0_to_q.lora_down.weight", d},
                      {"lora_unet_down_blocks_9_attentions_0_to_q.lora_up.weight", u},
                      {"text_encoder.text_model.encoder.layers.7.mlp.fc1.lora_A.weight", d},
                      {"something_else.weight", d}});
    SDModels m = tiny_models();
    const auto before =
        m.unet->named_parameters()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"].clone();
    const std::string msg = error_of([&] { apply_loras(m, {{file, 1.0}}); });
    INFO(msg);
    CHECK(msg.find("'" + file + "'") != std::string::npos);
    CHECK(msg.find("4 of 6 tensor(s) match no weight") != std::string::npos);
    CHECK(msg.find("lora_unet_down_blocks_9_attentions_0_to_q.lora_down.weight") != std::string::npos);
    CHECK(msg.find("lora_unet_down_blocks_9_attentions_0_to_q.lora_up.weight") != std::string::npos);
    CHECK(msg.find("text_encoder.text_model.encoder.layers.7.mlp.fc1.lora_A.weight") != std::string::npos);
    CHECK(msg.find("something_else.weight") != std::string::npos);
    // Nothing merged: the file is refused whole.
    CHECK(torch::equal(
        before, m.unet->named_parameters()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"]));

    // A shape that does not fit its weight names both.
    const std::string wrong = dir + "/wrong.safetensors";
    save_safetensors(wrong, {{"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", torch::ones({2, 5})},
                             {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", torch::ones({37, 2})}});
    const std::string msg2 = error_of([&] { apply_loras(m, {{wrong, 1.0}}); });
    INFO(msg2);
    CHECK(msg2.find("text_model.encoder.layers.0.mlp.fc1.weight' [37, 32]") != std::string::npos);
    // A file that is not there is a parameter error of the LoRA list.
    try {
        apply_loras(m, {{dir + "/missing.safetensors", 1.0}});
        FAIL("no error");
    } catch (const ParamError& e) {
        CHECK(e.field() == "loras");
        CHECK(std::string(e.what()).find("missing.safetensors") != std::string::npos);
    }
}

TEST_CASE("LoRA: FILE[:MULTIPLIER] specs", "[lora]") {
    CHECK(parse_lora_spec("a.safetensors").multiplier == 1.0);
    CHECK(parse_lora_spec("a.safetensors:0.8").path == "a.safetensors");
    CHECK(parse_lora_spec("a.safetensors:0.8").multiplier == 0.8);
    CHECK(parse_lora_spec("dir/a.safetensors:-0.5").multiplier == -0.5);
    for (const char* bad :
         {"a.safetensors:abc", "a.safetensors:", "a.safetensors:0.5x", ":0.5", "", "a:inf", "a:nan"}) {
        INFO(bad);
        try {
            (void)parse_lora_spec(bad);
            FAIL("accepted");
        } catch (const ParamError& e) {
            CHECK(e.field() == "loras");
        }
    }
    try {
        (void)parse_lora_spec("a.safetensors:abc");
    } catch (const ParamError& e) {
        CHECK(std::string(e.what()).find("multiplier 'abc' is not a finite number") != std::string::npos);
    }
}

TEST_CASE("LoRA: A1111 <lora:NAME:MULTIPLIER> prompt tags", "[lora]") {
    const std::string dir = test::golden(kCase);
    const auto r = take_prompt_loras(
        {"<lora:lora_kohya_a:0.8> a photo of a cat, <lora:lora_peft_c> best <lora:lora_kohya_b_noalpha:-0.5>"}, dir);
    REQUIRE(r.prompts.size() == 1);
    CHECK(r.prompts[0] == "a photo of a cat, best");
    REQUIRE(r.loras.size() == 3);
    CHECK(r.loras[0].path == (fs::path(dir) / "lora_kohya_a.safetensors").string());
    CHECK(r.loras[0].multiplier == 0.8);
    CHECK(r.loras[1].path == (fs::path(dir) / "lora_peft_c.safetensors").string());
    CHECK(r.loras[1].multiplier == 1.0);
    CHECK(r.loras[2].multiplier == -0.5);
    // No tags: the prompts unchanged, no LoRA, no folder needed.
    const auto none = take_prompt_loras({"a cat <b>", "x"}, "");
    CHECK(none.prompts == std::vector<std::string>{"a cat <b>", "x"});
    CHECK(none.loras.empty());
    auto field_of = [&](const std::vector<std::string>& prompts, const std::string& d, std::string* what) {
        try {
            (void)take_prompt_loras(prompts, d);
        } catch (const ParamError& e) {
            *what = e.what();
            return e.field();
        }
        return std::string("<none>");
    };
    std::string what;
    CHECK(field_of({"a <lora:nope:0.5>"}, dir, &what) == "lora_model_dir");
    CHECK(what.find((fs::path(dir) / "nope.safetensors").string()) != std::string::npos);
    CHECK(field_of({"a <lora:lora_peft_c>"}, "", &what) == "lora_model_dir");
    CHECK(field_of({"a <lora:lora_peft_c:x>"}, dir, &what) == "prompts");
    CHECK(field_of({"a <lora::1>"}, dir, &what) == "prompts");
    CHECK(field_of({"a <lora:lora_peft_c>", "b"}, dir, &what) == "prompts");
    // --lora specs first, then the tags.
    std::vector<std::string> prompts{"x <lora:lora_peft_c:-0.5>"};
    const auto all = run_loras({lora_path("lora_kohya_a.safetensors") + ":0.8"}, dir, prompts);
    CHECK(prompts[0] == "x");
    REQUIRE(all.size() == 2);
    CHECK(all[0].multiplier == 0.8);
    CHECK(all[1].multiplier == -0.5);
}

TEST_CASE("anchor-sd --lora twice and <lora:...> tags reproduce the golden two-LoRA run", "[cli][sd][lora]") {
    const fs::path gdir = test::golden(kCase);
    const auto golden = case_json("golden.json");
    const auto& pl = golden.at("pipeline");
    const auto pair = sdgolden::lora_pair(gdir, golden, case_json("targets.json"));
    REQUIRE(pl.at("scheduler") == "DDIMScheduler");
    const std::string prompt = pl.at("prompts").at(0).get<std::string>();
    const auto dir = test::scratch_dir("cli_sd_lora");
    std::vector<std::string> common = {"-m",          "assets/models/sd15-tiny-random",
                                       "--sampler",   "ddim",
                                       "--steps",     std::to_string(pl.at("num_inference_steps").get<int>()),
                                       "-s",          std::to_string(pl.at("seed").get<int64_t>()),
                                       "--cfg-scale", std::to_string(pl.at("guidance_scale").get<double>()),
                                       "-W",          "16",
                                       "-H",          "16",
                                       "--threads",   "1"};
    auto flags = common;
    std::vector<std::string> tags;
    for (const auto& s : pair) {
        std::ostringstream m;
        m << s.multiplier;
        flags.insert(flags.end(), {"--lora", s.path + ":" + m.str()});
        tags.push_back("<lora:" + fs::path(s.path).stem().string() + ":" + m.str() + ">");
    }
    flags.insert(flags.end(), {"-p", prompt, "-o", dir + "/flags.png", "--save-latents", dir + "/flags.safetensors"});
    auto r = test::run_program(test::sd_bin(), flags);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    auto ours = SafeTensorsFile::open(dir + "/flags.safetensors");
    auto ref = SafeTensorsFile::open(gdir.string() + "/" + pl.at("run").get<std::string>() + ".safetensors");
    CHECK(torch::equal(ours->tensor("initial_noise"), ref->tensor("initial_noise")));
    const auto gl = ref->tensor("final_latents");
    const double lat_err = test::max_abs_diff(ours->tensor("final_latents"), gl);
    const double gmax = gl.abs().max().item<double>();
    INFO("final latents max|a-b| " << lat_err << " (golden max " << gmax << ")");
    CHECK(lat_err <= 5e-2 * gmax);
    CHECK(test::max_abs_diff(ours->tensor("image"), ref->tensor("image")) <= 5e-2);
    // The sidecar names every LoRA with its hash and multiplier.
    std::ifstream f(dir + "/flags.png.json");
    const auto rec = nlohmann::json::parse(f);
    REQUIRE(rec.at("loras").size() == 2);
    for (size_t i = 0; i < 2; ++i) {
        CHECK(rec["loras"][i]["name"] == fs::path(pair[i].path).stem().string());
        CHECK(rec["loras"][i]["sha256"] == sha256_file(pair[i].path));
        CHECK(rec["loras"][i]["multiplier"].get<double>() == pair[i].multiplier);
    }

    // The same LoRAs as prompt tags: the tags leave the prompt, so the run is the same bit for bit.
    auto tagged = common;
    tagged.insert(tagged.end(), {"-p", tags[0] + " " + prompt + " " + tags[1], "--lora-model-dir", gdir.string(), "-o",
                                 dir + "/tags.png", "--save-latents", dir + "/tags.safetensors"});
    r = test::run_program(test::sd_bin(), tagged);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    auto ours2 = SafeTensorsFile::open(dir + "/tags.safetensors");
    CHECK(torch::equal(ours2->tensor("final_latents"), ours->tensor("final_latents")));
    std::ifstream f2(dir + "/tags.png.json");
    CHECK(nlohmann::json::parse(f2).at("prompt") == prompt);

    // Bad specs are usage errors naming the option.
    r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "x", "--lora",
                                           pair[0].path + ":abc", "-o", dir + "/bad.png"});
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--lora") != std::string::npos);
    r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "x <lora:absent:1>",
                                           "--lora-model-dir", gdir.string(), "-o", dir + "/bad.png"});
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--lora-model-dir") != std::string::npos);
    CHECK(r.output.find("absent.safetensors") != std::string::npos);
}

TEST_CASE("LoRA: an SD 1.x kohya file spelled in the original LDM layout merges the same", "[lora]") {
    // lora_kohya_a with every UNet module renamed to its original-layout name (input_blocks / middle_block /
    // output_blocks, resnets' in_layers.2 / out_layers.3) through unet/model/name_conversion.
    SDModels m = tiny_models();
    const auto targets = lora_targets(m);
    const LoraFile f = read_lora(lora_path("lora_kohya_a.safetensors"), targets);
    auto src = SafeTensorsFile::open(lora_path("lora_kohya_a.safetensors"));
    std::map<std::string, std::string> renamed; // diffusers kohya stem -> LDM kohya stem
    for (const auto& mod : f.modules) {
        if (mod.component != LoraComponent::Unet) continue;
        const std::string ldm = unet_ldm_name(mod.weight, m.unet->config());
        std::string stem = "lora_unet_" + ldm.substr(0, ldm.size() - 7);
        for (auto& ch : stem)
            if (ch == '.') ch = '_';
        renamed[mod.key] = stem;
    }
    REQUIRE(renamed.size() == 16);
    CHECK(renamed["lora_unet_down_blocks_1_resnets_0_conv1"] == "lora_unet_input_blocks_4_0_in_layers_2");
    NamedTensors out;
    for (const auto& ti : src->tensors()) {
        std::string name = ti.name;
        const auto dot = name.find('.');
        if (renamed.count(name.substr(0, dot))) name = renamed[name.substr(0, dot)] + name.substr(dot);
        out.push_back({name, src->tensor(ti.name)});
    }
    const auto dir = test::scratch_dir("lora_ldm_names");
    save_safetensors(dir + "/ldm.safetensors", out);
    const LoraFile g = read_lora(dir + "/ldm.safetensors", targets);
    REQUIRE(g.modules.size() == f.modules.size());
    std::map<std::string, const LoraModule*> by_weight;
    for (const auto& mod : g.modules) by_weight[enum_name(lora_component_table(), mod.component) + mod.weight] = &mod;
    for (const auto& mod : f.modules) {
        const auto* other = by_weight[enum_name(lora_component_table(), mod.component) + mod.weight];
        REQUIRE(other);
        CHECK(torch::equal(lora_delta(*other, {-1}), lora_delta(mod, {-1})));
    }
}
