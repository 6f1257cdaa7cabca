// RRDBNet: the layouts' names mapped onto one (basicsr's), the sizes read from the shapes, the forward pass in the
// operation order of the reference implementations (spandrel's ESRGAN / basicsr's RRDBNet).
#include "unet/model/esrgan.h"

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/torch_checkpoint.h"

#include <filesystem>
#include <set>

namespace anchor::unet {

namespace fs = std::filesystem;
namespace F = torch::nn::functional;

namespace {

enum class EsrLayout { Basicsr, Original, Bsrgan };

std::vector<std::string> esr_split(const std::string& s) {
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t dot; (dot = s.find('.', start)) != std::string::npos; start = dot + 1)
        parts.push_back(s.substr(start, dot - start));
    parts.push_back(s.substr(start));
    return parts;
}

bool esr_is_index(const std::string& s) {
    return !s.empty() && s.size() < 6 && s.find_first_not_of("0123456789") == std::string::npos;
}

// basicsr wraps its state dict as {"params_ema": ..., "params": ...} (the unpickler names the nested tensors
// "params_ema.<name>"); the EMA weights are the ones its inference scripts load.
std::map<std::string, at::Tensor> esr_unwrap(const std::map<std::string, at::Tensor>& in) {
    for (const std::string prefix : {"params_ema.", "params.", "state_dict."}) {
        std::map<std::string, at::Tensor> out;
        for (const auto& [k, v] : in)
            if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
        if (!out.empty()) return out;
    }
    return in;
}

// The original ESRGAN layout (a torch.nn.Sequential): model.0 = first conv, model.1 = the shortcut around
// sub.0..sub.{nb-1} (RRDBs, each conv a Sequential with the conv at .0) and sub.{nb} (the trunk conv), then per 2x
// upsampling [Upsample, conv, LeakyReLU] at 3i-1..3i+1 (i = 1..n), the HR conv at 3n+2 and the last conv at 3n+4.
// Returns basicsr names; names it cannot place keep their own (and are reported as unexpected).
std::map<std::string, at::Tensor> esr_from_original(const std::map<std::string, at::Tensor>& in,
                                                    std::map<std::string, std::string>& file_name) {
    int64_t nb = 0, top = -1;
    for (const auto& [k, v] : in) {
        const auto p = esr_split(k);
        if (p.size() == 8 && p[0] == "model" && p[1] == "1" && p[2] == "sub" && esr_is_index(p[3]))
            nb = std::max<int64_t>(nb, std::stoll(p[3]) + 1);
        if (p.size() == 3 && p[0] == "model" && esr_is_index(p[1])) top = std::max<int64_t>(top, std::stoll(p[1]));
    }
    const int64_t n_up = top >= 4 && (top - 4) % 3 == 0 ? (top - 4) / 3 : -1;
    std::map<std::string, at::Tensor> out;
    for (const auto& [k, v] : in) {
        const auto p = esr_split(k);
        std::string name = k;
        if (p[0] == "model" && p.size() >= 3 && esr_is_index(p[1])) {
            const int64_t i = std::stoll(p[1]);
            const std::string& wb = p.back();
            if (p.size() == 3 && i == 0) {
                name = "conv_first." + wb;
            } else if (p.size() == 3 && n_up >= 0 && i == 3 * n_up + 2) {
                name = "conv_hr." + wb;
            } else if (p.size() == 3 && n_up >= 0 && i == 3 * n_up + 4) {
                name = "conv_last." + wb;
            } else if (p.size() == 3 && n_up >= 0 && i % 3 == 0 && i >= 3 && i <= 3 * n_up) {
                name = "conv_up" + std::to_string(i / 3) + "." + wb;
            } else if (i == 1 && p.size() == 5 && p[2] == "sub" && p[3] == std::to_string(nb)) {
                name = "conv_body." + wb;
            } else if (i == 1 && p.size() == 8 && p[2] == "sub" && p[4].rfind("RDB", 0) == 0 &&
                       p[5].rfind("conv", 0) == 0 && p[6] == "0") {
                name = "body." + p[3] + ".rdb" + p[4].substr(3) + "." + p[5] + "." + wb;
            }
        }
        out[name] = v;
        file_name[name] = k;
    }
    return out;
}

// BSRGAN / RealSR (ESRGAN's second code release): RRDB_trunk, trunk_conv, upconvK, HRconv.
std::map<std::string, at::Tensor> esr_from_bsrgan(const std::map<std::string, at::Tensor>& in,
                                                  std::map<std::string, std::string>& file_name) {
    std::map<std::string, at::Tensor> out;
    for (const auto& [k, v] : in) {
        auto p = esr_split(k);
        std::string name = k;
        if (p.size() == 5 && p[0] == "RRDB_trunk" && p[2].rfind("RDB", 0) == 0)
            name = "body." + p[1] + ".rdb" + p[2].substr(3) + "." + p[3] + "." + p[4];
        else if (p.size() == 2 && p[0] == "trunk_conv")
            name = "conv_body." + p[1];
        else if (p.size() == 2 && p[0].rfind("upconv", 0) == 0)
            name = "conv_up" + p[0].substr(6) + "." + p[1];
        else if (p.size() == 2 && p[0] == "HRconv")
            name = "conv_hr." + p[1];
        out[name] = v;
        file_name[name] = k;
    }
    return out;
}

at::Tensor esr_conv(const at::Tensor& x, const EsrganConv& c) {
    return at::conv2d(x, c.weight, c.bias, {1, 1}, {1, 1});
}

at::Tensor esr_lrelu(const at::Tensor& x) {
    return at::leaky_relu(x, 0.2);
}

std::string esr_listing(const std::vector<std::string>& names, size_t most) {
    std::string s;
    for (size_t i = 0; i < names.size() && i < most; ++i) s += (i ? ", " : "") + names[i];
    if (names.size() > most) s += ", ... (" + std::to_string(names.size()) + " in all)";
    return s;
}

} // namespace

