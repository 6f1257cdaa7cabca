#include "kernels/onednn.h"

#include "kernels/cpu_features.h"
#include "kernels/op_timing.h"
#include "kernels/winograd.h"

#if defined(ANCHOR_HAVE_DNNL)
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include <ATen/record_function.h>

#include <algorithm>
#include <functional>
#include <list>
#include <mutex>
#include <unordered_map>
#include <variant>
#include <vector>

namespace anchor::kernels {

const EnumTable<GemmBackend>& gemm_backend_table() {
    static const EnumTable<GemmBackend> t = {
        {"torch", GemmBackend::Torch},
        {"onednn", GemmBackend::OneDnn},
        {"winograd", GemmBackend::Winograd},
        {"bf16", GemmBackend::Bf16}};
    return t;
}

namespace {

bool dense_cpu_no_grad(const torch::Tensor& t) {
    return t.defined() && t.device().is_cpu() && !t.is_mkldnn() && !(torch::GradMode::is_enabled() && t.requires_grad());
}

bool f32_cpu_no_grad(const torch::Tensor& t) {
    return dense_cpu_no_grad(t) && t.scalar_type() == torch::kFloat;
}

// A weight the kernels take: float32, or for the bf16 kernels also bfloat16 as stored.
bool weight_ok(const torch::Tensor& w, bool bf16) {
    return dense_cpu_no_grad(w) &&
           (w.scalar_type() == torch::kFloat || (bf16 && w.scalar_type() == torch::kBFloat16));
}

} // namespace

bool onednn_bf16_native() {
    return onednn_available() && (cpu_features().avx512bf16 || cpu_features().amx_bf16);
}

std::string gemm_backend_unavailable(GemmBackend b) {
    if (b != GemmBackend::Bf16 || onednn_bf16_native()) return "";
    if (!onednn_available()) return "bf16 runs on oneDNN, and this build has none";
    return "bf16 needs a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16); this one has: " +
           cpu_features_string();
}

bool onednn_linear_applies(const torch::Tensor& x, const torch::Tensor& w, bool bf16) {
    return onednn_available() && f32_cpu_no_grad(x) && weight_ok(w, bf16) && w.dim() == 2 && x.dim() >= 1 &&
           x.size(-1) == w.size(1) && w.stride(1) == 1 && w.size(0) > 0 && w.size(1) > 0;
}

bool onednn_conv2d_applies(const torch::Tensor& x, const torch::Tensor& w, int64_t groups, bool bf16) {
    return onednn_available() && f32_cpu_no_grad(x) && weight_ok(w, bf16) && x.dim() == 4 && w.dim() == 4 &&
           groups == 1 && w.size(1) == x.size(1) && x.size(0) > 0 && w.size(0) > 0;
}

#if defined(ANCHOR_HAVE_DNNL) && DNNL_VERSION_MAJOR == 2

namespace {

using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

dnnl::engine& cpu_engine() {
    static dnnl::engine e(dnnl::engine::kind::cpu, 0);
    return e;
}

dnnl::primitive_attr user_scratchpad() {
    dnnl::primitive_attr a;
    a.set_scratchpad_mode(dnnl::scratchpad_mode::user); // scratch from LibTorch's allocator, per call
    return a;
}

// Primitive descriptors and primitives by shape: creating a descriptor walks oneDNN's implementation list on every
// call otherwise (tens of microseconds; a small model's layers take about that).
template <class Pd, class Prim> class PrimitiveCache {
public:
    struct Entry {
        Pd pd;
        Prim prim;
    };
    template <class Make> Entry get(const std::vector<int64_t>& key, Make&& make) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = map_.find(key);
        if (it != map_.end()) return it->second;
        if (map_.size() >= kCapacity) map_.clear(); // shapes of a model are few; a new model starts over
        Pd pd = make();
        Entry e{pd, Prim(pd)};
        map_.emplace(key, e);
        return e;
    }

private:
    static constexpr size_t kCapacity = 512;
    struct Hash {
        size_t operator()(const std::vector<int64_t>& v) const {
            size_t h = 1469598103934665603ull;
            for (int64_t x : v) h = (h ^ size_t(x)) * 1099511628211ull;
            return h;
        }
    };
    std::mutex mu_;
    std::unordered_map<std::vector<int64_t>, Entry, Hash> map_;
};

// A oneDNN memory over a fresh LibTorch byte buffer kept alive by `owner`.
dnnl::memory buffer_memory(const dnnl::memory::desc& md, torch::Tensor& owner) {
    owner = torch::empty({std::max<int64_t>(int64_t(md.get_size()), 1)}, torch::kByte);
    return dnnl::memory(md, cpu_engine(), owner.data_ptr());
}

dnnl::memory::desc strided_md(const dims& d, const dims& strides, dt type = dt::f32) {
    return dnnl::memory::desc(d, type, strides);
}

using MatmulCache = PrimitiveCache<dnnl::matmul::primitive_desc, dnnl::matmul>;
using ConvCache = PrimitiveCache<dnnl::convolution_forward::primitive_desc, dnnl::convolution_forward>;

MatmulCache& matmul_cache() {
    static MatmulCache c;
    return c;
}
ConvCache& conv_cache() {
    static ConvCache c;
    return c;
}

// Batched: B products of [M, K] by [N, K]^T, each operand with its own batch and row strides.
dnnl::matmul::primitive_desc batched_matmul_pd(const std::vector<int64_t>& k) {
    const int64_t B = k[0], M = k[1], K = k[2], N = k[3];
    const auto src = strided_md({B, M, K}, {k[4], k[5], 1});
    const auto wei = strided_md({B, K, N}, {k[6], 1, k[7]});
    const auto dst = strided_md({B, M, N}, {k[8], k[9], 1});
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), user_scratchpad(), cpu_engine());
}

