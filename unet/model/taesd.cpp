// AutoencoderTiny (TAESD) with diffusers 0.27 semantics (../shared/golden/sd/taesd_tiny, tests/golden_runner/
// check_taesd.cpp).
#include "unet/model/taesd.h"
#include "unet/model/layers.h"

#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/weight_map.h"
#include "cache/util/heap.h"
#include "unet/model/checkpoint.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <filesystem>
#include <map>

namespace fs = std::filesystem;

namespace anchor::unet {

using torch::Tensor;

namespace {

const EnumTable<TinyActivation>& activation_table() {
    // diffusers' ACTIVATION_FUNCTIONS keys ("swish" and "silu" are the same module).
    static const EnumTable<TinyActivation> t{{"relu", TinyActivation::Relu},
                                             {"silu", TinyActivation::Silu},
                                             {"swish", TinyActivation::Silu},
                                             {"gelu", TinyActivation::Gelu},
                                             {"mish", TinyActivation::Mish}};
    return t;
}

torch::nn::Functional activation(TinyActivation a) {
    switch (a) {
    case TinyActivation::Silu: return torch::nn::Functional([](const Tensor& x) { return torch::silu(x); });
    case TinyActivation::Gelu: return torch::nn::Functional([](const Tensor& x) { return torch::gelu(x); });
    case TinyActivation::Mish: return torch::nn::Functional([](const Tensor& x) { return x * torch::tanh(torch::softplus(x)); });
    case TinyActivation::Relu: break;
    }
    return torch::nn::Functional([](const Tensor& x) { return torch::relu(x); });
}

void check_levels(const std::vector<int>& channels, const std::vector<int>& blocks, const char* what,
                  const std::string& source) {
    if (channels.empty() || channels.size() != blocks.size())
        throw Error("'" + source + "': " + what + "_block_out_channels (" + std::to_string(channels.size()) +
                    " levels) and num_" + what + "_blocks (" + std::to_string(blocks.size()) +
                    " levels) must be non-empty lists of one length");
    for (size_t i = 0; i < channels.size(); ++i)
        if (channels[i] < 1 || blocks[i] < 0)
            throw Error("'" + source + "': " + what + " level " + std::to_string(i) + " has " +
                        std::to_string(channels[i]) + " channels and " + std::to_string(blocks[i]) + " blocks");
}

// The index of `name`'s first component when `name` starts with "<prefix><digits>.", else -1.
int layer_index(const std::string& name, const std::string& prefix, std::string* rest = nullptr) {
    if (name.compare(0, prefix.size(), prefix) != 0) return -1;
    size_t i = prefix.size(), j = i;
    while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
    if (j == i || j >= name.size() || name[j] != '.' || j - i > 6) return -1;
    if (rest) *rest = name.substr(j + 1);
    return std::stoi(name.substr(i, j - i));
}

// What each layer index of a diffusers-named coder holds: 'c' a convolution, 'b' a block (nothing: an activation or
// an upsample), with the convolutions' weight shapes.
struct LayerPlan {
    std::map<int, char> kind;
    std::map<int, std::vector<int64_t>> conv_shape;
};

LayerPlan plan_of(const WeightMap& w, const std::string& prefix) {
    LayerPlan p;
    for (const auto& name : w.names()) {
        std::string rest;
        const int i = layer_index(name, prefix, &rest);
        if (i < 0) continue;
        if (rest == "weight") {
            p.kind[i] = 'c';
            p.conv_shape[i] = w.shape(name);
        } else if (rest.rfind("conv.", 0) == 0) {
            p.kind[i] = 'b';
            if (rest == "conv.0.weight") p.conv_shape[i] = w.shape(name);
        }
    }
    return p;
}

// A TAESD Sequential on `how`'s paths: its convolutions through perf::conv2d; on oneDNN a 2x nearest upsample and the
// 3x3 convolution after it as one resize-convolution (perf::upsample2x_conv3x3, as the VAE's Upsample2D) and the ReLUs
// in place on the convolutions' own outputs; the rest (other activations, the blocks, which follow their own paths) as
// they are. `upsample`: the coder's upsampling factor (0: none).
Tensor run_layers(torch::nn::Sequential& s, Tensor x, const perf::FastPaths& how, TinyActivation act, int upsample) {
    if (!how.fast) return s->forward(x);
    const bool onednn = perf::use_onednn(how);
    const size_t n = s->size();
    for (size_t i = 0; i < n; ++i) {
        auto& any = *(s->begin() + long(i));
        if (auto c = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(any.ptr())) {
            x = perf::conv2d(torch::nn::Conv2d(c), x, how);
            continue;
        }
        if (onednn && upsample == 2 && i + 1 < n && std::dynamic_pointer_cast<torch::nn::UpsampleImpl>(any.ptr()))
            if (auto c = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>((s->begin() + long(i + 1))->ptr()))
                if (auto y = perf::upsample2x_conv3x3(torch::nn::Conv2d(c), x, how); y.defined()) {
                    x = y, ++i;
                    continue;
                }
        if (onednn && act == TinyActivation::Relu && std::dynamic_pointer_cast<torch::nn::FunctionalImpl>(any.ptr()) &&
            perf::sole_owner(x)) {
            x.relu_();
            continue;
        }
        x = any.forward(x);
    }
    return x;
}

} // namespace

int TaesdConfig::encoder_factor() const {
    return 1 << (int(num_encoder_blocks.size()) - 1);
}

int TaesdConfig::decoder_factor() const {
    int f = 1;
    for (size_t i = 1; i < num_decoder_blocks.size(); ++i) f *= upsampling_scaling_factor;
    return f;
}

TaesdConfig TaesdConfig::from_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig f(j, source);
    TaesdConfig c;
    const std::string cls = f.get_string("_class_name", "AutoencoderTiny");
    if (cls != "AutoencoderTiny") f.fail("_class_name", "must be AutoencoderTiny", j.at("_class_name"));
    f.read({ANCHOR_JSON_FIELD(c, in_channels), ANCHOR_JSON_FIELD(c, out_channels),
            ANCHOR_JSON_FIELD(c, latent_channels), ANCHOR_JSON_FIELD(c, num_encoder_blocks),
            ANCHOR_JSON_FIELD(c, num_decoder_blocks), ANCHOR_JSON_FIELD(c, upsampling_scaling_factor),
            ANCHOR_JSON_FIELD(c, latent_magnitude), ANCHOR_JSON_FIELD(c, latent_shift),
            ANCHOR_JSON_FIELD(c, scaling_factor)});
    const auto legacy = f.get_int_list("block_out_channels", c.encoder_block_out_channels);
    c.encoder_block_out_channels = f.get_int_list("encoder_block_out_channels", legacy);
    c.decoder_block_out_channels = f.get_int_list("decoder_block_out_channels", legacy);
    c.act_fn = f.get_enum("act_fn", activation_table(), c.act_fn);
    check_levels(c.encoder_block_out_channels, c.num_encoder_blocks, "encoder", source);
    check_levels(c.decoder_block_out_channels, c.num_decoder_blocks, "decoder", source);
    if (c.upsampling_scaling_factor < 1)
        f.fail("upsampling_scaling_factor", "must be >= 1", j.at("upsampling_scaling_factor"));
    if (c.scaling_factor <= 0) f.fail("scaling_factor", "must be > 0", j.at("scaling_factor"));
    return c;
}

