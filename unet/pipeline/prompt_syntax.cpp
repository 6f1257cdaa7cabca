// A1111 prompt syntax: emphasis parser, 75-token chunking with comma backtracking, emphasis weighting.
#include "unet/pipeline/prompt_syntax.h"

#include "cache/io/error.h"
#include "unet/model/clip_tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace anchor::unet {

using torch::Tensor;

const EnumTable<PromptSyntax>& prompt_syntax_table() {
    static const EnumTable<PromptSyntax> t = {{"a1111", PromptSyntax::A1111}, {"plain", PromptSyntax::Plain}};
    return t;
}

bool is_chunk_break(const PromptFragment& f) {
    return f.weight == -1.0 && f.text == "BREAK";
}

namespace {

constexpr double kRoundMultiplier = 1.1;
constexpr double kSquareMultiplier = 1 / 1.1;

bool is_space(char c) {
    return std::isspace(static_cast<unsigned char>(c)) != 0;
}
// Python's \w on str: letters, digits, underscore; non-ASCII UTF-8 bytes count as letters.
bool is_word(char c) {
    const auto u = static_cast<unsigned char>(c);
    return u >= 0x80 || std::isalnum(u) || c == '_';
}

// re.split(r"\s*\bBREAK\b\s*", run): the pieces between the breaks.
std::vector<std::string> split_breaks(const std::string& s) {
    std::vector<std::string> parts;
    size_t begin = 0, search = 0;
    while (true) {
        size_t j = s.find("BREAK", search);
        if (j == std::string::npos) break;
        const bool left = j == 0 || !is_word(s[j - 1]);
        const bool right = j + 5 == s.size() || !is_word(s[j + 5]);
        if (!left || !right) {
            search = j + 1;
            continue;
        }
        size_t a = j, b = j + 5;
        while (a > begin && is_space(s[a - 1])) --a;
        while (b < s.size() && is_space(s[b])) ++b;
        parts.push_back(s.substr(begin, a - begin));
        begin = search = b;
    }
    parts.push_back(s.substr(begin));
    return parts;
}

// At s[i] == ':', the weight token `:\s*([+-]?[.\d]+)\s*\)`: its length (0 when it does not match) and the number.
size_t weight_token(const std::string& s, size_t i, std::string& number) {
    size_t k = i + 1;
    while (k < s.size() && is_space(s[k])) ++k;
    const size_t n0 = k;
    if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
    const size_t d0 = k;
    while (k < s.size() && (s[k] == '.' || std::isdigit(static_cast<unsigned char>(s[k])))) ++k;
    if (k == d0) return 0;
    number = s.substr(n0, k - n0);
    while (k < s.size() && is_space(s[k])) ++k;
    if (k == s.size() || s[k] != ')') return 0;
    return k + 1 - i;
}

double parse_weight(const std::string& number, const std::string& prompt) {
    char* end = nullptr;
    const double v = std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size() || number == "+" || number == "-")
        throw ParamError("prompts", "attention weight '" + number + "' is not a number in the prompt \"" +
                                        (prompt.size() > 60 ? prompt.substr(0, 57) + "..." : prompt) + "\"");
    return v;
}

bool is_special(char c) {
    return c == '\\' || c == '(' || c == ')' || c == '[' || c == ']' || c == ':';
}

} // namespace

void check_prompt_bytes(const std::string& text, const std::string& field) {
    if (text.size() > kMaxPromptBytes)
        throw ParamError(field, "a prompt of " + std::to_string(text.size()) + " bytes, at most " +
                                    std::to_string(kMaxPromptBytes) + " are read");
}

std::vector<PromptFragment> parse_prompt_attention(const std::string& text) {
    check_prompt_bytes(text);
    std::vector<PromptFragment> res;
    std::vector<size_t> round, square; // positions in res where an open bracket starts
    auto multiply_from = [&res](size_t start, double m) {
        for (size_t p = start; p < res.size(); ++p) res[p].weight *= m;
    };
    auto add_text = [&res](const std::string& run) {
        const auto parts = split_breaks(run);
        for (size_t i = 0; i < parts.size(); ++i) {
            if (i > 0) res.push_back({"BREAK", -1.0});
            res.push_back({parts[i], 1.0});
        }
    };
    size_t i = 0;
    while (i < text.size()) {
        const char c = text[i];
        if (c == '\\') { // \( \) \[ \] \\ are the character; a lone backslash is dropped (A1111's regex)
            const bool pair = i + 1 < text.size() && std::string("()[]\\").find(text[i + 1]) != std::string::npos;
            res.push_back({pair ? std::string(1, text[i + 1]) : std::string(), 1.0});
            i += pair ? 2 : 1;
        } else if (c == '(' || c == '[') {
            if (round.size() + square.size() >= size_t(kMaxPromptNesting))
                throw ParamError("prompts", "brackets nested more than " + std::to_string(kMaxPromptNesting) +
                                                " deep (at byte " + std::to_string(i) + " of the prompt)");
            (c == '(' ? round : square).push_back(res.size());
            ++i;
        } else if (c == ':') {
            std::string number;
            const size_t n = weight_token(text, i, number);
            if (n > 0 && !round.empty()) {
                multiply_from(round.back(), parse_weight(number, text));
                round.pop_back();
                i += n;
            } else if (n > 0) { // `:1.3)` with no bracket open is text
                add_text(text.substr(i, n));
                i += n;
            } else {
                add_text(":");
                ++i;
            }
        } else if (c == ')' && !round.empty()) {
            multiply_from(round.back(), kRoundMultiplier);
            round.pop_back();
            ++i;
        } else if (c == ']' && !square.empty()) {
            multiply_from(square.back(), kSquareMultiplier);
            square.pop_back();
            ++i;
        } else if (c == ')' || c == ']') {
            add_text(std::string(1, c));
            ++i;
        } else {
            size_t j = i;
            while (j < text.size() && !is_special(text[j])) ++j;
            add_text(text.substr(i, j - i));
            i = j;
        }
    }
    // Brackets left open close at the end, in the order they were opened.
    for (size_t pos : round) multiply_from(pos, kRoundMultiplier);
    for (size_t pos : square) multiply_from(pos, kSquareMultiplier);
    if (res.empty()) res.push_back({"", 1.0});
    std::vector<PromptFragment> merged{res.front()};
    for (size_t k = 1; k < res.size(); ++k) {
        if (res[k].weight == merged.back().weight)
            merged.back().text += res[k].text;
        else
            merged.push_back(res[k]);
    }
    return merged;
}

