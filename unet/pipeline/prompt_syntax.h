// Prompts as AUTOMATIC1111's stable-diffusion-webui reads them: attention emphasis `(text)`, `[text]`,
// `(text:1.3)`, `BREAK`, and prompts longer than CLIP's 75 tokens encoded as several 77-token chunks whose encodings
// are concatenated on the token axis (modules/prompt_parser.py parse_prompt_attention and modules/sd_hijack_clip.py
// FrozenCLIPEmbedderWithCustomWordsBase). `Plain` is diffusers' behaviour: the text as is, one chunk, truncated.
//
// The encoder is passed as a function of [B, 77] ids so a second text encoder (SDXL's) can reuse the same chunking.
#pragma once

#include "cache/io/enum_table.h"
#include "unet/model/embeddings.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

namespace anchor::unet {

class ClipTokenizer;

enum class PromptSyntax { A1111, Plain };
const EnumTable<PromptSyntax>& prompt_syntax_table(); // "a1111", "plain"

// One run of prompt text with its attention multiplier. A chunk break (`BREAK`) is the entry ("BREAK", -1), as in
// A1111; inside brackets its weight is multiplied like any other entry and it is then plain text (A1111 does so).
struct PromptFragment {
    std::string text;
    double weight = 1.0;
};
bool is_chunk_break(const PromptFragment& f);

// Bounds on one prompt (positive or negative), checked before any tokenizing or allocation so a request cannot hold
// the server: its UTF-8 bytes, its brackets' nesting (each closing bracket multiplies every entry it encloses, so the
// parse costs bytes x depth), and its CLIP tokens under A1111 chunking (each chunk is one more pass of the text
// encoder and 77 more keys in every cross-attention). A1111 itself has no bounds; these are far above real prompts.
constexpr size_t kMaxPromptBytes = size_t(1) << 16;
constexpr int kMaxPromptNesting = 256;
constexpr int kMaxPromptTokens = 75 * 20;
// ParamError(field) when `text` is longer than kMaxPromptBytes.
void check_prompt_bytes(const std::string& text, const std::string& field = "prompts");

// A1111 parse_prompt_attention: `(x)` x1.1, `[x]` /1.1, `(x:w)` xw, nesting multiplies, brackets left open are
// closed at the end, `\(` `\)` `\[` `\]` `\\` are literal characters, the word BREAK (upper case, on word
// boundaries, surrounding whitespace dropped) is a chunk break, consecutive entries of equal weight are merged, an
// empty prompt is [("", 1.0)]. Throws ParamError("prompts") for a weight that is not a number, e.g. `(x:1.2.3)`
// (A1111 fails there too), and ParamError("prompts") past kMaxPromptBytes or kMaxPromptNesting.
std::vector<PromptFragment> parse_prompt_attention(const std::string& text);
// Every text of each list is within kMaxPromptBytes and parses under `syntax` (A1111: ParamError("prompts") for a
// weight that is not a number; plain text always reads).
void check_prompt_syntax(PromptSyntax syntax, std::initializer_list<const std::vector<std::string>*> lists);

// A textual-inversion embedding in a chunk (A1111's PromptChunkFix): its vectors replace the input embeddings of
// positions offset + 1 .. offset + n of the chunk's ids (the + 1 is the bos), whose ids are placeholders (0, as A1111).
struct ChunkFix {
    int offset = 0;
    int index = 0; // the embedding's index in its EmbeddingDatabase (TokenEmbedding::index)
};

// One CLIP window: [bos] + up to chunk_length tokens + [eos] + padding, and the multiplier of every position (1.0 on
// the framing and the padding).
struct PromptChunk {
    std::vector<int64_t> ids;
    std::vector<float> weights;
    std::vector<ChunkFix> fixes;
};

struct ChunkedPrompt {
    std::vector<PromptChunk> chunks;
    int token_count = 0; // A1111's count: chunk_length per full chunk, the tokens of the last one
    std::vector<int> embeddings_used; // indices of the textual-inversion embeddings it names, in order of first use
};

struct PromptChunkOptions {
    int chunk_length = 75;             // CLIP's 77 positions less bos/eos
    int comma_backtrack = 20;          // A1111 opts.comma_padding_backtrack; 0 disables
    int max_tokens = kMaxPromptTokens; // more: ParamError("prompts"), raised as soon as the count passes it
    // Called before each fragment is tokenized: a cancellation point (it throws to stop).
    std::function<void()> check;
    // Textual-inversion names (EmbeddingDatabase::lookup, longest first); null: none.
    const std::vector<TokenEmbedding>* embeddings = nullptr;
};

// A1111 tokenize_line: every fragment tokenized on its own, the tokens collected into chunks of chunk_length; a chunk
// break starts a new chunk; when a chunk is full and its last comma is at most comma_backtrack tokens back, the
// tokens after that comma move to the next chunk. Always at least one chunk. With o.embeddings, a name found in a
// fragment's tokens becomes n placeholder positions of the fragment's weight and a ChunkFix (A1111's tokenize_line):
// the n vectors count against the chunk length, and a name whose vectors do not fit in the rest of the chunk starts
// the next one. Unlike A1111, the comma backtrack moves a fix with its positions (A1111 leaves it behind, writing the
// vectors over the old chunk's padding). ParamError("prompts") for an embedding of more vectors than a chunk holds.
ChunkedPrompt chunk_prompt(const ClipTokenizer& tok, const std::vector<PromptFragment>& parsed,
                           const PromptChunkOptions& o = {});
// The chunk of an empty prompt: [bos][eos] + padding, weights 1.
PromptChunk empty_chunk(const ClipTokenizer& tok, int chunk_length = 75);

// A1111's "Original" emphasis on one encoded chunk: for every row b with a weight != 1,
//   mean0 = z[b].mean(); z[b] *= w[b] (per token); z[b] *= mean0 / z[b].mean().
// Rows whose weights are all 1 are returned untouched (bit for bit). z [B, T, D], weights [B, T].
// A1111 takes the mean over the whole batch of the chunk; here it is per prompt, so a prompt's conditioning does not
// depend on the prompts batched with it (the same numbers for a batch of one, A1111's default).
torch::Tensor apply_emphasis(const torch::Tensor& z, const torch::Tensor& weights);

// [B, T] int64 ids -> [B, T, D] (the text encoder with its clip_skip).
using ChunkEncoder = std::function<torch::Tensor(const torch::Tensor& ids)>;
// The same with the textual-inversion fixes of every row (fixes[b] for row b) to splice into the input embeddings.
using SplicingChunkEncoder =
    std::function<torch::Tensor(const torch::Tensor& ids, const std::vector<std::vector<ChunkFix>>& fixes)>;

// The A1111 conditioning of a batch of prompts: every prompt chunked, every row padded with empty chunks to
// max(min_chunks, the longest prompt's chunk count), chunk i of every row encoded as one batch, emphasis applied,
// the chunks concatenated: [B, 77 * k, D].
torch::Tensor encode_chunked(const std::vector<ChunkedPrompt>& prompts, const PromptChunk& empty,
                             const ChunkEncoder& encode, size_t min_chunks = 0);
// The same, each chunk's fixes handed to the encoder with its ids.
torch::Tensor encode_chunked(const std::vector<ChunkedPrompt>& prompts, const PromptChunk& empty,
                             const SplicingChunkEncoder& encode, size_t min_chunks = 0);

} // namespace anchor::unet