TaesdConfig TaesdConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "TAESD config").json(), path);
}

TaesdConfig TaesdConfig::detect_from_weights(const WeightMap& w) {
    TaesdConfig c;
    // Encoder: conv, blocks, (stride-2 conv, blocks)..., final conv to the latents.
    const auto enc = plan_of(w, "encoder.layers.");
    if (!enc.kind.empty()) {
        std::vector<int> ch, nb;
        for (const auto& [i, k] : enc.kind) {
            if (k == 'c') {
                const auto& s = enc.conv_shape.at(i);
                if (ch.empty()) c.in_channels = int(s[1]);
                ch.push_back(int(s[0]));
                nb.push_back(0);
            } else if (!nb.empty()) {
                ++nb.back();
            }
        }
        if (ch.size() < 2) throw Error("TAESD encoder weights: expected at least two convolutions in encoder.layers");
        c.latent_channels = ch.back();
        ch.pop_back(), nb.pop_back();
        c.encoder_block_out_channels = ch;
        c.num_encoder_blocks = nb;
    }
    // Decoder: conv from the latents, act, then per level: blocks, (upsample), conv; the last conv to the image.
    const auto dec = plan_of(w, "decoder.layers.");
    if (!dec.kind.empty()) {
        std::vector<int> ch, nb;
        bool first = true;
        int pending = 0;
        for (const auto& [i, k] : dec.kind) {
            if (k == 'b') {
                ++pending;
                continue;
            }
            const auto& s = dec.conv_shape.at(i);
            if (first) {
                c.latent_channels = int(s[1]);
                first = false;
                continue;
            }
            ch.push_back(int(s[1]));
            nb.push_back(pending);
            pending = 0;
            c.out_channels = int(s[0]);
        }
        if (ch.empty()) throw Error("TAESD decoder weights: expected at least two convolutions in decoder.layers");
        c.decoder_block_out_channels = ch;
        c.num_decoder_blocks = nb;
    }
    if (enc.kind.empty() && dec.kind.empty())
        throw Error("no TAESD weights (encoder.layers.* / decoder.layers.*) among " + std::to_string(w.size()) +
                    " tensors");
    return c;
}

