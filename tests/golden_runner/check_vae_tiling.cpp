// golden_runner checker for tiled VAE cases (../shared/golden/sd/vae_tiling_tiny): config.json names the VAE folder
// (`vae_config`) and diffusers' tiling attributes (`tiling`: tile_sample_min_size, tile_latent_min_size,
// tile_overlap_factor); golden.safetensors holds the inputs (`latents`, `image`) and the plain and tiled results
// (`decoded_<plain|tiled>`, `encoded_<mean|moments|logvar|std>_<plain|tiled>`). Every parameter comes from the case;
// a key or tensor this checker does not know FAILs the case, naming it.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "tests/golden_runner/runner.h"
#include "tests/scheduler_golden.h"
#include "unet/model/checkpoint.h"
#include "unet/model/vae_tiling.h"

#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden {
namespace {

using namespace anchor::unet;


bool claims_vae_tiling(const fs::path& d) {
    if (!has_file(d, "golden.safetensors") || !has_file(d, "config.json")) return false;
    try {
        const auto j = test::read_json_file(d / "config.json");
        return j.contains("tiling") && j["tiling"].is_object() && j.contains("vae_config") &&
               j["vae_config"].is_string();
    } catch (const std::exception&) {
        return false;
    }
}

void only_known(const nlohmann::json& j, const std::string& what, const std::set<std::string>& known) {
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) throw Error(what + ": '" + k + "' is not understood by this checker");
}

fs::path vae_folder(const fs::path& dir, const nlohmann::json& cfg) {
    return (dir / cfg.at("vae_config").get<std::string>()).parent_path();
}

// The field of a LatentDistribution a golden tensor name asks for ("mean", "moments", "logvar", "std").
torch::Tensor distribution_field(const LatentDistribution& d, const std::string& field) {
    if (field == "mean") return d.mean;
    if (field == "moments") return d.moments;
    if (field == "logvar") return d.logvar;
    if (field == "std") return d.std;
    throw Error("encoded_" + field + ": not a posterior field this checker knows");
}

void check_case(const fs::path& dir, const nlohmann::json& cfg, Stats& st) {
    only_known(cfg, "config.json",
               {"diffusers", "vae_config", "tiling", "latents", "image", "max_abs_tiled_vs_plain_decode"});
    const auto& tj = cfg.at("tiling");
    only_known(tj, "config.json tiling",
               {"call", "tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor"});
    TileSizes t;
    t.sample = tj.at("tile_sample_min_size").get<int64_t>();
    t.latent = tj.at("tile_latent_min_size").get<int64_t>();
    t.overlap = tj.at("tile_overlap_factor").get<double>();
    auto vae = load_vae_folder(vae_folder(dir, cfg).string());
    vae->eval();
    const auto g = SafeTensorsFile::open((dir / "golden.safetensors").string());
    std::set<std::string> names;
    for (const auto& ti : g->tensors()) names.insert(ti.name);
    torch::NoGradGuard ng;
    const bool has_latents = names.count("latents"), has_image = names.count("image");
    torch::Tensor plain_dec, tiled_dec;
    if (has_latents) {
        const auto z = g->tensor("latents");
        plain_dec = vae->decode(z);
        tiled_dec = vae_decode(*vae, z, t);
        st.check_true("latents larger than a tile (the tiled path runs)",
                      z.size(-1) > t.latent || z.size(-2) > t.latent,
                      "latents " + std::to_string(z.size(-2)) + "x" + std::to_string(z.size(-1)) + ", tile " +
                          std::to_string(t.latent));
    }
    LatentDistribution plain_enc, tiled_enc;
    if (has_image) {
        const auto x = g->tensor("image");
        plain_enc = vae->encode(x);
        tiled_enc = vae_encode(*vae, x, t);
    }
    for (const auto& name : names) {
        if (name == "latents" || name == "image") continue;
        const auto us = name.rfind('_');
        const std::string stem = us == std::string::npos ? name : name.substr(0, us),
                          how = us == std::string::npos ? "" : name.substr(us + 1);
        if (how != "plain" && how != "tiled") {
            st.fail("golden tensor '" + name + "' is not understood by this checker");
            continue;
        }
        const bool tiled = how == "tiled";
        if (stem == "decoded") {
            if (!has_latents) throw Error(name + " without the 'latents' it decodes");
            st.check(name, tiled ? tiled_dec : plain_dec, g->tensor(name), kAtol, kRtol);
        } else if (stem.rfind("encoded_", 0) == 0) {
            if (!has_image) throw Error(name + " without the 'image' it encodes");
            st.check(name, distribution_field(tiled ? tiled_enc : plain_enc, stem.substr(8)), g->tensor(name), kAtol,
                     kRtol);
        } else {
            st.fail("golden tensor '" + name + "' is not understood by this checker");
        }
    }
    if (cfg.contains("max_abs_tiled_vs_plain_decode")) {
        if (!has_latents) throw Error("max_abs_tiled_vs_plain_decode without 'latents'");
        const double want = cfg["max_abs_tiled_vs_plain_decode"].get<double>();
        const double got = (tiled_dec - plain_dec).abs().max().item<double>();
        st.check_true("max_abs_tiled_vs_plain_decode", std::abs(got - want) <= kAtol + kRtol * std::abs(want),
                      "got " + std::to_string(got) + ", the case says " + std::to_string(want));
    }
}

const bool registered_vae_tiling =
    register_checker({"sd-vae-tiling", claims_vae_tiling, [](const fs::path& dir, const Context& ctx) {
                          return std::vector<CaseResult>{guarded(relative_name(dir, ctx) + "/tiled", [&](Stats& st) {
                              check_case(dir, test::read_json_file(dir / "config.json"), st);
                          })};
                      }});

// The case's VAE folder: it loads (every tensor used); its decode and encode are the case above.
const bool registered_vae_tiling_vae =
    register_checker({"sd-vae-tiling-vae",
                      [](const fs::path& d) {
                          const auto parent = d.parent_path();
                          if (!claims_vae_tiling(parent)) return false;
                          return fs::equivalent(vae_folder(parent, test::read_json_file(parent / "config.json")), d);
                      },
                      [](const fs::path& dir, const Context& ctx) {
                          return std::vector<CaseResult>{
                              guarded(relative_name(dir, ctx) + ":loads (decode/encode checked by the case above)",
                                      [&](Stats&) { (void)load_vae_folder(dir.string()); })};
                      }});

} // namespace
} // namespace anchor::golden
