#include "kernels/ring_write.h"

#include "cache/io/error.h"

#include <cstring>

namespace anchor::kernels {

int64_t ring_slot(int64_t position, int64_t sink, int64_t window) {
    if (position < 0 || sink < 0 || window < 1)
        throw Error("ring_slot: need position >= 0, sink >= 0, window >= 1 (got " + std::to_string(position) + ", " +
                    std::to_string(sink) + ", " + std::to_string(window) + ")");
    return position < sink ? position : sink + (position - sink) % window;
}

void check_ring_write(const torch::Tensor& k_buf, const torch::Tensor& v_buf, const torch::Tensor& k,
                      const torch::Tensor& v, int64_t slot) {
    for (const auto* t : {&k_buf, &v_buf, &k, &v})
        if (!t->defined()) throw Error("ring_write: undefined tensor");
    if (k_buf.dim() != 4 || v_buf.sizes() != k_buf.sizes())
        throw Error("ring_write: caches must both be [B, H, C, D], got " + shape_str(k_buf.sizes().vec()) + " and " +
                    shape_str(v_buf.sizes().vec()));
    if (!k_buf.is_contiguous() || !v_buf.is_contiguous()) throw Error("ring_write: caches must be contiguous");
    if (k_buf.scalar_type() != v_buf.scalar_type() || k.scalar_type() != k_buf.scalar_type() ||
        v.scalar_type() != k_buf.scalar_type())
        throw Error("ring_write: caches and rows must share one dtype");
    if (k_buf.device() != v_buf.device() || k.device() != k_buf.device() || v.device() != k_buf.device())
        throw Error("ring_write: caches and rows must be on one device");
    const int64_t B = k_buf.size(0), H = k_buf.size(1), C = k_buf.size(2), D = k_buf.size(3);
    const std::vector<int64_t> row3{B, H, D}, row4{B, H, 1, D};
    for (const auto* t : {&k, &v})
        if (t->sizes().vec() != row3 && t->sizes().vec() != row4)
            throw Error("ring_write: rows must be " + shape_str(row3) + " or " + shape_str(row4) + ", got " +
                        shape_str(t->sizes().vec()));
    if (slot < 0 || slot >= C)
        throw Error("ring_write: slot " + std::to_string(slot) + " outside [0, " + std::to_string(C) + ")");
}

void ring_write_cpu(torch::Tensor& k_buf, torch::Tensor& v_buf, const torch::Tensor& k, const torch::Tensor& v,
                    int64_t slot) {
    check_ring_write(k_buf, v_buf, k, v, slot);
    if (!k_buf.device().is_cpu()) throw Error("ring_write_cpu: tensors must be on the CPU");
    const int64_t rows = k_buf.size(0) * k_buf.size(1), C = k_buf.size(2);
    const size_t row_bytes = static_cast<size_t>(k_buf.size(3)) * k_buf.element_size();
    const auto kc = k.contiguous(), vc = v.contiguous();
    auto* kb = static_cast<char*>(k_buf.data_ptr());
    auto* vb = static_cast<char*>(v_buf.data_ptr());
    const auto* ks = static_cast<const char*>(kc.data_ptr());
    const auto* vs = static_cast<const char*>(vc.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
        const size_t dst = static_cast<size_t>(r * C + slot) * row_bytes, src = static_cast<size_t>(r) * row_bytes;
        std::memcpy(kb + dst, ks + src, row_bytes);
        std::memcpy(vb + dst, vs + src, row_bytes);
    }
}

} // namespace anchor::kernels
