#include "unet/train/fashion_mnist.h"

#include "cache/io/error.h"
#include "cache/io/gzip_file.h"

#include <filesystem>

namespace anchor::unet::train {

namespace fs = std::filesystem;

namespace {

uint32_t be32(const std::string& b, size_t off) {
    return uint32_t(uint8_t(b[off])) << 24 | uint32_t(uint8_t(b[off + 1])) << 16 | uint32_t(uint8_t(b[off + 2])) << 8 |
           uint32_t(uint8_t(b[off + 3]));
}

std::string idx_path(const std::string& dir, const std::string& name) {
    for (const auto& cand : {name + ".gz", name}) {
        const auto p = fs::path(dir) / cand;
        if (fs::exists(p)) return p.string();
    }
    throw Error("Fashion-MNIST file '" + (fs::path(dir) / (name + ".gz")).string() +
                "' not found (install the Debian package dataset-fashion-mnist, or pass the folder holding the IDX "
                "files)");
}

} // namespace

torch::Tensor parse_idx_u8(const std::string& b, const std::string& label) {
    if (b.size() < 4 || b[0] != 0 || b[1] != 0 || uint8_t(b[2]) != 0x08)
        throw Error("'" + label + "' is not an unsigned-byte IDX file (magic 00 00 08 xx expected)");
    const int ndim = uint8_t(b[3]);
    if (ndim < 1 || ndim > 4) throw Error("'" + label + "': IDX rank " + std::to_string(ndim) + " not in 1..4");
    if (b.size() < 4 + 4 * size_t(ndim)) throw Error("'" + label + "': IDX header truncated");
    std::vector<int64_t> dims;
    uint64_t n = 1;
    for (int i = 0; i < ndim; ++i) {
        dims.push_back(int64_t(be32(b, 4 + 4 * size_t(i))));
        n *= uint64_t(dims.back());
    }
    const size_t off = 4 + 4 * size_t(ndim);
    if (b.size() - off != n)
        throw Error("'" + label + "': IDX header says " + shape_str(dims) + " (" + std::to_string(n) + " bytes) but " +
                    std::to_string(b.size() - off) + " data bytes follow");
    auto t = torch::empty(dims, torch::kUInt8);
    std::memcpy(t.data_ptr<uint8_t>(), b.data() + off, n);
    return t;
}

FashionMnist load_fashion_mnist(const std::string& dir, const std::string& split) {
    if (split != "train" && split != "t10k") throw Error("Fashion-MNIST split must be train or t10k, got '" + split + "'");
    const auto ip = idx_path(dir, split + "-images-idx3-ubyte"), lp = idx_path(dir, split + "-labels-idx1-ubyte");
    FashionMnist d;
    d.images = parse_idx_u8(read_gzip_or_plain(ip, "Fashion-MNIST images"), ip);
    d.labels = parse_idx_u8(read_gzip_or_plain(lp, "Fashion-MNIST labels"), lp).to(torch::kInt64);
    if (d.images.dim() != 3 || d.images.size(1) != 28 || d.images.size(2) != 28)
        throw Error("'" + ip + "': expected [N, 28, 28] images, got " + shape_str(d.images.sizes().vec()));
    if (d.labels.dim() != 1 || d.labels.size(0) != d.images.size(0))
        throw Error("'" + lp + "': expected " + std::to_string(d.images.size(0)) + " labels, got " +
                    shape_str(d.labels.sizes().vec()));
    if (d.labels.max().item<int64_t>() > 9) throw Error("'" + lp + "': label above 9");
    return d;
}

const std::vector<std::string>& fashion_class_names() {
    static const std::vector<std::string> names{"t-shirt", "pair of trousers", "pullover", "dress",    "coat",
                                                "sandal",  "shirt",            "sneaker",  "handbag", "ankle boot"};
    return names;
}

const std::vector<std::string>& fashion_prompt_templates() {
    static const std::vector<std::string> t{"a photo of a {}", "a {}", "a picture of a {}", "a black and white photo of a {}"};
    return t;
}

std::string fashion_prompt(int cls, int template_index) {
    const auto& names = fashion_class_names();
    const auto& t = fashion_prompt_templates();
    if (cls < 0 || cls >= int(names.size())) throw Error("Fashion-MNIST class " + std::to_string(cls) + " not in 0..9");
    std::string s = t[size_t(template_index) % t.size()];
    s.replace(s.find("{}"), 2, names[size_t(cls)]);
    return s;
}

int fashion_class_of_prompt(const std::string& prompt) {
    const auto& names = fashion_class_names();
    int best = -1;
    size_t best_len = 0;
    for (size_t c = 0; c < names.size(); ++c) // longest name wins: "shirt" is inside "t-shirt"
        if (prompt.find(names[c]) != std::string::npos && names[c].size() > best_len) best = int(c), best_len = names[c].size();
    return best;
}

torch::Tensor fashion_to_model_input(const torch::Tensor& u8) {
    auto x = u8.to(torch::kFloat).div(127.5).sub(1.0).unsqueeze(1); // [B,1,28,28] in [-1,1]
    x = torch::constant_pad_nd(x, {2, 2, 2, 2}, -1.0);             // background is black (-1)
    return x.expand({-1, 3, -1, -1}).contiguous();
}

torch::Tensor rgb_to_classifier_input(const torch::Tensor& img, bool from_unit) {
    auto g = img.to(torch::kFloat).mean(1, true);
    return from_unit ? g.mul(2.0).sub(1.0) : g;
}

} // namespace anchor::unet::train
