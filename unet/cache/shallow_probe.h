// The shallow probe every SD cache mode runs at every step (unet/cache/freq_cache.h, rule 1): the low-band DCT energies
// of conv_in(x) and their relative change between consecutive steps.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace anchor::unet {

class UNet2DConditionModelImpl;

// The values a cache decision reads on the host at one step (each 0-d, on any device), in one transfer: on a GPU every
// read waits for the stream, so a step's decision synchronises once however many values it needs. Each call counts
// one device-to-host read in host_reads() (this thread's total), on the CPU as on a GPU, so the per-step count of
// the report (CacheStepLog::d2h_scalars) does not depend on the device.
std::vector<double> host_read(const std::vector<torch::Tensor>& values);
int64_t host_reads();

// Relative low-band DCT energy change of conv_in(x) between consecutive calls (see the top of this file).
//
// For a batch of several images update() returns the largest of the images' changes, each pooled over the image's
// rows (uncond and cond); for one image this is the change of the whole batch. freq decides per image from
// energies() (FreqAnchorDenoiser's lanes); DeepCache only logs it.
class ShallowProbe {
public:
    explicit ShallowProbe(int band) : band_(band) {}
    void reset(int images = 1) {
        prev_ = stem_ = observed_ = torch::Tensor();
        images_ = std::max(images, 1);
    }
    // Returns r_k (0 on the first call). `injected` (rows and channels of x): the energies come from
    // conv_in(x - injected), the deterministic part of the input (FreqParams::probe_det).
    double update(UNet2DConditionModelImpl& unet, const torch::Tensor& x, const torch::Tensor& injected = {});
    // The same r_k left on the energies' device as a 0-d float64 tensor, for a caller that reads it together with
    // other values (host_read).
    torch::Tensor update_value(UNet2DConditionModelImpl& unet, const torch::Tensor& x,
                               const torch::Tensor& injected = {});
    // conv_in(x) of the last update: handed to the UNet so that it is computed once per step.
    const torch::Tensor& stem() const { return stem_; }
    // What the energies of the last update came from: conv_in(x - injected), or stem() when nothing was injected.
    const torch::Tensor& observed() const { return observed_; }
    // Low-band energies [rows, C, L] of the last update.
    const torch::Tensor& energies() const { return prev_; }
    // The largest over the images of the relative L1 change sum |e - ref| / (sum ref + eps), each image pooled over
    // its rows (b, n + b, ...); the whole batch when images is 1 or does not divide the rows.
    static double largest_image_change(const torch::Tensor& e, const torch::Tensor& ref, int images);
    // The same as a 0-d float64 tensor on e's device: on the CPU largest_image_change's value (its bits), elsewhere
    // the same sums as tensor operations, nothing read back.
    static torch::Tensor image_change(const torch::Tensor& e, const torch::Tensor& ref, int images);

private:
    int band_;
    int images_ = 1;
    torch::Tensor prev_; // low-band energies [rows, C, L] of the previous step
    torch::Tensor stem_, observed_;
};

} // namespace anchor::unet
