#include "text/train/mdlm_train.h"
#include "cache/train/optim.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "text/gpt2/gpt2_tokenizer.h"
#include "text/params.h"
#include "text/token_file.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace anchor::text {

namespace fs = std::filesystem;

const EnumTable<MdlmLossWeight>& mdlm_loss_weight_table() {
    static const EnumTable<MdlmLossWeight> t = {{"nelbo", MdlmLossWeight::kNelbo},
                                                {"masked_mean", MdlmLossWeight::kMaskedMean}};
    return t;
}

torch::Tensor mdlm_loss(MdlmModel& model, const torch::Tensor& ids, at::Generator& gen, MdlmLossWeight weight) {
    const int64_t B = ids.size(0), L = ids.size(1);
    const double eps = model->config().noise_eps;
    // Low-discrepancy times (MDLM's antithetic sampling): t_b = eps + (1 - eps) ((u + b / B) mod 1). Drawn on the CPU
    // (`gen` is a CPU generator) and moved to the batch's device, so every device draws the same masks.
    auto u = torch::rand({1}, gen, torch::kFloat32);
    auto t_cpu = torch::remainder(u + torch::arange(B, torch::kFloat32) / double(B), 1.0) * (1.0 - eps) + eps;
    auto p_mask = (1.0 - eps) * t_cpu;
    auto r = torch::rand({B, L}, gen, torch::kFloat32);
    auto masked = (r < p_mask.unsqueeze(1)).to(ids.device());
    auto t = t_cpu.to(ids.device());
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
    for (auto& [n, t] : opt.m) ts.emplace_back("m." + n, t.cpu());
    for (auto& [n, t] : opt.v) ts.emplace_back("v." + n, t.cpu());
    save_safetensors(path, ts, {{"step", std::to_string(step)}, {"adam_t", std::to_string(opt.t)}});
}

} // namespace

void TrainOptions::validate() const {
    if (out_dir.empty()) throw ParamError("out_dir", "is empty: an output directory is required");
    if (batch <= 0) throw ParamError("batch", "must be >= 1, got " + std::to_string(batch));
    if (seq_len <= 1) throw ParamError("seq_len", "must be >= 2, got " + std::to_string(seq_len));
    if (steps <= 0) throw ParamError("steps", "must be >= 1, got " + std::to_string(steps));
    if (time_budget_s < 0) throw ParamError("time_budget_s", "must be >= 0, got " + std::to_string(time_budget_s));
    try {
        torch::Device d(device);
        if (d.is_cuda() && !torch::cuda::is_available())
            throw ParamError("device", "is '" + device + "' but this LibTorch has no usable CUDA device");
        if (!d.is_cpu() && !d.is_cuda())
            throw ParamError("device", "must be cpu, cuda or cuda:N, got '" + device + "'");
    } catch (const c10::Error&) {
        throw ParamError("device", "must be cpu, cuda or cuda:N, got '" + device + "'");
    }
    if (use_kjv == !tokens_path.empty())
        throw ParamError("tokens_path", use_kjv ? "and use_kjv are exclusive: give one corpus"
                                                : "is empty: give a token file or use_kjv");
}

