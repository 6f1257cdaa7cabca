// What the text benchmarks report of repeated timings: min / median / max.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

namespace anchor::text {

struct Spread {
    double min = 0, median = 0, max = 0;
    static Spread of(std::vector<double> samples); // the median of an even count is the mean of the middle two
    nlohmann::json to_json() const { return nlohmann::json::array({min, median, max}); }
};

} // namespace anchor::text
