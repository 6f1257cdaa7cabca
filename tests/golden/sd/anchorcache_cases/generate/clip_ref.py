# The SD 1.x prompt framing and the HF CLIPTextModel equations on the stored tiny weights, shared by the pipeline
# generators (gen_pipe.py, gen_img2img_batch.py). G: the golden sd/ folder. Needs openai/CLIP's simple_tokenizer on
# sys.path (CLIP_TOKENIZER_DIR).
import json
import torch
from safetensors.torch import load_file
from simple_tokenizer import SimpleTokenizer


def clip_reference(G):
    tok = SimpleTokenizer(G + '/vocab/bpe_simple_vocab_16e6.txt.gz')

    def ids(text):  # [BOS] + 75 BPE tokens + [EOS], padded with EOS to 77 (SD 1.x)
        b = tok.encode(text)[:75]
        r = [49406] + b + [49407]
        return r + [49407] * (77 - len(r))

    W = load_file(G + '/clip_tiny/model.safetensors'); C = json.load(open(G + '/clip_tiny/config.json'))

    def te(idx):
        p = 'text_model.'; H = C['num_attention_heads']; D = C['hidden_size']
        x = W[p + 'embeddings.token_embedding.weight'][idx] + W[p + 'embeddings.position_embedding.weight'][:idx.shape[1]]
        L = idx.shape[1]; mask = torch.full((L, L), float('-inf')).triu(1)
        for i in range(C['num_hidden_layers']):
            q = p + f'encoder.layers.{i}.'
            lin = lambda t, n: torch.nn.functional.linear(t, W[q + n + '.weight'], W[q + n + '.bias'])
            h = torch.nn.functional.layer_norm(x, (D,), W[q + 'layer_norm1.weight'], W[q + 'layer_norm1.bias'], 1e-5)
            B = h.shape[0]; hd = D // H
            qq = (lin(h, 'self_attn.q_proj') * hd ** -0.5).view(B, L, H, hd).transpose(1, 2)
            kk = lin(h, 'self_attn.k_proj').view(B, L, H, hd).transpose(1, 2)
            vv = lin(h, 'self_attn.v_proj').view(B, L, H, hd).transpose(1, 2)
            a = (qq @ kk.transpose(-1, -2) + mask).softmax(-1) @ vv
            x = x + lin(a.transpose(1, 2).reshape(B, L, D), 'self_attn.out_proj')
            h = torch.nn.functional.layer_norm(x, (D,), W[q + 'layer_norm2.weight'], W[q + 'layer_norm2.bias'], 1e-5)
            h = lin(h, 'mlp.fc1'); h = h * torch.sigmoid(1.702 * h)
            x = x + lin(h, 'mlp.fc2')
        return torch.nn.functional.layer_norm(x, (D,), W[p + 'final_layer_norm.weight'], W[p + 'final_layer_norm.bias'],
                                              1e-5)

    return ids, te
