// Reading a model's JSON config file with every failure reported against the file.
#pragma once

#include "cache/io/error.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

namespace anchor {

// Parses `path` and converts it with `from_json(const nlohmann::json&)`. Every failure is an anchor::Error naming the
// file: unreadable ("cannot open <what> '<path>'"), not JSON or a field of the wrong type ("cannot parse '<path>':
// ..."), a value the converter rejects with an anchor::Error ("'<path>': ...").
template <class FromJson>
auto read_json_config(const std::string& path, const std::string& what, FromJson&& from_json) {
    std::ifstream f(path);
    if (!f) throw Error("cannot open " + what + " '" + path + "'");
    try {
        return from_json(nlohmann::json::parse(f));
    } catch (const nlohmann::json::exception& e) {
        throw Error("cannot parse '" + path + "': " + e.what());
    } catch (const Error& e) {
        throw Error("'" + path + "': " + e.what());
    }
}

} // namespace anchor
