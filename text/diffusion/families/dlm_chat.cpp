// Tokenizers and chat templates of the published diffusion LMs (dlm_chat.h).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/diffusion/families/dlm_chat.h"

#include "cache/bpe.h"
#include "cache/io/error.h"
#include "text/gpt2/gpt2_tokenizer.h"

#include <nlohmann/json.hpp>
#include <pcre2.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>

namespace fs = std::filesystem;

namespace anchor::text {

namespace {

std::string hfbpe_utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
        s += char(cp);
    } else if (cp < 0x800) {
        s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        s += char(0xE0 | (cp >> 12)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
    } else {
        s += char(0xF0 | (cp >> 18)), s += char(0x80 | ((cp >> 12) & 0x3F)), s += char(0x80 | ((cp >> 6) & 0x3F));
        s += char(0x80 | (cp & 0x3F));
    }
    return s;
}

// GPT-2's bytes_to_unicode (byte-level BPE's alphabet): printable bytes stay, the other 68 map to U+0100 on.
std::vector<std::string> hfbpe_byte_map() {
    std::vector<std::string> out(256);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
        const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        out[b] = hfbpe_utf8(printable ? uint32_t(b) : next++);
    }
    return out;
}

class HfBpeTokenizer : public DlmTokenizer {
public:
    explicit HfBpeTokenizer(const std::string& path) : path_(path) {
        std::ifstream f(path);
        if (!f) throw Error("cannot open tokenizer '" + path + "'");
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(f);
        } catch (const std::exception& e) {
            throw Error("cannot parse tokenizer '" + path + "': " + e.what());
        }
        auto bad = [&](const std::string& field, const std::string& why) {
            throw Error("tokenizer '" + path + "', field '" + field + "': " + why);
        };
        const auto& model = j.at("model");
        if (model.value("type", std::string()) != "BPE") bad("model.type", "only byte-level BPE is supported");
        for (const auto& [tok, id] : model.at("vocab").items()) {
            vocab_[tok] = id.get<int64_t>();
            id_to_token_[id.get<int64_t>()] = tok;
        }
        int rank = 0;
        for (const auto& m : model.at("merges")) {
            std::string key;
            if (m.is_string()) key = m.get<std::string>();
            else if (m.is_array() && m.size() == 2) key = m[0].get<std::string>() + " " + m[1].get<std::string>();
            else bad("model.merges", "entries must be \"a b\" or [a, b]");
            ranks_.emplace(key, rank++);
        }
        if (j.contains("normalizer") && !j["normalizer"].is_null()) {
            const std::string nt = j["normalizer"].value("type", std::string());
            if (nt != "NFC") bad("normalizer", "type '" + nt + "' is not supported (NFC is assumed of the input)");
        }
        // The Split regex of the pre-tokenizer (alone or in a Sequence with ByteLevel(use_regex=false)).
        std::string pattern;
        std::function<void(const nlohmann::json&)> scan = [&](const nlohmann::json& p) {
            if (!p.is_object()) return;
            const std::string t = p.value("type", std::string());
            if (t == "Sequence")
                for (const auto& q : p.at("pretokenizers")) scan(q);
            else if (t == "Split" && p.contains("pattern") && p["pattern"].contains("Regex"))
                pattern = p["pattern"]["Regex"].get<std::string>();
            else if (t == "ByteLevel" && p.value("use_regex", true) && pattern.empty())
                pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
        };
        if (j.contains("pre_tokenizer")) scan(j["pre_tokenizer"]);
        if (pattern.empty()) bad("pre_tokenizer", "no Split regex or ByteLevel pre-tokenizer");
        int err = 0;
        PCRE2_SIZE off = 0;
        code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                              &err, &off, nullptr);
        if (!code_) bad("pre_tokenizer", "its regex does not compile at offset " + std::to_string(off));
        for (const auto& a : j.value("added_tokens", nlohmann::json::array())) {
            const std::string content = a.at("content").get<std::string>();
            const int64_t id = a.at("id").get<int64_t>();
            added_.emplace_back(content, id);
            id_to_token_[id] = content;
            if (a.value("special", false)) special_ids_.insert(id);
            added_ids_.insert(id);
        }
        // Longest first, so that a token that is a prefix of another never shadows it.
        std::sort(added_.begin(), added_.end(),
                  [](const auto& x, const auto& y) { return x.first.size() > y.first.size(); });
        byte_map_ = hfbpe_byte_map();
        for (int b = 0; b < 256; ++b) unicode_to_byte_[byte_map_[b]] = char(b);
    }
    ~HfBpeTokenizer() override {
        if (code_) pcre2_code_free(code_);
    }

    std::vector<int64_t> encode_with_specials(const std::string& text) const override {
        std::vector<int64_t> out;
        size_t start = 0, i = 0;
        while (i < text.size()) {
            bool hit = false;
            for (const auto& [content, id] : added_) {
                if (!content.empty() && text.compare(i, content.size(), content) == 0) {
                    encode_plain(text.substr(start, i - start), out);
                    out.push_back(id);
                    i += content.size();
                    start = i;
                    hit = true;
                    break;
                }
            }
            if (!hit) ++i;
        }
        encode_plain(text.substr(start), out);
        return out;
    }

    std::string decode(const std::vector<int64_t>& ids) const override {
        std::string bytes;
        for (auto id : ids) {
            if (special_ids_.count(id)) continue;
            // An id past the tokenizer's (the padding rows of an embedding table larger than the vocabulary, which a
            // model can still sample) has no text: left out like a special token, as GPT-2's decode does.
            auto it = id_to_token_.find(id);
            if (it == id_to_token_.end()) continue;
            if (added_ids_.count(id)) {
                bytes += it->second;
                continue;
            }
            const std::string& t = it->second;
            for (size_t k = 0; k < t.size();) {
                const auto b = static_cast<unsigned char>(t[k]);
                const size_t n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
                auto u = unicode_to_byte_.find(t.substr(k, n));
                if (u != unicode_to_byte_.end()) bytes += u->second;
                else bytes += t.substr(k, n);
                k += n;
            }
        }
        return utf8_decode_replace(bytes);
    }

