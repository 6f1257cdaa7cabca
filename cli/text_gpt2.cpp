// `anchor-text gpt2 ppl|generate|bench|train`: GPT-2 streaming with attention-sink rolling KV buffers (StreamingLLM,
// Xiao et al. 2023) next to full, window and recompute baselines. The work is the text library's (text/gpt2/gpt2_ppl.h,
// text/gpt2/gpt2_generate.h, text/bench/gpt2_bench.h, text/train/gpt2_train.h); here: options, printing, output files.
#include "cli/text_commands.h"

#include "cache/io/atomic_file.h"
#include "cache/io/enum_table.h"
#include "cache/io/read_file.h"
#include "cache/io/error.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "cli/loss_plot.h"
#include "text/bench/gpt2_bench.h"
#include "text/gpt2/gpt2_generate.h"
#include "text/gpt2/gpt2_ppl.h"
#include "text/text_job.h"
#include "text/train/gpt2_train.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace anchor::cli {

namespace {

std::string human_bytes(double b) {
    const char* units[] = {"B", "KiB", "MiB", "GiB"};
    int u = 0;
    while (b >= 1024.0 && u < 3) b /= 1024.0, ++u;
    std::ostringstream os;
    os << std::fixed << std::setprecision(u ? 1 : 0) << b << " " << units[u];
    return os.str();
}

std::string fmt_ms(const text::Spread& s) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(2) << s.min * 1e3 << " / " << s.median * 1e3 << " / " << s.max * 1e3 << " ms";
    return os.str();
}

// The flags of the fields every GPT-2 command shares.
const FlagNames& model_flags() {
    static const FlagNames f = {{"model", "--model"},   {"vocab", "--vocab"},
                                {"n_head", "--n-head"}, {"decode_weights", "--decode-weights"},
                                {"kv", "--kv"},         {"positions", "--positions"}};
    return f;
}

FlagNames with(FlagNames base, const FlagNames& more) {
    base.insert(base.begin(), more.begin(), more.end()); // earlier entries win: `more` overrides
    return base;
}

} // namespace

std::string default_gpt2_model() {
    return embedded_text_model("kjv-gpt2", "embedded GPT-2 (kjv-gpt2)");
}

