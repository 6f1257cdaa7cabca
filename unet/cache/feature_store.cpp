// The SD cache modes' view of the shared latent store (see feature_store.h).
#include "unet/cache/feature_store.h"

#include "cache/io/error.h"

#include <atomic>

namespace anchor::unet {

using torch::Tensor;

Tensor batch_image_rows(int64_t b, int64_t rows, int64_t images, const torch::Device& device) {
    return torch::arange(b, rows, images, torch::TensorOptions().dtype(torch::kLong).device(device));
}

namespace {
std::string fresh_namespace() {
    static std::atomic<uint64_t> next{0};
    return "sd/run" + std::to_string(next++);
}
} // namespace

BatchFeatureStore::BatchFeatureStore() : store_(std::make_shared<cache::LatentCache>()), ns_(fresh_namespace()) {}

BatchFeatureStore::BatchFeatureStore(std::shared_ptr<cache::LatentCache> store, std::string ns)
    : store_(std::move(store)), ns_(std::move(ns)) {
    if (!store_) throw Error("BatchFeatureStore: no store");
}

cache::CacheKey BatchFeatureStore::key(int b, int32_t layer, int32_t slot, int64_t anchor) const {
    return {ns_ + "/" + std::to_string(first_ + b), layer, slot, anchor};
}

void BatchFeatureStore::begin(int images) {
    for (int b = 0; b < images_; ++b) store_->erase_namespace(ns_ + "/" + std::to_string(first_ + b));
    images_ = std::max(images, 1);
}

BatchFeatureStore BatchFeatureStore::image(int b) const {
    if (b < 0 || b >= images_)
        throw Error("feature store: image " + std::to_string(b) + " of a batch of " + std::to_string(images_));
    BatchFeatureStore v(*this);
    v.images_ = 1;
    v.first_ = first_ + b;
    return v;
}

void BatchFeatureStore::put(int32_t layer, int32_t slot, int64_t anchor, const Tensor& batch, int64_t step) {
    const int64_t n = images_, rows = batch.size(0);
    if (n == 1 || rows % n != 0) {
        if (rows % n != 0)
            throw Error("feature store: " + std::to_string(rows) + " rows for " + std::to_string(n) + " images");
        store_->put(key(0, layer, slot, anchor), batch, step);
        return;
    }
    for (int64_t b = 0; b < n; ++b) {
        store_->put(key(int(b), layer, slot, anchor), batch.index_select(0, batch_image_rows(b, rows, n, batch.device())),
                    step);
    }
}

std::optional<Tensor> BatchFeatureStore::get(int32_t layer, int32_t slot, int64_t anchor, int64_t step,
                                             int max_staleness) {
    std::vector<Tensor> parts;
    for (int b = 0; b < images_; ++b) {
        auto t = store_->get(key(b, layer, slot, anchor), step, max_staleness);
        if (!t) return std::nullopt;
        parts.push_back(*t);
    }
    if (parts.size() == 1) return parts[0];
    // Back to the batch order: row r of image b was row r * n + b.
    return torch::stack(parts, 1).flatten(0, 1);
}

void BatchFeatureStore::erase(int32_t layer, int32_t slot, int64_t anchor) {
    for (int b = 0; b < images_; ++b) store_->erase(key(b, layer, slot, anchor));
}

} // namespace anchor::unet
