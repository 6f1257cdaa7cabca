// golden_runner: discovers reference cases in a directory tree by the files a case folder holds (config.json and its
// `_class_name`/`architectures`, golden_*.safetensors, the JSON case files) -- never by folder names -- checks each
// and prints one line per case: `case-name  max_abs_err  max_rel_err  PASS|FAIL`, then `N passed, N failed`.
//
// Every part of the engine registers its checkers here (one file per area: check_io.cpp, check_sd.cpp,
// check_text.cpp, ...). A folder that looks like a case but that no checker claims is reported as FAIL.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace anchor::unet {
struct SDModels;
}

namespace anchor::golden {

// The golden READMEs' tolerance of a single forward pass and of a teacher-forced step: |a - g| <= atol + rtol |g|.
constexpr double kAtol = 1e-4, kRtol = 1e-4;

namespace fs = std::filesystem;

// Running error statistics of one case; `check` compares elementwise |a - g| <= atol + rtol * |g|.
struct Stats {
    double max_abs = 0.0; // max |actual - golden|
    double max_rel = 0.0; // max |actual - golden| / max(|golden|, tiny)
    bool pass = true;
    std::vector<std::string> failures; // "tensor-name: max_abs=..., tol ..." for the report

    // Compares `actual` to `golden` (shapes must match; dtype converted to float64 for the comparison).
    void check(const std::string& what, const torch::Tensor& actual, const torch::Tensor& golden, double atol,
               double rtol);
    // Integer/ids comparison: must be equal.
    void check_equal(const std::string& what, const torch::Tensor& actual, const torch::Tensor& golden);
    void check_true(const std::string& what, bool ok, const std::string& detail = "");
    void fail(const std::string& why);
    void merge(const Stats& other);
};

struct CaseResult {
    std::string name; // printed first; unique within a run (relative folder + sub-case)
    Stats stats;
};

struct Context {
    fs::path root; // the directory given on the command line
    bool verbose = false;
};

// A checker claims folders by their contents and produces one or more results for each claimed folder.
struct Checker {
    std::string kind; // e.g. "unet-forward"
    // True when `dir` is a case this checker understands (decide from the files, e.g. config.json `_class_name`).
    std::function<bool(const fs::path& dir)> claims;
    std::function<std::vector<CaseResult>(const fs::path& dir, const Context& ctx)> run;
};

// Called from static initialisers in the check_*.cpp files: `static bool reg = register_checker({...});`
bool register_checker(Checker c);
const std::vector<Checker>& checkers();

// Helpers for checkers.
std::string read_text(const fs::path& p);
std::string relative_name(const fs::path& dir, const Context& ctx);
// Runs `body` on a fresh result named `name`; an exception becomes the case's failure ("exception: ...").
CaseResult guarded(const std::string& name, const std::function<void(Stats&)>& body);
bool has_file(const fs::path& dir, const std::string& name);
// Parsed config.json (or an empty object); `_class_name` (diffusers) or `architectures[0]` (HF) or "".
std::string config_class(const fs::path& dir);

// Every SDXL comparison of an SDXL golden folder on `models` (check_sdxl.cpp; also run on the single-file layout).
std::vector<CaseResult> check_sdxl_models(unet::SDModels& models, const fs::path& golden_dir, const std::string& base);

} // namespace anchor::golden
