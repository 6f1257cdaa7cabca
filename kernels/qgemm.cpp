// Linear layers on weights kept in their storage format (qgemm.h).
#include "kernels/qgemm.h"

#include "cache/io/error.h"
#include "kernels/gemv.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace anchor::kernels {

const EnumTable<QWeightType>& qweight_type_table() {
    static const EnumTable<QWeightType> t = {{"f32", QWeightType::F32},
                                             {"f16", QWeightType::F16},
                                             {"bf16", QWeightType::BF16},
                                             {"q8_0", QWeightType::Q8_0},
                                             {"q4_0", QWeightType::Q4_0}};
    return t;
}

namespace {

torch::ScalarType qweight_dtype(QWeightType t) {
    switch (t) {
    case QWeightType::F32: return torch::kFloat32;
    case QWeightType::F16: return torch::kFloat16;
    case QWeightType::BF16: return torch::kBFloat16;
    case QWeightType::Q8_0:
    case QWeightType::Q4_0: return torch::kUInt8;
    }
    return torch::kUInt8;
}

bool qweight_is_blocks(QWeightType t) {
    return t == QWeightType::Q8_0 || t == QWeightType::Q4_0;
}

// Weight rows per tile: the float32 tile (tile x cols) stays within ~1 MiB, so it is still in L2 when BLAS reads it
// back; at least 16 rows so narrow layers still get wide BLAS calls.
int64_t qgemm_tile_rows(int64_t cols) {
    return std::max<int64_t>(16, (int64_t(1) << 18) / std::max<int64_t>(1, cols));
}

} // namespace

int64_t QWeight::row_bytes(QWeightType t, int64_t cols) {
    switch (t) {
    case QWeightType::F32: return 4 * cols;
    case QWeightType::F16:
    case QWeightType::BF16: return 2 * cols;
    case QWeightType::Q8_0: return q8_0_blocks(cols) * int64_t(sizeof(BlockQ8_0));
    case QWeightType::Q4_0: return q4_0_blocks(cols) * int64_t(sizeof(BlockQ4_0));
    }
    return 0;
}

QWeight QWeight::from_float(const torch::Tensor& w, QWeightType t) {
    if (w.dim() != 2) throw Error("QWeight::from_float: weight must be 2-D, got " + std::to_string(w.dim()) + "-D");
    QWeight q;
    q.type = t, q.rows = w.size(0), q.cols = w.size(1);
    switch (t) {
    case QWeightType::Q8_0: q.data = quantize_q8_0(w); break;
    case QWeightType::Q4_0: q.data = quantize_q4_0(w); break;
    default: q.data = w.detach().to(torch::kCPU).to(qweight_dtype(t)).contiguous();
    }
    return q;
}

QWeight QWeight::from_stored(torch::Tensor data, QWeightType t, int64_t rows, int64_t cols, const std::string& what) {
    const bool blocks = qweight_is_blocks(t);
    const std::vector<int64_t> want = {rows, blocks ? row_bytes(t, cols) : cols};
    if (data.scalar_type() != qweight_dtype(t) || data.sizes().vec() != want || !data.is_contiguous())
        throw Error(what + ": stored " + enum_name(qweight_type_table(), t) + " weight must be contiguous " +
                    std::string(c10::toString(qweight_dtype(t))) + " [" + std::to_string(want[0]) + ", " +
                    std::to_string(want[1]) + "]");
    QWeight q;
    q.type = t, q.rows = rows, q.cols = cols, q.data = std::move(data);
    return q;
}

void QWeight::dequantize_rows(int64_t r0, int64_t r1, float* out) const {
    const int64_t n = r1 - r0;
    if (n <= 0) return;
    if (!qweight_is_blocks(type)) {
        torch::from_blob(out, {n, cols}, torch::kFloat32).copy_(data.narrow(0, r0, n));
        return;
    }
    const uint8_t* base = data.data_ptr<uint8_t>();
    const int64_t rb = row_bytes(type, cols);
    at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; ++r) {
            float* dst = out + (r - r0) * cols;
            if (type == QWeightType::Q8_0)
                dequantize_row_q8_0(reinterpret_cast<const BlockQ8_0*>(base + r * rb), dst, cols);
            else
                dequantize_row_q4_0(reinterpret_cast<const BlockQ4_0*>(base + r * rb), dst, cols);
        }
    });
}

torch::Tensor QWeight::dequantize() const {
    if (type == QWeightType::F32) return data;
    auto out = torch::empty({rows, cols}, torch::kFloat32);
    dequantize_rows(0, rows, out.data_ptr<float>());
    return out;
}

torch::Tensor QWeight::gather_rows(const torch::Tensor& ids_in) const {
    auto ids = ids_in.to(torch::kLong).contiguous();
    auto shape = ids.sizes().vec();
    shape.push_back(cols);
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i)
        if (p[i] < 0 || p[i] >= rows)
            throw Error("embedding lookup: id " + std::to_string(p[i]) + " outside [0, " + std::to_string(rows) + ")");
    if (type == QWeightType::F32) return data.index_select(0, ids.reshape({-1})).reshape(shape);
    auto out = torch::empty(shape, torch::kFloat32);
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < ids.numel(); ++i) dequantize_rows(p[i], p[i] + 1, o + i * cols);
    return out;
}

QWeight QWeight::permute_rows(const torch::Tensor& perm) const {
    QWeight q = *this;
    q.data = data.index_select(0, perm.to(torch::kLong)).contiguous();
    return q;
}

torch::Tensor qlinear(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b) {
    if (x.size(-1) != w.cols)
        throw Error("qlinear: input has " + std::to_string(x.size(-1)) + " features, the weight " +
                    std::to_string(w.cols));
    auto out_shape = x.sizes().vec();
    out_shape.back() = w.rows;
    if (w.type == QWeightType::F32) // a plain float32 linear layer, the same calls as before weights were kept
        return b.defined() ? torch::addmm(b, x.reshape({-1, w.cols}), w.data.t()).view(out_shape)
                           : torch::matmul(x, w.data.t());
    auto x2 = x.reshape({-1, w.cols}).to(torch::kFloat32).contiguous();
    const int64_t n = x2.size(0), tile = std::min(w.rows, qgemm_tile_rows(w.cols));
    auto y = torch::empty({n, w.rows}, torch::kFloat32);
    auto buf = torch::empty({tile, w.cols}, torch::kFloat32);
    for (int64_t r0 = 0; r0 < w.rows; r0 += tile) {
        const int64_t t = std::min(tile, w.rows - r0);
        w.dequantize_rows(r0, r0 + t, buf.data_ptr<float>());
        auto part = torch::mm(x2, buf.narrow(0, 0, t).t());
        y.narrow(1, r0, t).copy_(part);
    }
    if (b.defined()) y.add_(b.to(torch::kFloat32));
    return y.view(out_shape);
}

torch::Tensor qlinear_ref(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b) {
    auto y = torch::matmul(x.to(torch::kFloat32), w.dequantize().t());
    return b.defined() ? y + b.to(torch::kFloat32) : y;
}

} // namespace anchor::kernels
