// `anchor-sd bench --family sd3.5-medium|sd3.5-large`: the SD 3.5 transformer (MMDiT) at its real shapes with random
// weights built in memory (no file, no download): one classifier-free-guidance step timed against the analytic MAC
// count and the GEMM rate of this process, peak RSS; and, with image_steps, the memory of a whole image (the three
// text encoders, the transformer, the VAE decode) at those shapes.
#pragma once

#include "cache/io/enum_table.h"
#include "unet/model/clip_text.h"
#include "unet/model/mmdit.h"
#include "unet/model/t5_encoder.h"
#include "unet/model/vae.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>

namespace anchor::unet {

enum class Sd3Variant { Medium35, Large35 };
// "sd3.5-medium", "sd3.5-large"
const EnumTable<Sd3Variant>& sd3_variant_table();

// The published transformer configs (stabilityai/stable-diffusion-3.5-{medium,large}, transformer/config.json):
// Medium 24 joint blocks of 24 heads x 64 (1536 wide), MMDiT-X self-attention in blocks 0-12, QK RMSNorm, a 384^2
// position grid; Large 38 blocks of 38 heads x 64 (2432 wide), QK RMSNorm, a 192^2 grid. Both: patch 2, 16 latent
// channels, joint_attention_dim 4096, pooled 2048, sample_size 128.
SD3TransformerConfig sd3_transformer_config_of(Sd3Variant v);
// SD 3's text encoders and VAE (the same for every SD 3 / 3.5 model): CLIP ViT-L/14 (768, 12 layers, quick_gelu,
// projection 768), OpenCLIP ViT-bigG/14 (1280, 32 layers, gelu, projection 1280), T5 v1.1 XXL's encoder (4096 wide,
// 24 layers, 64 heads of 64, d_ff 10240, vocabulary 32128), the 16-channel VAE (128/256/512/512, no quant convs,
// scaling 1.5305, shift 0.0609).
ClipTextConfig sd3_clip_l_config();
ClipTextConfig sd3_clip_g_config();
T5EncoderConfig sd3_t5xxl_config();
VaeConfig sd3_vae_config();

// Multiply-accumulates of one transformer forward per sample, counted as unet_macs counts the UNet's: every Linear
// (and the patch embedding's convolution) as tokens x in x out; the attention matmuls (q k^T and p v over the joint
// image + text sequence, and MMDiT-X's image-only attention) apart.
struct MmditMacs {
    double linear = 0, conv = 0, attention = 0;
    double total() const { return linear + conv; }
};
MmditMacs mmdit_macs(const SD3TransformerConfig& c, int64_t latent_h, int64_t latent_w, int64_t text_tokens);

struct MmditBenchParams {
    Sd3Variant variant = Sd3Variant::Medium35;
    int width = 1024, height = 1024;
    int repeat = 3, warmup = 1, batch = 2;      // batch 2 = one classifier-free-guidance step
    int text_tokens = 77 + 256;                 // SD 3's CLIP window then T5's max_sequence_length
    torch::ScalarType dtype = torch::kBFloat16; // weights and compute (the transformer runs in one dtype)
    int gemm_n = 2048, gemm_repeat = 5;
    int64_t seed = 0;
    // > 0: the whole-image memory run instead of the step timing: CLIP-L, bigG and (with t5) T5-XXL encode one
    // prompt and its negative (random token ids), then this many flow-matching Euler CFG steps at the size, then the
    // VAE decode; every model stays resident throughout (as sd3_txt2img keeps them). Peak RSS does not depend on the
    // step count (each step allocates and frees the same buffers).
    int image_steps = 0;
    bool t5 = true;
    void validate() const; // ParamError naming the field
};

// Every parameter of `m` filled in place with N(0, stddev) (norm gains 1, biases 0), tensor by tensor, in the
// module's dtype (a float32 draw of one tensor at a time); deterministic for a seed set before.
void fill_random_weights(torch::nn::Module& m, double stddev = 0.02);

// Runs the benchmark; every report line goes to `emit` as it is known.
void run_mmdit_bench(const MmditBenchParams& p, const std::function<void(const std::string&)>& emit);

} // namespace anchor::unet
