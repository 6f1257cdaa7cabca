// LoRA loading and merging (see unet/model/lora.h). The merge rule and the file layouts are those of
// tests/golden/sd/lora_sd15_tiny/README.md (diffusers 0.27.2 + PEFT, kohya/sd-scripts, A1111 prompt tags).
#include "unet/model/lora.h"

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/sha256.h"
#include "cache/util/strings.h"
#include "unet/model/checkpoint.h"
#include "unet/model/name_conversion.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <set>

namespace anchor::unet {

namespace fs = std::filesystem;

namespace {

std::string underscored(std::string s) {
    for (auto& c : s)
        if (c == '.') c = '_';
    return s;
}

// A strict finite number: the whole text, no trailing characters.
bool parse_number(const std::string& s, double& v) {
    if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
    char* end = nullptr;
    v = std::strtod(s.c_str(), &end);
    return end == s.c_str() + s.size() && std::isfinite(v);
}

const char* kSpecForm = " (expected FILE[:MULTIPLIER], e.g. style.safetensors:0.8)";

// The tensor-name suffixes of the two layouts: which slot of a module each fills.
enum class Slot { Down, Up, Alpha };
struct Suffix {
    const char* text;
    Slot slot;
    const char* format;
};
const std::vector<Suffix>& suffixes() {
    static const std::vector<Suffix> s = {{".lora_down.weight", Slot::Down, "kohya"},
                                          {".lora_up.weight", Slot::Up, "kohya"},
                                          {".lora_A.weight", Slot::Down, "peft"},
                                          {".lora_B.weight", Slot::Up, "peft"},
                                          {".alpha", Slot::Alpha, ""}};
    return s;
}

// Why `down`/`up` cannot be merged into a weight of `w` ("" when they can). Linear: down [r, in], up [out, r]; conv:
// down [r, in, kh, kw] (or [r, in] for a 1x1 conv), up [out, r, 1, 1] (or [out, r]).
std::string fit_problem(const torch::Tensor& down, const torch::Tensor& up, const std::vector<int64_t>& w) {
    const bool conv = w.size() == 4;
    const bool down_ok = down.dim() == 2 || (conv && down.dim() == 4);
    const bool up_ok = up.dim() == 2 || (conv && up.dim() == 4 && up.size(2) == 1 && up.size(3) == 1);
    if (!down_ok || !up_ok || w.size() < 2) return "unsupported ranks";
    const int64_t r = down.size(0);
    if (up.size(1) != r) return "up has rank " + std::to_string(up.size(1)) + ", down " + std::to_string(r);
    if (up.size(0) != w[0])
        return "up has " + std::to_string(up.size(0)) + " outputs, the weight " + std::to_string(w[0]);
    if (down.size(1) != w[1])
        return "down has " + std::to_string(down.size(1)) + " inputs, the weight " + std::to_string(w[1]);
    if (conv && down.dim() == 4 && (down.size(2) != w[2] || down.size(3) != w[3]))
        return "down's kernel is not the weight's";
    if (conv && down.dim() == 2 && (w[2] != 1 || w[3] != 1)) return "a 2-D down for a kernel larger than 1x1";
    return "";
}

std::string lora_hint_join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : " / ") + x;
    return s;
}

// The shape a module's delta has: the weight's, or for a module over several weights (fused qkv) their rows stacked.
std::vector<int64_t> target_shape(const LoraTargets::Part& part, const std::string& weight,
                                  const std::vector<LoraPiece>& pieces) {
    auto shape = part.weights.at(weight).sizes().vec();
    if (pieces.empty()) return shape;
    shape[0] = 0;
    for (const auto& p : pieces) {
        const auto& w = part.weights.at(p.weight);
        if (w.dim() != int64_t(shape.size()) || (w.dim() > 1 && w.size(1) != shape[1]))
            throw Error("LoRA: the weights of a fused module differ in shape ('" + weight + "', '" + p.weight + "')");
        shape[0] += w.size(0);
    }
    return shape;
}

