// Enum <-> string tables: one table per enum drives parsing, names and the choices printed in --help.
#pragma once

#include "cache/io/error.h"

#include <string>
#include <utility>
#include <vector>

namespace anchor {

template <class E> using EnumTable = std::vector<std::pair<std::string, E>>;

// "a<sep>b<sep>c" in table order.
template <class E> std::string enum_choices(const EnumTable<E>& table, const std::string& sep = ", ") {
    std::string s;
    for (const auto& [name, value] : table) s += (s.empty() ? "" : sep) + name;
    return s;
}

// The value named `s`; otherwise a ParamError for field `what`: "unknown value '<s>' (choices: ...)".
template <class E> E enum_from_string(const EnumTable<E>& table, const std::string& s, const std::string& what) {
    for (const auto& [name, value] : table)
        if (name == s) return value;
    throw ParamError(what, "unknown value '" + s + "' (choices: " + enum_choices(table) + ")");
}

// The name of `v`; "?" for a value missing from the table (a programming error, never user input).
template <class E> std::string enum_name(const EnumTable<E>& table, E v) {
    for (const auto& [name, value] : table)
        if (value == v) return name;
    return "?";
}

} // namespace anchor