dnnl::matmul::primitive_desc matmul_pd(int64_t M, int64_t K, int64_t N, int64_t ldx, int64_t ldw, bool bias,
                                       bool bf16 = false) {
    const dt in = bf16 ? dt::bf16 : dt::f32; // operands; the bias and the output stay float32
    const auto src = strided_md({M, K}, {ldx, 1}, in);
    // W [N, K] read as its transpose; bf16: in the kernel's own layout, packed once (packed_weight)
    const auto wei = bf16 ? dnnl::memory::desc({K, N}, in, tag::any) : strided_md({K, N}, {1, ldw}, in);
    const auto dst = strided_md({M, N}, {N, 1});
    auto d = bias ? dnnl::matmul::desc(src, wei, strided_md({1, N}, {N, 1}), dst) : dnnl::matmul::desc(src, wei, dst);
    return dnnl::matmul::primitive_desc(d, user_scratchpad(), cpu_engine());
}

struct ConvShape {
    int64_t n, c, h, w, k, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
    bool bias, plain_weight, channels_last, bf16;
    std::vector<int64_t> key() const {
        return {n, c, h, w, k, kh, kw, sh, sw, ph, pw, dh, dw, bias, plain_weight, channels_last, bf16};
    }
};

dnnl::convolution_forward::primitive_desc conv_pd(const ConvShape& s) {
    const dims src{s.n, s.c, s.h, s.w}, wei{s.k, s.c, s.kh, s.kw}, dst{s.n, s.k, s.oh, s.ow};
    // Channels-last tensors are handed over as they are (the kernel reads and writes NHWC: no reorder, no copy);
    // NCHW ones in the kernel's preferred layout, reordered on the way in and out.
    const tag io = s.channels_last ? tag::nhwc : tag::any;
    const dt in = s.bf16 ? dt::bf16 : dt::f32; // operands; the bias and the output stay float32
    const dnnl::memory::desc src_md(src, in, io), dst_md(dst, dt::f32, io);
    const dnnl::memory::desc wei_md(wei, in, s.plain_weight ? tag::oihw : tag::any);
    // oneDNN counts dilation from 0 (no dilation), LibTorch from 1.
    const dims strides{s.sh, s.sw}, pad{s.ph, s.pw}, dil{s.dh - 1, s.dw - 1};
    auto d =
        s.bias
            ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                                              src_md, wei_md, dnnl::memory::desc({s.k}, dt::f32, tag::x), dst_md,
                                              strides, dil, pad, pad)
            : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                                              src_md, wei_md, dst_md, strides, dil, pad, pad);
    return dnnl::convolution_forward::primitive_desc(d, user_scratchpad(), cpu_engine());
}

