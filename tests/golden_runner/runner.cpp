#include "tests/golden_runner/runner.h"

#include "cache/io/read_file.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <sstream>

namespace anchor::golden {

void Stats::check(const std::string& what, const torch::Tensor& actual, const torch::Tensor& golden, double atol,
                  double rtol) {
    if (actual.sizes() != golden.sizes()) {
        std::ostringstream os;
        os << what << ": shape " << actual.sizes() << " != golden " << golden.sizes();
        fail(os.str());
        return;
    }
    if (golden.numel() == 0) return;
    auto a = actual.detach().to(torch::kCPU, torch::kFloat64);
    auto g = golden.detach().to(torch::kCPU, torch::kFloat64);
    auto diff = (a - g).abs();
    if (!torch::isfinite(a).all().item<bool>()) {
        fail(what + ": non-finite values");
        return;
    }
    double mabs = diff.max().item<double>();
    double gmax = g.abs().max().item<double>();
    double mrel = mabs / std::max(gmax, 1e-30);
    max_abs = std::max(max_abs, mabs);
    max_rel = std::max(max_rel, mrel);
    auto excess = diff - (atol + rtol * g.abs());
    if (excess.max().item<double>() > 0) {
        std::ostringstream os;
        os << what << ": max_abs=" << mabs << " exceeds atol " << atol << " + rtol " << rtol << " * |golden|";
        fail(os.str());
    }
}

void Stats::check_equal(const std::string& what, const torch::Tensor& actual, const torch::Tensor& golden) {
    if (actual.sizes() != golden.sizes()) {
        std::ostringstream os;
        os << what << ": shape " << actual.sizes() << " != golden " << golden.sizes();
        fail(os.str());
        return;
    }
    auto a = actual.detach().to(torch::kCPU, torch::kInt64);
    auto g = golden.detach().to(torch::kCPU, torch::kInt64);
    auto ne = (a != g);
    int64_t n = ne.sum().item<int64_t>();
    if (n > 0) fail(what + ": " + std::to_string(n) + " of " + std::to_string(g.numel()) + " values differ");
}

void Stats::check_true(const std::string& what, bool ok, const std::string& detail) {
    if (!ok) fail(what + (detail.empty() ? "" : ": " + detail));
}

void Stats::fail(const std::string& why) {
    pass = false;
    failures.push_back(why);
}

void Stats::merge(const Stats& o) {
    max_abs = std::max(max_abs, o.max_abs);
    max_rel = std::max(max_rel, o.max_rel);
    pass = pass && o.pass;
    failures.insert(failures.end(), o.failures.begin(), o.failures.end());
}

static std::vector<Checker>& registry() {
    static std::vector<Checker> r;
    return r;
}

bool register_checker(Checker c) {
    registry().push_back(std::move(c));
    return true;
}

const std::vector<Checker>& checkers() {
    return registry();
}

std::string read_text(const fs::path& p) {
    return anchor::read_file(p.string());
}

CaseResult guarded(const std::string& name, const std::function<void(Stats&)>& body) {
    CaseResult r;
    r.name = name;
    try {
        body(r.stats);
    } catch (const std::exception& e) {
        r.stats.fail(std::string("exception: ") + e.what());
    }
    return r;
}

std::string relative_name(const fs::path& dir, const Context& ctx) {
    std::error_code ec;
    auto rel = fs::relative(dir, ctx.root, ec);
    std::string s = ec ? dir.string() : rel.string();
    return s.empty() || s == "." ? std::string(".") : s;
}

bool has_file(const fs::path& dir, const std::string& name) {
    return fs::is_regular_file(dir / name);
}

std::string config_class(const fs::path& dir) {
    if (!has_file(dir, "config.json")) return "";
    try {
        auto j = nlohmann::json::parse(read_text(dir / "config.json"));
        if (j.contains("_class_name") && j["_class_name"].is_string()) return j["_class_name"];
        if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
            j["architectures"][0].is_string())
            return j["architectures"][0];
    } catch (...) {
    }
    return "";
}

} // namespace anchor::golden