private:
    void encode_plain(const std::string& s, std::vector<int64_t>& out) const {
        if (s.empty()) return;
        if (utf8_first_invalid(s) >= 0) throw Error("prompt is not valid UTF-8");
        pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
        PCRE2_SIZE pos = 0;
        const auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
        while (pos < s.size()) {
            const int rc = pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
            if (rc < 0) break;
            const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
            if (ov[1] == ov[0]) { // empty match: step one character
                pos = ov[0] + 1;
                while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
                continue;
            }
            // Split(behavior Isolated) keeps the text between matches as pieces too.
            if (ov[0] > pos) bpe_piece(s.substr(pos, ov[0] - pos), out);
            bpe_piece(s.substr(ov[0], ov[1] - ov[0]), out);
            pos = ov[1];
        }
        if (pos < s.size()) bpe_piece(s.substr(pos), out);
        pcre2_match_data_free(md);
    }
    void bpe_piece(const std::string& piece, std::vector<int64_t>& out) const {
        std::vector<std::string> word;
        for (unsigned char b : piece) word.push_back(byte_map_[b]);
        bpe_merge(word, ranks_);
        for (const auto& w : word) {
            auto it = vocab_.find(w);
            if (it == vocab_.end()) throw Error("tokenizer '" + path_ + "': symbol '" + w + "' is not in the vocabulary");
            out.push_back(it->second);
        }
    }

    std::string path_;
    std::unordered_map<std::string, int64_t> vocab_;
    std::unordered_map<int64_t, std::string> id_to_token_;
    std::unordered_map<std::string, int> ranks_;
    std::vector<std::pair<std::string, int64_t>> added_;
    std::set<int64_t> special_ids_, added_ids_;
    std::vector<std::string> byte_map_;
    std::unordered_map<std::string, char> unicode_to_byte_;
    pcre2_code* code_ = nullptr;
};

class Gpt2DlmTokenizer : public DlmTokenizer {
public:
    explicit Gpt2DlmTokenizer(Gpt2Tokenizer t, int64_t mask_id) : tok_(std::move(t)), mask_id_(mask_id) {}
    std::vector<int64_t> encode_with_specials(const std::string& text) const override {
        return tok_.encode(text, true);
    }
    std::string decode(const std::vector<int64_t>& ids) const override {
        std::vector<int64_t> keep;
        for (auto id : ids)
            if (id != mask_id_ && id < int64_t(tok_.vocab_size())) keep.push_back(id);
        return tok_.decode(keep);
    }

private:
    Gpt2Tokenizer tok_;
    int64_t mask_id_;
};

