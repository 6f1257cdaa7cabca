// The tiny MDLM shapes the text-diffusion tests build random models of (32 wide, 4 heads, 3 blocks): small enough for
// every test to run many samples, with the full GPT-2 vocabulary so that real prompts encode.
#pragma once

#include "text/diffusion/mdlm_model.h"

namespace anchor::test {

inline text::MdlmConfig tiny_mdlm_config(text::GateKind gate = text::GateKind::TimeAnchor) {
    text::MdlmConfig c;
    c.hidden_size = 32;
    c.n_heads = 4;
    c.n_blocks = 3;
    c.cond_dim = 16;
    c.freq_embed_size = 32;
    c.gate = gate;
    return c;
}

} // namespace anchor::test