namespace {

void add_model_options(CLI::App* sub, text::Gpt2ModelParams& m) {
    sub->add_option("-m,--model", m.model,
                    "GPT-2 model: folder (config.json + any *.safetensors), file or index (default: the embedded "
                    "assets/models/kjv-gpt2)");
    sub->add_option("--vocab", m.vocab,
                    "Tokenizer folder (encoder.json+vocab.bpe or vocab.json+merges.txt); default: the model folder "
                    "if it has one, else " +
                        text::Gpt2Tokenizer::default_dir());
    sub->add_option("--n-head", m.n_head, "Head count when the model has no config.json (default n_embd/64)");
    add_enum_option(*sub, "--decode-weights", m.decode_weights, text::decode_weight_table(),
                    "Weights one-token steps read: f16 keeps a half-size copy and halves the bytes per token (logits "
                    "move by ~1e-3); q8_0 keeps llama.cpp's int8 block format, 0.27x the bytes (logits move by ~1e-2); "
                    "q4_0 its 4-bit block format, 0.14x the bytes (logits move by ~1e-1)");
}

void add_stream_options(CLI::App* sub, std::string& kv, text::PositionMode& positions) {
    sub->add_option("--kv", kv, "KV cache: " + text::KvSpec::syntax_help())->capture_default_str();
    add_enum_option(*sub, "--positions", positions, text::position_mode_table(),
                    "Position ids past the cache: wrap = i % n_positions, cache = min(i, S+W-1), absolute = i (error "
                    "past n_positions), reencode = in-order positions; when the S+W buffer is full the sinks and the "
                    "newest W/2 tokens are encoded again at 0.. (window/sink modes; matches recompute:S+W perplexity)");
}

void write_json(const std::string& path, const nlohmann::json& j, bool overwrite, std::ostream& log) {
    write_file_atomic(path, j.dump(2) + "\n", overwrite);
    log << "wrote " << path << "\n";
}

// ---- ppl ---------------------------------------------------------------------------------------------------------

// --cuda-graphs of generate and ppl: the process-wide switch (text::set_decode_cuda_graphs), for a CUDA device only.
void set_graphs(const PlacementArgs& place, bool on) {
    if (on && (place.device == "cpu" || !kernels::CudaGraph::available()))
        throw UsageError("--cuda-graphs: needs --device cuda in a build with LibTorch >= 2 and CUDA (the torch2 "
                         "build), got --device " + place.device);
    text::set_decode_cuda_graphs(on);
}

struct PplArgs {
    text::PplParams p;
    PlacementArgs place;
    bool cuda_graphs = false;
    std::string kv = "full", compare, json_out;
    bool overwrite = false;
};

void print_ppl_header(const text::PplReport& r) {
    std::cout << "model: " << r.config << "\n"
              << "text: " << r.file << ", " << r.tokens << " tokens, scoring " << r.tokens - 1
              << " next-token predictions (one token per forward), positions "
              << enum_name(text::position_mode_table(), r.positions) << "\n"
              << std::left << std::setw(18) << "kv" << std::right << std::setw(10) << "tokens" << std::setw(14) << "ppl"
              << std::setw(12) << "mean_nll" << std::setw(11) << "tok/s" << std::setw(13) << "KV bytes" << std::setw(14)
              << "peak RSS"
              << "\n";
}

void print_ppl_run(const text::PplRun& run, const FlagNames& flags) {
    if (!run.skipped.empty()) {
        std::cout << "  " << text::with_flags(run.skipped_why, flags) << "\n";
        return;
    }
    if (!run.failed.empty()) {
        std::cout << "  failed: " << run.failed << "\n";
        return;
    }
    std::cout << std::setw(10) << run.tokens << std::setw(14) << std::setprecision(6) << std::defaultfloat << run.ppl
              << std::setw(12) << std::fixed << std::setprecision(5) << run.mean_nll << std::setw(11)
              << std::setprecision(1) << double(run.tokens) / run.seconds << std::setw(13)
              << human_bytes(double(run.kv_bytes)) << std::setw(14) << human_bytes(double(run.peak_rss)) << "\n"
              << std::defaultfloat;
}

int run_ppl(PplArgs a) {
    // Parse everything the user typed before loading anything.
    const auto flags =
        with(model_flags(),
             {{"kv", a.compare.empty() ? "--kv" : "--compare"}, {"file", "--file"}, {"max_tokens", "--max-tokens"}});
    if (a.p.model.model.empty()) a.p.model.model = default_gpt2_model();
    a.p.model.placement = resolve_placement(a.place);
    set_graphs(a.place, a.cuda_graphs);
    return with_flag_errors(flags, [&] {
        a.p.kv = text::parse_kv_list(a.compare.empty() ? a.kv : a.compare);
        a.p.validate();
        if (!a.json_out.empty()) check_output_path(a.json_out, a.overwrite);
        text::PplProgress progress;
        progress.loaded = print_ppl_header;
        progress.run_started = [](const text::KvSpec& kv) {
            std::cout << std::left << std::setw(18) << kv.str() << std::right << std::flush;
        };
        progress.run_finished = [&](const text::PplRun& run) { print_ppl_run(run, flags); };
        const auto report = text::evaluate_ppl(a.p, progress);
        std::cout << "(peak RSS is the process high-water mark so far, VmHWM)\n";
        if (!a.json_out.empty()) write_json(a.json_out, report.to_json(), a.overwrite, std::cout);
        return 0;
    });
}

// ---- generate ----------------------------------------------------------------------------------------------------

struct GenArgs {
    text::GenerateParams p;
    PlacementArgs place;
    bool cuda_graphs = false;
    std::string kv = "full", report_json;
    bool overwrite = false;
    BatchArgs batch; // --prompts-file
};

void print_soak(const text::GenerateReport& r) {
    const auto s = r.soak();
    if (!s) return;
    std::cerr << std::fixed << std::setprecision(2) << "soak: " << r.windows.size() << " windows of " << r.report_every
              << " tokens; RSS " << human_bytes(double(s->rss_first)) << " after the first, max "
              << human_bytes(double(s->rss_max)) << " later (growth " << s->rss_growth_percent << " %); latency "
              << s->latency_min << " / " << s->latency_median << " / " << s->latency_max
              << " ms/token (min/median/max of later windows); drift, last vs first quarter (medians) "
              << s->latency_drift_percent << " %\n";
}

int run_generate(GenArgs a) {
    const auto flags = with(model_flags(), {{"prompt", "--prompt"},
                                            {"max_new_tokens", "--max-new"},
                                            {"temperature", "--temperature"},
                                            {"top_k", "--top-k"},
                                            {"top_p", "--top-p"},
                                            {"min_p", "--min-p"},
                                            {"repeat_penalty", "--repeat-penalty"},
                                            {"repeat_last_n", "--repeat-last-n"},
                                            {"report_every", "--report-every"}});
    if (a.p.model.model.empty()) a.p.model.model = default_gpt2_model();
    if (!a.report_json.empty()) {
        if (a.p.report_every == 0) throw UsageError("--report-json needs --report-every N");
        check_output_path(a.report_json, a.overwrite);
    }
    if (a.batch.prompts_file.empty() == a.p.prompt.empty())
        throw UsageError("give a prompt (-p/--prompt TEXT, not empty) or --prompts-file FILE, not both");
    a.p.model.placement = resolve_placement(a.place);
    set_graphs(a.place, a.cuda_graphs);
    return with_flag_errors(flags, [&] {
        a.p.kv = text::KvSpec::parse(a.kv);
        if (!a.batch.prompts_file.empty()) {
            const auto job = make_item_job(a.batch, a.overwrite, {{"program", "anchor-text gpt2 generate"}});
            const auto r = text::run_gpt2_prompts(a.p, job, [](const nlohmann::json& rec) {
                std::cerr << "wrote " << rec["output"].get<std::string>() << " (" << rec["generated"] << " tokens, "
                          << rec["timings_s"]["generate"] << " s)\n";
            });
            print_item_job_result(r);
            return 0;
        }
        text::StreamRunner runner(a.p);
        if (a.p.kv.mode == text::KvMode::Sink && a.p.positions == text::PositionMode::Wrap &&
            a.p.kv.sinks + a.p.kv.window > runner.n_positions())
            std::cerr << "warning: --kv " << a.kv << " holds " << a.p.kv.sinks + a.p.kv.window
                      << " tokens, more than the model's n_positions " << runner.n_positions()
                      << ": --positions wrap gives tokens past it repeated positions\n";
        std::cout << a.p.prompt << std::flush;
        const auto r = runner.run([](const std::string& piece) { std::cout << piece << std::flush; },
                                  [](const text::SoakWindow& w) {
                                      std::cerr << "\n[report] " << w.tokens << " tokens: " << std::fixed
                                                << std::setprecision(3) << w.ms_per_token << " ms/token, RSS "
                                                << human_bytes(double(w.rss_bytes)) << std::endl;
                                  });
        std::cout << std::endl;
        std::cerr << "prompt: " << r.prompt_tokens << " tokens in " << std::fixed << std::setprecision(3) << r.prefill_s
                  << " s; generated " << r.generated << " tokens, " << std::setprecision(1)
                  << (r.generate_s > 0 ? double(r.generated) / r.generate_s : 0.0) << " tok/s; kv " << r.kv.str()
                  << " (" << human_bytes(double(r.kv_bytes)) << "), positions "
                  << enum_name(text::position_mode_table(), r.positions) << "; peak RSS "
                  << human_bytes(double(r.peak_rss)) << "\n";
        print_soak(r);
        if (!a.report_json.empty() && r.windows.size() >= 2) {
            write_file_atomic(a.report_json, r.to_json().dump(1) + "\n", a.overwrite);
            std::cerr << "wrote " << a.report_json << "\n";
        }
        return 0;
    });
}

// ---- bench -------------------------------------------------------------------------------------------------------

struct BenchArgs {
    text::Gpt2BenchParams p;
    PlacementArgs place;
    std::string stream_tokens = "1000,10000", contexts = "16,256,900", json_out;
    bool long_stream = false, overwrite = false;
};

void print_decode(const text::Gpt2BenchReport& r, text::Gpt2BenchStage stage) {
    if (stage == text::Gpt2BenchStage::DecodeSection) {
        if (r.copies_skipped)
            std::cout << "decode latency, f16, q8_0 and q4_0 weights: skipped (the "
                      << (r.placement == "cpu f32" ? "--reference-kernel path" : r.placement + " model")
                      << " reads its own weights, no decode copies)\n";
        else
            std::cout << "decode latency, full KV cache, " << r.decode.back().weights << " weights ("
                      << human_bytes(r.decode.back().weight_bytes) << " per token; per token):\n";
        return;
    }
    const auto& d = r.decode.back().rows.back();
    if (d.skipped) {
        std::cout << "  context " << d.context << ": skipped (n_positions " << r.n_positions << ")\n";
        return;
    }
    std::cout << "  context " << std::setw(4) << d.context << ": " << fmt_ms(d.seconds) << "  -> " << std::fixed
              << std::setprecision(2) << d.gbs << " GB/s of weights (" << std::setprecision(0) << d.memcpy_read_percent
              << "% of memcpy read bandwidth)";
    if (d.speedup_vs_f32 > 0) std::cout << std::setprecision(2) << ", " << d.speedup_vs_f32 << "x the f32 speed";
    std::cout << "\n";
}

void print_stream(const text::Gpt2BenchReport& r, text::Gpt2BenchStage stage) {
    if (stage == text::Gpt2BenchStage::StreamStarted) {
        std::cout << r.sink_spec << " --positions wrap, streaming:\n"
                  << "  KV cache: " << human_bytes(double(r.sink_kv_bytes)) << " preallocated\n";
        return;
    }
    const auto& s = r.stream.back();
    std::cout << "  after " << std::setw(6) << s.tokens << " tokens: " << fmt_ms(s.seconds) << " per token (last "
              << s.tail << "), " << std::fixed << std::setprecision(1) << s.tokens_per_s
              << " tokens/s over the segment, RSS " << human_bytes(double(s.rss_bytes)) << std::showpos << "  (latency "
              << s.latency_change_percent << " %, RSS " << s.rss_change_percent << " % vs the first)" << std::noshowpos
              << "\n";
}

void print_op_table(const text::Gpt2BenchReport::OpTable& t) {
    std::cout << "  decode profile, " << t.weights << " weights, " << t.tokens << " steps from context " << t.context
              << ": " << std::fixed << std::setprecision(3) << t.step_ms << " ms per step\n";
    for (const auto& o : t.rows) {
        std::cout << "    " << std::left << std::setw(12) << o.kind << " " << std::setw(11) << o.shape << std::right
                  << std::setprecision(1) << std::setw(6) << o.calls << " calls " << std::setprecision(3)
                  << std::setw(8) << o.ms << " ms " << std::setprecision(1) << std::setw(5)
                  << 100.0 * o.ms / t.step_ms << " %";
        if (o.gbs > 0) std::cout << std::setprecision(1) << std::setw(8) << o.gbs << " GB/s";
        std::cout << "\n";
    }
    std::cout << "    " << std::left << std::setw(24) << "outside ops" << std::right << "             "
              << std::setprecision(3) << std::setw(8) << t.other_ms << " ms " << std::setprecision(1) << std::setw(5)
              << 100.0 * t.other_ms / t.step_ms << " %\n";
}

void print_bench(const text::Gpt2BenchReport& r, text::Gpt2BenchStage stage) {
    using S = text::Gpt2BenchStage;
    switch (stage) {
    case S::Started:
        std::cout << "# anchor-text gpt2 bench\nmodel: " << r.model << "\n  " << r.config << "\nthreads: " << r.threads
                  << ", decode matrix-vector kernel: " << r.kernel << ", repeats: " << r.repeats
                  << " (min / median / max)\nplacement: " << r.placement << "\n"
                  << std::fixed << std::setprecision(2) << "memcpy bandwidth (read+write): " << r.memcpy_gbs.min
                  << " / " << r.memcpy_gbs.median << " / " << r.memcpy_gbs.max << " GB/s\n"
                  << "weights streamed per decode step: " << human_bytes(r.weight_bytes) << "\n";
        break;
    case S::Prompt:
        std::cout << "prompt " << r.prompt_tokens << " tokens: " << fmt_ms(r.prompt_s) << "  -> " << std::fixed
                  << std::setprecision(1) << double(r.prompt_tokens) / r.prompt_s.median << " tokens/s (median)\n";
        break;
    case S::DecodeSection:
    case S::DecodeRow:
        print_decode(r, stage);
        break;
    case S::StreamStarted:
    case S::StreamRow:
        print_stream(r, stage);
        break;
    case S::OpTable:
        print_op_table(r.op_tables.back());
        break;
    case S::Recompute:
        std::cout << "recompute:" << r.recompute_window << " (per token): " << fmt_ms(r.recompute_s);
        if (r.sink_speedup > 0)
            std::cout << "  -> " << r.sink_spec << " is " << std::fixed << std::setprecision(1) << r.sink_speedup
                      << "x faster per token";
        std::cout << "\npeak RSS: " << human_bytes(double(r.peak_rss)) << "\n";
        break;
    }
}

int run_bench(BenchArgs a) {
    a.p.stream_tokens = parse_int_list(a.stream_tokens, "--stream-tokens");
    a.p.contexts = parse_int_list(a.contexts, "--contexts");
    a.p.placement = resolve_placement(a.place);
    if (a.long_stream) a.p.stream_tokens.push_back(100000);
    if (!a.json_out.empty()) check_output_path(a.json_out, a.overwrite);
    const FlagNames flags = {{"model", "--model"},
                             {"n_head", "--n-head"},
                             {"repeats", "--repeats"},
                             {"stream_tokens", "--stream-tokens"},
                             {"recompute_repeats", "--recompute-repeats"},
                             {"contexts", "--contexts"},
                             {"cuda_graphs", "--cuda-graphs"},
                             {"op_table_tokens", "--op-table"}};
    const auto report = with_flag_errors(flags, [&] { return text::run_gpt2_bench(a.p, print_bench); });
    if (!a.json_out.empty()) write_json(a.json_out, report.to_json(), a.overwrite, std::cout);
    return 0;
}

} // namespace

