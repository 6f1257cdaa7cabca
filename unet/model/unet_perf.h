// Inference fast paths of the UNet forward (CPU float32), chosen per model (UNet2DConditionModelImpl::set_fast_paths,
// each module keeps its flag in FastPaths) so that the plain module forwards stay available as the reference in the
// same process: `anchor-sd bench --baseline/--ab` times them, tests/test_unet_macs.cpp checks that both paths give
// the same bits on random inputs. Training turns them off (the in-place adds would break autograd).
//
// What the fast paths change (measured in tests/bench/results/, see cli/sd_bench.cpp):
// * Conv2d: the weight is reordered ONCE into oneDNN's blocked layout (at::mkldnn_reorder_conv2d_weight) and the
//   convolution called with it (at::mkldnn_convolution). The plain path hands a dense OIHW weight to oneDNN, which
//   reorders it on every call: for SD 1.5 that is 2.4 GB of conv weights read and written again per UNet step.
//   Costs one packed copy of the conv weights in memory.
// * attention: queries chunked so the score buffer stays below 16 MiB: glibc serves such blocks from its heap
//   instead of fresh mmap()s whose pages fault in on every call. (Folding the softmax scale into q was tried and
//   dropped: it moved the tiny golden UNet's output by 1.8e-5 relative, above our 1e-5 budget.)
// * residual adds, GEGLU product: in place on fresh outputs (fewer allocations; identical values).
#pragma once

#include "kernels/group_norm.h"
#include "kernels/linear.h"
#include "kernels/onednn.h"

#include <torch/torch.h>

#include <ATen/Config.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR < 2
#include <ATen/native/ConvUtils.h>
#endif

#include <mutex>
#include <unordered_map>

