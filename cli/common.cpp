#include "cli/common.h"

#include "cache/io/assets.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/util/threads.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

namespace anchor {

std::string runtime_info(const std::string& program) {
    std::ostringstream os;
    os << program << " (AnchorCache " << ANCHOR_VERSION << ")\n";
    os << "  LibTorch:    " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "." << TORCH_VERSION_PATCH << "\n";
    os << "  BLAS:        " << util::blas_in_use() << "\n";
    os << "  threads:     " << at::get_num_threads() << " intra-op (cores: " << std::thread::hardware_concurrency()
       << ")\n";
#ifdef ANCHOR_WITH_CUDA
    os << "  CUDA:        on (kernels built; device available: " << (torch::cuda::is_available() ? "yes" : "no")
       << ")\n";
#else
    os << "  CUDA:        off (CPU-only build)\n";
#endif
    return os.str();
}

void add_common_options(CLI::App& app, int& threads, const std::string& program) {
    // Every program's outputs refuse to replace files unless --overwrite is given (cache/io/atomic_file.h).
    bind_field("overwrite", "--overwrite");
    app.add_option("-t,--threads", threads, "Intra-op threads, at most 4 per core (default: all cores)")
        ->check(cli::in_range(0, cli::max_threads(),
                              "4 x the " + std::to_string(cli::max_threads() / 4) + " cores of this machine"));
    app.add_flag_callback(
        "--version",
        [&threads, program]() {
            util::configure_threads(threads);
            std::cout << runtime_info(program);
            throw CLI::Success();
        },
        "Print versions, BLAS in use, threads and CUDA status, then exit");
}

namespace {
std::map<std::string, std::string>& field_options() {
    static std::map<std::string, std::string> m;
    return m;
}
} // namespace

void bind_field(const std::string& field, const std::string& option) {
    field_options()[field] = option;
}

std::string option_of_field(const std::string& field) {
    auto it = field_options().find(field);
    return it == field_options().end() ? std::string() : it->second;
}

int run_program(const std::function<int()>& body) {
    install_interrupt_cleanup();
    try {
        return body();
    } catch (const ParamError& e) {
        const std::string opt = option_of_field(e.field());
        std::cerr << "error: " << (opt.empty() ? e.field() : opt) << ": " << e.detail() << "\n";
        return 2;
    } catch (const UsageError& e) {
        std::cerr << "error: " << e.what() << "\n";
        return 2;
    } catch (const Error& e) {
        std::cerr << "error: " << e.what() << "\n";
        return 1;
    } catch (const c10::Error& e) {
        std::cerr << "error: " << e.what_without_backtrace() << "\n";
        return 1;
    } catch (const std::exception& e) {
        std::cerr << "error: " << e.what() << "\n";
        return 1;
    }
}

int parse_command_line(CLI::App& app, int argc, char** argv) {
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::Success& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        throw UsageError(e.what());
    }
    return -1;
}