namespace {
PromptChunk framed(const ClipTokenizer& tok, std::vector<int64_t> ids, std::vector<float> weights, int chunk_length) {
    PromptChunk c;
    c.ids.reserve(size_t(chunk_length) + 2);
    c.ids.push_back(ClipTokenizer::kBos);
    c.ids.insert(c.ids.end(), ids.begin(), ids.end());
    c.ids.push_back(ClipTokenizer::kEos);
    // A1111 pads with eos and then sets everything after the first eos to the pad id (SD 2.x's 0): the same ids.
    while (c.ids.size() < size_t(chunk_length) + 2) c.ids.push_back(tok.pad_id());
    c.weights.assign(c.ids.size(), 1.0f);
    for (size_t k = 0; k < weights.size(); ++k) c.weights[k + 1] = weights[k];
    return c;
}
} // namespace

PromptChunk empty_chunk(const ClipTokenizer& tok, int chunk_length) {
    return framed(tok, {}, {}, chunk_length);
}

namespace {
// A1111's find_embedding_at_position: the first (longest) name whose tokens start at tokens[pos].
const TokenEmbedding* embedding_at(const std::vector<TokenEmbedding>& names, const std::vector<int64_t>& tokens,
                                   size_t pos) {
    for (const auto& e : names)
        if (pos + e.ids.size() <= tokens.size() && std::equal(e.ids.begin(), e.ids.end(), tokens.begin() + long(pos)))
            return &e;
    return nullptr;
}
} // namespace

ChunkedPrompt chunk_prompt(const ClipTokenizer& tok, const std::vector<PromptFragment>& parsed,
                           const PromptChunkOptions& o) {
    const size_t L = size_t(o.chunk_length);
    const int64_t comma = tok.token_id(",</w>");
    ChunkedPrompt out;
    std::vector<int64_t> ids;
    std::vector<float> weights;
    std::vector<ChunkFix> fixes;
    long last_comma = -1; // index in the current chunk of its last comma
    auto next_chunk = [&](bool is_last) {
        out.token_count += is_last ? int(ids.size()) : o.chunk_length;
        out.chunks.push_back(framed(tok, ids, weights, o.chunk_length));
        out.chunks.back().fixes = std::move(fixes);
        ids.clear();
        weights.clear();
        fixes.clear();
        last_comma = -1;
    };
    size_t seen = 0; // tokens so far (an embedding's vectors in place of its name's tokens)
    auto count = [&](size_t n) {
        if (seen + n > size_t(o.max_tokens))
            throw ParamError("prompts", "a prompt of more than " + std::to_string(o.max_tokens) + " CLIP tokens (" +
                                            std::to_string(o.max_tokens / std::max(1, o.chunk_length)) + " chunks of " +
                                            std::to_string(o.chunk_length) + ")");
        seen += n;
    };
    for (const auto& f : parsed) {
        if (o.check) o.check();
        if (is_chunk_break(f)) {
            next_chunk(false);
            continue;
        }
        const auto tokens = tok.encode(f.text);
        count(tokens.size());
        size_t pos = 0;
        while (pos < tokens.size()) {
            const int64_t token = tokens[pos];
            if (token == comma) {
                last_comma = long(ids.size());
            } else if (o.comma_backtrack > 0 && ids.size() == L && last_comma >= 0 &&
                       long(ids.size()) - last_comma <= o.comma_backtrack) {
                // The words after the last comma move to the next chunk instead of being split across two.
                const size_t at = size_t(last_comma) + 1;
                std::vector<int64_t> moved_ids(ids.begin() + long(at), ids.end());
                std::vector<float> moved_w(weights.begin() + long(at), weights.end());
                std::vector<ChunkFix> kept, moved;
                for (const auto& fx : fixes)
                    (size_t(fx.offset) >= at ? moved : kept).push_back({fx.offset - int(at), fx.index});
                for (auto& fx : kept) fx.offset += int(at);
                ids.resize(at);
                weights.resize(at);
                fixes = std::move(kept);
                next_chunk(false);
                ids = std::move(moved_ids);
                weights = std::move(moved_w);
                fixes = std::move(moved);
            }
            if (ids.size() == L) next_chunk(false);
            const TokenEmbedding* e = o.embeddings ? embedding_at(*o.embeddings, tokens, pos) : nullptr;
            if (!e) {
                ids.push_back(token);
                weights.push_back(float(f.weight));
                ++pos;
                continue;
            }
            const size_t n = size_t(e->vectors);
            if (n > L)
                throw ParamError("prompts", "a textual-inversion embedding of " + std::to_string(n) +
                                                " vectors does not fit in a chunk of " + std::to_string(L) + " tokens");
            if (n > e->ids.size()) count(n - e->ids.size());
            if (ids.size() + n > L) next_chunk(false);
            fixes.push_back({int(ids.size()), e->index});
            ids.insert(ids.end(), n, 0);
            weights.insert(weights.end(), n, float(f.weight));
            if (std::find(out.embeddings_used.begin(), out.embeddings_used.end(), e->index) ==
                out.embeddings_used.end())
                out.embeddings_used.push_back(e->index);
            pos += e->ids.size();
        }
    }
    if (!ids.empty() || out.chunks.empty()) next_chunk(true);
    return out;
}