// The weight a kept derivative (a packed copy, phase weights) was made from: the tensor (held weakly), its storage and
// its version, so that a different weight at the same address, or one changed in place (a LoRA merged into it, a
// training step), is not taken for it.
struct WeightIdentity {
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> owner;
    const void* data;
    int64_t version;

    static int64_t version_of(const torch::Tensor& w) { return w.is_inference() ? 0 : int64_t(w._version()); }
    static WeightIdentity of(const torch::Tensor& w) {
        return {c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(w.getIntrusivePtr()), w.data_ptr(),
                version_of(w)};
    }
    bool is(const torch::Tensor& w) const {
        return owner.lock().get() == w.unsafeGetTensorImpl() && data == w.data_ptr() && version == version_of(w);
    }
    bool expired() const { return owner.expired(); }
};

// Values derived from weights (a packed copy, phase weights), each under a variant of its weight (the layout asked
// for), kept while the weight lives unchanged; the entries of weights that are gone are dropped at each look-up.
template <class Variant, class Value>
class KeptPerWeight {
public:
    // The value of (w, variant); make() makes it when there is none for w as it is now.
    Value get(const torch::Tensor& w, const Variant& variant, const std::function<Value()>& make) {
        std::lock_guard<std::mutex> lock(mu_);
        auto& v = map_[w.unsafeGetTensorImpl()];
        for (auto& e : v)
            if (e.variant == variant) {
                if (e.id.is(w)) return e.value;
                e.id.owner.reset(); // a different weight (or changed in place): made again below
            }
        for (auto it = map_.begin(); it != map_.end();) { // entries of weights that are gone
            auto& es = it->second;
            es.erase(std::remove_if(es.begin(), es.end(), [](const Entry& e) { return e.id.expired(); }), es.end());
            it = es.empty() && &es != &v ? map_.erase(it) : std::next(it);
        }
        v.push_back({WeightIdentity::of(w), variant, make()});
        return v.back().value;
    }
    void clear() {
        std::lock_guard<std::mutex> lock(mu_);
        map_.clear();
    }

private:
    struct Entry {
        WeightIdentity id;
        Variant variant;
        Value value;
    };
    std::mutex mu_;
    std::unordered_map<const c10::TensorImpl*, std::vector<Entry>> map_;
};

// The bf16 kernels' weights, reordered (and rounded) once into the layout the kernel wants and kept while the weight
// lives unchanged: a weight's reorder reads and writes it whole, as long as the product itself where the positions
// are few (SD's 1280-channel levels at 256x256: ~10 ms of a 20 ms convolution). One packed bf16 copy per weight
// (half the float32 weight's bytes) is the memory this costs; onednn_drop_packed_weights frees it.
struct PackedCopy {
    torch::Tensor buf; // owns mem's bytes
    dnnl::memory mem;
};

KeptPerWeight<dnnl::memory::desc, PackedCopy>& packed_weights() {
    static KeptPerWeight<dnnl::memory::desc, PackedCopy> p;
    return p;
}

// `user` (the weight w's own bytes) in layout md, packed once per weight.
dnnl::memory packed_weight(const torch::Tensor& w, const dnnl::memory& user, const dnnl::memory::desc& md,
                           dnnl::stream& s) {
    return packed_weights()
        .get(w, md,
             [&] {
                 PackedCopy p;
                 p.mem = buffer_memory(md, p.buf);
                 dnnl::memory src = user;
                 dnnl::reorder(src, p.mem).execute(s, src, p.mem);
                 return p;
             })
        .mem;
}

// The resize-convolution's phase weights of a float32 3x3 weight (onednn_upsample2x_conv3x3), made once and kept while
// the weight lives unchanged: making them reads the weight whole and writes 16/9 of it (SD 1.5's 1280-channel
// upsamplers: 105 MiB per call). A weight made for one call (a reduced-precision weight upcast) is not kept. One
// variant per weight.
KeptPerWeight<std::monostate, torch::Tensor>& phase_weights() {
    static KeptPerWeight<std::monostate, torch::Tensor> p;
    return p;
}

