// anchor-text: GPT-2 streaming with sink-rolling KV buffers and text diffusion with time-anchor caches.
#include "cache/io/error.h"
#include "cache/util/heap.h"
#include "cache/util/threads.h"
#include "cli/common.h"
#include "cli/text_commands.h"

#include <iostream>

#include <CLI/CLI.hpp>

namespace {
// "gpt2 ppl|generate|..., diffusion generate|...": the subcommands as registered.
std::string subcommand_names(const CLI::App& app) {
    std::string out;
    for (const auto* group : app.get_subcommands([](const CLI::App*) { return true; })) {
        std::string leaves;
        for (const auto* s : group->get_subcommands([](const CLI::App*) { return true; }))
            leaves += (leaves.empty() ? "" : "|") + s->get_name();
        out += (out.empty() ? "" : ", ") + group->get_name() + (leaves.empty() ? "" : " " + leaves);
    }
    return out;
}
} // namespace

int main(int argc, char** argv) {
    anchor::util::select_blas_core(argv);
    anchor::util::configure_heap();
    return anchor::run_program([&]() -> int {
        CLI::App app{"anchor-text: GPT-2 streaming and text diffusion with anchor caches (AnchorCache)"};
        int threads = 0;
        anchor::add_common_options(app, threads, "anchor-text");
        // --threads and --version are the program's: accepted before or after the subcommand (subcommands inherit
        // fallthrough and pass options they do not know to their parent).
        app.fallthrough();
        std::vector<std::pair<CLI::App*, anchor::cli::Runner>> runners;
        anchor::cli::add_gpt2_commands(app, runners);
        anchor::cli::add_diffusion_commands(app, runners);
        anchor::cli::add_text_serve_command(app, runners);
        try {
            app.parse(argc, argv);
        } catch (const CLI::ParseError& e) {
            // --help/--version exit 0; every parse error is a usage error (exit 2), whatever CLI11's own code.
            return app.exit(e) == 0 ? 0 : 2;
        }
        anchor::util::configure_threads(threads);
        for (auto& [sub, run] : runners)
            if (sub->parsed()) return run();
        std::cerr << app.help();
        throw anchor::UsageError("a subcommand is required: " + subcommand_names(app) + " (see --help)");
    });
}
