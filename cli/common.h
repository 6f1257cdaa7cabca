// Shared program-edge helpers for anchor-sd and anchor-text: runtime facts, threads, error handling.
#pragma once

#include "cache/util/batch_job.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
class Option;
class Validator;
} // namespace CLI

namespace anchor {

// Facts printed by --version: AnchorCache and LibTorch versions, BLAS library in use, intra-op threads, CUDA.
std::string runtime_info(const std::string& program);

// Adds --threads and --version to `app`; `threads` receives the option value (default 0 = all cores; threads are set
// by util::configure_threads, cache/util/threads.h).
void add_common_options(CLI::App& app, int& threads, const std::string& program);

// Runs `body` and maps exceptions to exit codes: UsageError, ParamError (a library parameter, reported under the
// option bound to its field, see bind_field) and CLI parse errors 2, other errors 1; prints "error: ..." on stderr.
int run_program(const std::function<int()>& body);

// Library parameters are named by their params struct field; the option tables say which option sets which field,
// so an error about field "steps" reads "--steps: must be >= 1, got 0".
void bind_field(const std::string& field, const std::string& option);
std::string option_of_field(const std::string& field); // "" when none is bound

// app.parse with the programs' conventions: returns -1 to go on, or the exit code after --help/--version (0);
// parse errors throw UsageError (exit 2 through run_program).
int parse_command_line(CLI::App& app, int argc, char** argv);

namespace cli {
// A CLI11 check: the option's number lies in [lo, hi] (NaN does not); the error quotes the value as typed, e.g.
// "--cfg-scale: must be in [0, 100], got 1e30". `why` (optional) says where the bound comes from.
CLI::Validator in_range(double lo, double hi, const std::string& why = "");
// A list of cache modes (--compare in both programs): repeatable, one list per occurrence, each split later by
// cache/modes/mode_list.h, so `--compare 'off;freq' --compare deepcache:3` and `--compare off,freq` read alike.
CLI::Option* add_mode_list_option(CLI::App& app, const std::string& name, std::vector<std::string>& lists,
                                  const std::string& help);
// The most intra-op threads --threads takes: 4 per core (more only adds OpenMP overhead; thousands hang the run).
int max_threads();

// "64,128,256" -> {64, 128, 256}; UsageError naming `option` on an empty list, an empty item or a non-number.
std::vector<int64_t> parse_int_list(const std::string& s, const std::string& option);

// Prompts of a prompts file (anchor-sd --prompts-file, bench-cache, calibrate; assets/prompts/*.txt): one per line,
// empty lines and '#' comment lines skipped, a trailing '\r' dropped, at most `max_n`. Throws anchor::Error naming
// the file when it cannot be read or holds no prompt.
std::vector<std::string> read_prompts_file(const std::string& path, int max_n = 1 << 30);

// A batch job's options (anchor-text's --prompts-file, -o, --skip-existing; anchor-sd has its own table): the
// prompts file's lines as the items, this process's MPI shard (cache/util/batch_job.h), "MPI rank r of n" printed.
struct BatchArgs {
    std::string prompts_file, output = "out/";
    bool skip_existing = false;
};
// Adds --prompts-file, -o/--output and --skip-existing to `sub` (`what`: the kind of output, for --help).
void add_batch_options(CLI::App* sub, BatchArgs& a, const std::string& what);
batch::ItemJob make_item_job(const BatchArgs& a, bool overwrite, const nlohmann::json& facts);
// "N prompts generated, M done before; manifest F" on stderr.
void print_item_job_result(const batch::ItemJobResult& r);
// --device (batch::DeviceSpec) for anchor-sd, anchor-text and their servers; the field it names is "device". `what`:
// what runs there, for --help.
CLI::Option* add_device_option(CLI::App& app, std::string& device, const std::string& what = "the UNet");
// --dtype on `device`, both programs' rule: auto is f16 on CUDA (diffusers' torch_dtype=float16 there) and f32 on the
// CPU; f16 on the CPU is a UsageError (LibTorch has no float16 CPU convolutions or matrix products).
torch::ScalarType parse_dtype(const std::string& s, const torch::Device& device);

// The embedded SD model used when -m is not given: assets/models/fashion-sd (trained by the project, issue 7), else
// the golden tiny random model assets/models/sd15-tiny-random. Throws anchor::Error when neither is found.
std::string default_sd_model();
// The folder of an embedded text model, assets/models/NAME (kjv-gpt2, kjv-mdlm), used when -m is not given. Throws
// anchor::Error naming `what` when it is not found.
std::string embedded_text_model(const std::string& name, const std::string& what);
} // namespace cli

} // namespace anchor
