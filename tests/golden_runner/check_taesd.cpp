// golden_runner checker for AutoencoderTiny (TAESD) cases (../shared/golden/sd/taesd_tiny): a folder whose
// config.json names class AutoencoderTiny, with the model's diffusers folder (its "config" key: <dir>/config.json) and
// golden.safetensors holding the inputs (image, latents) and diffusers' outputs (encoded, decoded). The inputs'
// recipes (torch.rand / randn with a seed) are re-drawn and compared to the stored ones; every key of config.json must
// be one this checker understands, else the case FAILs naming it. Also loads the same weights through madebyollin's
// single-file names (taesd_single_file_name) and checks both layouts give the same tensors.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/runner.h"
#include "tests/scheduler_golden.h"
#include "unet/model/taesd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <regex>
#include <sstream>
#include <set>

namespace anchor::golden {
namespace {

using namespace anchor::unet;


bool claims_taesd(const fs::path& d) {
    if (!has_file(d, "config.json") || !has_file(d, "golden.safetensors")) return false;
    try {
        const auto j = test::read_json_file(d / "config.json");
        return j.is_object() && j.value("class", "") == "AutoencoderTiny";
    } catch (const std::exception&) {
        return false;
    }
}

// "torch.rand((2,3,128,128), seed 306) * 2 - 1" / "randn((2,4,16,16), seed 307)": the tensor drawn by a CPU
// generator with that seed, as torch.manual_seed gives it.
torch::Tensor redraw(const std::string& key, const std::string& recipe) {
    static const std::regex re(R"(^\s*(?:torch\.)?(rand|randn)\(\(([0-9,\s]+)\),\s*seed\s+([0-9]+)\)\s*(\*\s*2\s*-\s*1)?\s*$)");
    std::smatch m;
    if (!std::regex_match(recipe, m, re)) throw Error("config.json " + key + ": recipe '" + recipe + "' is not understood");
    std::vector<int64_t> shape;
    std::stringstream ss(m[2].str());
    for (std::string part; std::getline(ss, part, ',');)
        if (part.find_first_not_of(" ") != std::string::npos) shape.push_back(std::stoll(part));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(std::stoull(m[3].str()));
    auto t = m[1] == "rand" ? torch::rand(shape, gen, torch::kFloat32) : torch::randn(shape, gen, torch::kFloat32);
    if (m[4].matched) t = t * 2 - 1;
    return t;
}

void expect_call(const nlohmann::json& cfg, const std::string& key, const std::string& want) {
    const std::string got = cfg.at(key).get<std::string>();
    if (got != want) throw Error("config.json " + key + ": '" + got + "' is not understood (expected '" + want + "')");
}

std::vector<CaseResult> run_taesd(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    std::vector<CaseResult> out;
    AutoencoderTiny model{nullptr};
    std::shared_ptr<SafeTensorsFile> g;
    out.push_back(guarded(base + "/encode", [&](Stats& st) {
        const auto cfg = test::read_json_file(dir / "config.json");
        const std::set<std::string> known{"diffusers", "class", "config", "image", "latents", "encoded", "decoded",
                                          "note"};
        for (const auto& [k, v] : cfg.items())
            if (!known.count(k)) throw Error("config.json: '" + k + "' is not understood by this checker");
        const fs::path model_dir = dir / fs::path(cfg.at("config").get<std::string>()).parent_path();
        model = load_taesd(model_dir.string());
        g = SafeTensorsFile::open((dir / "golden.safetensors").string());
        expect_call(cfg, "encoded", "vae.encode(image).latents");
        expect_call(cfg, "decoded", "vae.decode(latents).sample");
        const auto image = g->tensor("image");
        st.check("image", redraw("image", cfg.at("image").get<std::string>()), image, 0.0, 0.0);
        torch::NoGradGuard ng;
        st.check("encoded", model->encode(image), g->tensor("encoded"), kAtol, kRtol);
    }));
    out.push_back(guarded(base + "/decode", [&](Stats& st) {
        if (!model || !g) throw Error("the model did not load (see " + base + "/encode)");
        const auto cfg = test::read_json_file(dir / "config.json");
        const auto latents = g->tensor("latents");
        st.check("latents", redraw("latents", cfg.at("latents").get<std::string>()), latents, 0.0, 0.0);
        torch::NoGradGuard ng;
        st.check("decoded", model->decode(latents), g->tensor("decoded"), kAtol, kRtol);
    }));
    // The single-file layout: the same weights under madebyollin's names (written to a temporary folder) load to the
    // same tensors and the same outputs.
    out.push_back(guarded(base + "/single-file", [&](Stats& st) {
        if (!model || !g) throw Error("the model did not load (see " + base + "/encode)");
        const auto tmp = fs::temp_directory_path() / ("golden_taesd_" + std::to_string(::getpid()));
        fs::create_directories(tmp);
        NamedTensors enc, dec;
        for (const auto& item : model->named_parameters()) {
            const std::string& name = item.key();
            const torch::Tensor& t = item.value();
            const bool is_dec = name.rfind("decoder.layers.", 0) == 0;
            std::string rest = name.substr(std::string(is_dec ? "decoder.layers." : "encoder.layers.").size());
            const auto dot = rest.find('.');
            const int i = std::stoi(rest.substr(0, dot)) + (is_dec ? 1 : 0);
            (is_dec ? dec : enc).emplace_back(std::to_string(i) + rest.substr(dot), t.detach().clone());
        }
        anchor::save_safetensors((tmp / "taesd_encoder.safetensors").string(), enc);
        anchor::save_safetensors((tmp / "taesd_decoder.safetensors").string(), dec);
        auto single = load_taesd((tmp / "taesd_decoder.safetensors").string());
        fs::remove_all(tmp);
        st.check_true("both coders", single->has_encoder() && single->has_decoder());
        const auto a = model->named_parameters(), b = single->named_parameters();
        st.check_true("tensor count", a.size() == b.size());
        for (const auto& item : a) st.check(item.key(), b[item.key()], item.value(), 0.0, 0.0);
        torch::NoGradGuard ng;
        st.check("decoded", single->decode(g->tensor("latents")), g->tensor("decoded"), kAtol, kRtol);
    }));
    return out;
}

// The AutoencoderTiny folder the case above names in "config": loaded, its configuration against the weights' shapes
// (the outputs are checked by the case).
bool named_by_taesd_case(const fs::path& d) {
    if (config_class(d) != "AutoencoderTiny" || !claims_taesd(d.parent_path())) return false;
    try {
        const auto cfg = test::read_json_file(d.parent_path() / "config.json");
        return fs::path(cfg.at("config").get<std::string>()).parent_path() == d.filename();
    } catch (const std::exception&) {
        return false;
    }
}

std::vector<CaseResult> run_taesd_folder(const fs::path& dir, const Context& ctx) {
    return {guarded(relative_name(dir, ctx) + ":loads (outputs checked by the case above)", [&](Stats& st) {
        auto m = load_taesd(dir.string());
        const auto& c = m->config();
        const auto shapes = TaesdConfig::detect_from_weights(WeightMap::load(dir.string()));
        st.check_true("encoder levels", shapes.encoder_block_out_channels == c.encoder_block_out_channels &&
                                            shapes.num_encoder_blocks == c.num_encoder_blocks);
        st.check_true("decoder levels", shapes.decoder_block_out_channels == c.decoder_block_out_channels &&
                                            shapes.num_decoder_blocks == c.num_decoder_blocks);
        st.check_true("latent_channels", shapes.latent_channels == c.latent_channels);
        bool finite = true;
        for (const auto& p : m->parameters()) finite = finite && torch::isfinite(p).all().item<bool>();
        st.check_true("weights finite", finite);
    })};
}

const bool registered_taesd = register_checker({"sd-taesd", claims_taesd, run_taesd});
const bool registered_taesd_folder = register_checker({"sd-taesd-weights", named_by_taesd_case, run_taesd_folder});

} // namespace
} // namespace anchor::golden
