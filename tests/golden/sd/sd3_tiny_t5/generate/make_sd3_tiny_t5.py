"""Writes two cases: t5_tiny (a tiny random T5EncoderModel with its SentencePiece unigram tokenizer, as SD 3's
text_encoder_3 / tokenizer_3) and sd3_tiny_t5 (diffusers' StableDiffusion3Pipeline WITH that T5, over sd3_tiny_text's
CLIP encoders, transformer, VAE and scheduler, which it links to instead of copying).

usage: PYTHONPATH=<sentencepiece 0.2.0> python make_sd3_tiny_t5.py SD_GOLDEN_DIR
  (SD_GOLDEN_DIR = tests/golden/sd: reads sd3_tiny_text/ and vocab/, writes t5_tiny/ and sd3_tiny_t5/; diffusers 0.31.0, transformers 4.38.2, torch 1.13 CPU, float32, one thread)

The SentencePiece model is trained here (unigram, vocabulary 128, T5's special ids: pad 0, eos 1, unk 2, no bos;
nmt_nfkc normalisation as T5's spiece.model) on a corpus this script builds, so every byte of the case is
reproducible. T5TokenizerFast (what SD 3 ships as tokenizer_3) and the slow T5Tokenizer must agree on every recorded
prompt; the script stops if they do not.
"""
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    assert attn_mask is None and not is_causal
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-1, -2) * s, dim=-1) @ v


F.scaled_dot_product_attention = sdpa  # torch 1.13 has none: softmax(q k^T / sqrt(d)) v in float32, as sd3_tiny
torch.set_num_threads(1)

import sentencepiece as spm
from safetensors.torch import save_file
from transformers import T5Config, T5EncoderModel, T5Tokenizer, T5TokenizerFast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sd3_tiny_run import link, record_run, tiny_pipeline, token_ids  # noqa: E402

VOCAB = 128
EXTRA_IDS = 4  # T5's <extra_id_N> sentinels after the SentencePiece pieces (T5-XXL has 100)
T5 = dict(d_model=32, d_kv=8, num_heads=3, d_ff=37, num_layers=3, relative_attention_num_buckets=8,
          relative_attention_max_distance=20, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
          dropout_rate=0.0)
FUZZ_COUNT, FUZZ_MAX_LENGTH = 400, 40


def fuzz_prompts():
    """Random strings over what the normaliser, the unigram search and the special-token split must agree on
    (whitespace kinds, NFKC folds, combining marks, zero-width characters, characters outside the vocabulary, special
    tokens, a literal U+2581). Ids are T5TokenizerFast's (SD 3's tokenizer_3): the slow T5Tokenizer differs only where
    the text ends with </s> (it adds no second one)."""
    import random
    rng = random.Random(7)
    pool = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"-()") + \
        [" ", " ", " ", "  ", "\t", "\n", "\u3000", "\u00a0", "ｆ", "Ａ", "１", "ﬁ", "é", "e\u0301", "ß", "日", "本", "😀",
         "№", "—", "…", "▁", "</s>", "<pad>", "<unk>", "<extra_id_0>", "<extra_id_3>", "<extra_id_9>", "cat", "the ",
         " sofa", "Ⅻ", "㎏", "½", "\u200b", "\ufeff"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 20))) for _ in range(FUZZ_COUNT)]


# The encoder case: prompts with what the normaliser and the unigram search must handle (case, digits, fullwidth
# letters NFKC folds, ligatures, runs of spaces, leading/trailing spaces, characters outside the vocabulary -> unk,
# the empty prompt, special tokens written in the text, which HF matches before SentencePiece sees the rest) and
# one longer than 16 tokens for truncation.
T5_PROMPTS = ["a photo of a cat on a red sofa", "  Two   small DOGS, running on the beach at sunset!  ",
              "ｆｕｌｌｗｉｄｔｈ ﬁne café №5 — 42 cats", "日本 ß ∑ unknown ☃ glyphs", "",
              "a cat </s> on <extra_id_1>sofa", "<pad>red  ",
              "the quick brown fox jumps over the lazy dog " * 4]
T5_LENGTHS = [256, 16]
FEATURE_ROWS = 3  # the encoder's features for the first prompts only (the file stays small)
PROMPTS = ["a photo of a cat on a red sofa", "two small dogs running on the beach at sunset"]
NEGATIVE = "blurry, low quality"
STEPS, GUIDANCE, SEED, SIZE, MAX_SEQ = 3, 4.5, 23, 16, 256


def corpus():
    """Deterministic English-like sentences (and a few accented / numeric words) to train the unigram model on."""
    import random
    rng = random.Random(5)
    nouns = "cat dog fox bird sofa beach sunset house tree river city photo painting car boat mountain lake".split()
    adjs = "red small quick brown lazy blue green old bright dark quiet tall café naïve".split()
    verbs = "runs jumps sits sleeps flies swims walks stands shines".split()
    other = "a the on at over in of with and two three 5 42 2024 photo, low quality, blurry! high detail.".split()
    lines = []
    for _ in range(3000):
        w = [rng.choice(other), rng.choice(adjs), rng.choice(nouns), rng.choice(verbs), rng.choice(other),
             rng.choice(other), rng.choice(adjs), rng.choice(nouns)]
        s = " ".join(w)
        lines.append(s.capitalize() if rng.random() < 0.3 else s)
    return "\n".join(lines) + "\n"


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "relative_attention_bias" in name else 0.2))
            if "layer_norm" in name:
                p.add_(1.0)
            p.copy_(p.half().float())  # float16-exact, so a float16 copy would be lossless


def t5_ids(tok, prompts, length):
    return token_ids(tok, prompts, length)