EsrganModel esrgan_from_tensors(const std::map<std::string, at::Tensor>& tensors, const std::string& label) {
    const auto in = esr_unwrap(tensors);
    std::map<std::string, std::string> file_name; // basicsr name -> the file's own
    std::map<std::string, at::Tensor> t;
    EsrLayout layout;
    if (in.count("conv_first.weight") &&
        (in.count("trunk_conv.weight") || in.count("RRDB_trunk.0.RDB1.conv1.weight"))) {
        layout = EsrLayout::Bsrgan;
        t = esr_from_bsrgan(in, file_name);
    } else if (in.count("conv_first.weight")) {
        layout = EsrLayout::Basicsr;
        t = in;
        for (const auto& [k, v] : in) file_name[k] = k;
    } else if (in.count("model.0.weight")) {
        layout = EsrLayout::Original;
        t = esr_from_original(in, file_name);
    } else {
        std::vector<std::string> names;
        for (const auto& [k, v] : tensors) names.push_back(k);
        throw Error("'" + label +
                    "' is not an RRDBNet (ESRGAN) upscaler: missing its first convolution (conv_first.weight, or "
                    "model.0.weight in the original ESRGAN layout); the file has " +
                    std::to_string(names.size()) + " tensors: " + esr_listing(names, 6));
    }
    const auto cf = t.at("conv_first.weight");
    if (cf.dim() != 4)
        throw Error("'" + label + "': conv_first.weight has shape " + shape_str(cf.sizes().vec()) +
                    ", expected a 3x3 convolution [nf, in, 3, 3]");
    EsrganModel m;
    m.nf = cf.size(0);
    const int64_t net_in = cf.size(1);
    // Sizes from the names present: blocks and upsamplings are counted, gc read from the first dense conv.
    std::set<int64_t> blocks, ups;
    for (const auto& [k, v] : t) {
        const auto p = esr_split(k);
        if (p.size() == 5 && p[0] == "body" && esr_is_index(p[1])) blocks.insert(std::stoll(p[1]));
        if (p.size() == 2 && p[0].rfind("conv_up", 0) == 0 && esr_is_index(p[0].substr(7)))
            ups.insert(std::stoll(p[0].substr(7)));
    }
    m.nb = blocks.empty() ? 0 : *blocks.rbegin() + 1;
    m.upsamplings = ups.empty() ? 0 : *ups.rbegin();
    m.gc = t.count("body.0.rdb1.conv1.weight") ? t.at("body.0.rdb1.conv1.weight").size(0) : 32;
    m.out_channels = t.count("conv_last.weight") ? t.at("conv_last.weight").size(0) : 3;
    // Real-ESRGAN x2plus / x1: pixel-unshuffle by 2 / 4 in front, so the first conv sees 4x / 16x the channels.
    if (net_in == 4 * m.out_channels) m.shuffle = 2;
    if (net_in == 16 * m.out_channels) m.shuffle = 4;
    m.in_channels = net_in / (m.shuffle * m.shuffle);

    // Every tensor the sizes imply, with its shape; all missing ones and all left over are reported together.
    std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
    auto conv = [&](const std::string& base, int64_t out, int64_t inn) {
        expected.push_back({base + ".weight", {out, inn, 3, 3}});
        expected.push_back({base + ".bias", {out}});
    };
    conv("conv_first", m.nf, net_in);
    for (int64_t b = 0; b < m.nb; ++b)
        for (int r = 1; r <= 3; ++r)
            for (int c = 1; c <= 5; ++c)
                conv("body." + std::to_string(b) + ".rdb" + std::to_string(r) + ".conv" + std::to_string(c),
                     c == 5 ? m.nf : m.gc, m.nf + (c - 1) * m.gc);
    conv("conv_body", m.nf, m.nf);
    for (int64_t u = 1; u <= m.upsamplings; ++u) conv("conv_up" + std::to_string(u), m.nf, m.nf);
    conv("conv_hr", m.nf, m.nf);
    conv("conv_last", m.out_channels, m.nf);
    std::vector<std::string> missing, unexpected;
    std::set<std::string> known;
    for (const auto& [name, shape] : expected) {
        known.insert(name);
        if (!t.count(name)) {
            missing.push_back(name);
            continue;
        }
        const auto& v = t.at(name);
        if (v.sizes().vec() != shape)
            throw Error("'" + label + "': tensor '" + file_name.at(name) + "' has shape " + shape_str(v.sizes().vec()) +
                        ", expected " + shape_str(shape) + " for an RRDBNet with nf " + std::to_string(m.nf) + ", gc " +
                        std::to_string(m.gc) + " (read from conv_first and " + "the first dense block)");
        if (!v.is_floating_point())
            throw Error("'" + label + "': tensor '" + file_name.at(name) + "' is not floating point");
    }
    for (const auto& [k, v] : t)
        if (!known.count(k)) unexpected.push_back(file_name.count(k) ? file_name.at(k) : k);
    if (m.nb == 0 && missing.empty()) missing.push_back("body.0.rdb1.conv1.weight");
    if (!missing.empty() || !unexpected.empty()) {
        const char* lay = layout == EsrLayout::Original ? "original ESRGAN"
                          : layout == EsrLayout::Bsrgan ? "BSRGAN"
                                                        : "basicsr / Real-ESRGAN";
        std::string msg = "'" + label + "' is not an RRDBNet (ESRGAN) upscaler of the " + lay + " layout that " +
                          "its conv_first implies (nf " + std::to_string(m.nf) + ", nb " + std::to_string(m.nb) + ", " +
                          std::to_string(m.upsamplings) + " upsamplings)";
        if (!missing.empty())
            msg += ": missing " + std::to_string(missing.size()) +
                   " tensor(s) (in basicsr names): " + esr_listing(missing, 1000);
        if (!unexpected.empty())
            msg += std::string(missing.empty() ? ":" : ";") + " unexpected tensor(s): " + esr_listing(unexpected, 8);
        throw Error(msg);
    }
    if ((int64_t(1) << m.upsamplings) % m.shuffle != 0)
        throw Error("'" + label + "': " + std::to_string(m.upsamplings) +
                    " 2x upsampling(s) after a pixel-unshuffle by " + std::to_string(m.shuffle) +
                    " is not an integer scale");
    m.scale = (int64_t(1) << m.upsamplings) / m.shuffle;

    auto take = [&](const std::string& base) {
        return EsrganConv{t.at(base + ".weight").to(torch::kFloat).contiguous().clone(),
                          t.at(base + ".bias").to(torch::kFloat).contiguous().clone()};
    };
    m.conv_first = take("conv_first");
    m.rrdb.resize(size_t(m.nb));
    for (int64_t b = 0; b < m.nb; ++b)
        for (int r = 1; r <= 3; ++r) {
            m.rrdb[size_t(b)].emplace_back();
            for (int c = 1; c <= 5; ++c)
                m.rrdb[size_t(b)].back().push_back(
                    take("body." + std::to_string(b) + ".rdb" + std::to_string(r) + ".conv" + std::to_string(c)));
        }
    m.conv_body = take("conv_body");
    for (int64_t u = 1; u <= m.upsamplings; ++u) m.conv_up.push_back(take("conv_up" + std::to_string(u)));
    m.conv_hr = take("conv_hr");
    m.conv_last = take("conv_last");
    return m;
}

