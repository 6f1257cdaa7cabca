#include "text/bench_report.h"

#include "cli/bench_util.h" // stats_of: header-only, the programs' own min/median/max

namespace anchor::text {

Spread Spread::of(std::vector<double> samples) {
    const auto s = cli::bench::stats_of(std::move(samples));
    return {s.min, s.median, s.max};
}

} // namespace anchor::text
