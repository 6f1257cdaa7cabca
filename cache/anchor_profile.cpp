#include "cache/anchor_profile.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"

#include <algorithm>
#include <cmath>

namespace anchor::cache {

namespace {

constexpr const char* kFormat = "anchorcache-profile-1";
constexpr const char* kMdlmFormat = "anchorcache-mdlm-profile-1";
constexpr const char* kSdKind = "anchor-sd freq profile";

std::vector<StepRange> ranges_from_json(const nlohmann::json& arr, const std::string& source) {
    if (!arr.is_array() || arr.empty()) throw Error(source + ": the step ranges must be a non-empty list");
    std::vector<StepRange> out;
    for (const auto& e : arr) {
        StepRange r;
        r.begin = e.at("begin").get<double>();
        r.end = e.at("end").get<double>();
        r.threshold = e.at("threshold").get<double>();
        r.mean_change = e.value("mean_change", 0.0);
        if (!(r.begin >= 0 && r.end > r.begin && r.end <= 1.0 + 1e-9 && r.threshold > 0))
            throw Error(source + ": step range " + std::to_string(out.size()) + " [" + std::to_string(r.begin) + ", " +
                        std::to_string(r.end) + ") has threshold " + std::to_string(r.threshold) +
                        " (need 0 <= begin < end <= 1, threshold > 0)");
        out.push_back(r);
    }
    return out;
}

void layers_from_json(const nlohmann::json& j, AnchorProfile& p, const std::string& source) {
    p.n_layers = j.at("n_layers").get<int64_t>();
    p.time_bins = j.at("time_bins").get<int64_t>();
    for (const auto& c : j.at("classes")) {
        p.centroids.push_back(c.at("centroid").get<double>());
        p.class_stale.push_back(c.at("staleness").get<int64_t>());
    }
    p.class_of = j.at("class_of").get<std::vector<std::vector<int64_t>>>();
    if (p.n_layers <= 0 || p.time_bins <= 0 || int64_t(p.class_of.size()) != p.n_layers)
        throw Error(source + ": n_layers, time_bins and class_of disagree");
    for (const auto& row : p.class_of) {
        if (int64_t(row.size()) != p.time_bins) throw Error(source + ": a class_of row has not time_bins entries");
        for (auto c : row)
            if (c < 0 || c >= int64_t(p.class_stale.size()))
                throw Error(source + ": class index " + std::to_string(c) + " out of range");
    }
    for (auto s : p.class_stale)
        if (s < 0) throw Error(source + ": negative staleness");
}

} // namespace

std::vector<double> AnchorProfile::step_thresholds(int num_steps, double fallback) const {
    std::vector<double> t(size_t(std::max(num_steps, 0)), fallback);
    for (int k = 0; k < num_steps; ++k) {
        const double x = (k + 0.5) / num_steps; // the step's centre as a fraction of the loop
        for (const auto& r : step_ranges)
            if (x >= r.begin && x < r.end) t[size_t(k)] = r.threshold;
    }
    return t;
}

int64_t AnchorProfile::staleness(int64_t layer, int64_t step, int64_t total_steps) const {
    if (!has_layer_classes()) throw Error("anchor profile has no layer classes");
    if (layer < 0 || layer >= n_layers) throw Error("anchor profile: layer " + std::to_string(layer) + " out of range");
    const int64_t bin = total_steps > 0 ? std::min<int64_t>(time_bins - 1, step * time_bins / total_steps) : 0;
    return class_stale.at(size_t(class_of[size_t(layer)][size_t(std::max<int64_t>(0, bin))]));
}

nlohmann::json AnchorProfile::to_json() const {
    nlohmann::json j = {{"format", kFormat}, {"meta", meta}};
    if (has_step_ranges()) {
        auto& arr = j["step_ranges"] = nlohmann::json::array();
        for (const auto& r : step_ranges)
            arr.push_back(
                {{"begin", r.begin}, {"end", r.end}, {"threshold", r.threshold}, {"mean_change", r.mean_change}});
    }
    if (has_layer_classes()) {
        nlohmann::json classes = nlohmann::json::array();
        for (size_t i = 0; i < centroids.size(); ++i)
            classes.push_back({{"centroid", centroids[i]}, {"staleness", class_stale[i]}});
        j["layers"] = {{"n_layers", n_layers}, {"time_bins", time_bins}, {"classes", classes}, {"class_of", class_of}};
    }
    return j;
}

AnchorProfile AnchorProfile::from_json(const nlohmann::json& j, const std::string& source) {
    AnchorProfile p;
    try {
        if (!j.is_object()) throw Error(source + ": not a JSON object");
        const std::string format = j.value("format", std::string());
        if (format == kFormat) {
            if (j.contains("step_ranges")) p.step_ranges = ranges_from_json(j["step_ranges"], source);
            if (j.contains("layers")) layers_from_json(j["layers"], p, source);
            if (!p.has_step_ranges() && !p.has_layer_classes())
                throw Error(source + ": neither \"step_ranges\" nor \"layers\"");
        } else if (format == kMdlmFormat) {
            layers_from_json(j, p, source);
        } else if (j.value("kind", std::string()) == kSdKind || (format.empty() && j.contains("ranges"))) {
            p.step_ranges = ranges_from_json(j.at("ranges"), source);
        } else {
            throw Error(source + ": not an anchor profile (format '" + format + "'; expected '" + kFormat + "')");
        }
        if (j.contains("meta")) p.meta = j["meta"];
    } catch (const nlohmann::json::exception& e) {
        throw Error(source + ": " + e.what());
    }
    return p;
}

AnchorProfile AnchorProfile::load(const std::string& path) {
    return from_json(JsonConfig::load(path, "anchor profile").json(), "'" + path + "'");
}

void AnchorProfile::save(const std::string& path, bool overwrite) const {
    write_file_atomic(path, to_json().dump(1) + "\n", overwrite);
}

} // namespace anchor::cache
