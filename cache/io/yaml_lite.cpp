#include "cache/io/yaml_lite.h"

#include "cache/io/error.h"
#include "cache/io/read_file.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

namespace anchor {

namespace {

struct Line {
    int indent;
    std::string text; // without indentation and comment
    int number;       // 1-based, for messages
};

std::string strip_comment(const std::string& s) {
    char quote = 0;
    for (size_t i = 0; i < s.size(); ++i) {
        const char c = s[i];
        if (quote) {
            if (c == quote) quote = 0;
        } else if (c == '"' || c == '\'') {
            quote = c;
        } else if (c == '#' && (i == 0 || s[i - 1] == ' ' || s[i - 1] == '\t')) {
            return s.substr(0, i);
        }
    }
    return s;
}

std::string trim(const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r");
    if (b == std::string::npos) return "";
    return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

class Parser {
public:
    Parser(const std::string& text, std::string source) : source_(std::move(source)) {
        std::istringstream in(text);
        std::string raw;
        int n = 0;
        while (std::getline(in, raw)) {
            ++n;
            const std::string body = strip_comment(raw);
            const std::string t = trim(body);
            if (t.empty() || t == "---") continue;
            if (raw.find('\t') < raw.find_first_not_of(" \t")) fail(n, "tab indentation");
            lines_.push_back({int(body.find_first_not_of(' ')), t, n});
        }
    }

    nlohmann::json parse() {
        if (lines_.empty()) return nlohmann::json::object();
        size_t i = 0;
        auto j = node(i, lines_[0].indent);
        if (i < lines_.size()) fail(lines_[i].number, "unexpected indentation");
        return j;
    }

private:
    [[noreturn]] void fail(int line, const std::string& what) const {
        throw Error("'" + source_ + "' line " + std::to_string(line) + ": " + what +
                    " (only block mappings, block sequences and plain/quoted/flow-list scalars are read)");
    }

    static bool is_item(const std::string& t) { return t == "-" || t.rfind("- ", 0) == 0; }

    // "key: value" / "key:" -> key and the rest ("" when the value is a block below).
    bool split_key(const Line& l, std::string& key, std::string& rest) const {
        char quote = 0;
        for (size_t i = 0; i < l.text.size(); ++i) {
            const char c = l.text[i];
            if (quote) {
                if (c == quote) quote = 0;
                continue;
            }
            if (c == '"' || c == '\'') quote = c;
            if (c == ':' && (i + 1 == l.text.size() || l.text[i + 1] == ' ')) {
                key = trim(l.text.substr(0, i));
                rest = trim(l.text.substr(i + 1));
                if (key.size() >= 2 && (key[0] == '"' || key[0] == '\'')) key = key.substr(1, key.size() - 2);
                return true;
            }
        }
        return false;
    }

    nlohmann::json node(size_t& i, int indent) {
        return is_item(lines_[i].text) ? sequence(i, indent) : mapping(i, indent);
    }

    nlohmann::json sequence(size_t& i, int indent) {
        auto out = nlohmann::json::array();
        while (i < lines_.size() && lines_[i].indent == indent && is_item(lines_[i].text)) {
            Line l = lines_[i];
            const std::string rest = trim(l.text.substr(1));
            std::string k, v;
            if (rest.empty()) { // "-" then a block below
                ++i;
                if (i >= lines_.size() || lines_[i].indent <= indent) fail(l.number, "empty sequence item");
                out.push_back(node(i, lines_[i].indent));
            } else if (rest[0] != '"' && rest[0] != '\'' && rest[0] != '[' &&
                       split_key({l.indent + 2, rest, l.number}, k, v)) {
                // "- key: value": a mapping whose first key sits two columns in.
                lines_[i] = {indent + 2, rest, l.number};
                out.push_back(mapping(i, indent + 2));
            } else {
                out.push_back(scalar(rest, l.number));
                ++i;
            }
        }
        return out;
    }

    nlohmann::json mapping(size_t& i, int indent) {
        auto out = nlohmann::json::object();
        while (i < lines_.size() && lines_[i].indent == indent && !is_item(lines_[i].text)) {
            const Line l = lines_[i];
            std::string key, rest;
            if (!split_key(l, key, rest)) fail(l.number, "expected 'key: value'");
            if (rest.rfind('&', 0) == 0 || rest.rfind('*', 0) == 0 || rest.rfind('!', 0) == 0 || rest == "|" ||
                rest == ">")
                fail(l.number, "anchors, tags and block scalars are not supported");
            ++i;
            if (!rest.empty()) {
                out[key] = scalar(rest, l.number);
            } else if (i < lines_.size() &&
                       (lines_[i].indent > indent || (lines_[i].indent == indent && is_item(lines_[i].text)))) {
                out[key] = node(i, lines_[i].indent);
            } else {
                out[key] = nullptr;
            }
        }
        if (i < lines_.size() && lines_[i].indent > indent) fail(lines_[i].number, "unexpected indentation");
        return out;
    }

    nlohmann::json scalar(const std::string& s, int line) const {
        if (s.size() >= 2 && (s[0] == '"' || s[0] == '\'') && s.back() == s[0]) return s.substr(1, s.size() - 2);
        if (s[0] == '[') {
            if (s.back() != ']') fail(line, "unterminated flow list");
            auto out = nlohmann::json::array();
            const std::string inner = trim(s.substr(1, s.size() - 2));
            if (inner.empty()) return out;
            if (inner.find_first_of("[{") != std::string::npos) fail(line, "nested flow collections");
            std::stringstream ss(inner);
            std::string item;
            while (std::getline(ss, item, ',')) out.push_back(scalar(trim(item), line));
            return out;
        }
        if (s[0] == '{') fail(line, "flow mappings");
        if (s == "true" || s == "True") return true;
        if (s == "false" || s == "False") return false;
        if (s == "null" || s == "~" || s == "Null") return nullptr;
        char* end = nullptr;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (end && *end == 0) return v;
        const double d = std::strtod(s.c_str(), &end);
        if (end && *end == 0) return d;
        return s;
    }

    std::vector<Line> lines_;
    std::string source_;
};

} // namespace

nlohmann::json parse_yaml_lite(const std::string& text, const std::string& source) {
    return Parser(text, source).parse();
}

nlohmann::json load_yaml_lite(const std::string& path) {
    return parse_yaml_lite(read_file(path), path);
}

} // namespace anchor