// Reorders `user` into a buffer of layout `md` when they differ (the buffer owned by `owner`).
dnnl::memory in_layout(dnnl::stream& s, dnnl::memory user, const dnnl::memory::desc& md, torch::Tensor& owner) {
    if (user.get_desc() == md) return user;
    auto m = buffer_memory(md, owner);
    dnnl::reorder(user, m).execute(s, user, m);
    return m;
}

} // namespace

bool onednn_available() {
    return true;
}

void onednn_drop_packed_weights() {
    packed_weights().clear();
    phase_weights().clear();
}

std::string onednn_description() {
    const auto* v = dnnl::version();
    std::string s =
        "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
    try {
        s += ", matmul " + std::string(matmul_pd(2048, 320, 320, 320, 320, true).impl_info_str());
        ConvShape c{2, 320, 64, 64, 320, 3, 3, 1, 1, 1, 1, 1, 1, 64, 64, true, false, false, false};
        s += ", convolution " + std::string(conv_pd(c).impl_info_str());
        if (onednn_bf16_native()) {
            c.bf16 = true;
            s += "; bf16: matmul " + std::string(matmul_pd(2048, 320, 320, 320, 320, true, true).impl_info_str()) +
                 ", convolution " + std::string(conv_pd(c).impl_info_str());
        }
    } catch (const dnnl::error& e) {
        s += std::string(" (no kernel for SD's shapes: ") + e.what() + ")";
    }
    return s;
}

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w_in, const torch::Tensor& bias, bool bf16) {
    TORCH_CHECK(onednn_linear_applies(x, w_in, bf16), "onednn_linear: input ", x.sizes(), " ", x.scalar_type(), " and weight ",
                w_in.sizes(), " ", w_in.scalar_type(), " are not float32 CPU tensors of matching width outside autograd");
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == w_in.size(0) && f32_cpu_no_grad(bias)),
                "onednn_linear: bias ", bias.defined() ? bias.sizes() : at::IntArrayRef{}, " does not fit weight ",
                w_in.sizes());
    RECORD_FUNCTION(bf16 ? "anchor::onednn_linear_bf16" : "anchor::onednn_linear", std::vector<c10::IValue>({x}));
    const auto& w = w_in; // bf16: read through packed_weight (its layout, rounded once)
    const int64_t K = w.size(1), N = w.size(0);
    auto x2 = x.reshape({-1, K});
    if (x2.stride(1) != 1 || x2.stride(0) < K) x2 = x2.contiguous();
    if (bf16) x2 = x2.to(torch::kBFloat16); // rounded to nearest even, as oneDNN's reorder would
    const int64_t M = x2.size(0);
    ScopedOpTime timed(bf16 ? "linear bf16" : "linear", [&](std::string& shape, double& macs) {
        shape = std::to_string(M) + "x" + std::to_string(K) + " @ " + std::to_string(K) + "x" + std::to_string(N);
        macs = double(M) * double(K) * double(N);
    });
    std::vector<int64_t> out_sizes = x.sizes().vec();
    out_sizes.back() = N;
    auto out = torch::empty(out_sizes, x.options().memory_format(torch::MemoryFormat::Contiguous));
    if (M == 0) return out;
    const auto b = bias.defined() ? bias.contiguous() : bias;
    const int64_t ldx = x2.stride(0), ldw = w.stride(0);
    auto e = matmul_cache().get({M, K, N, ldx, ldw, b.defined(), bf16},
                                [&] { return matmul_pd(M, K, N, ldx, ldw, b.defined(), bf16); });
    auto& eng = cpu_engine();
    dnnl::stream s(eng);
    torch::Tensor scratch_buf;
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory(e.pd.src_desc(), eng, x2.data_ptr())},
        {DNNL_ARG_WEIGHTS,
         bf16 ? packed_weight(w_in,
                                     dnnl::memory(strided_md({K, N}, {1, w_in.stride(0)},
                                                             w_in.scalar_type() == torch::kBFloat16 ? dt::bf16 : dt::f32),
                                                  eng, w_in.data_ptr()),
                                     e.pd.weights_desc(), s)
              : dnnl::memory(e.pd.weights_desc(), eng, w.data_ptr())},
        {DNNL_ARG_DST, dnnl::memory(e.pd.dst_desc(), eng, out.data_ptr())},
        {DNNL_ARG_SCRATCHPAD, buffer_memory(e.pd.scratchpad_desc(), scratch_buf)}};
    if (b.defined()) args.emplace(DNNL_ARG_BIAS, dnnl::memory(e.pd.bias_desc(), eng, b.data_ptr()));
    e.prim.execute(s, args);
    s.wait();
    return out;
}

