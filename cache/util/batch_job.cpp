#include "cache/util/batch_job.h"

#include "cache/io/atomic_file.h"
#include "cache/io/enum_table.h"
#include "cache/io/error.h"

#include <torch/version.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace anchor::batch {

namespace fs = std::filesystem;

void Shard::validate() const {
    if (size < 1 || rank < 0 || rank >= size || local_rank < 0)
        throw ParamError("shard", "rank " + std::to_string(rank) + " of " + std::to_string(size) + " (local rank " +
                                      std::to_string(local_rank) + "; needs 0 <= rank < size)");
}

Shard shard_from_env() {
    auto get = [](std::initializer_list<const char*> names, int dflt) {
        for (const char* n : names)
            if (const char* v = std::getenv(n); v && *v) {
                char* end = nullptr;
                const long x = std::strtol(v, &end, 10);
                if (*end != '\0' || x < 0 || x > (1 << 24))
                    throw Error(std::string("environment variable ") + n + " is not a rank count: '" + v + "'");
                return int(x);
            }
        return dflt;
    };
    Shard s;
    s.rank = get({"OMPI_COMM_WORLD_RANK", "PMI_RANK"}, 0);
    s.size = get({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1);
    s.local_rank = get({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}, 0);
    try {
        s.validate();
    } catch (const ParamError& e) {
        throw Error("MPI environment: " + e.detail());
    }
    return s;
}

namespace {
const EnumTable<DeviceChoice>& device_choice_table() {
    static const EnumTable<DeviceChoice> t = {
        {"auto", DeviceChoice::Auto}, {"cpu", DeviceChoice::Cpu}, {"cuda", DeviceChoice::Cuda}};
    return t;
}
} // namespace

DeviceSpec DeviceSpec::parse(const std::string& s, const std::string& field) {
    DeviceSpec d;
    const auto colon = s.find(':');
    const std::string head = s.substr(0, colon);
    auto bad = [&] { return ParamError(field, "expected auto, cpu, cuda or cuda:N, got '" + s + "'"); };
    for (const auto& [name, v] : device_choice_table())
        if (name == head) d.choice = v;
    if (enum_name(device_choice_table(), d.choice) != head) throw bad();
    if (colon != std::string::npos) {
        const std::string n = s.substr(colon + 1);
        if (d.choice != DeviceChoice::Cuda || n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != n.npos)
            throw bad();
        d.index = std::stoi(n);
    }
    return d;
}

std::string DeviceSpec::str() const {
    return enum_name(device_choice_table(), choice) + (index >= 0 ? ":" + std::to_string(index) : "");
}

torch::Device select_device(const DeviceSpec& spec, int local_rank, int cuda_devices) {
    if (spec.choice == DeviceChoice::Cpu || (spec.choice == DeviceChoice::Auto && cuda_devices < 1)) return torch::kCPU;
    if (cuda_devices < 1)
        throw ParamError("device", "'" + spec.str() + "': this LibTorch sees no CUDA device (use cpu or auto)");
    if (spec.index >= cuda_devices)
        throw ParamError("device", "'" + spec.str() + "': this machine has " + std::to_string(cuda_devices) +
                                       " CUDA device(s), 0.." + std::to_string(cuda_devices - 1));
    // One GPU per process of this machine when there are enough; more processes than GPUs share them round-robin.
    const int index = spec.index >= 0 ? spec.index : local_rank % cuda_devices;
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

torch::Device select_device(const DeviceSpec& spec, int local_rank) {
#if !defined(ANCHOR_WITH_CUDA)
    // A build without CUDA (Debian's LibTorch 1.13 is CPU-only) says which build has it, not only that no device
    // is seen.
    if (spec.choice == DeviceChoice::Cuda)
        throw ParamError("device", "'" + spec.str() + "': this build has no CUDA (LibTorch " TORCH_VERSION
                                   " without CUDA, or no nvcc at configure time); build with `cli/setup.sh --torch "
                                   "pip` (build-torch2/, LibTorch 2.x with CUDA) or use cpu");
#endif
    const int n = torch::cuda::is_available() ? int(torch::cuda::device_count()) : 0;
    return select_device(spec, local_rank, n);
}

std::string numbered_output(const std::string& base, int64_t k, const std::string& ext) {
    if (!base.empty() && base.back() == '/') {
        char name[32];
        std::snprintf(name, sizeof name, "%05lld", static_cast<long long>(k));
        return base + name + ext;
    }
    if (k == 0) return base;
    const fs::path p(base);
    return (p.parent_path() / (p.stem().string() + "_" + std::to_string(k) + p.extension().string())).string();
}

std::string manifest_path(const std::string& base) {
    if (!base.empty() && base.back() == '/') return base + "manifest.json";
    const fs::path p(base);
    return (p.parent_path() / (p.stem().string() + "_manifest.json")).string();
}

bool output_done(const std::string& output) {
    return fs::exists(output) && fs::exists(sidecar_of(output));
}

namespace {
nlohmann::json read_json_file(const std::string& path) {
    std::ifstream in(path);
    try {
        return nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
        throw Error("'" + path + "': not a JSON record (" + e.what() + ")");
    }
}
} // namespace

nlohmann::json read_records(const std::vector<std::string>& outputs, double wait_s) {
    const auto t0 = std::chrono::steady_clock::now();
    nlohmann::json records = nlohmann::json::array();
    for (size_t k = 0; k < outputs.size(); ++k) {
        const std::string side = sidecar_of(outputs[k]);
        while (!fs::exists(side)) {
            if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > wait_s)
                throw Error("manifest: '" + side + "' (output " + std::to_string(k) + " of " +
                            std::to_string(outputs.size()) + ") did not appear within " + std::to_string(int(wait_s)) +
                            " s; did a shard fail?");
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        records.push_back(read_json_file(side));
    }
    return records;
}

void ItemJob::validate() const {
    if (items.empty()) throw ParamError("items", "no item");
    if (output.empty()) throw ParamError("output", "no output file");
    shard.validate();
}

ItemJobResult run_item_job(const ItemJob& job, const std::function<ItemOutput(int64_t, const std::string&)>& run,
                           const std::function<void(const nlohmann::json&)>& done, double manifest_wait_s) {
    job.validate();
    const int64_t n = int64_t(job.items.size());
    std::vector<std::string> outputs;
    for (int64_t k = 0; k < n; ++k) outputs.push_back(numbered_output(job.output, k, job.ext));
    if (job.output.back() == '/') fs::create_directories(job.output);
    // Every output of this shard is checked before the first item runs: a job never stops half-way on a user's file.
    std::vector<char> earlier(size_t(n), 0); // output and sidecar written by an earlier run (skip_existing)
    for (int64_t k = 0; k < n; ++k) {
        if (!job.shard.owns(k)) continue;
        earlier[size_t(k)] = job.skip_existing && output_done(outputs[size_t(k)]);
        if (earlier[size_t(k)]) continue;
        check_output_path(outputs[size_t(k)], job.overwrite);
        check_output_path(sidecar_of(outputs[size_t(k)]), job.overwrite);
    }
    ItemJobResult out;
    for (int64_t k = 0; k < n; ++k) {
        if (!job.shard.owns(k)) continue;
        const std::string& file = outputs[size_t(k)];
        if (earlier[size_t(k)]) {
            out.records.push_back(read_json_file(sidecar_of(file)));
            ++out.skipped;
            continue;
        }
        ItemOutput o = run(k, job.items[size_t(k)]);
        nlohmann::json rec = std::move(o.record);
        if (!rec.is_object()) rec = nlohmann::json::object();
        rec["index"] = k;
        rec["item"] = job.items[size_t(k)];
        rec["output"] = file;
        for (const auto& [key, v] : job.facts.items()) rec[key] = v;
        write_file_atomic(file, o.content, job.overwrite);
        // The sidecar last: its existence says the output is whole (output_done, read_records).
        write_file_atomic(sidecar_of(file), rec.dump(2) + "\n", job.overwrite);
        ++out.ran;
        if (done) done(rec);
        out.records.push_back(std::move(rec));
    }
    if (job.shard.rank == 0 && (job.shard.size > 1 || job.output.back() == '/')) {
        out.manifest = manifest_path(job.output);
        const nlohmann::json m = {
            {"items", read_records(outputs, manifest_wait_s)}, {"count", n}, {"shards", job.shard.size}};
        write_file_atomic(out.manifest, m.dump(2) + "\n", true);
    }
    return out;
}

} // namespace anchor::batch