// ---- train -------------------------------------------------------------------------------------------------------

namespace {

const EnumTable<torch::ScalarType>& export_dtype_table() {
    static const EnumTable<torch::ScalarType> t = {
        {"f16", torch::kFloat16}, {"bf16", torch::kBFloat16}, {"f32", torch::kFloat32}};
    return t;
}

struct TrainArgs {
    text::Gpt2TrainOptions o;
    int64_t layers = 4, dim = 128, heads = 4, positions = 256;
    std::string holdout = text::HoldoutSpec().str();
    bool no_resume = false;
};

void print_train_result(const text::Gpt2TrainResult& r) {
    std::cout << std::fixed << std::setprecision(4) << "trained steps " << r.start_step << ".." << r.end_step << ", "
              << r.tokens_seen << " training tokens seen (train text " << r.train_tokens << " tokens), "
              << std::setprecision(1) << r.wall_s << " s\n"
              << std::setprecision(4) << "train loss " << r.train_loss << ", val loss " << r.val_loss << " (ppl "
              << std::setprecision(2) << std::exp(r.val_loss) << ") on " << r.val_tokens << " held-out tokens\n";
    if (r.export_val_loss >= 0)
        std::cout << std::setprecision(4) << "exported model through load_gpt2: val loss " << r.export_val_loss
                  << " (ppl " << std::setprecision(2) << std::exp(r.export_val_loss) << ")\n";
    std::cout << std::defaultfloat;
}

// The loss curve over the whole run (all invocations), next to the run's log and, when exporting, the model.
void write_train_outputs(const TrainArgs& a, const text::Gpt2TrainResult& r) {
    LossSeries train_s{"train loss", {}, {}}, val_s{"validation loss", {}, {}};
    for (const auto& m : r.metrics) {
        train_s.steps.push_back(double(m.step)), train_s.losses.push_back(m.train_loss);
        if (m.val_loss >= 0) val_s.steps.push_back(double(m.step)), val_s.losses.push_back(m.val_loss);
    }
    const auto png =
        loss_curves_png({train_s, val_s}, "GPT-2 " + std::to_string(a.layers) + "x" + std::to_string(a.dim) +
                                              " on the KJV, held out " + a.o.holdout.str());
    namespace fs = std::filesystem;
    write_file_atomic((fs::path(a.o.out_dir) / "loss.png").string(), png);
    if (a.o.export_dir.empty()) return;
    write_file_atomic((fs::path(a.o.export_dir) / "loss.png").string(), png, a.o.overwrite_export);
    for (const char* f : {"train_log.txt", "metrics.csv"}) {
        const auto src = fs::path(a.o.out_dir) / f, dst = fs::path(a.o.export_dir) / f;
        write_file_atomic(dst.string(), read_file(src.string(), "text file"), a.o.overwrite_export);
    }
    std::cout << "wrote " << a.o.export_dir << "/{config.json,model.safetensors,loss.png,train_log.txt,"
              << "metrics.csv}\n";
}

int run_train(TrainArgs a) {
    a.o.config.n_layer = a.layers;
    a.o.config.n_embd = a.dim;
    a.o.config.n_head = a.heads;
    a.o.config.n_positions = a.positions;
    try {
        a.o.config.validate();
    } catch (const Error& e) {
        throw UsageError(e.what());
    }
    const FlagNames flags = {{"holdout", "--holdout"},
                             {"out_dir", "--out"},
                             {"export_dir", "--export"},
                             {"overwrite_export", "--overwrite"},
                             {"seq_len", "--seq-len"},
                             {"batch", "--batch"},
                             {"steps", "--steps"},
                             {"log_every", "--log-every"},
                             {"checkpoint_every", "--checkpoint-every"},
                             {"eval_every", "--eval-every"},
                             {"warmup", "--warmup"},
                             {"lr", "--lr"},
                             {"weight_decay", "--weight-decay"},
                             {"ema", "--ema"},
                             {"config", "--layers/--dim/--heads/--positions"}};
    const auto r = with_flag_errors(flags, [&] {
        a.o.holdout = text::HoldoutSpec::parse(a.holdout);
        a.o.resume = !a.no_resume;
        a.o.log = [](const std::string& s) { std::cout << s << std::endl; };
        return text::train_gpt2(a.o);
    });
    print_train_result(r);
    write_train_outputs(a, r);
    return 0;
}

} // namespace