void onednn_batched_linear_out(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& w) {
    TORCH_CHECK(a.dim() == 3 && w.dim() == 3 && out.dim() == 3 && a.size(0) == w.size(0) && a.size(2) == w.size(2) &&
                    out.size(0) == a.size(0) && out.size(1) == a.size(1) && out.size(2) == w.size(1) &&
                    f32_cpu_no_grad(a) && f32_cpu_no_grad(w) && f32_cpu_no_grad(out) && a.stride(2) == 1 &&
                    w.stride(2) == 1 && out.stride(2) == 1,
                "onednn_batched_linear_out: ", out.sizes(), " = ", a.sizes(), " x ", w.sizes(),
                "^T are not float32 CPU tensors [B, M, N], [B, M, K] and [B, N, K] with unit inner strides");
    RECORD_FUNCTION("anchor::onednn_batched_linear", std::vector<c10::IValue>({a}));
    const int64_t B = a.size(0), M = a.size(1), K = a.size(2), N = w.size(1);
    ScopedOpTime timed("batched linear", [&](std::string& shape, double& macs) {
        shape = std::to_string(B) + " x " + std::to_string(M) + "x" + std::to_string(K) + " @ " + std::to_string(K) +
                "x" + std::to_string(N);
        macs = double(B) * double(M) * double(K) * double(N);
    });
    if (B == 0 || M == 0 || N == 0) return;
    if (K == 0) {
        out.zero_();
        return;
    }
    const std::vector<int64_t> key{B, M, K, N, a.stride(0), a.stride(1), w.stride(0), w.stride(1), out.stride(0),
                                   out.stride(1), -1};
    auto e = matmul_cache().get(key, [&] { return batched_matmul_pd(key); });
    auto& eng = cpu_engine();
    dnnl::stream s(eng);
    torch::Tensor scratch_buf;
    e.prim.execute(s, {{DNNL_ARG_SRC, dnnl::memory(e.pd.src_desc(), eng, a.data_ptr())},
                       {DNNL_ARG_WEIGHTS, dnnl::memory(e.pd.weights_desc(), eng, w.data_ptr())},
                       {DNNL_ARG_DST, dnnl::memory(e.pd.dst_desc(), eng, out.data_ptr())},
                       {DNNL_ARG_SCRATCHPAD, buffer_memory(e.pd.scratchpad_desc(), scratch_buf)}});
    s.wait();
}

