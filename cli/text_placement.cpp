// --device and --dtype of anchor-text's commands (cli/text_commands.h): one declaration, anchor-sd's rules.
#include "cache/io/error.h"
#include "cache/util/batch_job.h"
#include "cli/common.h"
#include "cli/text_commands.h"

#include <CLI/CLI.hpp>

namespace anchor::cli {

void add_placement_options(CLI::App* sub, PlacementArgs& a, const std::string& what) {
    add_device_option(*sub, a.device, what);
    sub->add_option("--dtype", a.dtype,
                    "compute dtype of " + what +
                        ": f32, f16 or bf16; auto: f16 on CUDA, f32 on the CPU (f16 is rejected on the CPU; bf16 "
                        "there runs LibTorch's operators instead of the float32 kernels)")
        ->capture_default_str();
    bind_field("dtype", "--dtype");
}

text::Placement resolve_placement(const PlacementArgs& a) {
    try {
        text::Placement p;
        p.device = batch::select_device(batch::DeviceSpec::parse(a.device), batch::shard_from_env().local_rank);
        p.dtype = parse_dtype(a.dtype, p.device);
        return p;
    } catch (const ParamError& e) { // named by its option wherever this is called
        throw UsageError(option_of_field(e.field()) + ": " + e.detail());
    }
}

} // namespace anchor::cli
