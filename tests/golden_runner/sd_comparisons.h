// How golden_runner judges the comparisons of tests/sd_pipeline_golden.h (txt2img, img2img, LoRA and SDXL runs): one
// rule per comparison kind, and a run's comparisons split into its teacher-forced and free-running results.
#pragma once

#include "tests/golden_runner/runner.h"
#include "tests/sd_pipeline_golden.h"

#include <functional>

namespace anchor::golden {

inline void apply_comparison(Stats& st, const sdgolden::Comparison& c) {
    if (c.kind == sdgolden::Comparison::Exact)
        st.check_equal(c.what, c.actual, c.golden);
    else if (c.kind == sdgolden::Comparison::RelMax) // max|a - g| <= atol * max|g|
        st.check(c.what, c.actual, c.golden, c.atol * c.golden.abs().max().item<double>(), 0.0);
    else
        st.check(c.what, c.actual, c.golden, c.atol, c.rtol);
}

// `<prefix>:teacher-forced` and `<prefix>:free-running` (the comparisons named "free-running ..."); an exception
// fails both, its message after `why`.
inline std::vector<CaseResult> run_results(const std::string& prefix,
                                           const std::function<std::vector<sdgolden::Comparison>()>& compare,
                                           const std::string& why = "exception: ") {
    CaseResult tf, fr;
    tf.name = prefix + ":teacher-forced";
    fr.name = prefix + ":free-running";
    try {
        for (const auto& c : compare()) apply_comparison(c.what.rfind("free-running", 0) == 0 ? fr.stats : tf.stats, c);
    } catch (const std::exception& e) {
        tf.stats.fail(why + e.what());
        fr.stats.fail(why + e.what());
    }
    return {tf, fr};
}

} // namespace anchor::golden
