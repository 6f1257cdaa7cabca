#include "text/token_file.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/read_file.h"
#include "text/diffusion/mdlm_model.h"

#include <fstream>
#include <iterator>

namespace anchor::text {

std::vector<int64_t> load_token_file(const std::string& path) {
    const std::string bytes = read_file(path, "token file");
    if (bytes.size() % 2 != 0) throw Error("token file '" + path + "' has an odd size (expected uint16 LE ids)");
    std::vector<int64_t> ids(bytes.size() / 2);
    for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] =
            static_cast<uint8_t>(bytes[2 * i]) | (static_cast<int64_t>(static_cast<uint8_t>(bytes[2 * i + 1])) << 8);
        if (ids[i] >= kGpt2VocabSize)
            throw Error("token file '" + path + "': id " + std::to_string(ids[i]) + " at index " + std::to_string(i) +
                        " is not a GPT-2 id");
    }
    if (ids.empty()) throw Error("token file '" + path + "' is empty");
    return ids;
}

std::vector<std::vector<int64_t>> token_file_windows(const std::string& path, int64_t n, int64_t len,
                                                     const std::function<bool(const std::vector<int64_t>&)>& accept) {
    const auto toks = load_token_file(path);
    const int64_t size = static_cast<int64_t>(toks.size());
    if (len < 1 || size < len)
        throw Error("token file '" + path + "' has " + std::to_string(size) + " ids, fewer than the prompt length " +
                    std::to_string(len));
    std::vector<std::vector<int64_t>> out;
    int64_t next_free = 0; // accepted windows never share a start offset
    for (int64_t i = 0; i < n; ++i) {
        int64_t off = std::max(next_free, (size - len) * i / std::max<int64_t>(1, n));
        for (; off <= size - len; ++off) {
            std::vector<int64_t> w(toks.begin() + off, toks.begin() + off + len);
            if (!accept || accept(w)) {
                out.push_back(std::move(w));
                break;
            }
        }
        if (off > size - len)
            throw Error("token file '" + path + "': only " + std::to_string(out.size()) + " of " + std::to_string(n) +
                        " windows of " + std::to_string(len) + " ids use only tokens this model knows");
        next_free = off + 1;
    }
    return out;
}

void write_token_file(const std::string& path, const std::vector<int64_t>& ids) {
    std::string bytes(ids.size() * 2, '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] > 0xFFFF)
            throw Error("token file '" + path + "': id " + std::to_string(ids[i]) + " does not fit in uint16");
        bytes[2 * i] = static_cast<char>(ids[i] & 0xFF);
        bytes[2 * i + 1] = static_cast<char>((ids[i] >> 8) & 0xFF);
    }
    write_file_atomic(path, bytes);
}

} // namespace anchor::text