namespace cli {
namespace {
std::string num(double v) {
    std::ostringstream os;
    os << v;
    return os.str();
}
} // namespace

CLI::Validator in_range(double lo, double hi, const std::string& why) {
    const std::string range = "[" + num(lo) + ", " + num(hi) + "]";
    return CLI::Validator(
        [lo, hi, range, why](std::string& s) -> std::string {
            const char* b = s.c_str();
            char* end = nullptr;
            const double v = std::strtod(b, &end);
            if (end == b || *end != '\0') return ""; // not a number: the option's type says so
            if (v >= lo && v <= hi) return "";
            return "must be in " + range + (why.empty() ? "" : " (" + why + ")") + ", got " + s;
        },
        range);
}

CLI::Option* add_mode_list_option(CLI::App& app, const std::string& name, std::vector<std::string>& lists,
                                  const std::string& help) {
    return app.add_option(name, lists, help)
        ->type_size(1)
        ->expected(1)
        ->allow_extra_args(false)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

int max_threads() {
    return 4 * int(std::max(1u, std::thread::hardware_concurrency()));
}

std::vector<std::string> read_prompts_file(const std::string& path, int max_n) {
    if (std::filesystem::is_directory(path))
        throw UsageError("the prompts file '" + path + "' is a folder, not a file");
    std::ifstream f(path);
    if (!f) throw Error("cannot read the prompts file '" + path + "'");
    std::vector<std::string> out;
    std::string line;
    while (int(out.size()) < max_n && std::getline(f, line)) {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (!line.empty() && line[0] != '#') out.push_back(line);
    }
    if (out.empty()) throw Error("the prompts file '" + path + "' has no prompts");
    return out;
}

std::vector<int64_t> parse_int_list(const std::string& s, const std::string& option) {
    std::vector<int64_t> out;
    size_t b = 0;
    while (b <= s.size()) {
        const size_t e = std::min(s.find(',', b), s.size());
        const std::string item = s.substr(b, e - b);
        if (item.empty() || item.size() > 18 || item.find_first_not_of("0123456789") != std::string::npos)
            throw UsageError(option + ": expected comma-separated counts, got '" + s + "'");
        out.push_back(std::stoll(item));
        b = e + 1;
    }
    return out;
}

void add_batch_options(CLI::App* sub, BatchArgs& a, const std::string& what) {
    sub->add_option("--prompts-file", a.prompts_file,
                    "One prompt per line ('#' comments): one " + what +
                        " each, prompt k with seed + k; under mpirun the prompts are shared out by rank");
    sub->add_option("-o,--output", a.output,
                    "With --prompts-file: a folder DIR/ (DIR/00000.txt, ... and DIR/manifest.json) or a file name "
                    "(out.txt, out_1.txt, ...); every output gets a <file>.json record")
        ->capture_default_str();
    sub->add_flag("--skip-existing", a.skip_existing,
                  "With --prompts-file: do not run again the prompts whose output and record exist (a failed job "
                  "resumes)");
}

batch::ItemJob make_item_job(const BatchArgs& a, bool overwrite, const nlohmann::json& facts) {
    batch::ItemJob job;
    job.items = read_prompts_file(a.prompts_file);
    job.output = a.output;
    job.skip_existing = a.skip_existing;
    job.overwrite = overwrite;
    job.facts = facts;
    job.shard = batch::shard_from_env();
    if (job.shard.size > 1) std::fprintf(stderr, "MPI rank %d of %d\n", job.shard.rank, job.shard.size);
    return job;
}

void print_item_job_result(const batch::ItemJobResult& r) {
    std::fprintf(stderr, "%d prompts generated, %d done before%s\n", r.ran, r.skipped,
                 r.manifest.empty() ? "" : ("; manifest " + r.manifest).c_str());
}

torch::ScalarType parse_dtype(const std::string& s, const torch::Device& device) {
    if (s == "auto") return device.is_cuda() ? torch::kHalf : torch::kFloat;
    if (s == "f32") return torch::kFloat;
    // On the CPU LibTorch has no float16 convolutions or matrix products: say so instead of failing mid-run.
    if (s == "f16" && device.is_cuda()) return torch::kHalf;
    if (s == "f16")
        throw UsageError("--dtype f16 is not available on the CPU (LibTorch has no float16 CPU convolutions or matrix "
                         "products); use f32 or bf16 (f16 checkpoints are converted at load)");
    if (s == "bf16") return torch::kBFloat16;
    throw UsageError("--dtype must be auto, f32, f16 or bf16, got '" + s + "'");
}

CLI::Option* add_device_option(CLI::App& app, std::string& device, const std::string& what) {
    auto* o = app.add_option("--device", device,
                             "where " + what +
                                 " runs: cpu, cuda, cuda:N or auto (CUDA when there is a device, else the CPU); cuda "
                                 "and auto take the GPU of the MPI local rank under mpirun")
                  ->capture_default_str();
    bind_field("device", o->get_name());
    return o;
}

std::string default_sd_model() {
    for (const char* rel : {"models/fashion-sd", "models/sd15-tiny-random"}) {
        const std::string p = find_asset_or_empty(std::string(rel) + "/unet/config.json");
        if (!p.empty()) return std::filesystem::path(p).parent_path().parent_path().string();
    }
    return std::filesystem::path(find_asset("models/sd15-tiny-random/unet/config.json", "embedded SD model"))
        .parent_path()
        .parent_path()
        .string();
}

std::string embedded_text_model(const std::string& name, const std::string& what) {
    return std::filesystem::path(find_asset("models/" + name + "/config.json", what)).parent_path().string();
}
} // namespace cli

} // namespace anchor
