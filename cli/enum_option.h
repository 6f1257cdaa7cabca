// An enum-valued command-line option driven by the enum's one EnumTable: the table parses the value, names the
// choices in --help and in the error for an unknown value (a usage error, exit 2).
#pragma once

#include "cache/io/enum_table.h"

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

namespace anchor::cli {

template <class E>
CLI::Option* add_enum_option(CLI::App& app, const std::string& name, E& target, const EnumTable<E>& table,
                             const std::string& help) {
    const std::string flag = name.substr(name.rfind(',') == std::string::npos ? 0 : name.rfind(',') + 1);
    auto* opt = app.add_option_function<std::string>(
        name, [&target, &table, flag](const std::string& s) { target = enum_from_string(table, s, flag); },
        help + " (" + enum_choices(table, "|") + "; default " + enum_name(table, target) + ")");
    opt->type_name("NAME");
    return opt;
}

// The same for a value that may stay unset (the library then picks it); `unset` says in --help what that means.
template <class E>
CLI::Option* add_enum_option(CLI::App& app, const std::string& name, std::optional<E>& target,
                             const EnumTable<E>& table, const std::string& help, const std::string& unset) {
    const std::string flag = name.substr(name.rfind(',') == std::string::npos ? 0 : name.rfind(',') + 1);
    auto* opt = app.add_option_function<std::string>(
        name, [&target, &table, flag](const std::string& s) { target = enum_from_string(table, s, flag); },
        help + " (" + enum_choices(table, "|") + "; default: " + unset + ")");
    opt->type_name("NAME");
    return opt;
}

} // namespace anchor::cli
