// One key table per cache mode: each key of a mode's option grammar is declared once, with its range and help, and
// that one declaration drives the parser, the canonical string, the JSON of the resolved parameters, `--cache help`
// and the docs table (a test compares docs/caching.md with it). The shape is llama.cpp's common/arg.cpp, where an
// option is declared once and its help reads the default from the params struct.
//
// Header-only and without LibTorch: the SD modes (unet/cache/cache_config.h) and the text modes use the same grammar
// "mode[:key=value,...]".
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace anchor::cache::modes {

// A value outside a key's range; the parser turns it into one line naming the mode, the key and the range.
struct BadKeyValue : std::runtime_error {
    using std::runtime_error::runtime_error;
};

template <class P> struct ModeKey {
    std::string name;
    std::string values; // what the key takes, for help and errors: "a number in (0, inf)", "det|raw"
    std::string help;
    bool advanced = false;                            // a research key: listed under "advanced"
    std::function<void(P&, const std::string&)> set;  // throws BadKeyValue
    std::function<std::string(const P&)> get;         // the value as the grammar spells it
    std::function<nlohmann::json(const P&)> json;     // the resolved value in a report (null: left out)
    std::function<bool(const P&)> shown = nullptr;    // whether the canonical string writes it (unset: always)
};

template <class P> ModeKey<P> make_key(std::string name, std::string values, std::string help, bool advanced) {
    ModeKey<P> k;
    k.name = std::move(name);
    k.values = std::move(values);
    k.help = std::move(help);
    k.advanced = advanced;
    return k;
}

inline std::string format_number(double v) {
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", v);
    return buf;
}

inline double parse_number(const std::string& v, const std::string& expected) {
    try {
        size_t pos = 0;
        const double d = std::stod(v, &pos);
        if (pos == v.size() && std::isfinite(d)) return d;
    } catch (const std::exception&) {
    }
    throw BadKeyValue("must be " + expected + ", got '" + v + "'");
}

inline long long parse_integer(const std::string& v, const std::string& expected) {
    try {
        size_t pos = 0;
        const long long d = std::stoll(v, &pos);
        if (pos == v.size()) return d;
    } catch (const std::exception&) {
    }
    throw BadKeyValue("must be " + expected + ", got '" + v + "'");
}

// ">= lo", "> lo" or "a number in [lo, hi]" ("(lo, hi]" with lo_open).
inline std::string range_text(double lo, double hi, bool lo_open = false) {
    if (std::isinf(hi)) return std::string(lo_open ? "> " : ">= ") + format_number(lo);
    return std::string("a number in ") + (lo_open ? "(" : "[") + format_number(lo) + ", " + format_number(hi) + "]";
}

// A real number in [lo, hi] ((lo, ...) with lo_open; hi may be infinity).
template <class P>
ModeKey<P> number_key(std::string name, double P::*m, double lo, double hi, std::string help, bool advanced,
                      bool lo_open = false) {
    const std::string values = range_text(lo, hi, lo_open);
    auto k = make_key<P>(std::move(name), values, std::move(help), advanced);
    k.set = [m, lo, hi, lo_open, values](P& p, const std::string& v) {
        const double d = parse_number(v, values);
        if (d < lo || d > hi || (lo_open && d == lo)) throw BadKeyValue("must be " + values + ", got '" + v + "'");
        p.*m = d;
    };
    k.get = [m](const P& p) { return format_number(p.*m); };
    k.json = [m](const P& p) { return nlohmann::json(p.*m); };
    return k;
}

// An integer in [lo, hi]; with none_value, "none" stands for it (no bound).
template <class P, class I>
ModeKey<P> integer_key(std::string name, I P::*m, long long lo, long long hi, std::string help, bool advanced,
                       bool allow_none = false, I none_value = -1) {
    const std::string values = "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" +
                               (allow_none ? " or none" : "");
    auto k = make_key<P>(std::move(name), values, std::move(help), advanced);
    k.set = [m, lo, hi, values, allow_none, none_value](P& p, const std::string& v) {
        if (allow_none && v == "none") {
            p.*m = none_value;
            return;
        }
        const long long d = parse_integer(v, values);
        if (d < lo || d > hi) throw BadKeyValue("must be " + values + ", got '" + v + "'");
        p.*m = I(d);
    };
    k.get = [m, allow_none, none_value](const P& p) {
        return allow_none && p.*m == none_value ? std::string("none") : std::to_string(p.*m);
    };
    k.json = [m, allow_none, none_value](const P& p) {
        return allow_none && p.*m == none_value ? nlohmann::json("none") : nlohmann::json(p.*m);
    };
    return k;
}

// One of two words; `on` sets the flag. With as_bool the report holds true/false (for 0|1 keys), else the word.
template <class P>
ModeKey<P> choice_key(std::string name, bool P::*m, std::string on, std::string off, std::string help, bool advanced,
                      bool as_bool = false) {
    const std::string values = on + "|" + off;
    auto k = make_key<P>(std::move(name), values, std::move(help), advanced);
    k.set = [m, on, off](P& p, const std::string& v) {
        if (v != on && v != off) throw BadKeyValue("must be " + on + " or " + off + ", got '" + v + "'");
        p.*m = v == on;
    };
    k.get = [m, on, off](const P& p) { return p.*m ? on : off; };
    k.json = [m, on, off, as_bool](const P& p) { return as_bool ? nlohmann::json(p.*m) : nlohmann::json(p.*m ? on : off); };
    return k;
}

template <class P> const ModeKey<P>* find_key(const std::vector<ModeKey<P>>& table, const std::string& name) {
    for (const auto& k : table)
        if (k.name == name) return &k;
    return nullptr;
}

template <class P> std::string key_names(const std::vector<ModeKey<P>>& table) {
    std::string s;
    for (const auto& k : table) s += (s.empty() ? "" : ", ") + k.name;
    return s;
}

// Applies "key=value,key=value" to p. Errors (std::invalid_argument, one line): an item that is not key=value, an
// unknown key (listing the keys), a key given twice, a value out of the key's range.
template <class P> void apply_keys(const std::vector<ModeKey<P>>& table, P& p, const std::string& items) {
    std::set<std::string> seen;
    size_t b = 0;
    while (b <= items.size()) {
        const size_t e = std::min(items.find(',', b), items.size());
        const std::string item = items.substr(b, e - b);
        b = e + 1;
        const auto eq = item.find('=');
        if (eq == std::string::npos) throw std::invalid_argument("expected key=value, got '" + item + "'");
        const std::string name = item.substr(0, eq), value = item.substr(eq + 1);
        const auto* k = find_key(table, name);
        if (!k) throw std::invalid_argument("unknown key '" + name + "' (keys: " + key_names(table) + ")");
        if (!seen.insert(name).second) throw std::invalid_argument("key " + name + " is given twice");
        try {
            k->set(p, value);
        } catch (const BadKeyValue& bad) {
            throw std::invalid_argument(name + " " + bad.what());
        }
    }
}

// "key=value,..." of the keys the canonical string shows.
template <class P> std::string keys_string(const std::vector<ModeKey<P>>& table, const P& p) {
    std::string s;
    for (const auto& k : table)
        if (!k.shown || k.shown(p)) s += (s.empty() ? "" : ",") + k.name + "=" + k.get(p);
    return s;
}

template <class P> nlohmann::json keys_json(const std::vector<ModeKey<P>>& table, const P& p) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& k : table) {
        auto v = k.json(p);
        if (!v.is_null()) j[k.name] = std::move(v);
    }
    return j;
}