// Jinja's `trim`: Python str.strip() of ASCII / Unicode whitespace; the ASCII set here.
std::string dlm_jinja_trim(const std::string& s) {
    const char* ws = " \t\n\r\f\v";
    const auto b = s.find_first_not_of(ws);
    if (b == std::string::npos) return "";
    return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

} // namespace

std::shared_ptr<DlmTokenizer> load_hf_bpe_tokenizer(const std::string& tokenizer_json) {
    return std::make_shared<HfBpeTokenizer>(tokenizer_json);
}

std::shared_ptr<DlmTokenizer> load_dlm_tokenizer(const LoadedDlm& m, const std::string& vocab) {
    const auto& c = m.model->config();
    std::error_code ec;
    if (c.family == DlmFamily::DiffuGpt) {
        const std::string dir = !vocab.empty() ? vocab : m.folder;
        Gpt2Tokenizer t = Gpt2Tokenizer::dir_has_vocab(dir) ? Gpt2Tokenizer::from_dir(dir)
                                                            : Gpt2Tokenizer::load_default(vocab);
        return std::make_shared<Gpt2DlmTokenizer>(std::move(t), c.mask_token_id);
    }
    fs::path p = !vocab.empty() ? fs::path(vocab) : fs::path(m.folder);
    if (fs::is_directory(p, ec)) p /= "tokenizer.json";
    if (!fs::exists(p, ec))
        throw UsageError("no tokenizer.json at '" + p.string() + "' for the " +
                         enum_name(dlm_family_table(), c.family) + " model (give --vocab, or --prompt-ids and --ids)");
    return load_hf_bpe_tokenizer(p.string());
}

ChatTemplate detect_chat_template(const std::string& folder) {
    std::ifstream f(fs::path(folder) / "tokenizer_config.json");
    if (!f) return ChatTemplate::None;
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(f);
    } catch (...) {
        throw Error("cannot parse '" + (fs::path(folder) / "tokenizer_config.json").string() + "'");
    }
    if (!j.contains("chat_template") || !j["chat_template"].is_string()) return ChatTemplate::None;
    const std::string t = j["chat_template"].get<std::string>();
    if (t.find("<|start_header_id|>") != std::string::npos && t.find("<|eot_id|>") != std::string::npos)
        return ChatTemplate::Llada;
    if (t.find("<|im_start|>") != std::string::npos && t.find("<|im_end|>") != std::string::npos)
        return ChatTemplate::ChatMl;
    throw UsageError("the chat_template of '" + folder +
                     "/tokenizer_config.json' is neither LLaDA's (LLaMA-3 headers) nor Dream's (ChatML); this "
                     "engine renders only those two (use --no-chat and write the prompt's turns yourself)");
}

std::string render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages) {
    std::string out;
    switch (t) {
    case ChatTemplate::None:
        for (const auto& m : messages) out += m.content;
        return out;
    case ChatTemplate::Llada:
        // LLaDA-8B-Instruct: BOS before the first turn; each turn's content trimmed (the template's `| trim`); the
        // assistant header always follows.
        for (size_t i = 0; i < messages.size(); ++i)
            out += std::string(i == 0 ? "<|startoftext|>" : "") + "<|start_header_id|>" + messages[i].role +
                   "<|end_header_id|>\n\n" + dlm_jinja_trim(messages[i].content) + "<|eot_id|>";
        return out + "<|start_header_id|>assistant<|end_header_id|>\n\n";
    case ChatTemplate::ChatMl:
        // Dream-v0-Instruct (Qwen2's template): a default system turn when the conversation has none.
        if (messages.empty() || messages.front().role != "system")
            out += "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n";
        for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
        return out + "<|im_start|>assistant\n";
    }
    return out;
}

std::string apply_chat_template(ChatTemplate t, const std::string& user) {
    return render_chat(t, {{"user", user}});
}

} // namespace anchor::text