AutoencoderTinyBlockImpl::AutoencoderTinyBlockImpl(int64_t in, int64_t out, TinyActivation act_) : act(act_) {
    conv = register_module("conv", torch::nn::Sequential(conv3x3(in, out), activation(act), conv3x3(out, out),
                                                         activation(act), conv3x3(out, out)));
    fast = false;
    if (in != out)
        skip = register_module("skip", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).bias(false)));
}

Tensor AutoencoderTinyBlockImpl::forward(const Tensor& x) {
    auto y = run_layers(conv, x, *this, act, 0);
    const auto res = skip ? perf::conv2d(skip, x, *this) : x;
    if (perf::use_onednn(*this) && perf::sole_owner(y) && y.sizes() == res.sizes()) return y.add_(res).relu_();
    return torch::relu(y + res);
}

TinyCoderImpl::TinyCoderImpl(const TaesdConfig& c, bool decoder_)
    : decoder(decoder_), act(c.act_fn), upsample(c.upsampling_scaling_factor) {
    fast = false;
    torch::nn::Sequential s;
    if (!decoder) {
        const auto& ch = c.encoder_block_out_channels;
        for (size_t i = 0; i < ch.size(); ++i) {
            if (i == 0)
                s->push_back(conv3x3(c.in_channels, ch[0]));
            else
                s->push_back(conv3x3(ch[i], ch[i], 2, false)); // diffusers: the level's own width in and out
            for (int b = 0; b < c.num_encoder_blocks[i]; ++b) s->push_back(AutoencoderTinyBlock(ch[i], ch[i], c.act_fn));
        }
        s->push_back(conv3x3(ch.back(), c.latent_channels));
    } else {
        const auto& ch = c.decoder_block_out_channels;
        s->push_back(conv3x3(c.latent_channels, ch[0]));
        s->push_back(activation(c.act_fn));
        for (size_t i = 0; i < ch.size(); ++i) {
            const bool last = i + 1 == ch.size();
            for (int b = 0; b < c.num_decoder_blocks[i]; ++b) s->push_back(AutoencoderTinyBlock(ch[i], ch[i], c.act_fn));
            if (!last) {
                const double f = c.upsampling_scaling_factor;
                s->push_back(torch::nn::Upsample(
                    torch::nn::UpsampleOptions().scale_factor(std::vector<double>{f, f}).mode(torch::kNearest)));
            }
            s->push_back(conv3x3(ch[i], last ? c.out_channels : ch[i], 1, last));
        }
    }
    layers = register_module("layers", s);
}

Tensor TinyCoderImpl::forward(const Tensor& x) {
    // TAESD works on images in [0, 1]; diffusers' convention is [-1, 1] at both ends.
    if (!decoder) return run_layers(layers, x.add(1).div(2), *this, act, 0);
    // The decoder's soft clamp of its input.
    return run_layers(layers, torch::tanh(x / 3) * 3, *this, act, upsample).mul(2).sub(1);
}

AutoencoderTinyImpl::AutoencoderTinyImpl(const TaesdConfig& c, bool with_encoder, bool with_decoder) : cfg_(c) {
    fast = false;
    check_levels(c.encoder_block_out_channels, c.num_encoder_blocks, "encoder", "TAESD config");
    check_levels(c.decoder_block_out_channels, c.num_decoder_blocks, "decoder", "TAESD config");
    if (with_encoder) encoder = register_module("encoder", TinyCoder(c, false));
    if (with_decoder) decoder = register_module("decoder", TinyCoder(c, true));
}

Tensor AutoencoderTinyImpl::encode(const Tensor& image) {
    if (!has_encoder())
        throw Error("TAESD '" + source + "' has no encoder (madebyollin's taesd*_encoder.safetensors beside it)");
    if (image.dim() != 4 || image.size(1) != cfg_.in_channels)
        throw Error("TAESD encode: expected an image [B, " + std::to_string(cfg_.in_channels) + ", H, W], got " +
                    c10::str(image.sizes()));
    util::HeapScope heap; // reuse freed blocks instead of faulting each layer's output in again (cache/util/heap.h)
    // On oneDNN the coder runs channels-last, as the VAE's (AutoencoderKLImpl::in_layout).
    return encoder->forward(perf::use_onednn(*this) ? image.contiguous(torch::MemoryFormat::ChannelsLast) : image)
        .contiguous();
}

