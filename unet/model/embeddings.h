// Textual-inversion embeddings (Gal et al. 2022, "An Image is Worth One Word") as AUTOMATIC1111's webui reads them
// (modules/textual_inversion/textual_inversion.py): every file of an embeddings folder is one name, its file stem
// (`EasyNegative.pt` -> EasyNegative), standing for N learned vectors of the text encoder's input-embedding space. A
// prompt that names it gets the N vectors in place of the name's tokens (the spliced input embeddings: the position
// embeddings are added after, as for words), and A1111's emphasis weighs them as it weighs words.
//
// Formats (all read to float32, as A1111 does):
//   * A1111's own `.pt` (torch.save through the restricted unpickler): {"string_to_param": {"*": [N, D]}, ...}
//   * `.safetensors` with one tensor, `emb_params` [N, D] (what Civitai hands out), or any one tensor
//   * diffusers' concept `.bin` / `.pt`: {"<token>": [D] or [N, D]}
//   * SDXL: `clip_l` [N, 768] and `clip_g` [N, 1280] (one for each text encoder), in either container
// Matching: as A1111, on CLIP tokens: a name matches where the prompt's tokens of one emphasis fragment contain the
// name's tokens, so it is case-insensitive like the tokenizer (lower-cases); the longest name starting at a position
// wins. Two files whose names read as the same tokens (same stem, or stems differing in case) are refused at load.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace anchor::unet {

class ClipTokenizer;

struct TextualInversion {
    std::string name;   // the file stem: the word a prompt uses
    std::string file;   // the path it was read from
    std::string sha256; // of the whole file (A1111's Embedding.hash; its infotext writes the first 10 digits)
    // SD 1.x / 2.x files: `vectors` [N, D]. SDXL files: `clip_l` [N, D1] and `clip_g` [N, D2] (vectors undefined).
    torch::Tensor vectors, clip_l, clip_g;

    bool sdxl() const { return clip_l.defined(); }
    int64_t count() const; // N
    std::string short_hash() const { return sha256.substr(0, 10); }
    // A one-line description of the tensors ("[2, 768]" or "clip_l [2, 768], clip_g [2, 1280]").
    std::string shape_text() const;
    // The vectors for text encoder `encoder` (0: the only one, or SDXL's first; 1: SDXL's second) of a model whose
    // encoders take `widths` (one entry per encoder). Throws anchor::Error naming the file, the expected shape and
    // the actual one when the embedding is made for another encoder.
    torch::Tensor for_encoder(size_t encoder, const std::vector<int64_t>& widths) const;
};

// Reads one embedding file; `name` empty: the file stem. Throws anchor::Error naming the file (unreadable, corrupt,
// no tensor that is an embedding, vectors that are not [N, D] with N >= 1).
TextualInversion load_textual_inversion(const std::string& path, const std::string& name = "");

// One name as a tokenizer reads it, for the prompt chunker (prompt_syntax.h): its tokens, the embedding's index in
// its database and how many vectors it expands to.
struct TokenEmbedding {
    std::vector<int64_t> ids;
    int index = 0;
    int vectors = 0;
};

class EmbeddingDatabase {
public:
    // Every .pt / .bin / .safetensors file under `dir` (sub-folders too, as A1111; other files are skipped), in path
    // order. Throws anchor::Error for a folder that is missing, a file that does not read (naming it), and two files
    // of the same name.
    static EmbeddingDatabase load_dir(const std::string& dir);
    // Adds one; throws anchor::Error when its name reads as the same tokens as one already there.
    void add(TextualInversion e);
    const std::vector<TextualInversion>& items() const { return items_; }
    bool empty() const { return items_.empty(); }
    const TextualInversion* find(const std::string& name) const; // by exact name; nullptr when absent
    const std::string& dir() const { return dir_; }
    // The names as `tok` reads them, longest token sequence first (A1111's ids_lookup order).
    std::vector<TokenEmbedding> lookup(const ClipTokenizer& tok) const;

private:
    std::string dir_;
    std::vector<TextualInversion> items_;
};

} // namespace anchor::unet
