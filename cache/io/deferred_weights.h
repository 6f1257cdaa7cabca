// Layers whose weights a loader is about to fill: allocated, not initialised.
//
// Why: LibTorch's Linear and Conv2d write kaiming-uniform random values into every weight when they are built. For a
// model that is loaded next, that is pure cost: SD 1.5's 1.07 G parameters take ~16 s on two cores to initialise, and
// the writes make the whole float32 model resident (4.2 GB) before a byte of the checkpoint is read. Memory that
// torch::empty returns and nobody writes stays unmapped, so a layer built here costs nothing until load_into copies
// the checkpoint's values in; with a reduced-precision storage dtype (--weights-dtype bf16) the float32 copy is never
// made at all.
//
// Safe because WeightMap::load_into refuses a module with any parameter the map lacks: a layer built here is either
// filled from the file or the whole model is discarded with the error.
#pragma once

#include <torch/torch.h>

namespace anchor {

// While one is alive on this thread, make_linear/make_conv2d build deferred layers whose Linear/Conv2d weights are
// stored as `weight_dtype` (biases stay float32, as store_weights_as leaves them). Scopes nest; the innermost wins.
class DeferredWeights {
public:
    explicit DeferredWeights(torch::ScalarType weight_dtype = torch::kFloat);
    ~DeferredWeights();
    DeferredWeights(const DeferredWeights&) = delete;
    DeferredWeights& operator=(const DeferredWeights&) = delete;

private:
    bool prev_active_;
    torch::ScalarType prev_dtype_;
};

// torch::nn::Linear(opts) / Conv2d(opts); under a DeferredWeights scope, with uninitialised weights of the scope's
// dtype (and uninitialised float32 biases).
torch::nn::Linear make_linear(const torch::nn::LinearOptions& opts);
torch::nn::Conv2d make_conv2d(const torch::nn::Conv2dOptions& opts);

} // namespace anchor