// The help lines of a table: "    key (values, default D): help", the documented keys first, then "advanced".
template <class P> std::string keys_help(const std::vector<ModeKey<P>>& table, const P& defaults) {
    std::string s;
    for (int adv = 0; adv < 2; ++adv) {
        bool any = false;
        for (const auto& k : table) {
            if (k.advanced != bool(adv)) continue;
            if (adv && !any) s += "  advanced:\n";
            any = true;
            const std::string d = k.get(defaults);
            s += "    " + k.name + " (" + k.values + ", default " + (d.empty() ? "unset" : d) + "): " + k.help + "\n";
        }
    }
    return s;
}

// The Markdown table of a mode's keys (docs/caching.md holds these, checked by a test): key, values, default, help.
inline std::string markdown_cell(const std::string& text) {
    std::string s;
    for (char c : text) s += c == '|' ? std::string("\\|") : std::string(1, c);
    return s;
}
template <class P> std::string keys_markdown(const std::vector<ModeKey<P>>& table, const P& defaults, bool advanced) {
    std::string s = "| key | values | default | what it does |\n|---|---|---|---|\n";
    for (const auto& k : table) {
        if (k.advanced != advanced) continue;
        const std::string d = k.get(defaults);
        s += "| `" + k.name + "` | " + markdown_cell(k.values) + " | " + (d.empty() ? "unset" : "`" + d + "`") +
             " | " + markdown_cell(k.help) + " |\n";
    }
    return s;
}

} // namespace anchor::cache::modes
