// Canny edges for ControlNet control images (OpenCV's implementation, as sd-webui-controlnet's annotator).
#include "unet/pipeline/control_preprocess.h"

#include "cache/io/error.h"

#include <cmath>
#include <cstdlib>

#if ANCHOR_HAVE_OPENCV
#include <opencv2/imgproc.hpp>
#endif

namespace anchor::unet {

const EnumTable<ControlPreprocess>& control_preprocess_table() {
    static const EnumTable<ControlPreprocess> t = {{"none", ControlPreprocess::None},
                                                   {"canny", ControlPreprocess::Canny}};
    return t;
}

ControlPreprocessSpec ControlPreprocessSpec::parse(const std::string& text, const std::string& field) {
    ControlPreprocessSpec s;
    const auto bad = [&] {
        return ParamError(field, "expected none, canny or canny:LOW:HIGH (thresholds in [0, 1000], LOW <= HIGH), got '" +
                                     text + "'");
    };
    const size_t colon = text.find(':');
    const std::string name = text.substr(0, colon);
    if (name == "none" && colon == std::string::npos) return s;
    if (name != "canny") throw bad();
    s.kind = ControlPreprocess::Canny;
    if (colon == std::string::npos) return s;
    const std::string rest = text.substr(colon + 1);
    const size_t c2 = rest.find(':');
    if (c2 == std::string::npos) throw bad();
    char* end = nullptr;
    const std::string a = rest.substr(0, c2), b = rest.substr(c2 + 1);
    s.low = std::strtod(a.c_str(), &end);
    if (a.empty() || *end) throw bad();
    s.high = std::strtod(b.c_str(), &end);
    if (b.empty() || *end) throw bad();
    if (!(s.low >= 0 && s.high <= 1000 && s.low <= s.high)) throw bad();
    return s;
}

torch::Tensor preprocess_control_image(const torch::Tensor& rgb_u8, const ControlPreprocessSpec& spec,
                                       const std::string& field) {
    if (spec.kind == ControlPreprocess::None) return rgb_u8;
    if (rgb_u8.dim() == 4) {
        std::vector<torch::Tensor> rows;
        for (int64_t i = 0; i < rgb_u8.size(0); ++i) rows.push_back(preprocess_control_image(rgb_u8[i], spec, field));
        return torch::stack(rows, 0);
    }
    TORCH_CHECK(rgb_u8.dim() == 3 && rgb_u8.size(2) == 3 && rgb_u8.scalar_type() == torch::kUInt8,
                "preprocess_control_image: uint8 [H, W, 3] expected, got ", rgb_u8.sizes());
#if ANCHOR_HAVE_OPENCV
    auto in = rgb_u8.contiguous();
    const cv::Mat img(int(in.size(0)), int(in.size(1)), CV_8UC3, in.data_ptr<uint8_t>());
    cv::Mat edges;
    cv::Canny(img, edges, spec.low, spec.high);
    auto out = torch::from_blob(edges.data, {in.size(0), in.size(1), 1}, torch::kUInt8).clone();
    return out.expand({in.size(0), in.size(1), 3}).contiguous();
#else
    (void)spec;
    throw ParamError(field, "canny needs OpenCV, and this build has none (rebuild with OpenCV, or give an edge image "
                            "made elsewhere)");
#endif
}

} // namespace anchor::unet