// The LoraConfig diffusers writes into a PEFT file's header (safetensors metadata "lora_adapter_metadata", a JSON
// object of "<component>.<LoraConfig field>"): lora_alpha, alpha_pattern and use_rslora decide the scale; a module
// without a pattern entry scales by lora_alpha / rank (sqrt(rank) with rsLoRA, Kalajdzievski 2023).
struct PeftComponentConfig {
    double lora_alpha = 0;
    std::map<std::string, double> alpha_pattern;
    bool rslora = false;
    // PEFT's pattern rule (peft.utils.other.get_pattern_key): a key matches a module name that ends with it after a
    // '.', or is it.
    double alpha_for(const std::string& module) const {
        for (const auto& [key, alpha] : alpha_pattern)
            if (module == key || ends_with(module, "." + key)) return alpha;
        return lora_alpha;
    }
};
using PeftMetadata = std::map<std::string, PeftComponentConfig>; // by component prefix ("transformer", ...)

PeftMetadata peft_metadata(const SafeTensorsFile& st, const std::string& path) {
    PeftMetadata out;
    const auto it = st.metadata().find("lora_adapter_metadata");
    if (it == st.metadata().end()) return out;
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(it->second);
    } catch (const std::exception& e) {
        throw Error("LoRA file '" + path + "': header metadata lora_adapter_metadata is not JSON (" + e.what() + ")");
    }
    if (!j.is_object()) throw Error("LoRA file '" + path + "': lora_adapter_metadata is not a JSON object");
    for (const auto& [key, v] : j.items()) {
        const auto dot = key.find('.');
        if (dot == std::string::npos) continue;
        const std::string comp = key.substr(0, dot), field = key.substr(dot + 1);
        auto& c = out[comp];
        auto bad = [&](const std::string& why) {
            return Error("LoRA file '" + path + "': lora_adapter_metadata '" + key + "' " + why);
        };
        if (field == "lora_alpha") {
            if (!v.is_number()) throw bad("is not a number");
            c.lora_alpha = v.get<double>();
        } else if (field == "alpha_pattern") {
            if (!v.is_object()) throw bad("is not an object");
            for (const auto& [k, a] : v.items()) {
                if (!a.is_number()) throw bad("entry '" + k + "' is not a number");
                c.alpha_pattern[k] = a.get<double>();
            }
        } else if (field == "use_rslora") {
            c.rslora = v.is_boolean() && v.get<bool>();
        } else if (field == "use_dora" && v.is_boolean() && v.get<bool>()) {
            throw bad("is true: DoRA adapters are not supported (only plain LoRA merges into the weights)");
        }
    }
    for (auto it2 = out.begin(); it2 != out.end();)
        it2 = it2->second.lora_alpha > 0 || !it2->second.alpha_pattern.empty() ? std::next(it2) : out.erase(it2);
    return out;
}

} // namespace

LoraSpec parse_lora_spec(const std::string& spec, const std::string& field) {
    if (spec.empty()) throw ParamError(field, std::string("empty LoRA") + kSpecForm);
    if (fs::is_regular_file(spec)) return {spec, 1.0};
    const auto colon = spec.rfind(':');
    if (colon == std::string::npos) return {spec, 1.0};
    LoraSpec s{spec.substr(0, colon), 1.0};
    const std::string mult = spec.substr(colon + 1);
    if (s.path.empty()) throw ParamError(field, "'" + spec + "': no file name" + kSpecForm);
    if (!parse_number(mult, s.multiplier))
        throw ParamError(field, "'" + spec + "': multiplier '" + mult + "' is not a finite number" + kSpecForm);
    return s;
}