namespace {

bool is_channels_last(const torch::Tensor& x) {
    return x.is_contiguous(torch::MemoryFormat::ChannelsLast) && !x.is_contiguous();
}

// The convolution onednn_conv2d hands the kernel for x and w: the output size, whether the weight is read in place
// and the activations' layout.
ConvShape conv_shape(const torch::Tensor& x, const torch::Tensor& w, bool bias, at::IntArrayRef stride,
                     at::IntArrayRef padding, at::IntArrayRef dilation, bool bf16) {
    ConvShape sh{x.size(0),   x.size(1), x.size(2), x.size(3),  w.size(0),  w.size(2),
                 w.size(3),   stride[0], stride[1], padding[0], padding[1], dilation[0],
                 dilation[1], 0,         0,         bias,       false,      is_channels_last(x), bf16};
    sh.oh = (sh.h + 2 * sh.ph - sh.dh * (sh.kh - 1) - 1) / sh.sh + 1;
    sh.ow = (sh.w + 2 * sh.pw - sh.dw * (sh.kw - 1) - 1) / sh.sw + 1;
    TORCH_CHECK(sh.oh > 0 && sh.ow > 0, "onednn_conv2d: input ", x.sizes(), " is smaller than the kernel ", w.sizes(),
                " with padding ", padding, " and dilation ", dilation);
    // (bf16: always the kernel's blocked layout, into which the per-call reorder rounds the weight anyway)
    sh.plain_weight = !bf16 && sh.n * sh.oh * sh.ow <= kPlainWeightMaxPositions;
    // oneDNN 2.6 has no optimised float32 kernel for NHWC activations with a plain OIHW weight: it falls back to its
    // scalar reference convolution (ref:any, orders of magnitude slower). At these few positions the activations are cheaper to
    // transpose to NCHW and back than the weight is to reorder.
    if (sh.plain_weight) sh.channels_last = false;
    return sh;
}

// onednn_conv2d; `pack`: a bf16 weight is packed once and kept (packed_weight) - false for a weight made for this
// call alone (the resize-convolution's phase weights), which would only leave a dead entry behind.
torch::Tensor conv2d_impl(const torch::Tensor& x_in, const torch::Tensor& w_in, const torch::Tensor& bias,
                          at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                          ConvArithmetic arithmetic, bool pack) {
    const bool bf16 = arithmetic == ConvArithmetic::Bf16;
    TORCH_CHECK(onednn_conv2d_applies(x_in, w_in, 1, bf16), "onednn_conv2d: input ", x_in.sizes(), " ", x_in.scalar_type(),
                " and weight ", w_in.sizes(), " ", w_in.scalar_type(),
                " are not float32 CPU tensors [N, C, H, W] and [K, C, kh, kw] outside autograd");
    TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2 && stride[0] > 0 && stride[1] > 0 &&
                    padding[0] >= 0 && padding[1] >= 0 && dilation[0] > 0 && dilation[1] > 0,
                "onednn_conv2d: stride ", stride, ", padding ", padding, ", dilation ", dilation,
                " must be two positive (padding: non-negative) numbers each");
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == w_in.size(0) && f32_cpu_no_grad(bias)),
                "onednn_conv2d: bias ", bias.defined() ? bias.sizes() : at::IntArrayRef{}, " does not fit weight ",
                w_in.sizes());
    if (arithmetic == ConvArithmetic::Winograd && winograd_applies(x_in, w_in, stride, padding, dilation))
        return winograd_conv3x3(x_in, w_in, bias, WinogradGemm::OneDnn);
    RECORD_FUNCTION(bf16 ? "anchor::onednn_conv2d_bf16" : "anchor::onednn_conv2d", std::vector<c10::IValue>({x_in}));
    const ConvShape sh = conv_shape(x_in, w_in, bias.defined(), stride, padding, dilation, bf16);
    ScopedOpTime timed(bf16 ? "conv bf16" : "conv", [&](std::string& shape, double& macs) {
        shape = conv_shape_text(x_in.sizes().vec(), w_in.sizes().vec(), stride[0]);
        macs = double(sh.n) * double(sh.k) * double(sh.oh) * double(sh.ow) * double(w_in.numel() / w_in.size(0));
    });
    // A 1x1 convolution of channels-last activations is one matrix product over the positions: oneDNN's matmul runs
    // SD's at 70-90 % of the GEMM rate where its convolution kernels reach 30-60 % (anchor-sd bench --op-table).
    if (!bf16 && sh.kh == 1 && sh.kw == 1 && stride[0] == 1 && stride[1] == 1 && padding[0] == 0 && padding[1] == 0 &&
        x_in.is_contiguous(torch::MemoryFormat::ChannelsLast)) {
        const int64_t N = x_in.size(0), C = x_in.size(1), H = x_in.size(2), W = x_in.size(3), K = w_in.size(0);
        const auto rows = x_in.permute({0, 2, 3, 1}).reshape({N * H * W, C}); // a view of the NHWC storage
        const auto w2 = w_in.reshape({K, C});
        if (onednn_linear_applies(rows, w2, false))
            return onednn_linear(rows, w2, bias).view({N, H, W, K}).permute({0, 3, 1, 2});
    }
    const bool channels_last = sh.channels_last;
    const auto x = channels_last ? x_in : x_in.contiguous(), w = w_in.contiguous();
    const auto b = bias.defined() ? bias.contiguous() : bias;
    auto out = torch::empty(
        {sh.n, sh.k, sh.oh, sh.ow},
        x.options().memory_format(channels_last ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Contiguous));
    auto e = conv_cache().get(sh.key(), [&] { return conv_pd(sh); });
    auto& eng = cpu_engine();
    dnnl::stream s(eng);
    const tag io = channels_last ? tag::nhwc : tag::nchw;
    dnnl::memory user_src({{sh.n, sh.c, sh.h, sh.w}, dt::f32, io}, eng, x.data_ptr());
    const dt wt = w.scalar_type() == torch::kBFloat16 ? dt::bf16 : dt::f32;
    dnnl::memory user_wei({{sh.k, sh.c, sh.kh, sh.kw}, wt, tag::oihw}, eng, w.data_ptr());
    dnnl::memory user_dst({{sh.n, sh.k, sh.oh, sh.ow}, dt::f32, io}, eng, out.data_ptr());
    torch::Tensor src_buf, wei_buf, dst_buf, scratch_buf;
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, in_layout(s, user_src, e.pd.src_desc(), src_buf)},
        {DNNL_ARG_WEIGHTS, bf16 && pack ? packed_weight(w_in, user_wei, e.pd.weights_desc(), s)
                                        : in_layout(s, user_wei, e.pd.weights_desc(), wei_buf)},
        {DNNL_ARG_SCRATCHPAD, buffer_memory(e.pd.scratchpad_desc(), scratch_buf)}};
    const bool direct_dst = e.pd.dst_desc() == user_dst.get_desc();
    dnnl::memory conv_dst = direct_dst ? user_dst : buffer_memory(e.pd.dst_desc(), dst_buf);
    args.emplace(DNNL_ARG_DST, conv_dst);
    if (b.defined()) args.emplace(DNNL_ARG_BIAS, dnnl::memory(e.pd.bias_desc(), eng, b.data_ptr()));
    e.prim.execute(s, args);
    if (!direct_dst) {
        args.clear();
        src_buf = wei_buf = scratch_buf = torch::Tensor(); // free before the output reorder
        dnnl::reorder(conv_dst, user_dst).execute(s, conv_dst, user_dst);
    }
    s.wait();
    return is_channels_last(x_in) && !channels_last ? out.contiguous(torch::MemoryFormat::ChannelsLast) : out;
}

} // namespace

