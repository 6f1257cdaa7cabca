// `anchor-text gpt2 ...` (comes with the GPT-2 issue; nothing is registered until it is real).
#include "cli/text_commands.h"

namespace anchor::cli {
void add_gpt2_commands(CLI::App&, std::vector<std::pair<CLI::App*, Runner>>&) {}
} // namespace anchor::cli