PromptLoras take_prompt_loras(const std::vector<std::string>& prompts, const std::string& dir) {
    // A1111 extra-network syntax: <lora:NAME> or <lora:NAME:MULTIPLIER>.
    static const std::regex tag(R"(<lora:([^>]*)>)");
    PromptLoras out;
    std::vector<std::string> first_tags;
    for (size_t i = 0; i < prompts.size(); ++i) {
        std::string text = prompts[i];
        std::vector<LoraSpec> specs;
        std::vector<std::string> tags;
        std::smatch m;
        while (std::regex_search(text, m, tag)) {
            const std::string body = m[1].str(), whole = m[0].str();
            const auto colon = body.find(':');
            LoraSpec s{body.substr(0, colon), 1.0};
            if (s.path.empty() || (colon != std::string::npos && (body.find(':', colon + 1) != std::string::npos ||
                                                                  !parse_number(body.substr(colon + 1), s.multiplier))))
                throw ParamError("prompts", "tag '" + whole + "': expected <lora:NAME> or <lora:NAME:MULTIPLIER>");
            if (dir.empty())
                throw ParamError("lora_model_dir", "the prompt has '" + whole + "' but no LoRA folder is given");
            const std::string file = ends_with(s.path, ".safetensors") ? s.path : s.path + ".safetensors";
            s.path = (fs::path(dir) / file).string();
            if (!fs::is_regular_file(s.path))
                throw ParamError("lora_model_dir", "'" + whole + "' in the prompt: '" + s.path + "' does not exist");
            // The tag goes with one side's whitespace, so "a <lora:x> b" reads "a b".
            size_t from = size_t(m.position(0)), to = from + whole.size();
            while (to < text.size() && std::isspace(static_cast<unsigned char>(text[to]))) ++to;
            if (to == text.size())
                while (from > 0 && std::isspace(static_cast<unsigned char>(text[from - 1]))) --from;
            text.erase(from, to - from);
            tags.push_back(s.path + ":" + std::to_string(s.multiplier));
            specs.push_back(s);
        }
        if (i == 0) {
            out.loras = specs;
            first_tags = tags;
        } else if (tags != first_tags) {
            throw ParamError("prompts", "prompt " + std::to_string(i + 1) +
                                            " names other LoRAs than prompt 1; LoRAs are merged into the weights once "
                                            "per run, so every prompt must name the same <lora:...> tags");
        }
        out.prompts.push_back(text);
    }
    return out;
}

std::vector<LoraSpec> run_loras(const std::vector<std::string>& specs, const std::string& lora_model_dir,
                                std::vector<std::string>& prompts) {
    std::vector<LoraSpec> out;
    for (const auto& s : specs) out.push_back(parse_lora_spec(s));
    auto tagged = take_prompt_loras(prompts, lora_model_dir);
    prompts = tagged.prompts;
    out.insert(out.end(), tagged.loras.begin(), tagged.loras.end());
    return out;
}

const EnumTable<LoraComponent>& lora_component_table() {
    static const EnumTable<LoraComponent> t = {{"unet", LoraComponent::Unet},
                                               {"text_encoder", LoraComponent::TextEncoder},
                                               {"text_encoder_2", LoraComponent::TextEncoder2},
                                               {"transformer", LoraComponent::Transformer},
                                               {"text_encoder_3", LoraComponent::TextEncoder3}};
    return t;
}

LoraTargets lora_targets(SDModels& models) {
    LoraTargets t;
    auto add = [&](torch::nn::Module& m, LoraComponent c, const UNetConfig* ldm) {
        LoraTargets::Part p{c, {}, ldm};
        for (const auto& np : m.named_parameters(true)) p.weights[np.key()] = np.value();
        t.parts.push_back(std::move(p));
    };
    if (models.unet) add(*models.unet, LoraComponent::Unet, &models.unet->config());
    if (models.text_encoder) add(*models.text_encoder, LoraComponent::TextEncoder, nullptr);
    if (models.text_encoder_2) add(*models.text_encoder_2, LoraComponent::TextEncoder2, nullptr);
    return t;
}

