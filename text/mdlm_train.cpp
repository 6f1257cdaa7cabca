#include "text/mdlm_train.h"
#include "cache/train/optim.h"

#include "cache/calibration.h"
#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "text/gpt2_tokenizer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace anchor::text {

namespace fs = std::filesystem;

std::vector<int64_t> load_token_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw Error("cannot open token file '" + path + "'");
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (bytes.size() % 2 != 0) throw Error("token file '" + path + "' has an odd size (expected uint16 LE ids)");
    std::vector<int64_t> ids(bytes.size() / 2);
    for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] =
            static_cast<uint8_t>(bytes[2 * i]) | (static_cast<int64_t>(static_cast<uint8_t>(bytes[2 * i + 1])) << 8);
        if (ids[i] >= kGpt2VocabSize)
            throw Error("token file '" + path + "': id " + std::to_string(ids[i]) + " at index " + std::to_string(i) +
                        " is not a GPT-2 id");
    }
    if (ids.empty()) throw Error("token file '" + path + "' is empty");
    return ids;
}

std::vector<std::vector<int64_t>> token_file_windows(const std::string& path, int64_t n, int64_t len,
                                                     const std::function<bool(const std::vector<int64_t>&)>& accept) {
    const auto toks = load_token_file(path);
    const int64_t size = static_cast<int64_t>(toks.size());
    if (len < 1 || size < len)
        throw Error("token file '" + path + "' has " + std::to_string(size) + " ids, fewer than the prompt length " +
                    std::to_string(len));
    std::vector<std::vector<int64_t>> out;
    int64_t next_free = 0; // accepted windows never share a start offset
    for (int64_t i = 0; i < n; ++i) {
        int64_t off = std::max(next_free, (size - len) * i / std::max<int64_t>(1, n));
        for (; off <= size - len; ++off) {
            std::vector<int64_t> w(toks.begin() + off, toks.begin() + off + len);
            if (!accept || accept(w)) {
                out.push_back(std::move(w));
                break;
            }
        }
        if (off > size - len)
            throw Error("token file '" + path + "': only " + std::to_string(out.size()) + " of " + std::to_string(n) +
                        " windows of " + std::to_string(len) + " ids use only tokens this model knows");
        next_free = off + 1;
    }
    return out;
}

void write_token_file(const std::string& path, const std::vector<int64_t>& ids) {
    std::string bytes(ids.size() * 2, '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] > 0xFFFF)
            throw Error("token file '" + path + "': id " + std::to_string(ids[i]) + " does not fit in uint16");
        bytes[2 * i] = static_cast<char>(ids[i] & 0xFF);
        bytes[2 * i + 1] = static_cast<char>((ids[i] >> 8) & 0xFF);
    }
    write_file_atomic(path, bytes);
}

const EnumTable<MdlmLossWeight>& mdlm_loss_weight_table() {
    static const EnumTable<MdlmLossWeight> t = {{"nelbo", MdlmLossWeight::kNelbo},
                                                {"masked_mean", MdlmLossWeight::kMaskedMean}};
    return t;
}

