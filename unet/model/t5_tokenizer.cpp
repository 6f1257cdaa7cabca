// T5 tokenizer (unet/model/t5_tokenizer.h).
#include "unet/model/t5_tokenizer.h"

#include "cache/io/error.h"
#include "cache/io/json_config.h"

#include <filesystem>

namespace anchor::unet {

namespace fs = std::filesystem;

T5Tokenizer T5Tokenizer::from_folder(const std::string& dir) {
    const fs::path model = fs::path(dir) / "spiece.model";
    if (!fs::exists(model))
        throw Error("T5 tokenizer folder '" + dir + "' has no spiece.model (the SentencePiece model" +
                    (fs::exists(fs::path(dir) / "tokenizer.json") ? "; tokenizer.json alone is not supported)" : ")"));
    T5Tokenizer t;
    auto sp = std::make_shared<SentencePieceModel>(SentencePieceModel::load(model.string()));
    t.pad_id_ = sp->pad_id();
    t.eos_id_ = sp->eos_id();
    if (t.pad_id_ < 0 || t.pad_id_ >= sp->piece_size() || t.eos_id_ < 0 || t.eos_id_ >= sp->piece_size())
        throw Error("'" + model.string() + "': the SentencePiece model has no <pad> or </s> piece (T5 needs both)");
    const fs::path cfg = fs::path(dir) / "tokenizer_config.json";
    const JsonConfig c = fs::exists(cfg) ? JsonConfig::load(cfg.string(), "tokenizer config")
                                         : JsonConfig(nlohmann::json::object(), cfg.string());
    if (c.has("added_tokens_decoder") && c.json().at("added_tokens_decoder").is_object()) {
        for (const auto& [id, tok] : c.json().at("added_tokens_decoder").items()) {
            if (!tok.is_object() || !tok.contains("content") || !tok["content"].is_string() || id.empty() ||
                id.find_first_not_of("0123456789") != std::string::npos)
                c.fail("added_tokens_decoder", "entries \"<id>\": {\"content\": \"<token>\"}", tok);
            t.specials_[tok["content"].get<std::string>()] = std::stoll(id);
        }
    } else {
        for (int id : {sp->pad_id(), sp->eos_id(), sp->unk_id()}) t.specials_[sp->id_to_piece(id)] = id;
        const int extra = c.get_int("extra_ids", 100);
        for (int i = 0; i < extra; ++i)
            t.specials_["<extra_id_" + std::to_string(i) + ">"] = sp->piece_size() + extra - 1 - i;
    }
    t.sp_ = sp;
    return t;
}

std::vector<int64_t> T5Tokenizer::encode(const std::string& text) const {
    if (!sp_) throw Error("T5 tokenizer: not loaded");
    std::vector<int64_t> ids;
    auto encode_stretch = [&](size_t from, size_t to) {
        for (int id : sp_->encode(text.substr(from, to - from))) ids.push_back(id);
    };
    // HF splits on its added (special) tokens first, the longest at the earliest position, and SentencePiece encodes
    // each stretch between them on its own (its own dummy prefix and whitespace trimming).
    size_t start = 0, pos = 0;
    while (pos < text.size()) {
        size_t best = 0;
        int64_t best_id = -1;
        for (const auto& [s, id] : specials_)
            if (s.size() > best && text.compare(pos, s.size(), s) == 0) best = s.size(), best_id = id;
        if (best == 0) {
            ++pos;
            continue;
        }
        if (pos > start) encode_stretch(start, pos);
        ids.push_back(best_id);
        pos += best;
        start = pos;
    }
    if (start < text.size()) encode_stretch(start, text.size());
    ids.push_back(eos_id_);
    return ids;
}

std::vector<int64_t> T5Tokenizer::tokenize(const std::string& text, int max_length) const {
    if (max_length < 1)
        throw ParamError("max_sequence_length", "must be at least 1, got " + std::to_string(max_length));
    auto ids = encode(text);
    if (int64_t(ids.size()) > max_length) {
        ids.resize(size_t(max_length) - 1);
        ids.push_back(eos_id_);
    }
    ids.resize(size_t(max_length), pad_id_);
    return ids;
}

} // namespace anchor::unet
