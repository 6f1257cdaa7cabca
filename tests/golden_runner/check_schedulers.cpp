// golden_runner checker for scheduler loops: a folder holding `<run>.json` files whose `scheduler` (or
// `config._class_name`) names a diffusers scheduler class, each with a matching `<run>.safetensors`, plus
// `common.safetensors` (initial noise). One result line per run.
#include "tests/golden_runner/runner.h"
#include "tests/scheduler_golden.h"

#include <algorithm>

namespace anchor::golden {
namespace {

// The runs of `dir` in name order: `<run>.json` naming a scheduler class (known to this engine or not: a class it
// does not implement is a FAIL naming it, never a skipped run) with a `<run>.safetensors` next to it.
std::vector<std::string> scheduler_runs(const fs::path& dir) {
    std::vector<std::string> runs;
    if (!fs::exists(dir / "common.safetensors")) return runs;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
        const auto& p = e.path();
        if (p.extension() != ".json" || p.filename() == "config.json") continue;
        const std::string run = p.stem().string();
        if (!fs::exists(dir / (run + ".safetensors"))) continue;
        try {
            const auto j = test::read_json_file(p);
            if (j.is_object() && !test::scheduler_golden_class(j).empty()) runs.push_back(run);
        } catch (const std::exception&) {
            // not a scheduler run file
        }
    }
    std::sort(runs.begin(), runs.end());
    return runs;
}

std::vector<CaseResult> run_schedulers(const fs::path& dir, const Context& ctx) {
    std::vector<CaseResult> results;
    for (const auto& run : scheduler_runs(dir)) {
        CaseResult r;
        r.name = relative_name(dir, ctx) + "/" + run;
        test::SchedulerGoldenSink sink;
        sink.tensor = [&](const std::string& what, const torch::Tensor& a, const torch::Tensor& g, double atol,
                          double rtol) { r.stats.check(what, a, g, atol, rtol); };
        sink.fact = [&](const std::string& what, bool ok, const std::string& detail) {
            r.stats.check_true(what, ok, detail);
        };
        try {
            test::run_scheduler_golden(dir, run, sink);
        } catch (const std::exception& e) {
            r.stats.fail(std::string("exception: ") + e.what());
        }
        results.push_back(std::move(r));
    }
    return results;
}

const bool registered_schedulers =
    register_checker({"schedulers", [](const fs::path& dir) { return !scheduler_runs(dir).empty(); }, run_schedulers});

} // namespace
} // namespace anchor::golden
