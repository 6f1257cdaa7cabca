// Catch2 assertions of one golden comparison (tests/sd_pipeline_golden.h): the txt2img, img2img and inpaint tests
// judge their teacher-forced and free-running stages by the same rules.
#pragma once

#include "tests/sd_pipeline_golden.h"

#include <catch2/catch.hpp>

namespace anchor::sdgolden {

// Checks c by its kind and returns the max abs error.
inline double check_comparison(const std::string& label, const Comparison& c) {
    INFO(label << " " << c.what << " actual " << c.actual.sizes() << " golden " << c.golden.sizes());
    REQUIRE(c.actual.sizes() == c.golden.sizes());
    auto a = c.actual.to(torch::kFloat64), g = c.golden.to(torch::kFloat64);
    const double err = (a - g).abs().max().item<double>();
    INFO("max abs error " << err);
    switch (c.kind) {
    case Comparison::Exact:
        CHECK(torch::equal(a, g));
        break;
    case Comparison::RelMax:
        CHECK(err <= c.atol * g.abs().max().item<double>());
        break;
    case Comparison::Close:
        CHECK(((a - g).abs() <= c.atol + c.rtol * g.abs()).all().item<bool>());
        break;
    }
    return err;
}

} // namespace anchor::sdgolden