torch::Tensor mdlm_loss(MdlmModel& model, const torch::Tensor& ids, at::Generator& gen, MdlmLossWeight weight) {
    const int64_t B = ids.size(0), L = ids.size(1);
    const double eps = model->config().noise_eps;
    // Low-discrepancy times (MDLM's antithetic sampling): t_b = eps + (1 - eps) ((u + b / B) mod 1).
    auto u = torch::rand({1}, gen, torch::kFloat32);
    auto t = torch::remainder(u + torch::arange(B, torch::kFloat32) / double(B), 1.0) * (1.0 - eps) + eps;
    auto p_mask = (1.0 - eps) * t;
    auto r = torch::rand({B, L}, gen, torch::kFloat32);
    auto masked = r < p_mask.unsqueeze(1);
    auto xt = torch::where(masked, torch::full_like(ids, model->internal_mask_id()), ids);
    auto c = model->conditioning(t);
    auto h = model->hidden(xt, c); // [B, L, D]
    auto flat = torch::nonzero(masked.reshape(-1)).reshape(-1);
    if (flat.size(0) == 0) return (h.sum() * 0.0);
    auto rows = h.reshape({B * L, -1}).index_select(0, flat).unsqueeze(1); // [N, 1, D]
    auto batch_of = torch::div(flat, L, "floor");
    auto logits = model->head(rows, c.index_select(0, batch_of)).squeeze(1); // [N, V]
    auto target = ids.reshape(-1).index_select(0, flat);
    auto nll = torch::nn::functional::cross_entropy(
        logits, target, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    if (weight == MdlmLossWeight::kMaskedMean) {
        auto count = masked.sum(1).clamp_min(1).to(torch::kFloat32); // [B]
        return (nll / count.index_select(0, batch_of)).sum() / double(B);
    }
    auto w = 1.0 / t.index_select(0, batch_of);
    return (nll * w).sum() / double(B * L);
}

namespace {

using AdamW = cache::NamedAdamW;

cache::AdamWConfig adamw_config(const TrainOptions& o) {
    return {o.beta1, o.beta2, o.adam_eps, o.weight_decay};
}

double lr_at(const TrainOptions& o, int64_t step) {
    return cache::warmup_cosine_lr(o.lr, step, o.warmup, o.steps, 0.1);
}

void save_state(const std::string& path, AdamW& opt, int64_t step) {
    NamedTensors ts;
    for (auto& [n, t] : opt.m) ts.emplace_back("m." + n, t);
    for (auto& [n, t] : opt.v) ts.emplace_back("v." + n, t);
    save_safetensors(path, ts, {{"step", std::to_string(step)}, {"adam_t", std::to_string(opt.t)}});
}

} // namespace

TrainResult train_mdlm(const TrainOptions& o) {
    auto log = [&](const std::string& s) {
        if (o.log) o.log(s);
    };
    if (o.out_dir.empty()) throw UsageError("train: an output directory is required");
    if (o.batch <= 0 || o.seq_len <= 1 || o.steps <= 0)
        throw UsageError("train: batch, seq_len, steps must be positive");
    if (o.use_kjv == !o.tokens_path.empty()) throw UsageError("train: give either a token file or the KJV corpus");
    fs::create_directories(o.out_dir);
    std::vector<int64_t> corpus;
    std::string source = o.tokens_path;
    if (o.use_kjv) {
        const auto split = split_kjv(read_kjv(o.kjv_path), o.holdout);
        const auto tok = Gpt2Tokenizer::load_default(o.vocab_dir);
        corpus = kjv_token_stream(split.train, tok);
        write_kjv_text((fs::path(o.out_dir) / "heldout.txt").string(), split.val);
        write_token_file((fs::path(o.out_dir) / "heldout_tokens.bin").string(), kjv_token_stream(split.val, tok));
        source = "KJV (held out " + o.holdout.str() + ")";
        log("corpus: " + source + ", " + std::to_string(corpus.size()) + " training tokens");
    } else {
        corpus = load_token_file(o.tokens_path);
    }
    if (static_cast<int64_t>(corpus.size()) <= o.seq_len)
        throw Error("corpus '" + source + "' is shorter than one sequence (" + std::to_string(o.seq_len) + ")");
    auto corpus_t = torch::tensor(corpus, torch::kInt64);
    const auto model_path = (fs::path(o.out_dir) / "model.safetensors").string();
    const auto state_path = (fs::path(o.out_dir) / "train_state.safetensors").string();
    const auto log_path = (fs::path(o.out_dir) / "train_log.txt").string();

    MdlmModel model{nullptr};
    AdamW opt;
    int64_t start = 0;
    if (o.resume && fs::exists(state_path) && fs::exists(model_path)) {
        model = load_mdlm(o.out_dir);
        opt.init(*model);
        auto st = SafeTensorsFile::open(state_path);
        torch::NoGradGuard ng;
        for (auto& [n, t] : opt.m) t.copy_(st->tensor("m." + n));
        for (auto& [n, t] : opt.v) t.copy_(st->tensor("v." + n));
        start = std::stoll(st->metadata().at("step"));
        opt.t = std::stoll(st->metadata().at("adam_t"));
        log("resumed from " + o.out_dir + " at step " + std::to_string(start));
    } else {
        MdlmConfig cfg = o.config;
        if (o.compact_vocab) {
            auto uniq = std::get<0>(torch::_unique(corpus_t, /*sorted=*/true));
            auto ids = torch::cat({uniq, torch::tensor({kMdlmMaskId}, torch::kInt64)});
            cfg.compact_vocab = true;
            cfg.vocab_size = ids.size(0);
            cfg.mask_token_id = kMdlmMaskId;
            model = MdlmModel(cfg);
            model->set_vocab_ids(ids);
        } else {
            model = MdlmModel(cfg);
        }
        init_mdlm_weights(model, o.seed);
        opt.init(*model);
        log("new model: " + cfg.to_json().dump());
    }
    model->train();
    auto data = model->to_internal(corpus_t);
    const int64_t n_windows = data.size(0) - o.seq_len;

    TrainResult res;
    res.start_step = start;
    std::ofstream logf(log_path, std::ios::app);
    auto t0 = std::chrono::steady_clock::now();
    double running = 0.0;
    int64_t running_n = 0;
    const int64_t stop = o.stop_after > 0 ? std::min(o.steps, start + o.stop_after) : o.steps;
    for (int64_t step = start; step < stop; ++step) {
        // Per-step generator: a resumed run draws exactly what the uninterrupted run would have drawn.
        auto gen = at::detail::createCPUGenerator(o.seed * 1000003ULL + static_cast<uint64_t>(step) + 1);
        auto offs = torch::randint(n_windows, {o.batch}, gen, torch::kInt64);
        auto idx = offs.unsqueeze(1) + torch::arange(o.seq_len, torch::kInt64).unsqueeze(0);
        auto batch = data.index_select(0, idx.reshape(-1)).view({o.batch, o.seq_len});
        for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
        auto loss = mdlm_loss(model, batch, gen, o.loss_weight);
        loss.backward();
        if (o.grad_clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), o.grad_clip);
        double lr = lr_at(o, step);
        opt.step(lr, adamw_config(o));
        double lv = loss.item<double>();
        if (!std::isfinite(lv))
            throw Error("train: loss became " + std::to_string(lv) + " at step " + std::to_string(step));
        res.losses.push_back(lv);
        running += lv, running_n++;
        if ((step + 1) % o.log_every == 0 || step + 1 == stop) {
            double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            std::ostringstream os;
            os << "step " << (step + 1) << "/" << o.steps << " loss " << std::fixed << std::setprecision(4)
               << running / running_n << " lr " << std::scientific << std::setprecision(2) << lr << " elapsed "
               << std::fixed << std::setprecision(1) << el << "s";
            log(os.str());
            logf << os.str() << "\n";
            logf.flush();
            running = 0, running_n = 0;
        }
        if ((step + 1) % o.checkpoint_every == 0 || step + 1 == stop) {
            // Model first, then the state that names its step: a crash between the two resumes from the older
            // state with newer weights, which is harmless; the reverse could skip steps.
            save_mdlm(model, o.out_dir, torch::kFloat32, true);
            save_state(state_path, opt, step + 1);
        }
    }
    res.end_step = std::max(start, stop);
    model->eval();
    if (!o.export_dir.empty()) {
        save_mdlm(model, o.export_dir, o.export_dtype, true);
        log("exported " + std::string(c10::toString(o.export_dtype)) + " weights to " + o.export_dir);
    }
    return res;
}