torch::Tensor onednn_conv2d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                            ConvArithmetic arithmetic) {
    return conv2d_impl(x, w, bias, stride, padding, dilation, arithmetic, true);
}

std::string onednn_conv2d_kernel(const torch::Tensor& x, const torch::Tensor& w, bool bias, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation, bool bf16) {
    const auto sh = conv_shape(x, w, bias, stride, padding, dilation, bf16);
    return conv_cache().get(sh.key(), [&] { return conv_pd(sh); }).pd.impl_info_str();
}

torch::Tensor onednn_upsample2x_conv3x3(const torch::Tensor& x, const torch::Tensor& w_in, const torch::Tensor& bias,
                                        bool bf16, bool keep) {
    TORCH_CHECK(onednn_conv2d_applies(x, w_in, 1, bf16) && w_in.size(2) == 3 && w_in.size(3) == 3,
                "onednn_upsample2x_conv3x3: input ",
                x.sizes(), " and weight ", w_in.sizes(), " are not a float32 CPU 3x3 convolution outside autograd");
    const auto w = w_in.to(torch::kFloat); // the taps are summed in float32 (a bf16-stored weight upcast)
    RECORD_FUNCTION("anchor::onednn_upsample2x_conv3x3", std::vector<c10::IValue>({x}));
    const int64_t N = x.size(0), K = w.size(0), H = x.size(2), W = x.size(3);
    // Counted as the 3x3 convolution of the upsampled image it replaces (what the reference computes).
    ScopedOpTime timed(bf16 ? "upsample2x+conv bf16" : "upsample2x+conv", [&](std::string& shape, double& macs) {
        shape = conv_shape_text(x.sizes().vec(), w.sizes().vec(), 1);
        macs = double(N) * double(K) * double(4 * H * W) * double(w.numel() / K);
    });
    // Taps of the phase's two rows (dim 2) or columns (dim 3): phase 0 = (w0, w1 + w2), phase 1 = (w0 + w1, w2).
    auto phase = [](const torch::Tensor& t, int64_t dim, int p) {
        const auto a = t.select(dim, 0), b = t.select(dim, 1), c = t.select(dim, 2);
        return p == 0 ? torch::stack({a, b + c}, dim) : torch::stack({a + b, c}, dim);
    };
    auto make = [&] {
        std::vector<torch::Tensor> phases;
        for (int dy = 0; dy < 2; ++dy) {
            const auto rows = phase(w, 2, dy);
            for (int dx = 0; dx < 2; ++dx) phases.push_back(phase(rows, 3, dx));
        }
        return torch::cat(phases, 0).contiguous(); // [4K, C, 2, 2], phase p = 2 dy + dx
    };
    const auto w4 = keep && w_in.scalar_type() == torch::kFloat ? phase_weights().get(w_in, {}, make) : make();
    const auto b4 = bias.defined() ? bias.repeat({4}) : bias;
    const std::vector<int64_t> one{1, 1};
    const auto y = conv2d_impl(x, w4, b4, one, one, one, bf16 ? ConvArithmetic::Bf16 : ConvArithmetic::F32,
                               false); // [N, 4K, H+1, W+1], x's layout
    const bool channels_last = y.is_contiguous(torch::MemoryFormat::ChannelsLast) && !y.is_contiguous();
    auto out =
        torch::empty({N, K, 2 * H, 2 * W}, y.options().memory_format(channels_last ? torch::MemoryFormat::ChannelsLast
                                                                                   : torch::MemoryFormat::Contiguous));
    // out[n, k, 2i + dy, 2j + dx] = y[n, p K + k, i + dy, j + dx]: four strided copies, of K-long rows when
    // channels-last.
    const auto o6 = out.view({N, K, H, 2, W, 2});
    for (int dy = 0; dy < 2; ++dy)
        for (int dx = 0; dx < 2; ++dx)
            o6.select(5, dx).select(3, dy).copy_(y.narrow(1, (2 * dy + dx) * K, K).narrow(2, dy, H).narrow(3, dx, W));
    return out;
}

