// Fashion-MNIST (Xiao, Rasul, Vollgraf 2017) as Debian's dataset-fashion-mnist ships it: IDX files, gzipped, in
// /usr/share/datasets/fashion-mnist. 60,000 training and 10,000 test images, 28x28 grey, 10 classes.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace anchor::unet::train {

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct FashionMnist {
    torch::Tensor images; // [N, 28, 28] uint8
    torch::Tensor labels; // [N] int64 in [0, 10)
};

// `split`: "train" or "t10k". Throws anchor::Error naming the file for a missing file or a malformed IDX header
// (magic, dimensions, length).
FashionMnist load_fashion_mnist(const std::string& dir, const std::string& split);

// Parses IDX bytes (big-endian header: 0x0000 08 <ndim>, then ndim uint32 sizes, then uint8 data) into a uint8 tensor.
torch::Tensor parse_idx_u8(const std::string& bytes, const std::string& label);

// Class names as the prompts use them, in label order (0 = t-shirt/top ... 9 = ankle boot).
const std::vector<std::string>& fashion_class_names();
// The prompt templates of training ("a photo of a {}", ...); prompt(c, k) fills template k with class c.
const std::vector<std::string>& fashion_prompt_templates();
std::string fashion_prompt(int cls, int template_index = 0);
// Class from a prompt made by fashion_prompt (any template): -1 if none matches.
int fashion_class_of_prompt(const std::string& prompt);

// [B, 28, 28] uint8 -> [B, 3, 32, 32] float in [-1, 1]: zero padding of 2 (background), grey copied to RGB, so the
// SD pipeline's 3-channel VAE and PNG output apply unchanged.
torch::Tensor fashion_to_model_input(const torch::Tensor& u8);
// [B, 3, 32, 32] images in [-1, 1] (or [0, 1] with from_unit = true) -> [B, 1, 32, 32] grey in [-1, 1] (classifier input).
torch::Tensor rgb_to_classifier_input(const torch::Tensor& img, bool from_unit);

} // namespace anchor::unet::train