Tensor AutoencoderTinyImpl::decode(const Tensor& z) {
    if (!has_decoder())
        throw Error("TAESD '" + source + "' has no decoder (madebyollin's taesd*_decoder.safetensors beside it)");
    if (z.dim() != 4 || z.size(1) != cfg_.latent_channels)
        throw Error("TAESD '" + source + "': expected latents [B, " + std::to_string(cfg_.latent_channels) +
                    ", h, w], got " + c10::str(z.sizes()));
    util::HeapScope heap; // as the VAE's decode: its 64-channel maps at full size are 64 MiB per image
    return decoder->forward(perf::use_onednn(*this) ? z.contiguous(torch::MemoryFormat::ChannelsLast) : z).contiguous();
}

Tensor AutoencoderTinyImpl::decode_latents(const Tensor& latents) {
    return decode(latents / cfg_.scaling_factor);
}

Tensor AutoencoderTinyImpl::scale_latents(const Tensor& x) const {
    return x.div(2 * cfg_.latent_magnitude).add(cfg_.latent_shift).clamp(0, 1);
}

Tensor AutoencoderTinyImpl::unscale_latents(const Tensor& x) const {
    return x.sub(cfg_.latent_shift).mul(2 * cfg_.latent_magnitude);
}

void AutoencoderTinyImpl::load(const WeightMap& w) {
    w.load_into(*this);
}

void AutoencoderTinyImpl::set_fast_paths(bool on, kernels::GemmBackend gemm) {
    for (const auto& m : modules(true))
        if (auto* f = dynamic_cast<perf::FastPaths*>(m.get())) f->fast = on, f->gemm = gemm;
}

VaeDecoderChoice VaeDecoderChoice::parse(const std::string& text, const std::string& field) {
    VaeDecoderChoice c;
    if (text == "full") return c;
    if (text == "taesd" || text.rfind("taesd:", 0) == 0) {
        c.kind = VaeDecoder::Taesd;
        if (text.size() > 6) c.file = text.substr(6);
        if (text.size() == 6) throw ParamError(field, "taesd: needs a file after the colon (or plain taesd)");
        return c;
    }
    throw ParamError(field, "expected full, taesd or taesd:FILE, got '" + text + "'");
}

std::string taesd_single_file_name(const std::string& name, bool decoder) {
    std::string rest;
    const int i = layer_index(name, "", &rest);
    if (i < 0 || (decoder && i < 1)) return "";
    return std::string(decoder ? "decoder" : "encoder") + ".layers." + std::to_string(decoder ? i - 1 : i) + "." + rest;
}

namespace {

// A madebyollin single file's role from its shapes: an encoder's layer 0 is the convolution from the RGB image; a
// decoder has no layer 0 (the clamp) and its layer 1 is the convolution from the latents.
bool single_file_is_decoder(const WeightMap& w, const std::string& file) {
    if (w.has("0.weight")) return false;
    if (w.has("1.weight")) return true;
    throw Error("'" + file + "': neither a TAESD encoder (tensor 0.weight) nor a decoder (tensor 1.weight), nor "
                "diffusers-named (encoder.layers.* / decoder.layers.*)");
}

bool is_sequential_file(const WeightMap& w) {
    for (const auto& n : w.names())
        if (layer_index(n, "") < 0) return false;
    return w.size() > 0;
}

// madebyollin's partner file of `file` (taesd_decoder.safetensors <-> taesd_encoder.safetensors), "" when absent.
std::string partner_file(const fs::path& file) {
    std::string name = file.filename().string();
    for (auto [a, b] : {std::pair{"decoder", "encoder"}, std::pair{"encoder", "decoder"}}) {
        const auto at = name.rfind(a);
        if (at == std::string::npos) continue;
        name.replace(at, std::string(a).size(), b);
        const auto p = file.parent_path() / name;
        return fs::exists(p) ? p.string() : "";
    }
    return "";
}

AutoencoderTiny from_weights(const WeightMap& w, const TaesdConfig& c, const std::string& source) {
    bool enc = false, dec = false;
    for (const auto& n : w.names()) {
        enc = enc || n.rfind("encoder.", 0) == 0;
        dec = dec || n.rfind("decoder.", 0) == 0;
    }
    AutoencoderTiny m(c, enc, dec);
    try {
        m->load(w);
    } catch (const Error& e) {
        throw Error("TAESD '" + source + "': " + e.what());
    }
    m->source = source;
    m->eval();
    return m;
}

// madebyollin's single files, converted to diffusers names with taesd_single_file_name.
AutoencoderTiny load_single_files(const std::vector<std::string>& files) {
    WeightMap all;
    std::string source;
    for (const auto& f : files) {
        const auto w = WeightMap::load(f);
        if (!is_sequential_file(w)) throw Error("'" + f + "': a TAESD single file holds only Sequential-indexed tensors");
        const bool dec = single_file_is_decoder(w, f);
        for (const auto& n : w.names()) {
            const std::string to = taesd_single_file_name(n, dec);
            if (to.empty()) throw Error("'" + f + "': tensor '" + n + "' is outside the TAESD layout");
            all.insert(to, w.get(n), f);
        }
        all.keep_files_of(w);
        source += (source.empty() ? "" : " + ") + f;
    }
    return from_weights(all, TaesdConfig::detect_from_weights(all), source);
}

} // namespace