#else // no oneDNN 2.x at build time: LibTorch's kernels only

bool onednn_available() {
    return false;
}

void onednn_drop_packed_weights() {}

std::string onednn_description() {
    return "not built (no oneDNN 2.x headers and library at build time: Debian's libdnnl-dev)";
}

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor&, bool) {
    TORCH_CHECK(false, "onednn_linear: this build has no oneDNN (input ", x.sizes(), ", weight ", w.sizes(), ")");
}

void onednn_batched_linear_out(torch::Tensor&, const torch::Tensor& a, const torch::Tensor& w) {
    TORCH_CHECK(false, "onednn_batched_linear_out: this build has no oneDNN (", a.sizes(), ", ", w.sizes(), ")");
}

torch::Tensor onednn_conv2d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor&, at::IntArrayRef,
                            at::IntArrayRef, at::IntArrayRef, ConvArithmetic) {
    TORCH_CHECK(false, "onednn_conv2d: this build has no oneDNN (input ", x.sizes(), ", weight ", w.sizes(), ")");
}

std::string onednn_conv2d_kernel(const torch::Tensor&, const torch::Tensor&, bool, at::IntArrayRef, at::IntArrayRef,
                                 at::IntArrayRef, bool) {
    return "none (no oneDNN in this build)";
}

torch::Tensor onednn_upsample2x_conv3x3(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor&, bool,
                                        bool) {
    TORCH_CHECK(false, "onednn_upsample2x_conv3x3: this build has no oneDNN (input ", x.sizes(), ", weight ", w.sizes(),
                ")");
}

#endif

} // namespace anchor::kernels