TrainResult train_mdlm(const TrainOptions& o) {
    auto log = [&](const std::string& s) {
        if (o.log) o.log(s);
    };
    o.validate();
    fs::create_directories(o.out_dir);
    std::vector<int64_t> corpus;
    std::string source = o.tokens_path;
    if (o.use_kjv) {
        const auto split = split_kjv(read_kjv(o.kjv_path), o.holdout);
        const auto tok = Gpt2Tokenizer::load_default(o.vocab_dir);
        corpus = kjv_token_stream(split.train, tok);
        write_kjv_text((fs::path(o.out_dir) / "heldout.txt").string(), split.val);
        write_token_file((fs::path(o.out_dir) / "heldout_tokens.bin").string(), kjv_token_stream(split.val, tok));
        // The training stream too, so that another trainer of the same run folder (text/train/mdlm_train_torch.py on
        // a GPU machine's PyTorch) reads exactly these tokens.
        write_token_file((fs::path(o.out_dir) / "train_tokens.bin").string(), corpus);
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
    const bool resuming = o.resume && fs::exists(state_path) && fs::exists(model_path);
    if (resuming) {
        model = load_mdlm(o.out_dir);
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
        log("new model: " + cfg.to_json().dump());
    }
    // The corpus is mapped to internal ids on the CPU (the vocabulary buffer is still there), then everything moves.
    const torch::Device dev(o.device);
    auto data = model->to_internal(corpus_t).to(dev);
    model->to(dev);
    if (dev.is_cuda()) at::globalContext().setFloat32MatmulPrecision("high"); // TF32 matmuls
    opt.init(*model);
    if (resuming) {
        auto st = SafeTensorsFile::open(state_path);
        torch::NoGradGuard ng;
        for (auto& [n, t] : opt.m) t.copy_(st->tensor("m." + n));
        for (auto& [n, t] : opt.v) t.copy_(st->tensor("v." + n));
        start = std::stoll(st->metadata().at("step"));
        opt.t = std::stoll(st->metadata().at("adam_t"));
        log("resumed from " + o.out_dir + " at step " + std::to_string(start));
    }
    model->train();
    const int64_t n_windows = data.size(0) - o.seq_len;

    TrainResult res;
    res.start_step = start;
    std::ofstream logf(log_path, std::ios::app);
    auto t0 = std::chrono::steady_clock::now();
    double running = 0.0;
    int64_t running_n = 0;
    // The schedule's length: `steps`, or (time budget) the count that fits, set once from the rate of the steps
    // [start + kPlanFrom, start + kPlanAt): the first steps pay one-off costs (allocator, kernel selection).
    TrainOptions sched = o;
    constexpr int64_t kPlanFrom = 5, kPlanAt = 25;
    auto t_plan = t0;
    // This invocation's last step: the schedule's end, or stop_after steps from where it started.
    auto stop_of = [&](int64_t total) { return o.stop_after > 0 ? std::min(total, start + o.stop_after) : total; };
    int64_t stop = stop_of(o.steps);
    for (int64_t step = start; step < stop; ++step) {
        if (o.time_budget_s > 0 && step == start + kPlanFrom) t_plan = std::chrono::steady_clock::now();
        if (o.time_budget_s > 0 && step == start + kPlanAt) {
            const auto now = std::chrono::steady_clock::now();
            const double per_step = std::chrono::duration<double>(now - t_plan).count() / double(kPlanAt - kPlanFrom);
            const double left = o.time_budget_s - std::chrono::duration<double>(now - t0).count();
            const int64_t fit = step + std::max<int64_t>(1, static_cast<int64_t>(std::max(0.0, left) / per_step));
            sched.steps = std::max(o.warmup + 1, std::min(o.steps, fit));
            stop = stop_of(sched.steps);
            std::ostringstream os;
            os << "time budget " << o.time_budget_s << " s: " << std::setprecision(4) << per_step * 1e3
               << " ms/step -> schedule of " << sched.steps << " steps";
            log(os.str());
            logf << os.str() << "\n";
        }
        // Per-step generator: a resumed run draws exactly what the uninterrupted run would have drawn.
        auto gen = at::detail::createCPUGenerator(o.seed * 1000003ULL + static_cast<uint64_t>(step) + 1);
        auto offs = torch::randint(n_windows, {o.batch}, gen, torch::kInt64);
        auto idx = offs.unsqueeze(1) + torch::arange(o.seq_len, torch::kInt64).unsqueeze(0);
        auto batch = data.index_select(0, idx.reshape(-1).to(dev)).view({o.batch, o.seq_len});
        for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
        auto loss = mdlm_loss(model, batch, gen, o.loss_weight);
        loss.backward();
        if (o.grad_clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), o.grad_clip);
        double lr = lr_at(sched, step);
        opt.step(lr, adamw_config(o));
        double lv = loss.item<double>();
        if (!std::isfinite(lv))
            throw Error("train: loss became " + std::to_string(lv) + " at step " + std::to_string(step));
        res.losses.push_back(lv);
        running += lv, running_n++;
        if ((step + 1) % o.log_every == 0 || step + 1 == stop) {
            double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            std::ostringstream os;
            os << "step " << (step + 1) << "/" << sched.steps << " loss " << std::fixed << std::setprecision(4)
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

} // namespace anchor::text
