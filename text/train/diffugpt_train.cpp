// DiffuGPT adaptation of an autoregressive GPT-2 (diffugpt_train.h).
#include "text/train/diffugpt_train.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/train/optim.h"
#include "text/diffusion/families/dlm_model.h"
#include "text/gpt2/gpt2_tokenizer.h"
#include "text/params.h"
#include "text/token_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <set>
#include <sstream>

namespace anchor::text {

namespace fs = std::filesystem;

double diffugpt_anneal_ratio(int64_t step, int64_t anneal_steps) {
    if (anneal_steps <= 0) return 1.0;
    return std::min(1.0, double(step + 1) / double(anneal_steps));
}

torch::Tensor diffugpt_anneal_mask(int64_t T, double ratio, at::Generator& gen) {
    auto pos = torch::arange(T, torch::kLong);
    auto causal = pos.unsqueeze(0) <= pos.unsqueeze(1); // [query, key]: key <= query
    if (ratio >= 1.0) return torch::ones({T, T}, torch::kBool);
    if (ratio <= 0.0) return causal;
    auto u = at::rand({T, T}, gen, torch::kFloat64);
    return causal.logical_or(u < ratio);
}

torch::Tensor diffugpt_train_hidden(Gpt2Model& model, const torch::Tensor& ids, const torch::Tensor& allowed) {
    const int64_t B = ids.size(0), T = ids.size(1);
    const auto& cfg = model->config();
    if (T > cfg.n_positions)
        throw Error("DiffuGPT training forward: " + std::to_string(T) + " tokens exceed n_positions " +
                    std::to_string(cfg.n_positions));
    const int64_t C = cfg.n_embd, H = cfg.n_head, D = C / H;
    torch::Tensor blocked;
    if (allowed.defined()) blocked = allowed.logical_not().view({1, 1, T, T});
    auto x = model->wte(ids) + model->wpe(torch::arange(T, torch::kLong));
    for (const auto& m : *model->h) {
        auto& b = *m->as<Gpt2BlockImpl>();
        auto qkv = b.attn->c_attn(b.ln_1(x)).split(C, 2);
        auto heads = [&](const torch::Tensor& t) { return t.reshape({B, T, H, D}).transpose(1, 2); };
        // GPT-2's attention (q k^T / sqrt(D), softmax, @ v) with the annealed mask in place of the causal one; the
        // diagonal is always allowed, so no row is empty.
        auto scores = torch::matmul(heads(qkv[0]), heads(qkv[1]).transpose(-2, -1)) / std::sqrt(double(D));
        if (blocked.defined()) scores = scores.masked_fill(blocked, -std::numeric_limits<float>::infinity());
        auto y = torch::matmul(torch::softmax(scores, -1), heads(qkv[2])).transpose(1, 2).reshape({B, T, C});
        x = x + b.attn->c_proj(y);
        x = x + b.mlp(b.ln_2(x));
    }
    return model->ln_f(x);
}

DiffuGptLoss diffugpt_shift_loss(const torch::Tensor& logits, const torch::Tensor& x0, const torch::Tensor& xt,
                                 int64_t mask_id, const torch::Tensor& t) {
    const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
    DiffuGptLoss out;
    if (T < 2) {
        out.weighted = out.unweighted = logits.sum() * 0.0;
        return out;
    }
    // Row i of the logits predicts token i + 1 (the shift of the AR model the weights come from).
    auto rows = logits.narrow(1, 0, T - 1).reshape({-1, V});
    auto target = x0.narrow(1, 1, T - 1).reshape(-1);
    auto in_loss = xt.narrow(1, 1, T - 1).eq(mask_id).to(torch::kFloat32); // [B, T - 1]
    auto ce = torch::nn::functional::cross_entropy(
                  rows, target, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
                  .view({B, T - 1}) *
              in_loss;
    out.masked = static_cast<int64_t>(in_loss.sum().item<double>());
    const double denom = double(std::max<int64_t>(out.masked, 1));
    out.unweighted = ce.sum() / denom;
    out.weighted = (ce * t.to(torch::kFloat32).reciprocal().view({B, 1})).sum() / denom;
    return out;
}

torch::Tensor diffugpt_noise(const torch::Tensor& x0, const torch::Tensor& t, int64_t mask_id, at::Generator& gen) {
    auto u = at::rand(x0.sizes(), gen, torch::kFloat64);
    return x0.masked_fill(u < t.to(torch::kFloat64).view({-1, 1}), mask_id);
}

torch::Tensor diffugpt_times(int64_t B, double eps, at::Generator& gen) {
    const double u = at::rand({1}, gen, torch::kFloat64).item<double>();
    std::vector<double> t(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
        const double f = std::fmod(u + double(b) / double(B), 1.0);
        t[static_cast<size_t>(b)] = eps + (1.0 - eps) * f;
    }
    return torch::tensor(t, torch::kFloat64);
}

double diffugpt_heldout_nelbo(const std::vector<int64_t>& stream, int64_t seq_len, int64_t windows, int64_t mask_id,
                              double eps, uint64_t seed,
                              const std::function<torch::Tensor(const torch::Tensor&)>& logits_of) {
    torch::NoGradGuard ng;
    const int64_t W = std::min<int64_t>(windows, static_cast<int64_t>(stream.size()) / seq_len);
    if (W < 1 || seq_len < 2) throw Error("DiffuGPT evaluation: the held-out text is shorter than one window");
    auto all = torch::tensor(stream, torch::kLong);
    auto gen = at::detail::createCPUGenerator(seed);
    double total = 0.0;
    for (int64_t w = 0; w < W; ++w) {
        auto x0 = all.narrow(0, w * seq_len, seq_len).view({1, seq_len});
        auto t = torch::full({1}, eps + (1.0 - eps) * (double(w) + 0.5) / double(W), torch::kFloat64);
        auto xt = diffugpt_noise(x0, t, mask_id, gen);
        auto l = diffugpt_shift_loss(logits_of(xt), x0, xt, mask_id, t);
        total += l.weighted.item<double>() * double(std::max<int64_t>(l.masked, 1)); // the window's sum
    }
    return total / double(W * (seq_len - 1));
}

void DiffuGptTrainOptions::validate() const {
    if (init_from.empty()) throw ParamError("init_from", "is empty: name the autoregressive GPT-2 folder");
    if (out_dir.empty()) throw ParamError("out_dir", "is empty: a run folder is required");
    const std::vector<std::pair<const char*, int64_t>> positive = {
        {"batch", batch}, {"steps", steps}, {"log_every", log_every}, {"eval_windows", eval_windows}};
    for (const auto& [field, v] : positive)
        if (v <= 0) throw ParamError(field, "must be >= 1, got " + std::to_string(v));
    const std::vector<std::pair<const char*, int64_t>> non_negative = {
        {"seq_len", seq_len}, {"eval_every", eval_every}, {"warmup", warmup}, {"anneal_steps", anneal_steps}};
    for (const auto& [field, v] : non_negative)
        if (v < 0) throw ParamError(field, "must be >= 0, got " + std::to_string(v));
    if (!(lr > 0)) throw ParamError("lr", "must be > 0");
    if (weight_decay < 0) throw ParamError("weight_decay", "must be >= 0");
    if (!(sampling_eps > 0 && sampling_eps < 1)) throw ParamError("sampling_eps", "must be in (0, 1)");
    if (time_budget_s < 0) throw ParamError("time_budget_s", "must be >= 0");
    if (!(unseen_logit < 0)) throw ParamError("unseen_logit", "must be < 0");
}

namespace {

std::string dgpt_fixed(double v, int digits) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(digits) << v;
    return os.str();
}

std::string dgpt_metrics_csv(const std::vector<Gpt2TrainMetric>& ms) {
    std::ostringstream os;
    os << "step,train_loss,lr,val_loss,tokens,elapsed_s\n" << std::setprecision(8);
    for (const auto& m : ms) {
        os << m.step << "," << m.train_loss << "," << m.lr << ",";
        if (m.val_loss >= 0) os << m.val_loss;
        os << "," << m.tokens << "," << m.elapsed_s << "\n";
    }
    return os.str();
}

// The AR model was trained with coordinate 0 of ln_f's output pinned to 1 (gpt2_train.h): column 0 of the table is a
// per-token logit bias, which makes the compact softmax and its expansion exact.
bool dgpt_has_pinned_bias(Gpt2Model& m) {
    return m->ln_f->weight[0].item<double>() == 0.0 && m->ln_f->bias[0].item<double>() == 1.0;
}

void dgpt_pin_bias(Gpt2Model& m) {
    torch::NoGradGuard ng;
    m->ln_f->weight[0].fill_(0.0);
    m->ln_f->bias[0].fill_(1.0);
}

} // namespace

DiffuGptTrainResult train_diffugpt(const DiffuGptTrainOptions& o) {
    using Clock = std::chrono::steady_clock;
    const auto t_start = Clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t_start).count(); };
    o.validate();
    const auto export_model = (fs::path(o.export_dir) / "model.safetensors").string();
    const auto export_config = (fs::path(o.export_dir) / "config.json").string();
    if (!o.export_dir.empty() && !o.overwrite_export)
        for (const auto& p : {export_model, export_config})
            if (fs::exists(p))
                throw ParamError("export_dir", "holds '" + p + "' already; set overwrite_export to replace the model");
    fs::create_directories(o.out_dir);
    std::ofstream logf((fs::path(o.out_dir) / "train_log.txt").string(), std::ios::trunc);
    if (!logf) throw Error("cannot write the training log in '" + o.out_dir + "'");
    auto log_line = [&](const std::string& s) {
        if (o.log) o.log(s);
        logf << s << "\n";
        logf.flush();
    };

    // The AR model.
    auto ar = load_gpt2(o.init_from);
    Gpt2Config cfg = ar.config;
    const int64_t V_ar = cfg.vocab_size;
    const bool compact = dgpt_has_pinned_bias(ar.model);
    const int64_t T = o.seq_len > 0 ? o.seq_len : cfg.n_positions;
    if (T > cfg.n_positions)
        throw ParamError("seq_len", std::to_string(T) + " exceeds n_positions " + std::to_string(cfg.n_positions));
    if (T < 2) throw ParamError("seq_len", "must be >= 2, got " + std::to_string(T));

    // Data (the split and tokenizer of gpt2_train.h).
    const auto verses = read_kjv(o.kjv_path);
    const auto split = split_kjv(verses, o.holdout);
    const auto tok = Gpt2Tokenizer::load_default(o.vocab_dir);
    const auto train_ids = kjv_token_stream(split.train, tok);
    const auto val_ids = kjv_token_stream(split.val, tok);
    write_kjv_text((fs::path(o.out_dir) / "heldout.txt").string(), split.val);
    write_token_file((fs::path(o.out_dir) / "heldout_tokens.bin").string(), val_ids);

    // Rows of the model being trained: the KJV's tokens (compact) or every AR row, then [MASK].
    torch::Tensor vocab_ids;
    if (compact) {
        std::set<int64_t> used(train_ids.begin(), train_ids.end());
        used.insert(val_ids.begin(), val_ids.end());
        used.insert(Gpt2Tokenizer::kEndOfText);
        vocab_ids = torch::tensor(std::vector<int64_t>(used.begin(), used.end()), torch::kLong);
    } else {
        vocab_ids = torch::arange(V_ar, torch::kLong);
    }
    const int64_t R = vocab_ids.size(0), mask_row = R, mask_id = V_ar;
    std::vector<int64_t> lut(static_cast<size_t>(V_ar), -1);
    for (int64_t i = 0; i < R; ++i) lut[static_cast<size_t>(vocab_ids[i].item<int64_t>())] = i;
    auto to_rows = [&](const std::vector<int64_t>& ids) {
        std::vector<int64_t> r(ids.size());
        for (size_t i = 0; i < ids.size(); ++i) {
            if (ids[i] < 0 || ids[i] >= V_ar || lut[static_cast<size_t>(ids[i])] < 0)
                throw Error("DiffuGPT training: token " + std::to_string(ids[i]) + " is not a row of the model");
            r[i] = lut[static_cast<size_t>(ids[i])];
        }
        return r;
    };
    const auto train_rows = to_rows(train_ids), val_rows = to_rows(val_ids);
    const auto train_t = torch::tensor(train_rows, torch::kLong);
    const int64_t N = train_t.size(0);
    if (N <= T) throw Error("the training text is shorter than one sequence of " + std::to_string(T));

    Gpt2Config tcfg = cfg;
    tcfg.vocab_size = R + 1;
    Gpt2Model model(tcfg);
    {
        torch::NoGradGuard ng;
        auto src = ar.model->named_parameters(true);
        for (auto& p : model->named_parameters(true)) {
            if (p.key() == "wte.weight") {
                auto rows = src["wte.weight"].detach().to(torch::kFloat32).index_select(0, vocab_ids);
                p.value().narrow(0, 0, R).copy_(rows);
                p.value()[R].copy_(rows.mean(0));
            } else {
                p.value().copy_(src[p.key()].detach().to(torch::kFloat32));
            }
        }
    }
    model->train();
    cache::NamedAdamW opt;
    opt.init(*model);
    const cache::AdamWConfig acfg{o.beta1, o.beta2, o.adam_eps, o.weight_decay};

    DiffuGptTrainResult res;
    res.vocab_rows = R + 1;
    res.mask_id = mask_id;
    log_line("init from " + o.init_from + ": " + cfg.describe() + "; [MASK] = id " + std::to_string(mask_id) + ", " +
             std::to_string(R + 1) + " rows trained (" + (compact ? "the KJV's GPT-2 tokens" : "every AR row") +
             " + [MASK])");
    log_line("data: held out " + o.holdout.str() + ": " + std::to_string(split.val.size()) + " verses, " +
             std::to_string(val_ids.size()) + " tokens; training " + std::to_string(split.train.size()) +
             " verses, " + std::to_string(train_ids.size()) + " tokens; sequences of " + std::to_string(T) +
             " x batch " + std::to_string(o.batch) + "; anneal over " + std::to_string(o.anneal_steps) + " steps");

    const uint64_t eval_seed = o.seed * 7919ULL + 17;
    auto evaluate = [&] {
        model->eval();
        const double v = diffugpt_heldout_nelbo(val_rows, T, o.eval_windows, mask_row, o.sampling_eps, eval_seed,
                                                [&](const torch::Tensor& xt) {
                                                    auto h = diffugpt_train_hidden(model, xt, torch::Tensor());
                                                    return torch::matmul(h, model->wte->weight.t());
                                                });
        model->train();
        return v;
    };
    res.val_nelbo_start = evaluate();
    log_line("step 0 | val nelbo " + dgpt_fixed(res.val_nelbo_start, 4) + " (the AR weights, full attention)");

    int64_t planned = o.steps;
    // The step rate is measured from here (not loading, tokenising and the first evaluation).
    double rate_from_s = elapsed();
    int64_t rate_from_step = 0;
    double running = 0.0;
    int64_t running_n = 0, step = 0;
    const auto pos = torch::arange(T, torch::kLong).unsqueeze(0);
    for (; step < planned; ++step) {
        // Per-step generator: batches, times, masks and the annealed attention mask of a step depend on the seed and
        // the step only.
        auto gen = at::detail::createCPUGenerator(o.seed * 1000003ULL + static_cast<uint64_t>(step) + 1);
        auto offs = torch::randint(N - T + 1, {o.batch}, gen, torch::kLong);
        auto x0 = train_t.index_select(0, (offs.unsqueeze(1) + pos).reshape(-1)).view({o.batch, T});
        auto t = diffugpt_times(o.batch, o.sampling_eps, gen);
        auto xt = diffugpt_noise(x0, t, mask_row, gen);
        const double ratio = diffugpt_anneal_ratio(step, o.anneal_steps);
        auto allowed = ratio >= 1.0 ? torch::Tensor() : diffugpt_anneal_mask(T, ratio, gen);
        for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
        auto h = diffugpt_train_hidden(model, xt, allowed);
        auto logits = torch::matmul(h, model->wte->weight.t());
        auto loss = diffugpt_shift_loss(logits, x0, xt, mask_row, t);
        loss.weighted.backward();
        if (o.grad_clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), o.grad_clip);
        const double lr = cache::warmup_cosine_lr(o.lr, step, o.warmup, planned, o.min_lr_ratio);
        opt.step(lr, acfg);
        if (compact) dgpt_pin_bias(model);
        const double lv = loss.weighted.item<double>();
        if (!std::isfinite(lv))
            throw Error("DiffuGPT training: the loss became " + std::to_string(lv) + " at step " +
                        std::to_string(step + 1));
        running += lv, running_n++;
        const double el = elapsed();
        if (o.time_budget_s > 0 && (step + 1 == 10 || (step + 1) % 50 == 0)) {
            // Resize the schedule to the budget from the rate of the steps since the last resize (the evaluations
            // included by a margin), again every 50 steps: on a shared machine the rate changes, and the cosine
            // should still reach its floor when the budget ends.
            const double rate = (el - rate_from_s) / double(step + 1 - rate_from_step);
            const auto fit = static_cast<int64_t>((o.time_budget_s - el) / (rate * 1.08)) + step + 1;
            const int64_t before = planned;
            planned = std::max({o.warmup + 1, step + 2, std::min(o.steps, fit)});
            rate_from_s = el, rate_from_step = step + 1;
            if (planned != before)
                log_line("time budget " + dgpt_fixed(o.time_budget_s, 0) + " s at " + dgpt_fixed(rate, 2) +
                         " s/step: the schedule spans " + std::to_string(planned) + " steps");
        }
        const bool out_of_time = o.time_budget_s > 0 && el >= o.time_budget_s;
        const bool last = step + 1 == planned || out_of_time;
        const bool eval_due = (o.eval_every > 0 && (step + 1) % o.eval_every == 0) || last;
        if ((step + 1) % o.log_every == 0 || eval_due) {
            Gpt2TrainMetric m;
            m.step = step + 1;
            m.train_loss = running / double(running_n);
            m.lr = lr;
            m.tokens = (step + 1) * o.batch * T;
            m.elapsed_s = el;
            res.train_loss = m.train_loss;
            std::ostringstream os;
            os << "step " << m.step << "/" << planned << " loss " << dgpt_fixed(m.train_loss, 4) << " unweighted "
               << dgpt_fixed(loss.unweighted.item<double>(), 4) << " lr " << std::scientific << std::setprecision(2)
               << lr << " anneal " << dgpt_fixed(ratio, 3) << " elapsed " << dgpt_fixed(el, 1) << "s";
            if (eval_due) {
                m.val_loss = evaluate();
                os << " | val nelbo " << dgpt_fixed(m.val_loss, 4);
            }
            log_line(os.str());
            res.metrics.push_back(m);
            write_file_atomic((fs::path(o.out_dir) / "metrics.csv").string(), dgpt_metrics_csv(res.metrics));
            running = 0, running_n = 0;
        }
        if (out_of_time) {
            log_line("stopping: the time budget is spent at step " + std::to_string(step + 1));
            ++step;
            break;
        }
    }
    res.steps_run = step;
    res.planned_steps = planned;
    res.val_nelbo = res.metrics.empty() ? res.val_nelbo_start : res.metrics.back().val_loss;
    res.wall_s = elapsed();

    if (!o.export_dir.empty()) {
        torch::NoGradGuard ng;
        model->eval();
        fs::create_directories(o.export_dir);
        NamedTensors ts;
        for (auto& p : model->named_parameters(true)) {
            torch::Tensor v = p.value().detach();
            std::string name = "denoise_model." + p.key();
            if (p.key() == "wte.weight") {
                // Every AR id (unseen ones as a logit of unseen_logit), then [MASK] at id V_ar.
                auto full = torch::zeros({V_ar + 1, cfg.n_embd});
                if (compact) full.select(1, 0).fill_(o.unseen_logit);
                full.index_copy_(0, vocab_ids, v.narrow(0, 0, R));
                full[V_ar].copy_(v[R]);
                v = full;
                name = "embed_tokens.weight";
            }
            ts.emplace_back(name, v.to(o.export_dtype).contiguous());
        }
        Gpt2Config out_cfg = cfg;
        out_cfg.vocab_size = V_ar + 1;
        auto cj = out_cfg.to_json();
        cj["mask_token_id"] = mask_id;
        cj["torch_dtype"] = o.export_dtype == torch::kFloat16    ? "float16"
                            : o.export_dtype == torch::kBFloat16 ? "bfloat16"
                                                                 : "float32";
        save_safetensors(export_model, ts, {{"format", "pt"}}, true);
        write_file_atomic(export_config, cj.dump(2) + "\n", true);
        // The exported folder as a user loads it (load_dlm, every logit): the same held-out windows and masks.
        auto dlm = load_dlm(o.export_dir);
        res.export_val_nelbo = diffugpt_heldout_nelbo(
            val_ids, T, o.eval_windows, mask_id, o.sampling_eps, eval_seed, [&](const torch::Tensor& xt) {
                std::vector<torch::Tensor> rows;
                for (int64_t b = 0; b < xt.size(0); ++b) rows.push_back(dlm.model->logits(xt.narrow(0, b, 1)));
                return torch::cat(rows, 0);
            });
        log_line("exported " + std::string(c10::toString(o.export_dtype)) + " weights to " + o.export_dir +
                 "; through load_dlm (every logit): val nelbo " + dgpt_fixed(res.export_val_nelbo, 4) +
                 " (trained weights: " + dgpt_fixed(res.val_nelbo, 4) + ")");
    }
    return res;
}

} // namespace anchor::text
