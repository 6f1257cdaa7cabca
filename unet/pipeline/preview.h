// Live previews of a running job: every N denoising steps the current latents of the batch's first image become a
// small PNG, decoded by the model's TAESD (SDModels::taesd) when it has one, else by a linear latent -> RGB
// projection (a 4x3 matrix per model family, no network at all). A library hook on the pipeline's progress
// callback (ProgressInfo::latents): the CLI writes the PNG to a file (--preview N), the server keeps the job's latest
// one for /sdapi/v1/progress's current_image.
#pragma once

#include "unet/model/checkpoint.h"
#include "unet/pipeline/pipeline.h"

#include <torch/torch.h>

#include <functional>
#include <string>

namespace anchor::unet {

enum class PreviewMethod { Taesd, LatentProjection };
const EnumTable<PreviewMethod>& preview_method_table(); // "taesd", "latent-projection"

// The latent -> RGB projection of UNet latents [B, 4, h, w]: image in [0, 1], [B, 3, h, w] at the latent size.
torch::Tensor latent_rgb_projection(const torch::Tensor& latents, SdFamily family);

// What previews of `m` use: TAESD when m.taesd has a decoder, else the projection.
PreviewMethod preview_method(const SDModels& m);
// Image 0 of `latents` as a preview, RGB uint8 [H, W, 3]: TAESD's decode at the full size, or the projection at the
// latent size.
torch::Tensor preview_image(SDModels& m, const torch::Tensor& latents);

// A progress hook: call it with every ProgressInfo; at steps every, 2 * every, ... (and the last step) it encodes the
// preview and hands the PNG bytes to `sink` (step: the steps done, total: the run's steps). every <= 0: never.
class PreviewHook {
public:
    using Sink = std::function<void(const std::string& png, int step, int total)>;
    PreviewHook(SDModels& m, int every, Sink sink);
    void operator()(const ProgressInfo& p);
    PreviewMethod method() const { return preview_method(m_); }
    int previews() const { return count_; } // PNGs handed to the sink so far

private:
    SDModels& m_;
    int every_;
    Sink sink_;
    int count_ = 0;
};

// Where the CLI's --preview writes: <output stem>_preview.png beside the output (DIR/preview.png for a folder).
std::string preview_path(const std::string& output);

} // namespace anchor::unet
