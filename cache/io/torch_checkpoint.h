// PyTorch checkpoints (torch.save >= 1.6: .ckpt / .pt / .pth / .bin) read without Python and without running code.
//
// torch.save writes a ZIP archive (cache/io/zip_file.h) of `<archive>/data.pkl` (the pickled object, protocol 2),
// `<archive>/data/<key>` (one record per storage, raw little-endian elements), `<archive>/version` and, from torch
// 2.x, `<archive>/byteorder`. data.pkl is read by the restricted unpickler (cache/io/pickle.h: no code ever runs;
// its header states which globals are understood, refused or read as placeholders). Storages are memory-mapped
// (copy-on-write); a tensor that is a whole contiguous storage used once is a view of the mapping, any other view
// (transposed, offset, sharing a storage) is copied to its own contiguous tensor.
//
// The state dict is the top-level dict, or its "state_dict" entry when that is a dict (Lightning / original SD
// checkpoints); its tensor entries are the checkpoint's tensors, everything else (epoch, global_step, callbacks,
// optimizer states, ...) is ignored (when no tensor is at the top, the tensors of its nested dicts are read as
// "outer.inner"), except an entry torch rebuilds some other way (a placeholder of a torch.* global:
// quantized, sparse, ...), which is an error naming it rather than a tensor gone missing. The pre-1.6 format (a bare
// pickle led by a magic number, or a tar file) is refused with advice.
#pragma once

#include "cache/io/mapped_file.h"

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace anchor {

enum class WeightFileKind { SafeTensors, TorchZip, TorchLegacy, Other };
// From the first bytes of the file (not its extension); Other when it cannot be read.
WeightFileKind sniff_weight_file(const std::string& path);
// .ckpt, .pt, .pth, .bin: names under which torch.save files are found.
bool has_torch_extension(const std::string& path);

class TorchCheckpoint {
public:
    // Maps the file, parses the archive and data.pkl, and checks every tensor of the state dict against its storage
    // record. Throws anchor::Error naming the file and the problem.
    static std::shared_ptr<TorchCheckpoint> open(const std::string& path);
    // The same from bytes (tests, fuzzing); the bytes are copied.
    static std::shared_ptr<TorchCheckpoint> from_bytes(const std::string& bytes, const std::string& label);
    ~TorchCheckpoint();

    const std::string& path() const { return path_; }
    // Tensor names of the state dict in file order.
    const std::vector<std::string>& names() const { return names_; }
    bool has(const std::string& name) const;
    // The tensor (dtype of the file, on the CPU); the storage's CRC-32 is checked the first time it is read.
    torch::Tensor tensor(const std::string& name) const;

private:
    struct Impl;
    TorchCheckpoint();
    void parse();
    std::string path_;
    MappedFile mapped_; // empty for from_bytes
    std::string owned_;
    const char* base_ = nullptr;
    size_t size_ = 0;
    std::unique_ptr<Impl> impl_;
    std::vector<std::string> names_;
    std::weak_ptr<TorchCheckpoint> self_;
};

} // namespace anchor
