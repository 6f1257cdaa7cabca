#include "cache/io/json_config.h"

#include <fstream>
#include <limits>

namespace anchor {

JsonConfig::JsonConfig(nlohmann::json j, std::string source) : j_(std::move(j)), source_(std::move(source)) {
    if (!j_.is_object()) fail("expected a JSON object");
}

JsonConfig JsonConfig::load(const std::string& path, const std::string& what) {
    std::ifstream f(path);
    if (!f) throw Error("cannot open " + what + " '" + path + "'");
    try {
        return JsonConfig(nlohmann::json::parse(f), path);
    } catch (const nlohmann::json::exception& e) {
        throw Error("cannot parse '" + path + "': " + e.what());
    }
}

JsonConfig JsonConfig::parse(const std::string& text, const std::string& source) {
    try {
        return JsonConfig(nlohmann::json::parse(text), source);
    } catch (const nlohmann::json::exception& e) {
        throw Error("cannot parse '" + source + "': " + e.what());
    }
}

bool JsonConfig::has(const std::string& key) const {
    auto it = j_.find(key);
    return it != j_.end() && !it->is_null();
}

void JsonConfig::fail(const std::string& key, const std::string& expected, const nlohmann::json& got) const {
    std::string shown = got.dump();
    if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
    throw Error("'" + source_ + "': '" + key + "' " + expected + ", got " + shown);
}

void JsonConfig::fail(const std::string& message) const {
    throw Error("'" + source_ + "': " + message);
}

int64_t JsonConfig::get_int64(const std::string& key, int64_t def) const {
    if (!has(key)) return def;
    const auto& v = j_.at(key);
    if (v.is_number_integer()) return v.get<int64_t>();
    // 4.0 is an integer written as a float by some exporters
    if (v.is_number_float() && v.get<double>() == double(int64_t(v.get<double>()))) return int64_t(v.get<double>());
    fail(key, "must be an integer", v);
}

int JsonConfig::get_int(const std::string& key, int def) const {
    const int64_t v = get_int64(key, def);
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
        fail(key, "must fit a 32-bit integer", j_.at(key));
    return int(v);
}

double JsonConfig::get_double(const std::string& key, double def) const {
    if (!has(key)) return def;
    const auto& v = j_.at(key);
    if (!v.is_number()) fail(key, "must be a number", v);
    return v.get<double>();
}

bool JsonConfig::get_bool(const std::string& key, bool def) const {
    if (!has(key)) return def;
    const auto& v = j_.at(key);
    if (!v.is_boolean()) fail(key, "must be true or false", v);
    return v.get<bool>();
}

std::string JsonConfig::get_string(const std::string& key, const std::string& def) const {
    if (!has(key)) return def;
    const auto& v = j_.at(key);
    if (!v.is_string()) fail(key, "must be a string", v);
    return v.get<std::string>();
}

std::vector<int> JsonConfig::get_int_list(const std::string& key, const std::vector<int>& def) const {
    if (!has(key)) return def;
    const auto& v = j_.at(key);
    if (!v.is_array()) fail(key, "must be a list of integers", v);
    std::vector<int> out;
    for (const auto& e : v) {
        if (!e.is_number_integer()) fail(key, "must be a list of integers", v);
        out.push_back(e.get<int>());
    }
    return out;
}

std::vector<std::string> JsonConfig::get_string_list(const std::string& key,
                                                     const std::vector<std::string>& def) const {
    if (!has(key)) return def;
    const auto& v = j_.at(key);
    if (!v.is_array()) fail(key, "must be a list of strings", v);
    std::vector<std::string> out;
    for (const auto& e : v) {
        if (!e.is_string()) fail(key, "must be a list of strings", v);
        out.push_back(e.get<std::string>());
    }
    return out;
}

std::vector<int> JsonConfig::get_int_or_list(const std::string& key, size_t n, const std::vector<int>& def) const {
    if (!has(key)) return def;
    const auto& v = j_.at(key);
    const std::string expected = "must be an integer or a list of " + std::to_string(n) + " integers";
    if (v.is_number_integer()) return std::vector<int>(n, v.get<int>());
    if (!v.is_array() || v.size() != n) fail(key, expected, v);
    std::vector<int> out;
    for (const auto& e : v) {
        if (!e.is_number_integer()) fail(key, expected, v);
        out.push_back(e.get<int>());
    }
    return out;
}

void JsonConfig::reject(const std::string& key, const std::string& why) const {
    if (!has(key)) return;
    const auto& v = j_.at(key);
    if ((v.is_boolean() && !v.get<bool>()) || (v.is_string() && v.get<std::string>().empty()) ||
        (v.is_array() && v.empty()))
        return;
    fail(key, "is not supported (" + why + ")", v);
}

void JsonConfig::read(const std::vector<JsonField>& fields) const {
    for (const auto& field : fields) {
        const std::string key = field.key;
        std::visit(
            [&](auto* member) {
                using T = std::remove_pointer_t<decltype(member)>;
                if constexpr (std::is_same_v<T, int>)
                    *member = get_int(key, *member);
                else if constexpr (std::is_same_v<T, int64_t>)
                    *member = get_int64(key, *member);
                else if constexpr (std::is_same_v<T, double>)
                    *member = get_double(key, *member);
                else if constexpr (std::is_same_v<T, bool>)
                    *member = get_bool(key, *member);
                else if constexpr (std::is_same_v<T, std::string>)
                    *member = get_string(key, *member);
                else if constexpr (std::is_same_v<T, std::vector<int>>)
                    *member = get_int_list(key, *member);
                else
                    *member = get_string_list(key, *member);
            },
            field.target);
    }
}

nlohmann::json json_of(const std::vector<JsonField>& fields) {
    auto j = nlohmann::json::object();
    for (const auto& field : fields) std::visit([&](auto* member) { j[field.key] = *member; }, field.target);
    return j;
}

} // namespace anchor