EsrganModel load_esrgan(const std::string& path) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) throw Error("upscale model '" + path + "' does not exist or is not a file");
    if (fs::file_size(path, ec) == 0) throw Error("upscale model '" + path + "' is empty");
    std::map<std::string, at::Tensor> tensors;
    switch (sniff_weight_file(path)) {
    case WeightFileKind::SafeTensors: {
        const auto f = SafeTensorsFile::open(path);
        for (const auto& ti : f->tensors()) tensors[ti.name] = f->tensor(ti.name).clone();
        break;
    }
    case WeightFileKind::TorchZip:
    case WeightFileKind::TorchLegacy: { // TorchCheckpoint says how to convert the legacy format
        const auto c = TorchCheckpoint::open(path);
        for (const auto& n : c->names()) tensors[n] = c->tensor(n);
        break;
    }
    case WeightFileKind::Other:
        throw Error("upscale model '" + path + "' is neither a safetensors file nor a torch.save archive (corrupt?)");
    }
    auto m = esrgan_from_tensors(tensors, path);
    m.path = path;
    m.name = fs::path(path).stem().string();
    return m;
}

at::Tensor EsrganModel::forward_aligned(const at::Tensor& x) const {
    torch::NoGradGuard ng;
    const auto h = shuffle > 1 ? at::pixel_unshuffle(x, shuffle) : x;
    const auto feat = esr_conv(h, conv_first);
    at::Tensor body = feat;
    for (const auto& block : rrdb) {
        const at::Tensor block_in = body;
        at::Tensor y = body;
        for (const auto& rdb : block) { // residual dense block: five convs on the concatenated features
            std::vector<at::Tensor> feats{y};
            for (size_t c = 0; c < 4; ++c) feats.push_back(esr_lrelu(esr_conv(at::cat(feats, 1), rdb[c])));
            y = esr_conv(at::cat(feats, 1), rdb[4]) * 0.2 + y; // residual scaling (ESRGAN Sec. 3.1)
        }
        body = y * 0.2 + block_in;
    }
    at::Tensor out = feat + esr_conv(body, conv_body);
    for (const auto& up : conv_up)
        out = esr_lrelu(esr_conv(
            F::interpolate(
                out, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(torch::kNearest)),
            up));
    return esr_conv(esr_lrelu(esr_conv(out, conv_hr)), conv_last);
}

