// Subcommand groups of anchor-text; each group lives in its own file so the GPT-2 and diffusion paths stay apart.
#pragma once

#include "cache/io/error.h"
#include "text/params.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace anchor::cli {

// Each adder registers its subcommands on `app` and appends the callbacks that run them (a callback returns the exit
// code; it is invoked after parsing when its subcommand was selected).
using Runner = std::function<int()>;
void add_gpt2_commands(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners); // cli/text_gpt2.cpp
void add_diffusion_commands(CLI::App& app,
                            std::vector<std::pair<CLI::App*, Runner>>& runners); // cli/text_diffusion.cpp
void add_text_serve_command(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners); // cli/text_serve.cpp

// The embedded GPT-2 (assets/models/kjv-gpt2): the model of `gpt2 generate`, `gpt2 ppl` and `serve` without -m.
std::string default_gpt2_model(); // cli/text_gpt2.cpp

// --device and --dtype of every anchor-text command that runs a model (declared once, by add_placement_options);
// resolved after parsing by resolve_placement into the library's typed text::Placement.
struct PlacementArgs {
    std::string device = "cpu", dtype = "auto";
};
void add_placement_options(CLI::App* sub, PlacementArgs& a, const std::string& what); // cli/text_main.cpp
// batch::select_device (the GPU of this process's MPI local rank for cuda / auto) and cli::parse_dtype, the rules of
// anchor-sd: a CUDA device in a build without CUDA or on a machine without one is a usage error naming --device.
text::Placement resolve_placement(const PlacementArgs& a);

// Library field -> the flag that fills it, for the messages of text::ParamError.
using FlagNames = std::vector<std::pair<std::string, std::string>>;

// Runs `body` (a subcommand's library call); a text::ParamError comes out as a usage error (exit 2) that names the
// flags of `flags` where the library named its fields.
template <class F> auto with_flag_errors(const FlagNames& flags, F&& body) -> decltype(body()) {
    try {
        return body();
    } catch (const text::ParamError& e) {
        throw UsageError(text::with_flags(e, flags));
    }
}

} // namespace anchor::cli
