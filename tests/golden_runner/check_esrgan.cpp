// golden_runner checker for ESRGAN upscaler cases (tests/golden/sd/esrgan_tiny): cases.json ("kind": "esrgan") lists
// each network's files (.pth and .safetensors of one RRDBNet), the sizes spandrel read from it and the input images;
// golden.safetensors holds the inputs (`input_<image>`) and spandrel's raw outputs (`out_<case>_<image>`). Each file
// must load with those sizes and give those outputs (unet/model/esrgan.h); the tiled upscale (unet/pipeline/upscale.h)
// with an overlap wider than the network's receptive field must give the clamped outputs too. A key this checker does
// not know FAILs the case, naming it.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "tests/golden_runner/runner.h"
#include "tests/scheduler_golden.h"
#include "unet/model/esrgan.h"
#include "unet/pipeline/upscale.h"

#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden {
namespace {

using namespace anchor::unet;

bool esrgan_claims(const fs::path& d) {
    if (!has_file(d, "cases.json") || !has_file(d, "golden.safetensors")) return false;
    try {
        return test::read_json_file(d / "cases.json").value("kind", "") == "esrgan";
    } catch (const std::exception&) {
        return false;
    }
}

void esrgan_only_known(const nlohmann::json& j, const std::string& what, const std::set<std::string>& known) {
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) throw Error(what + ": '" + k + "' is not understood by this checker");
}

void esrgan_check_file(const fs::path& dir, const nlohmann::json& c, const std::string& file, const SafeTensorsFile& g,
                       double atol, double rtol, Stats& st) {
    const auto m = load_esrgan((dir / file).string());
    const std::pair<const char*, int64_t> sizes[] = {{"scale", m.scale},
                                                     {"in_channels", m.in_channels},
                                                     {"out_channels", m.out_channels},
                                                     {"nf", m.nf},
                                                     {"nb", m.nb},
                                                     {"gc", m.gc},
                                                     {"shuffle_factor", m.shuffle}};
    for (const auto& [key, got] : sizes)
        st.check_true(std::string(key) + " read from the shapes", c.at(key).get<int64_t>() == got,
                      "expected " + std::to_string(c.at(key).get<int64_t>()) + ", got " + std::to_string(got));
    // An overlap past the receptive field (1 + 15 nb + 1 convs before upsampling, 2 + upsamplings after, in input
    // pixels at most that many): the tiles' crops are the untiled pixels.
    UpscaleTiling tiling;
    tiling.tile = 4;
    tiling.overlap = 2 + 15 * m.nb + 2 + m.upsamplings + m.shuffle;
    for (const auto& img : c.at("images")) {
        const std::string name = img.get<std::string>();
        const auto x = g.tensor("input_" + name);
        const auto want = g.tensor("out_" + c.at("name").get<std::string>() + "_" + name);
        st.check(file + ":" + name, m.forward(x), want, atol, rtol);
        const auto tiled = esrgan_upscale(m, x, tiling);
        st.check(file + ":" + name + ":tiled", tiled, want.clamp(0.0, 1.0), atol, rtol);
    }
}

const bool registered_esrgan =
    register_checker({"esrgan-upscaler", esrgan_claims, [](const fs::path& dir, const Context& ctx) {
                          std::vector<CaseResult> out;
                          const std::string base = relative_name(dir, ctx);
                          nlohmann::json cfg;
                          std::shared_ptr<SafeTensorsFile> g;
                          try {
                              cfg = test::read_json_file(dir / "cases.json");
                              esrgan_only_known(cfg, "cases.json", {"kind", "generated_with", "tolerance", "cases"});
                              g = SafeTensorsFile::open((dir / "golden.safetensors").string());
                          } catch (const std::exception& e) {
                              const std::string why = e.what();
                              out.push_back(guarded(base, [&](Stats&) { throw Error(why); }));
                              return out;
                          }
                          const double atol = cfg.at("tolerance").at("atol").get<double>();
                          const double rtol = cfg.at("tolerance").at("rtol").get<double>();
                          for (const auto& c : cfg.at("cases"))
                              for (const auto& f : c.at("files")) {
                                  const std::string file = f.get<std::string>();
                                  out.push_back(guarded(base + ":" + file, [&](Stats& st) {
                                      esrgan_only_known(c, "cases.json case",
                                                        {"name", "files", "layout", "scale", "in_channels",
                                                         "out_channels", "nf", "nb", "gc", "shuffle_factor", "images"});
                                      esrgan_check_file(dir, c, file, *g, atol, rtol, st);
                                  }));
                              }
                          return out;
                      }});

} // namespace
} // namespace anchor::golden