std::map<std::string, std::string> kohya_names(const LoraTargets::Part& part, const std::string& te_prefix) {
    const bool denoiser = part.component == LoraComponent::Unet || part.component == LoraComponent::Transformer;
    const std::string base = denoiser ? "lora_unet_" : "lora_" + te_prefix + "_";
    std::map<std::string, std::string> out;
    std::set<std::string> ambiguous;
    auto add = [&](const std::string& kohya, const std::string& weight) {
        auto [it, fresh] = out.emplace(kohya, weight);
        if (!fresh && it->second != weight) ambiguous.insert(kohya);
    };
    for (const auto& [name, t] : part.weights) {
        if (!ends_with(name, ".weight") || (t.dim() != 2 && t.dim() != 4)) continue;
        add(base + underscored(name.substr(0, name.size() - 7)), name);
        if (!part.ldm) continue;
        // The original layout's name of the same weight (SDXL kohya files: input_blocks / middle_block /
        // output_blocks); weights the table has no name for (e.g. SDXL's add_embedding) have only one spelling.
        try {
            const std::string ldm = unet_ldm_name(name, *part.ldm);
            if (ends_with(ldm, ".weight")) add(base + underscored(ldm.substr(0, ldm.size() - 7)), name);
        } catch (const Error&) {
        }
    }
    // Two weights with one kohya spelling cannot be told apart: such a name matches nothing.
    for (const auto& k : ambiguous) out.erase(k);
    return out;
}

