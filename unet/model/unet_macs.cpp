// Analytic UNet MAC counts; the walk mirrors UNet2DConditionModelImpl's constructor and run() (unet/model/unet_model.cpp).
#include "unet/model/unet_macs.h"

#include "cache/io/error.h"

#include <cstdio>

namespace anchor::unet {

namespace {

struct Walker {
    const UNetConfig& c;
    int64_t temb, tokens;

    // 3x3 (or kxk) convolution producing co channels on n output positions.
    static void conv(MacCount& m, int64_t ci, int64_t co, int64_t k, int64_t n) { m.conv += ci * co * k * k * n; }

    // ResnetBlock2D: conv1, conv2, time_emb_proj (one token), 1x1 conv_shortcut when the width changes.
    void resnet(MacCount& m, int64_t ci, int64_t co, int64_t n) const {
        conv(m, ci, co, 3, n);
        conv(m, co, co, 3, n);
        m.linear += temb * co;
        if (ci != co) conv(m, ci, co, 1, n);
    }

    // Transformer2DModel with `depth` BasicTransformerBlocks of width ch on n tokens (inner dim = ch).
    void transformer(MacCount& m, int64_t ch, int64_t depth, int64_t n) const {
        const int64_t proj = 2 * ch * ch * n; // proj_in + proj_out, 1x1 conv (SD 1.x) or Linear (SD 2.x)
        (c.use_linear_projection ? m.linear : m.conv) += proj;
        const int64_t ctx = c.cross_attention_dim;
        for (int64_t d = 0; d < depth; ++d) {
            m.linear += 4 * ch * ch * n;                         // attn1 to_q, to_k, to_v, to_out.0
            m.linear += 2 * ch * ch * n + 2 * ctx * ch * tokens; // attn2 to_q, to_out.0 on n; to_k, to_v on context
            m.linear += ch * 8 * ch * n + 4 * ch * ch * n; // GEGLU proj (dim -> 2 * 4 dim), ff.net.2 (4 dim -> dim)
            m.attention += 2 * n * n * ch + 2 * n * tokens * ch; // (q k^T, p v) for self- and cross-attention
        }
    }
};

} // namespace

MacCount UNetMacBreakdown::full() const {
    MacCount m = stem;
    for (const auto& d : down) m += d;
    m += mid;
    for (const auto& u : up) m += u;
    m += head;
    return m;
}

MacCount UNetMacBreakdown::shallow(int branch, bool attention) const {
    if (branch < 0 || branch >= num_skips())
        throw Error("DeepCache branch " + std::to_string(branch) + " out of range [0, " + std::to_string(num_skips()) +
                    ")");
    MacCount m = stem;
    for (int k = 1; k <= branch; ++k) {
        m += down[size_t(k)];
        if (!attention) m -= down_attention[size_t(k)];
    }
    for (int k = 0; k <= branch; ++k) {
        m += up[size_t(k)];
        if (!attention) m -= up_attention[size_t(k)];
    }
    m += head;
    return m;
}

UNetMacBreakdown unet_mac_breakdown(const UNetConfig& c, int64_t latent_h, int64_t latent_w, int64_t tokens) {
    const size_t nb = c.block_out_channels.size();
    if (nb == 0 || c.down_block_types.size() != nb || c.up_block_types.size() != nb ||
        c.layers_per_block.size() != nb || c.transformer_layers_per_block.size() != nb)
        throw Error("UNet config: per-block lists must all have " + std::to_string(nb) + " entries");
    if (latent_h <= 0 || latent_w <= 0) throw Error("MAC count: latent size must be positive");
    const int64_t ch0 = c.block_out_channels[0];
    Walker w{c, 4 * ch0, tokens};
    UNetMacBreakdown b;

    int64_t h = latent_h, wd = latent_w;
    Walker::conv(b.stem, c.in_channels, ch0, 3, h * wd);
    b.stem.linear += ch0 * 4 * ch0 + 4 * ch0 * 4 * ch0; // time_embedding.linear_1, linear_2 (one token)
    if (c.text_time())                                  // SDXL's add_embedding.linear_1, linear_2 (one token)
        b.stem.linear += int64_t(c.projection_class_embeddings_input_dim) * 4 * ch0 + 4 * ch0 * 4 * ch0;

    // Down path: remember each skip's width and spatial size.
    std::vector<int64_t> skip_ch{ch0}, skip_h{h}, skip_w{wd};
    b.down.emplace_back(); // skip 0 = conv_in, counted in stem
    b.down_attention.emplace_back();
    int64_t ch = ch0;
    for (size_t i = 0; i < nb; ++i) {
        const int64_t co = c.block_out_channels[i];
        const bool attn = c.down_block_types[i] == "CrossAttnDownBlock2D";
        for (int j = 0; j < c.layers_per_block[i]; ++j) {
            MacCount m, t;
            w.resnet(m, ch, co, h * wd);
            ch = co;
            if (attn) w.transformer(t, ch, c.transformer_layers_per_block[i], h * wd);
            b.down.push_back(m += t);
            b.down_attention.push_back(t);
            skip_ch.push_back(ch), skip_h.push_back(h), skip_w.push_back(wd);
        }
        if (i + 1 < nb) {
            h = (h - 1) / 2 + 1; // 3x3, stride 2, padding 1
            wd = (wd - 1) / 2 + 1;
            MacCount m;
            Walker::conv(m, ch, ch, 3, h * wd);
            b.down.push_back(m);
            b.down_attention.emplace_back();
            skip_ch.push_back(ch), skip_h.push_back(h), skip_w.push_back(wd);
        }
    }
    if (c.mid_block) {
        w.resnet(b.mid, ch, ch, h * wd);
        w.transformer(b.mid, ch, c.transformer_layers_per_block.back(), h * wd);
        w.resnet(b.mid, ch, ch, h * wd);
    }

    // Up path: up block i mirrors down block nb-1-i with one extra layer; skips are consumed from the end.
    b.up.resize(b.down.size());
    b.up_attention.resize(b.down.size());
    int idx = int(b.down.size());
    for (size_t i = 0; i < nb; ++i) {
        const int64_t co = c.block_out_channels[nb - 1 - i];
        const bool attn = c.up_block_types[i] == "CrossAttnUpBlock2D";
        const int layers = c.layers_per_block[nb - 1 - i] + 1;
        const int64_t depth = c.transformer_layers_per_block[nb - 1 - i];
        int k = idx;
        for (int j = 0; j < layers; ++j) {
            k = --idx;
            if (k < 0) throw Error("UNet config: up blocks consume more skips than the down blocks produce");
            MacCount& m = b.up[size_t(k)];
            w.resnet(m, ch + skip_ch[size_t(k)], co, h * wd);
            ch = co;
            if (attn) {
                MacCount t;
                w.transformer(t, ch, depth, h * wd);
                m += t;
                b.up_attention[size_t(k)] = t;
            }
        }
        if (i + 1 < nb) { // nearest upsample to the next skip's size, then a 3x3 conv; runs with the layer of skip k
            h = skip_h[size_t(idx - 1)];
            wd = skip_w[size_t(idx - 1)];
            Walker::conv(b.up[size_t(k)], ch, ch, 3, h * wd);
        }
    }
    Walker::conv(b.head, ch0, c.out_channels, 3, h * wd);
    return b;
}

double deepcache_macs_per_step(const UNetMacBreakdown& b, int interval, int branch, int steps) {
    if (interval < 1) throw Error("DeepCache interval must be >= 1");
    const double full = double(b.full().total()), shallow = double(b.shallow(branch).total());
    if (steps <= 0) return (full + double(interval - 1) * shallow) / double(interval);
    const int n_full = (steps + interval - 1) / interval;
    return (double(n_full) * full + double(steps - n_full) * shallow) / double(steps);
}

std::string format_gmacs(double macs, int decimals) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, macs / 1e9);
    return buf;
}

} // namespace anchor::unet
