#include "text/bench/bench_report.h"

#include "cache/util/bench.h"

namespace anchor::text {

Spread Spread::of(std::vector<double> samples) {
    const auto s = util::stats_of(std::move(samples));
    return {s.min, s.median, s.max};
}

} // namespace anchor::text