def make_t5(out):
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    open(os.path.join(tmp, "corpus.txt"), "w").write(corpus())
    cwd = os.getcwd()
    os.chdir(tmp)  # relative paths: the trainer records them in the model (the same bytes on every run)
    spm.SentencePieceTrainer.train(input="corpus.txt", model_prefix="spiece",
                                   vocab_size=VOCAB, model_type="unigram", character_coverage=1.0, pad_id=0,
                                   eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
                                   unk_piece="<unk>", normalization_rule_name="nmt_nfkc", num_threads=1,
                                   seed_sentencepiece_size=5000, shuffle_input_sentence=False)
    os.chdir(cwd)
    shutil.copy(os.path.join(tmp, "spiece.model"), os.path.join(out, "spiece.model"))
    slow = T5Tokenizer(os.path.join(out, "spiece.model"), extra_ids=EXTRA_IDS, legacy=True)
    fast = T5TokenizerFast(vocab_file=os.path.join(out, "spiece.model"), extra_ids=EXTRA_IDS, from_slow=True)
    fast.save_pretrained(out)
    os.remove(os.path.join(out, "tokenizer.json"))  # the engine reads spiece.model; T5TokenizerFast rebuilds it
    cfg = T5Config(vocab_size=VOCAB + EXTRA_IDS, **T5)
    model = T5EncoderModel(cfg).eval()
    randomize(model, 41)
    model.save_pretrained(out, safe_serialization=True)
    g = {}
    for length in T5_LENGTHS:
        ids = t5_ids(fast, T5_PROMPTS, length)
        assert torch.equal(ids, t5_ids(slow, T5_PROMPTS, length)), "T5TokenizerFast and T5Tokenizer disagree"
        g[f"input_ids.{length}"] = ids
    fuzz = fuzz_prompts()
    g["fuzz_input_ids"] = t5_ids(fast, fuzz, FUZZ_MAX_LENGTH)
    feats = {}
    hooks = [b.register_forward_hook(lambda mod, i, o, k=k: feats.__setitem__(f"block.{k}", o[0].clone()))
             for k, b in enumerate(model.encoder.block)]
    with torch.no_grad():
        out_h = model(g[f"input_ids.{T5_LENGTHS[0]}"][:FEATURE_ROWS], output_hidden_states=True)
    for h in hooks:
        h.remove()
    g["embeddings"] = out_h.hidden_states[0]
    g.update(feats)
    g["last_hidden_state"] = out_h.last_hidden_state
    save_file({k: v.contiguous() for k, v in g.items()}, os.path.join(out, "golden_t5.safetensors"))
    json.dump({"prompts": T5_PROMPTS, "max_lengths": T5_LENGTHS, "features_of": f"input_ids.{T5_LENGTHS[0]}[:{FEATURE_ROWS}]",
               "fuzz_prompts": fuzz, "fuzz_max_length": FUZZ_MAX_LENGTH,
               "tokenizer": "T5TokenizerFast(spiece.model, extra_ids=%d) == T5Tokenizer(legacy=True): "
                            "padding max_length, truncation, add_special_tokens (EOS)" % EXTRA_IDS,
               "recorded": "input_ids.<max_length>, fuzz_input_ids (T5TokenizerFast), embeddings, block.<i> (each T5Block's output), "
                           "last_hidden_state (final_layer_norm)"},
              open(os.path.join(out, "golden_t5.json"), "w"), indent=1, ensure_ascii=False)
    shutil.rmtree(tmp)
    return model, fast


def make_pipeline(src, out, t5, t5_tok):
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    pipe = tiny_pipeline(src, BPE, tmp, t5, t5_tok)
    assert t5.config.d_model == pipe.transformer.config.joint_attention_dim
    g = record_run(pipe, PROMPTS, NEGATIVE, STEPS, GUIDANCE, SEED, SIZE, MAX_SEQ)
    index = json.load(open(os.path.join(src, "model_index.json")))
    index["text_encoder_3"] = ["transformers", "T5EncoderModel"]
    index["tokenizer_3"] = ["transformers", "T5TokenizerFast"]
    json.dump(index, open(os.path.join(out, "model_index.json"), "w"), indent=2)
    link(out, ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
         os.path.join("..", "sd3_tiny_text"))
    for sub in ("text_encoder_3", "tokenizer_3"):
        if not os.path.lexists(os.path.join(out, sub)):
            os.symlink(os.path.join("..", "t5_tiny"), os.path.join(out, sub))
    save_file({k: v.contiguous() for k, v in g.items()}, os.path.join(out, "golden_sd3_text.safetensors"))
    json.dump({"prompts": PROMPTS, "negative_prompt": NEGATIVE, "num_inference_steps": STEPS,
               "guidance_scale": GUIDANCE, "height": SIZE, "width": SIZE, "generator_seed": SEED,
               "initial_latents": f"torch.randn((batch, 16, h/2, w/2), manual_seed({SEED})): the pipeline's first draw",
               "text_encoder_3": "T5EncoderModel", "max_sequence_length": MAX_SEQ,
               "recorded": "input_ids(_2, _3), negative_input_ids(_2, _3), prompt_embeds, negative_prompt_embeds, "
                           "pooled_prompt_embeds, negative_pooled_prompt_embeds, latents.<i> after step i, image"},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    print({k: tuple(v.shape) for k, v in g.items()})


BPE = None

if __name__ == "__main__":
    root = sys.argv[1]
    BPE = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "vocab", "bpe_simple_vocab_16e6.txt.gz")
    t5, t5_tok = make_t5(os.path.join(root, "t5_tiny"))
    make_pipeline(os.path.join(root, "sd3_tiny_text"), os.path.join(root, "sd3_tiny_t5"), t5, t5_tok)
