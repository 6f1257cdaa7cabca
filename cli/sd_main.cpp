// anchor-sd: Stable Diffusion txt2img with anchor caches.
#include "cli/common.h"

#include <CLI/CLI.hpp>

int main(int argc, char** argv) {
    return anchor::run_program([&]() -> int {
        CLI::App app{"anchor-sd: Stable Diffusion txt2img with anchor caches (AnchorCache)"};
        int threads = 0;
        anchor::add_common_options(app, threads, "anchor-sd");
        try {
            app.parse(argc, argv);
        } catch (const CLI::ParseError& e) {
            // --help/--version exit 0; every parse error is a usage error (exit 2), whatever CLI11's own code.
            return app.exit(e) == 0 ? 0 : 2;
        }
        anchor::configure_threads(threads);
        std::cout << app.help();
        return 0;
    });
}