at::Tensor EsrganModel::forward(const at::Tensor& x) const {
    if (x.dim() != 4 || x.size(1) != in_channels)
        throw Error("upscale model '" + name + "': expected an image batch [N, " + std::to_string(in_channels) +
                    ", H, W], got " + shape_str(x.sizes().vec()));
    const int64_t hh = x.size(2), ww = x.size(3);
    const int64_t ph = (shuffle - hh % shuffle) % shuffle, pw = (shuffle - ww % shuffle) % shuffle;
    if (ph >= hh || pw >= ww) // reflection padding needs more pixels than it adds
        throw Error("upscale model '" + name + "': an image of " + std::to_string(ww) + "x" + std::to_string(hh) +
                    " is too small for its pixel-unshuffle by " + std::to_string(shuffle));
    const auto xp = ph || pw ? F::pad(x, F::PadFuncOptions({0, pw, 0, ph}).mode(torch::kReflect)) : x;
    const auto y = forward_aligned(xp);
    return ph || pw ? y.narrow(2, 0, hh * scale).narrow(3, 0, ww * scale).contiguous() : y;
}

std::string EsrganModel::describe() const {
    std::string s = "RRDBNet " + std::to_string(scale) + "x (nf " + std::to_string(nf) + ", nb " + std::to_string(nb) +
                    ", gc " + std::to_string(gc) + ")";
    if (shuffle > 1) s += ", pixel-unshuffle " + std::to_string(shuffle);
    return s;
}

} // namespace anchor::unet