cache::AnchorProfile calibrate_mdlm(MdlmModel& model, const CalibrateOptions& opt,
                                    std::vector<std::vector<double>>* out) {
    if (opt.prompts.empty()) throw UsageError("calibrate: at least one prompt is needed");
    const int64_t nl = model->config().n_blocks, T = opt.sampler.steps;
    std::vector<std::vector<double>> sum(static_cast<size_t>(nl), std::vector<double>(static_cast<size_t>(T), 0.0));
    std::vector<std::vector<int64_t>> cnt(static_cast<size_t>(nl), std::vector<int64_t>(static_cast<size_t>(T), 0));
    const int64_t mask = model->internal_mask_id();
    for (const auto& prompt : opt.prompts) {
        MdlmDenoiser den(model, CacheSpec{});
        std::vector<torch::Tensor> prev_h(static_cast<size_t>(nl));
        std::vector<torch::Tensor> prev_ids(static_cast<size_t>(nl));
        den.on_layer_output = [&](int64_t step, int64_t l, const torch::Tensor& ids, const torch::Tensor& h) {
            auto& ph = prev_h[static_cast<size_t>(l)];
            auto& pi = prev_ids[static_cast<size_t>(l)];
            if (ph.defined() && step < T) {
                auto keep = (ids == pi) & (ids != mask);
                auto d = (h - ph).norm(2, {1}); // [L]
                double delta = keep.any().item<bool>()
                                   ? d.index_select(0, torch::nonzero(keep).reshape(-1)).mean().item<double>()
                                   : d.mean().item<double>();
                sum[static_cast<size_t>(l)][static_cast<size_t>(step)] += delta;
                cnt[static_cast<size_t>(l)][static_cast<size_t>(step)]++;
            }
            ph = h.clone();
            pi = ids.clone();
        };
        SamplerOptions so = opt.sampler;
        so.prompt = prompt;
        sample(den, so);
    }
    std::vector<std::vector<double>> deltas(static_cast<size_t>(nl), std::vector<double>(static_cast<size_t>(T), 0.0));
    for (int64_t l = 0; l < nl; ++l) {
        for (int64_t s = 1; s < T; ++s) deltas[l][s] = cnt[l][s] ? sum[l][s] / double(cnt[l][s]) : 0.0;
        deltas[l][0] = T > 1 ? deltas[l][1] : 0.0; // no previous step: like the next one
    }
    auto prof = cache::build_layer_profile(deltas, opt.classes, opt.max_stale);
    prof.meta = {{"steps", T},
                 {"length", opt.sampler.length},
                 {"prompts", opt.prompts.size()},
                 {"unmask", unmask_rule_name(opt.sampler.rule)},
                 {"max_stale", opt.max_stale},
                 {"delta", "mean ||H_s - H_{s-1}|| over positions decoded at both steps, per layer and step"}};
    if (out) *out = deltas;
    return prof;
}

} // namespace anchor::text