AutoencoderTiny load_taesd(const std::string& path) {
    const fs::path p(path);
    if (!fs::exists(p)) throw Error("TAESD '" + path + "': no such file or folder");
    if (fs::is_directory(p)) {
        if (fs::exists(p / "config.json")) {
            const auto c = TaesdConfig::from_json_file((p / "config.json").string());
            return from_weights(WeightMap::load(path), c, path);
        }
        std::vector<std::string> files;
        for (const auto& e : fs::directory_iterator(p)) {
            const auto n = e.path().filename().string();
            if (e.path().extension() == ".safetensors" &&
                (n.find("_decoder") != std::string::npos || n.find("_encoder") != std::string::npos))
                files.push_back(e.path().string());
        }
        std::sort(files.begin(), files.end());
        if (files.empty() || files.size() > 2)
            throw Error("TAESD folder '" + path + "': expected config.json + weights (diffusers AutoencoderTiny) or "
                        "madebyollin's *_encoder.safetensors / *_decoder.safetensors, found " +
                        std::to_string(files.size()) + " such files");
        return load_single_files(files);
    }
    const auto w = WeightMap::load(path);
    if (is_sequential_file(w)) {
        std::vector<std::string> files{path};
        if (const auto other = partner_file(p); !other.empty()) files.push_back(other);
        return load_single_files(files);
    }
    const auto cfg_file = p.parent_path() / "config.json";
    const auto c = fs::exists(cfg_file) ? TaesdConfig::from_json_file(cfg_file.string())
                                        : TaesdConfig::detect_from_weights(w);
    return from_weights(w, c, path);
}

std::vector<std::string> taesd_candidates(const std::string& model_path, bool sdxl) {
    const fs::path m(model_path);
    const fs::path dir = fs::is_directory(m) ? m : m.parent_path();
    const std::string name = sdxl ? "taesdxl" : "taesd";
    std::vector<std::string> out;
    for (const auto& d : {dir, dir.parent_path()}) {
        if (d.empty()) continue;
        out.push_back((d / name).string());
        out.push_back((d / (name + "_decoder.safetensors")).string());
    }
    return out;
}

std::string find_taesd(const std::string& model_path, bool sdxl) {
    for (const auto& c : taesd_candidates(model_path, sdxl))
        if (fs::exists(c)) return c;
    return "";
}

void attach_taesd(SDModels& models, const std::string& file, const std::string& model_path) {
    const bool sdxl = models.family == SdFamily::SDXL || models.family == SdFamily::SDXLRefiner;
    std::string path = file;
    if (path.empty()) {
        path = find_taesd(model_path, sdxl);
        if (path.empty()) {
            std::string looked;
            for (const auto& c : taesd_candidates(model_path, sdxl)) looked += (looked.empty() ? "" : ", ") + c;
            throw Error("vae_decoder: no TAESD next to the model '" + model_path + "'; looked for " + looked +
                        " (give one as taesd:FILE)");
        }
    }
    auto t = load_taesd(path);
    if (!t->has_decoder()) throw Error("TAESD '" + t->source + "' has no decoder; the image needs one");
    const int64_t want = models.vae ? models.vae->config().latent_channels : models.unet->config().out_channels;
    if (t->config().latent_channels != want)
        throw Error("TAESD '" + t->source + "': latent_channels expected " + std::to_string(want) +
                    " (the model's latents), got " + std::to_string(t->config().latent_channels));
    if (models.vae && t->config().decoder_factor() != models.vae->config().spatial_factor())
        throw Error("TAESD '" + t->source + "': upscales latents by " + std::to_string(t->config().decoder_factor()) +
                    ", the model's VAE by " + std::to_string(models.vae->config().spatial_factor()));
    t->set_fast_paths(true, models.gemm);
    models.taesd = t;
}

} // namespace anchor::unet