LoraFile read_lora(const std::string& path, const LoraTargets& targets) {
    struct Dest {
        const LoraTargets::Part* part;
        std::string weight;
        std::vector<LoraPiece> pieces; // several weights' rows (Part::grouped), else empty
    };
    std::map<std::string, Dest> table; // kohya module names and PEFT "<component>.<module>" -> weight
    std::vector<std::string> kohya_hint; // the kohya prefixes taken, for the error
    int text_parts = 0;
    for (const auto& p : targets.parts)
        text_parts += p.component == LoraComponent::TextEncoder || p.component == LoraComponent::TextEncoder2;
    for (const auto& p : targets.parts) {
        const std::string te = p.component == LoraComponent::TextEncoder3 ? "te3"
                               : text_parts > 1 ? (p.component == LoraComponent::TextEncoder ? "te1" : "te2")
                                                : "te";
        const bool denoiser = p.component == LoraComponent::Unet || p.component == LoraComponent::Transformer;
        if (p.kohya_prefixes.empty())
            kohya_hint.push_back(denoiser ? std::string("lora_unet_") : "lora_" + te + "_");
        kohya_hint.insert(kohya_hint.end(), p.kohya_prefixes.begin(), p.kohya_prefixes.end());
        for (const auto& [k, w] : kohya_names(p, te)) {
            if (p.kohya_prefixes.empty()) table[k] = {&p, w, {}};
            // Other spellings of the prefix (OneTrainer's lora_transformer_ for SD 3): the module path after it.
            const auto cut = k.find('_', 5);
            for (const auto& pre : p.kohya_prefixes) table[pre + k.substr(cut + 1)] = {&p, w, {}};
        }
        for (const auto& [k, pieces] : p.grouped) {
            // One piece in the weight's own row order is a plain module.
            const bool plain = pieces.size() == 1 && !pieces.front().swap_halves;
            for (const auto& pre : p.kohya_prefixes)
                table[pre + k] = {&p, pieces.front().weight, plain ? std::vector<LoraPiece>{} : pieces};
        }
        const std::string peft = enum_name(lora_component_table(), p.component) + ".";
        for (const auto& [name, t] : p.weights)
            if (ends_with(name, ".weight")) table[peft + name.substr(0, name.size() - 7)] = {&p, name, {}};
    }
    auto st = SafeTensorsFile::open(path);
    const PeftMetadata meta = peft_metadata(*st, path);
    struct Pending {
        Dest dest;
        torch::Tensor down, up, alpha;
        std::set<std::string> formats;
    };
    std::map<std::string, Pending> mods;
    std::vector<std::string> unmatched, problems, out_skipped;
    for (const auto& ti : st->tensors()) {
        const Suffix* suf = nullptr;
        for (const auto& s : suffixes())
            if (ends_with(ti.name, s.text)) suf = &s;
        bool absent = false;
        for (const auto& [prefix, why] : targets.absent) absent = absent || ti.name.rfind(prefix, 0) == 0;
        if (absent) {
            out_skipped.push_back(ti.name);
            continue;
        }
        if (!suf) {
            unmatched.push_back(ti.name + " (no .lora_down/.lora_up/.lora_A/.lora_B/.alpha suffix)");
            continue;
        }
        const std::string stem = ti.name.substr(0, ti.name.size() - std::string(suf->text).size());
        const auto it = table.find(stem);
        if (it == table.end()) {
            unmatched.push_back(ti.name);
            continue;
        }
        auto& pm = mods.emplace(stem, Pending{it->second, {}, {}, {}, {}}).first->second;
        if (*suf->format) pm.formats.insert(suf->format);
        torch::Tensor& slot = suf->slot == Slot::Down ? pm.down : suf->slot == Slot::Up ? pm.up : pm.alpha;
        if (slot.defined()) problems.push_back(ti.name + ": a second tensor for the same module and slot");
        slot = st->tensor(ti.name);
    }
    LoraFile out{path, "", {}, {}};
    std::set<std::string> formats;
    for (auto& [stem, pm] : mods) {
        if (!pm.down.defined() || !pm.up.defined()) {
            problems.push_back(stem + ": no " + std::string(pm.down.defined() ? "up" : "down") +
                               " tensor (.lora_up.weight / .lora_B.weight or .lora_down.weight / .lora_A.weight)");
            continue;
        }
        const auto ws = target_shape(*pm.dest.part, pm.dest.weight, pm.dest.pieces);
        if (const auto why = fit_problem(pm.down, pm.up, ws); !why.empty()) {
            std::string names = pm.dest.weight;
            for (size_t i = 1; i < pm.dest.pieces.size(); ++i) names += " + " + pm.dest.pieces[i].weight;
            problems.push_back(stem + ": down " + shape_str(pm.down.sizes().vec()) + " / up " +
                               shape_str(pm.up.sizes().vec()) + " do not fit " +
                               enum_name(lora_component_table(), pm.dest.part->component) + " weight '" + names +
                               "' " + shape_str(ws) + ": " + why);
            continue;
        }
        LoraModule m{stem, pm.dest.part->component, pm.dest.weight, pm.down, pm.up, double(pm.down.size(0)), false};
        m.pieces = pm.dest.pieces;
        // diffusers' adapter metadata (PEFT LoraConfig per component) for PEFT-named modules without a stored alpha.
        if (!pm.alpha.defined() && pm.formats.count("peft"))
            if (const auto it = meta.find(enum_name(lora_component_table(), pm.dest.part->component)); it != meta.end()) {
                const std::string module = stem.substr(stem.find('.') + 1);
                m.alpha = it->second.alpha_for(module);
                m.alpha_stored = true;
                m.rslora = it->second.rslora;
            }
        if (pm.alpha.defined()) {
            if (pm.alpha.numel() != 1) {
                problems.push_back(stem + ".alpha: expected one value, got shape " + shape_str(pm.alpha.sizes().vec()));
                continue;
            }
            m.alpha = pm.alpha.to(torch::kDouble).item<double>();
            m.alpha_stored = true;
        }
        formats.insert(pm.formats.begin(), pm.formats.end());
        out.modules.push_back(std::move(m));
    }
    if (!unmatched.empty() || !problems.empty()) {
        std::string msg = "LoRA file '" + path + "' does not fit the model:";
        if (!unmatched.empty()) {
            std::string prefixes;
            for (const auto& p : targets.parts) {
                const std::string c = enum_name(lora_component_table(), p.component);
                prefixes += (prefixes.empty() ? "" : ", ") + c + ".";
            }
            msg += "\n" + std::to_string(unmatched.size()) + " of " + std::to_string(st->tensors().size()) +
                   " tensor(s) match no weight of the model (kohya " + lora_hint_join(kohya_hint) +
                   " + module path with '_', or PEFT " +
                   prefixes + " + module path):" + indented_list(unmatched, 200);
        }
        if (!problems.empty())
            msg += "\n" + std::to_string(problems.size()) + " bad module(s):" + indented_list(problems, 200);
        throw Error(msg);
    }
    out.skipped = out_skipped;
    if (out.modules.empty()) {
        if (!out.skipped.empty())
            throw Error("LoRA file '" + path + "': every tensor belongs to a model part that is not loaded (" +
                        targets.absent.begin()->second + "), e.g. '" + out.skipped.front() + "'");
        throw Error("LoRA file '" + path + "' holds no LoRA tensors");
    }
    for (const auto& f : formats) out.format += (out.format.empty() ? "" : "+") + f;
    return out;
}

