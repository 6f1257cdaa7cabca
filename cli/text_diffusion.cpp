// `anchor-text diffusion ...` (comes with the text-diffusion issue; nothing is registered until it is real).
#include "cli/text_commands.h"

namespace anchor::cli {
void add_diffusion_commands(CLI::App&, std::vector<std::pair<CLI::App*, Runner>>&) {}
} // namespace anchor::cli