namespace anchor::unet::perf {

// The per-module switch: true (default) runs the fast paths, false the plain module forwards (the reference).
// `gemm`: which library runs the module's linear layers and convolutions on the fast paths (kernels/onednn.h; set
// for a whole model by set_gemm_backend below).
struct FastPaths {
    bool fast = true;
    kernels::GemmBackend gemm = kernels::GemmBackend::Torch;
};

// Score-buffer bound of the attention's query chunks in fast mode.
constexpr int64_t kAttentionChunkBytes = int64_t(16) << 20;

namespace detail {

// LibTorch 1.x has its own c10::variant, 2.x uses std::variant.
template <typename T, typename V> const T* variant_get_if(const V& v) {
#if TORCH_VERSION_MAJOR >= 2
    return std::get_if<T>(&v);
#else
    return c10::get_if<T>(&v);
#endif
}

struct PackedConv {
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> owner; // the dense weight it was made from
    const void* data = nullptr;
    int64_t version = -1;
    torch::Tensor packed;
};

struct PackedConvCache {
    std::mutex mu;
    std::unordered_map<const c10::TensorImpl*, PackedConv> entries;
    bool disabled = false; // set when this LibTorch cannot run the packed path
};

inline PackedConvCache& cache() {
    static PackedConvCache c;
    return c;
}

inline int64_t version_of(const torch::Tensor& w) {
    return w.is_inference() ? 0 : int64_t(w._version());
}

// LibTorch's own backend choice for conv2d(x, w) (at::native::select_conv_backend, exposed for testing in 1.x; its
// signature changed in 2.x, where the plain forward is used).
inline bool torch_picks_mkldnn(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                               const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                               const std::vector<int64_t>& dilation, int64_t groups) {
#if TORCH_VERSION_MAJOR < 2
    const c10::optional<torch::Tensor> b = bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
    return at::native::select_conv_backend(x, w, b, stride, padding, dilation, false, {0, 0}, groups) ==
           at::native::ConvBackend::Mkldnn;
#else
    (void)x, (void)w, (void)bias, (void)stride, (void)padding, (void)dilation, (void)groups;
    return false;
#endif
}

// The convolution's padding where it is zero padding given as numbers (what every convolution of these models has),
// else null.
inline const torch::ExpandingArray<2>* zero_padding(const torch::nn::detail::ConvNdOptions<2>& o) {
    const auto* pad = variant_get_if<torch::ExpandingArray<2>>(o.padding());
    return pad != nullptr && variant_get_if<torch::enumtype::kZeros>(o.padding_mode()) != nullptr ? pad : nullptr;
}

// conv->forward(x) for a weight stored in reduced precision under a float32 input (kernels::upcast_at_use), the bias
// as it is (float32). Zero padding given as numbers only.
inline torch::Tensor conv2d_upcast(torch::nn::Conv2dImpl& conv, const torch::Tensor& x) {
    const auto& o = conv.options;
    const auto* pad = zero_padding(o);
    TORCH_CHECK(pad != nullptr, "a reduced-precision convolution weight needs zero padding given as numbers");
    const auto bias = conv.bias.defined() ? c10::optional<torch::Tensor>(conv.bias) : c10::nullopt;
    return at::conv2d(x, conv.weight.to(torch::kFloat), bias, at::IntArrayRef(o.stride()), at::IntArrayRef(*pad),
                      at::IntArrayRef(o.dilation()), o.groups());
}

} // namespace detail

// lhs + rhs in the reference's operand order (diffusers writes each residual as `lhs + rhs`), in place into
// `scratch` (lhs or rhs: a fresh temporary of the caller) when that gives the same tensor, i.e. both operands have the
// same sizes and strides. Otherwise `lhs + rhs` lets LibTorch choose the output layout exactly as the reference does:
// [B, C, 1, 1] maps whose size-1 dimensions carry channels-last strides are such a case, and the layout decides later
// kernels (GroupNorm has a channels-last kernel that sums in another order).
inline torch::Tensor reference_add(const torch::Tensor& lhs, const torch::Tensor& rhs, torch::Tensor scratch,
                                   bool fast) {
    if (fast && lhs.strides() == rhs.strides() && lhs.sizes() == rhs.sizes() &&
        lhs.scalar_type() == rhs.scalar_type() && !lhs.requires_grad() && !rhs.requires_grad())
        return scratch.add_(scratch.is_same(lhs) ? rhs : lhs);
    return lhs + rhs;
}

// conv->forward(x) with a once-reordered oneDNN weight where possible (float32 CPU, zero padding given as numbers,
// LibTorch built with oneDNN); otherwise exactly conv->forward(x).
// A reduced-precision weight under a float32 input is upcast at use (detail::conv2d_upcast).
inline torch::Tensor conv2d(torch::nn::Conv2d conv, const torch::Tensor& x, bool fast) { // holder: non-const Impl
    if (kernels::upcast_at_use(conv->weight, x)) return detail::conv2d_upcast(*conv, x);
#if AT_MKLDNN_ENABLED()
    const auto& o = conv->options;
    const torch::Tensor& w = conv->weight;
    const auto* pad = detail::zero_padding(o);
    auto& c = detail::cache();
    if (!fast || c.disabled || pad == nullptr || x.scalar_type() != torch::kFloat || w.scalar_type() != torch::kFloat ||
        !x.device().is_cpu() || !w.device().is_cpu() || x.dim() != 4 || x.requires_grad() || w.requires_grad() ||
        !at::hasMKLDNN())
        return conv->forward(x);
    const std::vector<int64_t> padding = at::IntArrayRef(*pad).vec(), stride = at::IntArrayRef(o.stride()).vec(),
                               dilation = at::IntArrayRef(o.dilation()).vec();
    // Only where LibTorch itself would run this convolution on oneDNN (batch size, 1x1 kernels on one thread, small
    // inputs go to its own im2col path): then the packed weight gives the same algorithm and the same bits as the
    // reference; elsewhere the plain forward is the reference.
    if (!detail::torch_picks_mkldnn(x, w, conv->bias, stride, padding, dilation, o.groups())) return conv->forward(x);
    torch::Tensor packed;
    {
        std::lock_guard<std::mutex> lock(c.mu);
        auto it = c.entries.find(w.unsafeGetTensorImpl());
        if (it != c.entries.end()) {
            auto alive = it->second.owner.lock();
            if (alive.get() == w.unsafeGetTensorImpl() && it->second.data == w.data_ptr() &&
                it->second.version == detail::version_of(w))
                packed = it->second.packed;
        }
        if (!packed.defined()) {
            try {
                c10::InferenceMode guard;
                packed =
                    at::mkldnn_reorder_conv2d_weight(w.contiguous().to_mkldnn(), padding, stride, dilation, o.groups());
            } catch (const std::exception&) {
                c.disabled = true;
                return conv->forward(x);
            }
            // Drop entries whose model is gone before adding this one.
            for (auto e = c.entries.begin(); e != c.entries.end();)
                e = e->second.owner.expired() ? c.entries.erase(e) : std::next(e);
            c.entries.insert_or_assign(
                w.unsafeGetTensorImpl(),
                detail::PackedConv{
                    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(w.getIntrusivePtr()),
                    w.data_ptr(), detail::version_of(w), packed});
        }
    }
    c10::optional<torch::Tensor> bias;
    if (conv->bias.defined()) bias = conv->bias;
    try {
        return at::mkldnn_convolution(x.contiguous(), packed, bias, padding, stride, dilation, o.groups());
    } catch (const std::exception&) { // dense input + packed weight not supported by this LibTorch: plain path
        std::lock_guard<std::mutex> lock(c.mu);
        c.disabled = true;
        c.entries.clear();
    }
    return conv->forward(x);
#else
    return conv->forward(x);
#endif
}

// The GEMM backend of every module under `root` (a UNet, a VAE).
inline void set_gemm_backend(torch::nn::Module& root, kernels::GemmBackend b) {
    for (const auto& m : root.modules(true))
        if (auto* f = dynamic_cast<FastPaths*>(m.get())) f->gemm = b;
}

inline bool use_onednn(const FastPaths& m) {
    return m.fast && kernels::runs_on_onednn(m.gemm);
}

inline bool bf16_operands(const FastPaths& m) {
    return m.gemm == kernels::GemmBackend::Bf16;
}

// The weight oneDNN reads: as stored for the bf16 kernels (a bf16 weight needs no upcast), else float32.
inline torch::Tensor onednn_weight(const torch::Tensor& w, const torch::Tensor& x, const FastPaths& m) {
    return bf16_operands(m) ? w : kernels::weight_for(w, x);
}

inline kernels::ConvArithmetic conv_arithmetic(const FastPaths& m) {
    switch (m.gemm) {
    case kernels::GemmBackend::Bf16:
        return kernels::ConvArithmetic::Bf16;
    case kernels::GemmBackend::Winograd:
        return kernels::ConvArithmetic::Winograd;
    default:
        return kernels::ConvArithmetic::F32;
    }
}

// conv2d(conv, x, m.fast) on LibTorch, or on oneDNN's inference kernels (kernels/onednn.h) for a module on the fast
// paths with the OneDnn backend (a reduced-precision weight upcast at use, as on LibTorch).
inline torch::Tensor conv2d(torch::nn::Conv2d conv, const torch::Tensor& x, const FastPaths& m) {
    if (use_onednn(m)) {
        const auto& o = conv->options;
        if (const auto* pad = detail::zero_padding(o)) {
            const auto wf = onednn_weight(conv->weight, x, m);
            if (kernels::onednn_conv2d_applies(x, wf, o.groups(), bf16_operands(m)))
                return kernels::onednn_conv2d(x, wf, conv->bias, at::IntArrayRef(o.stride()), at::IntArrayRef(*pad),
                                              at::IntArrayRef(o.dilation()), conv_arithmetic(m));
        }
    }
    return conv2d(conv, x, m.fast);
}

// conv(nearest_2x(x)) for a 3x3, stride-1, padding-1 convolution on oneDNN's kernels without the upsampled tensor
// (kernels::onednn_upsample2x_conv3x3); undefined where that does not apply (the caller runs the two steps).
inline torch::Tensor upsample2x_conv3x3(torch::nn::Conv2d conv, const torch::Tensor& x, const FastPaths& m) {
    const auto& o = conv->options;
    const auto* pad = detail::zero_padding(o);
    const auto& w = conv->weight;
    if (pad == nullptr || at::IntArrayRef(*pad) != at::IntArrayRef({1, 1}) ||
        at::IntArrayRef(o.stride()) != at::IntArrayRef({1, 1}) ||
        at::IntArrayRef(o.dilation()) != at::IntArrayRef({1, 1}) || w.dim() != 4 || w.size(2) != 3 || w.size(3) != 3)
        return {};
    const auto wf = onednn_weight(w, x, m);
    if (!kernels::onednn_conv2d_applies(x, wf, o.groups(), bf16_operands(m))) return {};
    return kernels::onednn_upsample2x_conv3x3(x, wf, conv->bias, bf16_operands(m), wf.is_same(w));
}

// Whether x's storage is referenced by x alone (no other tensor, view or caller holds it): then it may be overwritten.
inline bool sole_owner(const torch::Tensor& x) {
    return x.defined() && x.use_count() == 1 && x.storage().use_count() == 1 && !x.requires_grad();
}

// silu(norm(x)): in x's storage (kernels::group_norm_silu_, another summation order than LibTorch's GroupNorm) on
// the oneDNN paths, whose bits differ from the reference anyway, where x is the caller's alone; else LibTorch's
// GroupNorm and an in-place SiLU on its output.
inline torch::Tensor group_norm_silu(torch::nn::GroupNorm norm, torch::Tensor x, const FastPaths& m) {
    const auto& o = norm->options;
    if (use_onednn(m) && x.scalar_type() == torch::kFloat && sole_owner(x) &&
        (x.is_contiguous() || (x.dim() == 4 && x.is_contiguous(torch::MemoryFormat::ChannelsLast))))
        return kernels::group_norm_silu_(std::move(x), o.num_groups(), o.affine() ? norm->weight : torch::Tensor(),
                                         o.affine() ? norm->bias : torch::Tensor(), o.eps());
    auto h = norm->forward(x);
    return torch::silu_(h);
}

// kernels::linear(l, x) on LibTorch, or oneDNN's matmul for a module on the fast paths with the OneDnn backend.
inline torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x, const FastPaths& m) {
    if (use_onednn(m)) {
        const auto wf = onednn_weight(l->weight, x, m);
        if (kernels::onednn_linear_applies(x, wf, bf16_operands(m)))
            return kernels::onednn_linear(x, wf, l->bias, bf16_operands(m));
    }
    return kernels::linear(l, x);
}

} // namespace anchor::unet::perf