torch::Tensor lora_delta(const LoraModule& m, const std::vector<int64_t>& weight_shape) {
    const int64_t r = m.rank();
    const auto up = m.up.to(torch::kFloat).reshape({m.up.size(0), r});
    const auto down = m.down.to(torch::kFloat).reshape({r, -1});
    // The reference's (alpha / rank) * (up @ down), in float32.
    return (up.matmul(down) * m.scale()).reshape(weight_shape);
}

nlohmann::json LoraApplied::to_json() const {
    nlohmann::json j = {{"name", name},
            {"file", path},
            {"sha256", sha256},
            {"format", format},
            {"multiplier", multiplier},
            {"modules", modules},
            {"modules_per_component", modules_per_component}};
    if (skipped > 0) j["skipped_tensors"] = skipped;
    return j;
}

nlohmann::json lora_records_json(const std::vector<LoraApplied>& loras) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& l : loras) j.push_back(l.to_json());
    return j;
}

std::vector<LoraApplied> merge_loras(const LoraTargets& targets, const std::vector<LoraSpec>& loras) {
    // Every file is read and matched before any weight changes: a bad second file leaves the model as loaded.
    std::vector<LoraFile> files;
    for (const auto& spec : loras) {
        if (!fs::is_regular_file(spec.path)) throw ParamError("loras", "LoRA file '" + spec.path + "' does not exist");
        files.push_back(read_lora(spec.path, targets));
    }
    std::vector<LoraApplied> out;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < loras.size(); ++i) {
        const auto& spec = loras[i];
        LoraApplied a;
        a.name = fs::path(spec.path).stem().string();
        a.path = spec.path;
        a.sha256 = sha256_file(spec.path);
        a.format = files[i].format;
        a.multiplier = spec.multiplier;
        a.skipped = int(files[i].skipped.size());
        for (const auto& m : files[i].modules) {
            const LoraTargets::Part* part = nullptr;
            for (const auto& p : targets.parts)
                if (p.component == m.component) part = &p;
            if (m.pieces.empty()) {
                torch::Tensor w = part->weights.at(m.weight); // shares the parameter's storage
                // LoRA by LoRA in float32 (the reference's order); a reduced-precision weight is rounded once after.
                const auto merged = w.to(torch::kFloat) + lora_delta(m, w.sizes().vec()) * spec.multiplier;
                w.copy_(merged.to(w.scalar_type()));
            } else {
                // A fused module: its delta's rows are the pieces' rows in order, each added to its own weight.
                const auto delta = lora_delta(m, target_shape(*part, m.weight, m.pieces)) * spec.multiplier;
                int64_t row = 0;
                for (const auto& piece : m.pieces) {
                    torch::Tensor w = part->weights.at(piece.weight);
                    auto d = delta.narrow(0, row, w.size(0));
                    row += w.size(0);
                    if (piece.swap_halves) d = torch::cat({d.chunk(2, 0)[1], d.chunk(2, 0)[0]}, 0);
                    const auto merged = w.to(torch::kFloat) + d;
                    w.copy_(merged.to(w.scalar_type()));
                }
            }
            ++a.modules;
            ++a.modules_per_component[enum_name(lora_component_table(), m.component)];
        }
        out.push_back(a);
    }
    return out;
}

std::vector<LoraApplied> apply_loras(SDModels& models, const std::vector<LoraSpec>& loras) {
    auto applied = merge_loras(lora_targets(models), loras);
    models.loras.insert(models.loras.end(), applied.begin(), applied.end());
    return applied;
}

} // namespace anchor::unet
