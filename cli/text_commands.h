// Subcommand groups of anchor-text; each group lives in its own file so the GPT-2 and diffusion paths stay apart.
#pragma once

#include <functional>
#include <vector>

namespace CLI {
class App;
}

namespace anchor::cli {

// Each adder registers its subcommands on `app` and appends the callbacks that run them (a callback returns the exit
// code; it is invoked after parsing when its subcommand was selected).
using Runner = std::function<int()>;
void add_gpt2_commands(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners);      // cli/text_gpt2.cpp
void add_diffusion_commands(CLI::App& app, std::vector<std::pair<CLI::App*, Runner>>& runners); // cli/text_diffusion.cpp

} // namespace anchor::cli