Tensor apply_emphasis(const Tensor& z, const Tensor& weights) {
    TORCH_CHECK(z.dim() == 3 && weights.dim() == 2 && weights.size(0) == z.size(0) && weights.size(1) == z.size(1),
                "apply_emphasis: z [B, T, D] and weights [B, T], got ", z.sizes(), " and ", weights.sizes());
    const auto w = weights.to(z.device(), z.scalar_type());
    std::vector<Tensor> rows;
    bool any = false;
    for (int64_t b = 0; b < z.size(0); ++b) {
        auto zb = z[b];
        if ((w[b] == 1).all().item<bool>()) {
            rows.push_back(zb);
            continue;
        }
        any = true;
        const auto mean0 = zb.mean();
        auto weighted = zb * w[b].unsqueeze(-1);
        rows.push_back(weighted * (mean0 / weighted.mean()));
    }
    return any ? torch::stack(rows, 0) : z;
}

Tensor encode_chunked(const std::vector<ChunkedPrompt>& prompts, const PromptChunk& empty, const ChunkEncoder& encode,
                      size_t min_chunks) {
    const SplicingChunkEncoder plain = [&encode](const Tensor& ids, const std::vector<std::vector<ChunkFix>>& fixes) {
        for (const auto& row : fixes)
            TORCH_CHECK(row.empty(), "encode_chunked: a prompt names an embedding and the encoder splices none");
        return encode(ids);
    };
    return encode_chunked(prompts, empty, plain, min_chunks);
}

Tensor encode_chunked(const std::vector<ChunkedPrompt>& prompts, const PromptChunk& empty,
                      const SplicingChunkEncoder& encode, size_t min_chunks) {
    size_t k = std::max<size_t>(min_chunks, 1);
    for (const auto& p : prompts) k = std::max(k, p.chunks.size());
    const int64_t B = int64_t(prompts.size()), T = int64_t(empty.ids.size());
    std::vector<Tensor> parts;
    for (size_t c = 0; c < k; ++c) {
        auto ids = torch::empty({B, T}, torch::kLong);
        auto w = torch::empty({B, T}, torch::kFloat);
        std::vector<std::vector<ChunkFix>> fixes(static_cast<size_t>(B));
        for (int64_t b = 0; b < B; ++b) {
            const auto& chunks = prompts[size_t(b)].chunks;
            const PromptChunk& ch = c < chunks.size() ? chunks[c] : empty;
            TORCH_CHECK(int64_t(ch.ids.size()) == T, "encode_chunked: chunks of ", ch.ids.size(), " and ", T, " ids");
            std::copy(ch.ids.begin(), ch.ids.end(), ids[b].data_ptr<int64_t>());
            std::copy(ch.weights.begin(), ch.weights.end(), w[b].data_ptr<float>());
            fixes[size_t(b)] = ch.fixes;
        }
        parts.push_back(apply_emphasis(encode(ids, fixes), w));
    }
    return parts.size() == 1 ? parts[0] : torch::cat(parts, 1);
}

void check_prompt_syntax(PromptSyntax syntax, std::initializer_list<const std::vector<std::string>*> lists) {
    for (const auto* list : lists)
        for (const auto& text : *list) check_prompt_bytes(text);
    if (syntax != PromptSyntax::A1111) return;
    for (const auto* list : lists)
        for (const auto& text : *list) (void)parse_prompt_attention(text);
}

} // namespace anchor::unet
