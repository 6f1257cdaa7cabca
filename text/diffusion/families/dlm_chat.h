// Text in and out of the published diffusion LMs: their tokenizers and chat templates.
//
// - DiffuGPT: GPT-2's tokenizer (text/gpt2/gpt2_tokenizer.h), from the model folder or the default vocabulary.
// - LLaDA / Dream: Hugging Face `tokenizer.json` byte-level BPE (LLaMA-3's / Qwen2's): the pre-tokenizer's Split
//   regex (PCRE2 with Unicode properties), GPT-2's byte-to-unicode map, lowest-rank merges, and the added tokens
//   (<|eot_id|>, <|im_start|>, [MASK] ...) matched literally before anything else. Only that layout is read; a
//   tokenizer.json of another kind (WordPiece, Unigram, a normalizer other than NFC, which is not applied) is refused
//   naming the field.
// - Chat templates: the two the instruct models ship (tokenizer_config.json `chat_template`), recognised by their
//   markers and formatted here, not by a Jinja engine: LLaDA-Instruct's LLaMA-3 turns and Dream-Instruct's ChatML
//   (Qwen2's, with its default system turn). A folder with another template is refused (use --no-chat).
#pragma once

#include "text/diffusion/families/dlm_model.h"

#include <memory>
#include <string>
#include <vector>

namespace anchor::text {

class DlmTokenizer {
public:
    virtual ~DlmTokenizer() = default;
    // UTF-8 text -> ids, the added/special tokens written in the text taken as themselves (a chat prompt).
    virtual std::vector<int64_t> encode_with_specials(const std::string& text) const = 0;
    // ids -> UTF-8 text (invalid sequences as U+FFFD); special tokens are left out.
    virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
};

// A byte-level BPE from a Hugging Face tokenizer.json. anchor::Error naming the file and field otherwise.
std::shared_ptr<DlmTokenizer> load_hf_bpe_tokenizer(const std::string& tokenizer_json);
// The tokenizer of a loaded model: `vocab` when given (a folder or tokenizer.json), else the model folder's
// tokenizer.json, else (DiffuGPT) GPT-2's from the folder or the default vocabulary.
std::shared_ptr<DlmTokenizer> load_dlm_tokenizer(const LoadedDlm& m, const std::string& vocab = "");

enum class ChatTemplate { None, Llada, ChatMl };
// From <folder>/tokenizer_config.json `chat_template`: None when there is none; anchor::Error for an unknown one.
ChatTemplate detect_chat_template(const std::string& folder);
struct ChatMessage {
    std::string role; // "system", "user", "assistant"
    std::string content;
};
// The conversation and the assistant's header, as the template renders it with add_generation_prompt; None joins
// the contents.
std::string render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages);
// One user turn (render_chat of {user}).
std::string apply_chat_template(ChatTemplate t, const std::string& user);

} // namespace anchor::text