void add_gpt2_commands(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners) {
    auto* gpt2 = app.add_subcommand("gpt2", "GPT-2 with KV cache and attention-sink rolling KV buffers");
    gpt2->require_subcommand(1);

    auto ppl = std::make_shared<PplArgs>();
    auto* p = gpt2->add_subcommand("ppl", "Streaming perplexity (StreamingLLM protocol: one token per forward, "
                                          "score the next; ppl = exp(mean NLL))");
    add_model_options(p, ppl->p.model);
    add_placement_options(p, ppl->place, "the GPT-2 and its KV cache");
    p->add_flag("--cuda-graphs", ppl->cuda_graphs, "One-token steps on a CUDA device replay a captured CUDA graph");
    add_stream_options(p, ppl->kv, ppl->p.positions);
    p->add_option("--file", ppl->p.file, "UTF-8 text file to score")->required();
    p->add_option("--compare", ppl->compare,
                  "Comma-separated KV modes run over the same text, e.g. full,window:32,sink:4,28,recompute:32");
    p->add_option("--max-tokens", ppl->p.max_tokens, "Score only the first N tokens (0: all)");
    p->add_option("--json", ppl->json_out, "Also write the results as JSON to this file");
    p->add_flag("--overwrite", ppl->overwrite, "Replace an existing --json file");
    runners.emplace_back(p, [ppl]() { return run_ppl(*ppl); });

    auto gen = std::make_shared<GenArgs>();
    auto* g = gpt2->add_subcommand("generate", "Generate text, printing tokens as they are produced");
    add_model_options(g, gen->p.model);
    add_placement_options(g, gen->place, "the GPT-2 and its KV cache");
    g->add_flag("--cuda-graphs", gen->cuda_graphs, "One-token steps on a CUDA device replay a captured CUDA graph");
    add_stream_options(g, gen->kv, gen->p.positions);
    g->add_option("-p,--prompt", gen->p.prompt, "Prompt text");
    add_batch_options(g, gen->batch, "text file");
    g->add_option("--max-new", gen->p.max_new_tokens, "New tokens (may exceed n_positions with sink/window modes)")
        ->capture_default_str();
    auto& sp = gen->p.sampling;
    g->add_option("--temperature", sp.temperature, "0 = greedy")->capture_default_str();
    g->add_option("--top-k", sp.top_k, "Sample from the k most likely tokens (0: all)")->capture_default_str();
    g->add_option("--top-p", sp.top_p, "Nucleus sampling threshold")->capture_default_str();
    g->add_option("--min-p", sp.min_p, "Keep tokens with probability >= min-p x the most likely one's (0: off)")
        ->capture_default_str();
    g->add_option("--repeat-penalty", sp.repeat_penalty,
                  "CTRL repetition penalty on the last --repeat-last-n tokens, prompt included (1: off)")
        ->capture_default_str();
    g->add_option("--repeat-last-n", sp.repeat_last_n, "Tokens the repetition penalty looks back over")
        ->capture_default_str();
    g->add_option("-s,--seed", sp.seed, "Sampling seed")->capture_default_str();
    g->add_flag("--stop-at-eos", gen->p.stop_at_eos, "Stop after <|endoftext|> (id 50256)");
    g->add_flag("--allow-special", gen->p.allow_special, "Encode a literal <|endoftext|> in the prompt as id 50256");
    g->add_option("--report-every", gen->p.report_every,
                  "Soak: print latency and RSS every N generated tokens, and the growth/drift at the end");
    g->add_option("--report-json", gen->report_json, "Soak: write the --report-every figures to this JSON file");
    g->add_flag("--overwrite", gen->overwrite, "Replace existing output files (--report-json, --prompts-file outputs)");
    runners.emplace_back(g, [gen]() { return run_generate(*gen); });

    auto bo = std::make_shared<BenchArgs>();
    auto* b =
        gpt2->add_subcommand("bench", "Decode speed: prompt tokens/s, per-token latency by context, sink streaming "
                                      "latency/RSS, speed-up over recompute, GB/s vs memcpy");
    b->add_option("-m,--model", bo->p.model, "GPT-2 model (default: random GPT-2-small shapes in memory)");
    b->add_option("--n-head", bo->p.n_head, "Head count when the model has no config.json");
    add_placement_options(b, bo->place, "the GPT-2 and its KV cache");
    b->add_option("--contexts", bo->contexts, "Contexts of the decode latency rows (full KV cache)")
        ->capture_default_str();
    b->add_flag("--cuda-graphs", bo->p.cuda_graphs,
                "One-token steps on a CUDA device replay a captured CUDA graph (LibTorch >= 2; off by default)");
    b->add_option("--repeats", bo->p.repeats, "Timed repeats per measurement")->capture_default_str();
    b->add_option("--stream-tokens", bo->stream_tokens, "Stream lengths for the sink:4,1020 run")
        ->capture_default_str();
    b->add_flag("--long", bo->long_stream, "Also stream 100k tokens");
    b->add_option("--recompute-repeats", bo->p.recompute_repeats, "Timed recompute steps")->capture_default_str();
    b->add_flag("--reference-kernel", bo->p.reference_kernel, "Decode with torch::addmv/mv instead of the gemv kernel");
    b->add_option("--op-table", bo->p.op_table_tokens,
                  "Decode profile: per weight type, time every op of this many more steps at the first context and "
                  "print per token the time and weight GB/s of each op kind and shape (0 = none)")
        ->capture_default_str();
    b->add_option("--json", bo->json_out, "Also write every figure as JSON to this file");
    b->add_flag("--overwrite", bo->overwrite, "Replace an existing --json file");
    runners.emplace_back(b, [bo]() { return run_bench(*bo); });

    auto ta = std::make_shared<TrainArgs>();
    auto& to = ta->o;
    auto* t = gpt2->add_subcommand("train", "Train a small GPT-2 on the King James Version (bible-kjv-text) with the "
                                            "GPT-2 tokenizer; AdamW, warm-up + cosine, optional EMA, resumable");
    t->add_option("-o,--out", to.out_dir,
                  "Run folder (checkpoint, log, metrics, held-out text; resumed when it "
                  "holds a checkpoint)")
        ->required();
    t->add_option("--export", to.export_dir,
                  "Folder for the final model (config.json + model.safetensors, loss.png, "
                  "train_log.txt, metrics.csv)");
    add_enum_option(*t, "--export-dtype", to.export_dtype, export_dtype_table(), "Dtype of the exported weights");
    t->add_flag("--overwrite", to.overwrite_export, "Replace an existing exported model");
    t->add_option("--kjv", to.kjv_path,
                  "KJV file: bible.data, a .Z file or tagged text (default: the installed "
                  "bible-kjv-text)");
    t->add_option("--vocab", to.vocab_dir,
                  "GPT-2 tokenizer folder (default " + text::Gpt2Tokenizer::default_dir() + ")");
    t->add_option("--holdout", ta->holdout, "Validation text: " + text::HoldoutSpec::syntax_help())
        ->capture_default_str();
    t->add_option("--layers", ta->layers, "Blocks (n_layer)")->capture_default_str();
    t->add_option("--dim", ta->dim, "Hidden size (n_embd)")->capture_default_str();
    t->add_option("--heads", ta->heads, "Attention heads (n_head)")->capture_default_str();
    t->add_option("--positions", ta->positions, "Context (n_positions)")->capture_default_str();
    t->add_option("--seq-len", to.seq_len, "Training sequence length (0: n_positions)")->capture_default_str();
    t->add_flag("--full-vocab", to.full_vocab,
                "Train all 50257 output rows (default: the KJV's tokens, expanded "
                "exactly on export)");
    t->add_option("--batch", to.batch, "Sequences per step")->capture_default_str();
    t->add_option("--steps", to.steps, "Total optimizer steps (the schedule's length)")->capture_default_str();
    t->add_option("--stop-after", to.stop_after, "Stop after this many steps in this invocation");
    t->add_option("--max-minutes", to.max_minutes, "Stop (checkpoint, evaluate, export) after this much wall time");
    t->add_option("--lr", to.lr, "Peak learning rate")->capture_default_str();
    t->add_option("--min-lr-ratio", to.min_lr_ratio, "Cosine floor as a fraction of --lr")->capture_default_str();
    t->add_option("--warmup", to.warmup, "Linear warm-up steps")->capture_default_str();
    t->add_option("--weight-decay", to.weight_decay, "AdamW decoupled weight decay (matrices)")->capture_default_str();
    t->add_option("--beta2", to.beta2, "AdamW beta2")->capture_default_str();
    t->add_option("--grad-clip", to.grad_clip, "Gradient norm clip (0: off)")->capture_default_str();
    t->add_option("--ema", to.ema, "EMA decay of the weights (0: off; evaluated and exported when on)")
        ->capture_default_str();
    t->add_option("--eval-every", to.eval_every, "Validation interval in steps (0: only at the end)")
        ->capture_default_str();
    t->add_option("--log-every", to.log_every, "Progress line interval")->capture_default_str();
    t->add_option("--checkpoint-every", to.checkpoint_every, "Checkpoint interval")->capture_default_str();
    t->add_option("-s,--seed", to.seed, "Seed (initialisation and batches)")->capture_default_str();
    t->add_flag("--no-resume", ta->no_resume, "Start fresh even when the run folder holds a checkpoint");
    runners.emplace_back(t, [ta]() { return run_train(*ta); });
}

} // namespace anchor::cli
