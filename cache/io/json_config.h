// The one reader of JSON config files (model configs, scheduler configs, anchor profiles): typed field helpers whose
// errors name the file, the field, what was expected and what was there, e.g.
//   'unet/config.json': 'layers_per_block' must be an integer or a list of 4 integers, got "two"
// A missing or null field takes the caller's default; a present field of the wrong type is always an error.
#pragma once

#include "cache/io/enum_table.h"
#include "cache/io/error.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace anchor {

// A config field bound to its member, so that a config's reader (JsonConfig::read) and writer (json_of) spell each
// name once.
struct JsonField {
    using Target =
        std::variant<int*, int64_t*, double*, bool*, std::string*, std::vector<int>*, std::vector<std::string>*>;
    const char* key;
    Target target;
};

// A member read and written under its own name: ANCHOR_JSON_FIELD(c, sample_size) = {"sample_size", &c.sample_size}.
#define ANCHOR_JSON_FIELD(obj, name)                                                                                   \
    ::anchor::JsonField {                                                                                              \
#name, &(obj).name                                                                                             \
    }

// {key: *target} for each field.
nlohmann::json json_of(const std::vector<JsonField>& fields);

class JsonConfig {
public:
    JsonConfig(nlohmann::json j, std::string source);
    // Reads and parses `path`: "cannot open <what> '<path>'" / "cannot parse '<path>': ..." on failure; the top level
    // must be an object.
    static JsonConfig load(const std::string& path, const std::string& what);
    static JsonConfig parse(const std::string& text, const std::string& source);

    bool has(const std::string& key) const; // present and not null
    const nlohmann::json& json() const { return j_; }
    const std::string& source() const { return source_; }

    int get_int(const std::string& key, int def) const;
    int64_t get_int64(const std::string& key, int64_t def) const;
    double get_double(const std::string& key, double def) const;
    bool get_bool(const std::string& key, bool def) const;
    std::string get_string(const std::string& key, const std::string& def) const;
    std::vector<int> get_int_list(const std::string& key, const std::vector<int>& def) const;
    std::vector<std::string> get_string_list(const std::string& key, const std::vector<std::string>& def) const;
    // An integer for every one of n entries, or a list of n integers (diffusers' per-block fields).
    std::vector<int> get_int_or_list(const std::string& key, size_t n, const std::vector<int>& def) const;
    // Each field's member = get_<its type>(key, member): absent fields keep the member's value as the default.
    void read(const std::vector<JsonField>& fields) const;
    template <class E> E get_enum(const std::string& key, const EnumTable<E>& table, E def) const {
        if (!has(key)) return def;
        const std::string s = get_string(key, "");
        for (const auto& [name, value] : table)
            if (name == s) return value;
        fail(key, "must be one of " + enum_choices(table), j_.at(key));
    }
    // Throws when the field is present and not null/false/empty: the format has it, this engine does not.
    void reject(const std::string& key, const std::string& why) const;

    [[noreturn]] void fail(const std::string& key, const std::string& expected, const nlohmann::json& got) const;
    [[noreturn]] void fail(const std::string& message) const; // "'<source>': <message>"

private:
    nlohmann::json j_;
    std::string source_;
};

} // namespace anchor
