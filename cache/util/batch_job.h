// Batch jobs over a list of items (prompts), shared by anchor-sd and anchor-text: sharding over the processes of an
// MPI job, outputs numbered by the item's global index, a sidecar record per output, resuming a failed job from the
// outputs that exist, and the manifest rank 0 writes of every output. No MPI library is linked: mpirun's environment
// says which rank a process is, and the shards meet only in the file system (every output and sidecar is written
// atomically, so one that exists is whole).
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace anchor::batch {

// This process's place in an MPI job, from the environment mpirun gives it (Open MPI's OMPI_COMM_WORLD_*, MPICH's
// PMI_* / MPI_LOCALRANKID): rank 0 of 1 outside mpirun.
struct Shard {
    int rank = 0, size = 1;
    int local_rank = 0; // rank among the processes of this machine (the GPU it takes)
    // Item i belongs to rank i mod size: the same items every run, so a rerun resumes the same shard.
    bool owns(int64_t item) const { return item % size == rank; }
    void validate() const; // ParamError("shard") unless 0 <= rank < size and local_rank >= 0
};
// anchor::Error naming the variable when one is set but not a number, or the ranks do not fit.
Shard shard_from_env();

// Where a process of an MPI job runs its model (`--device`).
enum class DeviceChoice {
    Auto, // CUDA when there is a device (the one of local rank mod the device count), else the CPU
    Cpu,
    Cuda, // CUDA: index as given, or without one the device of local rank mod the device count
};
struct DeviceSpec {
    DeviceChoice choice = DeviceChoice::Cpu;
    int index = -1; // cuda:N
    // "auto", "cpu", "cuda", "cuda:N"; ParamError(field) otherwise.
    static DeviceSpec parse(const std::string& s, const std::string& field = "device");
    std::string str() const;
};
// The device a process with `local_rank` takes when the machine has `cuda_devices` CUDA devices (a parameter, so that
// the choice is testable without a GPU). ParamError("device") for CUDA without a device or an index past the count.
torch::Device select_device(const DeviceSpec& spec, int local_rank, int cuda_devices);
// The same with this LibTorch's CUDA device count (0 in a CPU build).
torch::Device select_device(const DeviceSpec& spec, int local_rank);

// The output of item k: a folder `base` (ending in '/') gets DIR/00000<ext>, DIR/00001<ext>, ...; a file `base` is
// itself for k = 0 and <stem>_k<ext of base> after.
std::string numbered_output(const std::string& base, int64_t k, const std::string& ext);
// The sidecar of an output: <output>.json.
inline std::string sidecar_of(const std::string& output) {
    return output + ".json";
}
// Where the manifest goes: DIR/manifest.json for a folder output, else <stem>_manifest.json.
std::string manifest_path(const std::string& base);
// The sidecar records of `outputs` in order, waiting up to `wait_s` seconds for those other shards are still
// writing; anchor::Error naming the first missing sidecar after that.
nlohmann::json read_records(const std::vector<std::string>& outputs, double wait_s);
// Whether output and sidecar both exist (a resumed job skips the item).
bool output_done(const std::string& output);

// A job of one output file per item (anchor-text's --prompts-file): item k's text goes to numbered_output(output, k,
// ext) and its record to the sidecar.
struct ItemJob {
    std::vector<std::string> items;
    std::string output = "out/"; // folder "DIR/" or a file name
    std::string ext = ".txt";    // of the outputs in a folder
    Shard shard;
    bool skip_existing = false; // items whose output and sidecar exist are not run again (their records read back)
    bool overwrite = false;
    nlohmann::json facts = nlohmann::json::object(); // copied into every record (program, model, ...)
    void validate() const;                           // ParamError naming the field
};
struct ItemOutput {
    std::string content;   // the output file's bytes
    nlohmann::json record; // its sidecar (the runner adds index, item, output, facts)
};
struct ItemJobResult {
    std::vector<nlohmann::json> records; // of this shard's items, in order (the skipped ones read back)
    int ran = 0, skipped = 0;
    std::string manifest; // written by rank 0 ("" on other ranks)
};
// Checks every output of this shard first (none replaced without overwrite), runs `run(k, item)` for each owned item
// in order writing output and sidecar atomically (`done` after each), then on rank 0 of a sharded job or of a folder
// output waits up to `manifest_wait_s` for the other shards' sidecars and writes the manifest {items: [records...],
// count, shards}.
ItemJobResult run_item_job(const ItemJob& job, const std::function<ItemOutput(int64_t k, const std::string& item)>& run,
                           const std::function<void(const nlohmann::json& record)>& done = {},
                           double manifest_wait_s = 3600);

} // namespace anchor::batch
