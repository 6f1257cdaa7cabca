// Where the SD cache modes keep what they cache: the shared store cache::LatentCache (cache/latent_cache.h), the
// same store the text-diffusion cache uses, under (namespace = this run / image b of the batch, layer = the DeepCache
// branch, slot, anchor = the full step that made a spectrum, 0 for the feature and slope of the latest one), each
// entry stamped with the step that wrote it. A reuse reads its entries with the mode's staleness bound, so a schedule
// can never reuse a feature older than the mode allows: a missing or stale entry makes the step full.
#pragma once

#include "cache/latent_cache.h"

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>

namespace anchor::unet {

// The rows of image b in a batch of `rows` rows holding `images` images ([uncond rows; cond rows]): b, images + b, ...
torch::Tensor batch_image_rows(int64_t b, int64_t rows, int64_t images, const torch::Device& device);

// The tensors of a batch in the store, one entry per image: image b owns rows b, n + b, ... of a batch of n images
// (with guidance the UNet batch is [uncond rows; cond rows]). One image: the whole tensor, no copy.
class BatchFeatureStore {
public:
    BatchFeatureStore();                                                          // a store of its own
    BatchFeatureStore(std::shared_ptr<cache::LatentCache> store, std::string ns); // a shared one (e.g. a server's)
    // Drops this run's entries; the next run has `images` images.
    void begin(int images);
    void put(int32_t layer, int32_t slot, int64_t anchor, const torch::Tensor& batch, int64_t step);
    // The batch tensor when every image's entry is present and at most `max_staleness` steps old, else nullopt.
    std::optional<torch::Tensor> get(int32_t layer, int32_t slot, int64_t anchor, int64_t step, int max_staleness);
    void erase(int32_t layer, int32_t slot, int64_t anchor);
    // Image b's entries alone, as a store of one image (the same entries the batch view reads and writes).
    BatchFeatureStore image(int b) const;
    const cache::LatentCache& store() const { return *store_; }
    const std::string& ns() const { return ns_; }

private:
    cache::CacheKey key(int b, int32_t layer, int32_t slot, int64_t anchor) const;
    std::shared_ptr<cache::LatentCache> store_;
    std::string ns_;
    int images_ = 1;
    int first_ = 0; // the batch image of this view's image 0
};

// Slots of the feature caches' store entries.
// kAttnResidual entries are keyed by the attention layer (attn=reuse), not the branch.
enum FeatureSlot : int32_t { kFeature = 0, kSpectrum = 1, kSlope = 2, kCurvature = 3, kStem = 4, kAttnResidual = 5 };

} // namespace anchor::unet
