#include "text/train/gpt2_train.h"
#include "cache/train/optim.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "text/gpt2/gpt2_tokenizer.h"
#include "text/params.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

namespace anchor::text {

namespace fs = std::filesystem;

// ---- data --------------------------------------------------------------------------------------------------------

const std::vector<std::pair<HoldoutKind, std::string>>& holdout_kind_names() {
    static const std::vector<std::pair<HoldoutKind, std::string>> t = {{HoldoutKind::Books, "books"},
                                                                       {HoldoutKind::Tail, "tail"}};
    return t;
}

std::string HoldoutSpec::syntax_help() {
    return "books:TAG[,TAG...] (whole books, tags as in bible.data or English names) | tail:P (the last P% of "
           "verses)";
}

HoldoutSpec HoldoutSpec::parse(const std::string& s) {
    const auto colon = s.find(':');
    const std::string head = s.substr(0, colon), args = colon == std::string::npos ? "" : s.substr(colon + 1);
    auto bad = [&](const std::string& why) {
        return ParamError("holdout", "split '" + s + "' is not valid: " + why + " (expected " + syntax_help() + ")");
    };
    HoldoutSpec h;
    bool found = false;
    for (const auto& [k, name] : holdout_kind_names())
        if (name == head) h.kind = k, found = true;
    if (!found) throw bad("unknown kind '" + head + "'");
    if (args.empty()) throw bad("missing argument");
    if (h.kind == HoldoutKind::Books) {
        h.books.clear();
        std::stringstream ss(args);
        std::string b;
        while (std::getline(ss, b, ',')) {
            const int i = kjv_book_index(b);
            if (i < 0) throw bad("unknown book '" + b + "'");
            h.books.push_back(kjv_books()[static_cast<size_t>(i)].first);
        }
        if (h.books.empty()) throw bad("no book named");
    } else {
        size_t used = 0;
        try {
            h.tail_percent = std::stod(args, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != args.size() || !(h.tail_percent > 0.0 && h.tail_percent < 100.0))
            throw bad("P must be a number in (0, 100)");
    }
    return h;
}

std::string HoldoutSpec::str() const {
    std::ostringstream os;
    if (kind == HoldoutKind::Books) {
        os << "books:";
        for (size_t i = 0; i < books.size(); ++i) os << (i ? "," : "") << books[i];
    } else {
        os << "tail:" << tail_percent;
    }
    return os.str();
}

KjvSplit split_kjv(const std::vector<KjvVerse>& verses, const HoldoutSpec& spec) {
    KjvSplit s;
    if (spec.kind == HoldoutKind::Books) {
        std::set<std::string> held(spec.books.begin(), spec.books.end());
        for (const auto& v : verses) (held.count(v.book) ? s.val : s.train).push_back(v);
    } else {
        const auto n_val = static_cast<size_t>(std::llround(double(verses.size()) * spec.tail_percent / 100.0));
        const size_t cut = verses.size() - std::min(n_val, verses.size());
        s.train.assign(verses.begin(), verses.begin() + static_cast<std::ptrdiff_t>(cut));
        s.val.assign(verses.begin() + static_cast<std::ptrdiff_t>(cut), verses.end());
    }
    if (s.train.empty()) throw ParamError("holdout", "split '" + spec.str() + "' leaves no training verses");
    if (s.val.empty()) throw ParamError("holdout", "split '" + spec.str() + "' selects no verses");
    return s;
}

std::vector<std::string> kjv_documents(const std::vector<KjvVerse>& verses) {
    std::vector<std::string> docs;
    std::string book;
    for (const auto& v : verses) {
        if (docs.empty() || v.book != book) docs.emplace_back(), book = v.book;
        docs.back() += v.text;
        docs.back() += '\n';
    }
    return docs;
}

void write_kjv_text(const std::string& path, const std::vector<KjvVerse>& verses) {
    std::string text;
    for (const auto& d : kjv_documents(verses)) text += (text.empty() ? "" : "\n") + d;
    write_file_atomic(path, text);
}

std::vector<int64_t> kjv_token_stream(const std::vector<KjvVerse>& verses, const Gpt2Tokenizer& tok) {
    std::vector<int64_t> ids;
    for (const auto& d : kjv_documents(verses)) {
        auto t = tok.encode(d);
        ids.insert(ids.end(), t.begin(), t.end());
        ids.push_back(Gpt2Tokenizer::kEndOfText);
    }
    return ids;
}

// ---- model -------------------------------------------------------------------------------------------------------

torch::Tensor gpt2_train_hidden(Gpt2Model& model, const torch::Tensor& ids) {
    const int64_t T = ids.size(1);
    if (T > model->config().n_positions)
        throw Error("GPT-2 training forward: " + std::to_string(T) + " tokens exceed n_positions " +
                    std::to_string(model->config().n_positions));
    auto x = model->wte(ids) + model->wpe(torch::arange(T, torch::kLong));
    for (const auto& m : *model->h) x = m->as<Gpt2BlockImpl>()->forward(x);
    return model->ln_f(x);
}

void init_gpt2_weights(Gpt2Model& model, uint64_t seed) {
    torch::NoGradGuard ng;
    auto gen = at::detail::createCPUGenerator(seed);
    const double proj_std = 0.02 / std::sqrt(2.0 * double(model->config().n_layer));
    for (auto& p : model->named_parameters(true)) {
        const std::string& n = p.key();
        auto& t = p.value();
        const bool ln = n.find("ln_") != std::string::npos;
        if (ln)
            t.fill_(n.size() >= 6 && n.compare(n.size() - 6, 6, "weight") == 0 ? 1.0 : 0.0);
        else if (t.dim() >= 2)
            t.normal_(0.0, n.find("c_proj.weight") != std::string::npos ? proj_std : 0.02, gen);
        else
            t.zero_();
    }
}

namespace {

// Pins coordinate 0 of ln_f's output to 1 (see the header: column 0 of wte becomes a per-token logit bias).
void pin_bias_dim(Gpt2Model& model) {
    torch::NoGradGuard ng;
    model->ln_f->weight[0].fill_(0.0);
    model->ln_f->bias[0].fill_(1.0);
}

} // namespace

double gpt2_mean_nll(Gpt2Model& model, const std::vector<int64_t>& stream, int64_t seq_len, int64_t batch,
                     int64_t* scored) {
    torch::NoGradGuard ng;
    const int64_t N = static_cast<int64_t>(stream.size());
    if (N < 2) throw Error("GPT-2 evaluation: fewer than 2 tokens");
    auto all = torch::tensor(stream, torch::kLong);
    double nll = 0.0;
    int64_t count = 0;
    auto score = [&](const std::vector<int64_t>& starts, int64_t len) {
        std::vector<torch::Tensor> rows;
        for (auto s : starts) rows.push_back(all.narrow(0, s, len + 1));
        auto w = torch::stack(rows);
        auto h = gpt2_train_hidden(model, w.narrow(1, 0, len));
        auto logits = torch::matmul(h, model->wte->weight.t());
        auto l = torch::nn::functional::cross_entropy(
            logits.reshape({-1, logits.size(-1)}), w.narrow(1, 1, len).reshape(-1),
            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
        nll += l.item<double>();
        count += len * static_cast<int64_t>(starts.size());
    };
    std::vector<int64_t> starts;
    int64_t s = 0;
    for (; s + seq_len + 1 <= N; s += seq_len) {
        starts.push_back(s);
        if (static_cast<int64_t>(starts.size()) == batch) score(starts, seq_len), starts.clear();
    }
    if (!starts.empty()) score(starts, seq_len);
    if (N - s >= 2) score({s}, N - s - 1);
    if (scored) *scored = count;
    return nll / double(count);
}

// ---- training ----------------------------------------------------------------------------------------------------

namespace {

using AdamW = cache::NamedAdamW;

cache::AdamWConfig adamw_config(const Gpt2TrainOptions& o) {
    return {o.beta1, o.beta2, o.adam_eps, o.weight_decay};
}

double lr_at(const Gpt2TrainOptions& o, int64_t step) {
    return cache::warmup_cosine_lr(o.lr, step, o.warmup, o.steps, o.min_lr_ratio);
}

std::string metrics_csv(const std::vector<Gpt2TrainMetric>& ms) {
    std::ostringstream os;
    os << "step,train_loss,lr,val_loss,tokens,elapsed_s\n" << std::setprecision(8);
    for (const auto& m : ms) {
        os << m.step << "," << m.train_loss << "," << m.lr << ",";
        if (m.val_loss >= 0) os << m.val_loss;
        os << "," << m.tokens << "," << m.elapsed_s << "\n";
    }
    return os.str();
}

std::string fixed(double v, int digits) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(digits) << v;
    return os.str();
}

} // namespace

std::vector<Gpt2TrainMetric> read_train_metrics(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw Error("cannot read training metrics '" + path + "'");
    std::vector<Gpt2TrainMetric> out;
    std::string line;
    int64_t line_no = 0;
    while (std::getline(in, line)) {
        if (++line_no == 1 || line.empty()) continue; // header
        std::vector<std::string> f;
        std::stringstream ss(line);
        std::string x;
        while (std::getline(ss, x, ',')) f.push_back(x);
        while (f.size() < 6) f.emplace_back();
        try {
            Gpt2TrainMetric m;
            m.step = std::stoll(f[0]);
            m.train_loss = f[1].empty() ? 0.0 : std::stod(f[1]);
            m.lr = f[2].empty() ? 0.0 : std::stod(f[2]);
            m.val_loss = f[3].empty() ? -1.0 : std::stod(f[3]);
            m.tokens = f[4].empty() ? 0 : std::stoll(f[4]);
            m.elapsed_s = f[5].empty() ? 0.0 : std::stod(f[5]);
            out.push_back(m);
        } catch (const std::exception&) {
            throw Error("training metrics '" + path + "' line " + std::to_string(line_no) + " is malformed: " + line);
        }
    }
    return out;
}

void Gpt2TrainOptions::validate() const {
    if (out_dir.empty()) throw ParamError("out_dir", "is empty: a run folder is required");
    const std::vector<std::pair<const char*, int64_t>> positive = {{"batch", batch},
                                                                   {"steps", steps},
                                                                   {"eval_batch", eval_batch},
                                                                   {"log_every", log_every},
                                                                   {"checkpoint_every", checkpoint_every}};
    for (const auto& [field, v] : positive)
        if (v <= 0) throw ParamError(field, "must be >= 1, got " + std::to_string(v));
    const std::vector<std::pair<const char*, int64_t>> non_negative = {
        {"seq_len", seq_len}, {"eval_every", eval_every}, {"warmup", warmup}};
    for (const auto& [field, v] : non_negative)
        if (v < 0) throw ParamError(field, "must be >= 0, got " + std::to_string(v));
    if (!(lr > 0)) throw ParamError("lr", "must be > 0");
    if (weight_decay < 0) throw ParamError("weight_decay", "must be >= 0");
    if (!(ema >= 0.0 && ema < 1.0)) throw ParamError("ema", "must be in [0, 1)");
    if (!(unseen_logit < 0)) throw ParamError("unseen_logit", "must be < 0");
}

Gpt2TrainResult train_gpt2(const Gpt2TrainOptions& o) {
    using Clock = std::chrono::steady_clock;
    const auto t_start = Clock::now();
    auto log = [&](const std::string& s) {
        if (o.log) o.log(s);
    };
    o.validate();
    const auto export_model = (fs::path(o.export_dir) / "model.safetensors").string();
    const auto export_config = (fs::path(o.export_dir) / "config.json").string();
    if (!o.export_dir.empty() && !o.overwrite_export)
        for (const auto& p : {export_model, export_config})
            if (fs::exists(p))
                throw ParamError("export_dir", "holds '" + p + "' already; set overwrite_export to replace the model");

    fs::create_directories(o.out_dir);
    const auto ckpt_path = (fs::path(o.out_dir) / "checkpoint.safetensors").string();
    const auto log_path = (fs::path(o.out_dir) / "train_log.txt").string();
    const auto csv_path = (fs::path(o.out_dir) / "metrics.csv").string();
    const bool resuming = o.resume && fs::exists(ckpt_path);
    // A fresh run starts a fresh log; a resumed one appends.
    std::ofstream logf(log_path, resuming ? std::ios::app : std::ios::trunc);
    if (!logf) throw Error("cannot write the training log '" + log_path + "'");
    auto log_line = [&](const std::string& s) {
        log(s);
        logf << s << "\n";
        logf.flush();
    };

    // Data.
    const auto verses = read_kjv(o.kjv_path);
    const auto split = split_kjv(verses, o.holdout);
    const auto tok = Gpt2Tokenizer::load_default(o.vocab_dir);
    const auto train_ids = kjv_token_stream(split.train, tok);
    const auto val_ids = kjv_token_stream(split.val, tok);
    write_kjv_text((fs::path(o.out_dir) / "heldout.txt").string(), split.val);

    // Model, optimizer, EMA: fresh or from the checkpoint.
    Gpt2Config cfg = o.config;
    bool full_vocab = o.full_vocab;
    torch::Tensor vocab_ids;
    Gpt2Model model{nullptr};
    AdamW opt;
    std::map<std::string, torch::Tensor> ema;
    int64_t start = 0;
    double elapsed_before = 0;
    std::vector<Gpt2TrainMetric> metrics;
    if (resuming) {
        auto st = SafeTensorsFile::open(ckpt_path);
        const auto& md = st->metadata();
        try {
            cfg = Gpt2Config::from_json(nlohmann::json::parse(md.at("config")), ckpt_path);
            full_vocab = md.at("full_vocab") == "1";
            start = std::stoll(md.at("step"));
            opt.t = std::stoll(md.at("adam_t"));
            elapsed_before = std::stod(md.at("elapsed_s"));
        } catch (const std::out_of_range&) {
            throw Error("checkpoint '" + ckpt_path + "' lacks training metadata (config, step, adam_t, elapsed_s)");
        }
        vocab_ids = st->tensor("vocab_ids").to(torch::kLong).clone();
        model = Gpt2Model(cfg);
        opt.init(*model);
        torch::NoGradGuard ng;
        for (auto& [n, p] : opt.params) {
            p.copy_(st->tensor("param." + n));
            opt.m[n].copy_(st->tensor("m." + n));
            opt.v[n].copy_(st->tensor("v." + n));
            if (o.ema > 0)
                ema[n] = st->has("ema." + n) ? st->tensor("ema." + n).to(torch::kFloat32).clone() : p.detach().clone();
        }
        if (fs::exists(csv_path))
            for (const auto& m : read_train_metrics(csv_path))
                if (m.step <= start) metrics.push_back(m);
        log_line("resumed from " + ckpt_path + " at step " + std::to_string(start));
    } else {
        if (full_vocab) {
            vocab_ids = torch::arange(Gpt2Tokenizer::kEndOfText + 1, torch::kLong);
        } else {
            std::set<int64_t> used(train_ids.begin(), train_ids.end());
            used.insert(val_ids.begin(), val_ids.end());
            used.insert(Gpt2Tokenizer::kEndOfText);
            vocab_ids = torch::tensor(std::vector<int64_t>(used.begin(), used.end()), torch::kLong);
        }
        cfg.vocab_size = vocab_ids.size(0);
        try {
            cfg.validate();
        } catch (const Error& e) {
            throw ParamError("config", std::string("is not valid: ") + e.what());
        }
        model = Gpt2Model(cfg);
        init_gpt2_weights(model, o.seed);
        if (!full_vocab) pin_bias_dim(model);
        opt.init(*model);
        if (o.ema > 0)
            for (auto& [n, p] : opt.params) ema[n] = p.detach().clone();
        log_line("new model: " + cfg.describe() + (full_vocab ? " (all GPT-2 tokens)" : " (the KJV's GPT-2 tokens)"));
    }
    const int64_t T = o.seq_len > 0 ? o.seq_len : cfg.n_positions;
    if (T > cfg.n_positions)
        throw ParamError("seq_len", std::to_string(T) + " exceeds n_positions " + std::to_string(cfg.n_positions));
    model->train();

    // GPT-2 ids -> rows of this model.
    std::vector<int64_t> lut(static_cast<size_t>(Gpt2Tokenizer::kEndOfText + 1), -1);
    {
        auto acc = vocab_ids.accessor<int64_t, 1>();
        for (int64_t i = 0; i < acc.size(0); ++i) {
            if (acc[i] < 0 || acc[i] >= static_cast<int64_t>(lut.size()))
                throw Error("checkpoint vocabulary holds id " + std::to_string(acc[i]) + ", not a GPT-2 id");
            lut[static_cast<size_t>(acc[i])] = i;
        }
    }
    auto to_rows = [&](const std::vector<int64_t>& ids) {
        std::vector<int64_t> r(ids.size());
        for (size_t i = 0; i < ids.size(); ++i) {
            r[i] = lut[static_cast<size_t>(ids[i])];
            if (r[i] < 0)
                throw Error("token " + std::to_string(ids[i]) + " of the KJV is not in the checkpoint's vocabulary");
        }
        return r;
    };
    const auto train_rows = to_rows(train_ids), val_rows = to_rows(val_ids);
    const auto train_t = torch::tensor(train_rows, torch::kLong);
    const int64_t N = train_t.size(0);
    if (N <= T + 1) throw Error("the training text is shorter than one sequence of " + std::to_string(T + 1));

    Gpt2TrainResult res;
    res.start_step = start;
    res.vocab_used = cfg.vocab_size;
    res.train_tokens = static_cast<int64_t>(train_ids.size());
    res.val_tokens = static_cast<int64_t>(val_ids.size());
    log_line("data: " + std::to_string(verses.size()) + " verses; held out " + o.holdout.str() + ": " +
             std::to_string(split.val.size()) + " verses, " + std::to_string(val_ids.size()) + " tokens; training " +
             std::to_string(split.train.size()) + " verses, " + std::to_string(train_ids.size()) + " tokens; " +
             std::to_string(cfg.vocab_size) + " vocabulary rows; sequences of " + std::to_string(T) + " x batch " +
             std::to_string(o.batch));

    // The weights evaluated and exported: the EMA when enabled, else the trained ones.
    Gpt2Model eval_model(cfg);
    auto eval_params = eval_model->named_parameters(true);
    auto load_eval = [&]() {
        torch::NoGradGuard ng;
        for (auto& [n, p] : opt.params) {
            auto& e = eval_params[n];
            e.copy_(o.ema > 0 ? ema.at(n) : p.detach());
            e.set_requires_grad(false);
        }
        if (!full_vocab) pin_bias_dim(eval_model);
        eval_model->eval();
    };
    int64_t evaluated_at = -1; // step of `last_val`
    double last_val = 0;
    auto evaluate = [&](int64_t at_step) {
        if (evaluated_at != at_step) {
            load_eval();
            last_val = gpt2_mean_nll(eval_model, val_rows, T, o.eval_batch);
            evaluated_at = at_step;
        }
        return last_val;
    };
    auto save_checkpoint = [&](int64_t step, double elapsed) {
        NamedTensors ts;
        for (auto& [n, p] : opt.params) {
            ts.emplace_back("param." + n, p.detach());
            ts.emplace_back("m." + n, opt.m[n]);
            ts.emplace_back("v." + n, opt.v[n]);
            if (o.ema > 0) ts.emplace_back("ema." + n, ema[n]);
        }
        ts.emplace_back("vocab_ids", vocab_ids);
        save_safetensors(ckpt_path, ts,
                         {{"step", std::to_string(step)},
                          {"adam_t", std::to_string(opt.t)},
                          {"elapsed_s", std::to_string(elapsed)},
                          {"config", cfg.to_json().dump()},
                          {"full_vocab", full_vocab ? "1" : "0"},
                          {"holdout", o.holdout.str()},
                          {"seq_len", std::to_string(T)},
                          {"batch", std::to_string(o.batch)}});
        write_file_atomic(csv_path, metrics_csv(metrics));
    };

    auto elapsed_now = [&]() { return elapsed_before + std::chrono::duration<double>(Clock::now() - t_start).count(); };
    double running = 0.0;
    int64_t running_n = 0;
    const int64_t stop = o.stop_after > 0 ? std::min(o.steps, start + o.stop_after) : o.steps;
    int64_t step = start;
    const auto pos = torch::arange(T + 1, torch::kLong).unsqueeze(0);
    for (; step < stop; ++step) {
        // Per-step generator: a resumed run draws exactly what the uninterrupted run would have drawn.
        auto gen = at::detail::createCPUGenerator(o.seed * 1000003ULL + static_cast<uint64_t>(step) + 1);
        auto offs = torch::randint(N - T, {o.batch}, gen, torch::kLong);
        auto w = train_t.index_select(0, (offs.unsqueeze(1) + pos).reshape(-1)).view({o.batch, T + 1});
        for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
        auto h = gpt2_train_hidden(model, w.narrow(1, 0, T));
        auto logits = torch::matmul(h, model->wte->weight.t());
        auto loss =
            torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}), w.narrow(1, 1, T).reshape(-1));
        loss.backward();
        if (o.grad_clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), o.grad_clip);
        const double lr = lr_at(o, step);
        opt.step(lr, adamw_config(o));
        if (!full_vocab) pin_bias_dim(model);
        if (o.ema > 0) {
            torch::NoGradGuard ng;
            const double d = std::min(o.ema, double(step + 1) / double(step + 10));
            for (auto& [n, p] : opt.params) ema[n].mul_(d).add_(p.detach(), 1.0 - d);
        }
        const double lv = loss.item<double>();
        if (!std::isfinite(lv))
            throw Error("gpt2 train: loss became " + std::to_string(lv) + " at step " + std::to_string(step + 1));
        running += lv, running_n++;
        const bool last = step + 1 == stop;
        const double el = elapsed_now();
        const bool out_of_time = o.max_minutes > 0 && el - elapsed_before >= o.max_minutes * 60.0;
        const bool finishing = last || out_of_time;
        const bool eval_due = (o.eval_every > 0 && (step + 1) % o.eval_every == 0) || finishing;
        if ((step + 1) % o.log_every == 0 || eval_due) {
            Gpt2TrainMetric m;
            m.step = step + 1;
            m.train_loss = running / double(running_n);
            m.lr = lr;
            m.tokens = (step + 1) * o.batch * T;
            m.elapsed_s = el;
            res.train_loss = m.train_loss;
            std::ostringstream os;
            os << "step " << m.step << "/" << o.steps << " loss " << fixed(m.train_loss, 4) << " lr " << std::scientific
               << std::setprecision(2) << lr << " tokens " << m.tokens << " elapsed " << fixed(el, 1) << "s";
            if (eval_due) {
                m.val_loss = evaluate(step + 1);
                os << " | val loss " << fixed(m.val_loss, 4) << " ppl " << fixed(std::exp(m.val_loss), 2);
            }
            log_line(os.str());
            metrics.push_back(m);
            running = 0, running_n = 0;
        }
        if ((step + 1) % o.checkpoint_every == 0 || finishing) save_checkpoint(step + 1, el);
        if (out_of_time) {
            log_line("stopping: --max-minutes " + fixed(o.max_minutes, 1) + " reached at step " +
                     std::to_string(step + 1) + " (the schedule spans " + std::to_string(o.steps) + " steps)");
            ++step;
            break;
        }
    }
    res.end_step = std::max(start, step);
    res.tokens_seen = res.end_step * o.batch * T;
    res.wall_s = elapsed_now();
    if (res.end_step == start && !metrics.empty()) res.train_loss = metrics.back().train_loss;
    res.val_loss = evaluate(res.end_step);
    if (res.end_step == start) // nothing left to train (resumed at the end): report what there is
        log_line("at step " + std::to_string(start) + ": val loss " + fixed(res.val_loss, 4) + " ppl " +
                 fixed(std::exp(res.val_loss), 2));
    res.metrics = metrics;

    if (!o.export_dir.empty()) {
        load_eval();
        fs::create_directories(o.export_dir);
        NamedTensors ts;
        Gpt2Config out_cfg = cfg;
        for (auto& p : eval_model->named_parameters(true)) {
            torch::Tensor t = p.value().detach();
            if (p.key() == "wte.weight" && !full_vocab) {
                auto full = torch::zeros({Gpt2Tokenizer::kEndOfText + 1, cfg.n_embd});
                full.select(1, 0).fill_(o.unseen_logit);
                full.index_copy_(0, vocab_ids, t);
                t = full;
            }
            ts.emplace_back(p.key(), t.to(o.export_dtype).contiguous());
        }
        out_cfg.vocab_size = Gpt2Tokenizer::kEndOfText + 1;
        auto cj = out_cfg.to_json();
        cj["torch_dtype"] = o.export_dtype == torch::kFloat16    ? "float16"
                            : o.export_dtype == torch::kBFloat16 ? "bfloat16"
                                                                 : "float32";
        save_safetensors(export_model, ts, {{"format", "pt"}}, true);
        write_file_atomic(export_config, cj.dump(2) + "\n", true);
        // The exported file as any user gets it: the normal loader, all 50257 logits.
        auto loaded = load_gpt2(o.export_dir);
        res.export_val_loss = gpt2_mean_nll(loaded.model, val_ids, T, 2);
        log_line("exported " + std::string(c10::toString(o.export_dtype)) + " weights to " + o.export_dir +
                 "; through load_gpt2 (50257-way softmax): val loss " + fixed(res.export_val_loss, 4) + " ppl " +
                 fixed(std::exp(res.export_val_loss), 2) + " (trained weights, " +
                 (full_vocab ? "all tokens" : "KJV tokens") + ": " + fixed(res.val_loss, 4) + ")");
    }
    return res;
}

} // namespace anchor::text
