# Textual-inversion reference cases (textual_inversion_sd15/, textual_inversion_sdxl/): embedding files in the
# formats users download (A1111 .pt with string_to_param, .safetensors with emb_params, diffusers' .bin concept, SDXL
# clip_l / clip_g), loaded with diffusers 0.27.2 `load_textual_inversion` into the real tiny pipelines, and
#   encode.<name>.prompt_embeds   pipe.encode_prompt of a prompt naming them (no CFG), [1, 77, D]; a case with
#                                 "fragments" also gets A1111's "Original" emphasis applied to diffusers' embeddings
#                                 with the per-token weights of the fragments (modules/sd_hijack_clip.py:
#                                 z *= w, then z *= mean_before / mean_after)
#   encode.<name>.pooled_prompt_embeds   SDXL: text_encoder_2's projection of the final-layer-norm state at the first
#                                 end-of-text token (A1111's pooling; diffusers 0.27 with transformers 4.38 pools at
#                                 input_ids.argmax(-1), which is the added token's id when one is in the prompt)
#   run.<name>.{prompt_embeds, initial_noise, final_latents, image}   a short pipeline __call__ (output_type latent,
#                                 then the VAE decode as the pipeline's postprocess does)
# Run: PYTHONPATH=generate /tmp/d27/bin/python generate/gen_textual_inversion.py GOLDEN_SD_DIR OUT_DIR
# (diffusers 0.27.2, transformers 4.38.2, torch 1.13.1 CPU, one thread). The tiny models' tokenizer folders hold no
# vocabulary files: vocab.json / merges.txt are written from vocab/bpe_simple_vocab_16e6.txt.gz exactly as openai's
# simple_tokenizer builds its tables.
import baddbmm_fix  # noqa: F401
import gzip, json, os, sys, tempfile
import torch
from safetensors.torch import save_file
from transformers import CLIPTokenizer, CLIPTextModel, CLIPTextModelWithProjection
from diffusers import (StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel, AutoencoderKL,
                       EulerDiscreteScheduler, DPMSolverMultistepScheduler)

torch.set_num_threads(1)
G, OUT = sys.argv[1], sys.argv[2]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return [chr(c) for c in cs]


def vocab_files():
    merges = gzip.open(G + '/vocab/bpe_simple_vocab_16e6.txt.gz').read().decode('utf-8').split('\n')
    merges = merges[1:49152 - 256 - 2 + 1]
    vocab = bytes_to_unicode()
    vocab = vocab + [v + '</w>' for v in vocab]
    vocab += [''.join(m.split()) for m in merges]
    vocab += ['<|startoftext|>', '<|endoftext|>']
    d = tempfile.mkdtemp()
    json.dump({v: i for i, v in enumerate(vocab)}, open(d + '/vocab.json', 'w'))
    open(d + '/merges.txt', 'w').write('#version: 0.2\n' + '\n'.join(merges) + '\n')
    return d + '/vocab.json', d + '/merges.txt'


VOCAB, MERGES = vocab_files()


def tokenizer(folder):
    c = json.load(open(folder + '/tokenizer_config.json'))
    return CLIPTokenizer(VOCAB, MERGES, pad_token=c.get('pad_token', '<|endoftext|>'), model_max_length=77)


def a1111_emphasis(z, weights):
    m0 = z.mean()
    z = z * weights.reshape(1, -1, 1)
    return z * (m0 / z.mean())


def fragment_weights(tok, pipe, fragments):
    # A1111 tokenizes every fragment on its own; the embedding names expand as diffusers' maybe_convert_prompt does.
    w = [1.0]
    for text, weight in fragments:
        text = pipe.maybe_convert_prompt(text, tok)
        w += [weight] * len(tok(text, add_special_tokens=False).input_ids)
    return torch.tensor(w + [1.0] * (77 - len(w)), dtype=torch.float32)


def randn_like_tokens(table, n, g):
    return torch.randn(n, table.shape[1], generator=g) * table.std() * 2.0


def sd15():
    folder = OUT + '/textual_inversion_sd15'
    emb_dir = folder + '/embeddings'
    os.makedirs(emb_dir, exist_ok=True)
    te = CLIPTextModel.from_pretrained(G + '/clip_tiny').eval()
    tok = tokenizer(G + '/clip_tiny/tokenizer')
    table = te.text_model.embeddings.token_embedding.weight.detach()
    g = torch.Generator().manual_seed(6100)
    vec = {'EasyNegative': randn_like_tokens(table, 2, g), 'bad_hands': randn_like_tokens(table, 3, g),
           'watercolor': randn_like_tokens(table, 1, g)[0]}
    # A1111's own format (modules/textual_inversion/textual_inversion.py Embedding.save)
    torch.save({'string_to_token': {'*': 265}, 'string_to_param': {'*': vec['EasyNegative'].clone().requires_grad_()},
                'name': 'EasyNegative', 'step': 1200, 'sd_checkpoint': '0123456789', 'sd_checkpoint_name': 'tiny'},
               emb_dir + '/EasyNegative.pt')
    save_file({'emb_params': vec['bad_hands']}, emb_dir + '/bad_hands.safetensors')  # Civitai's safetensors
    torch.save({'<watercolor>': vec['watercolor']}, emb_dir + '/watercolor.bin')  # diffusers' learned_embeds.bin
    unet = UNet2DConditionModel.from_pretrained(G + '/unet_sd15_tiny').eval()
    vae = AutoencoderKL.from_pretrained(G + '/vae_tiny').eval()
    base = json.load(open(G + '/pipeline_tiny/config.json'))['scheduler_base_config']
    sch = EulerDiscreteScheduler.from_config(base)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=sch,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    for name in ['EasyNegative', 'bad_hands', 'watercolor']:
        v = vec[name]
        pipe.load_textual_inversion(v if v.dim() == 2 else v.unsqueeze(0), token=name)
    T = {}
    encode = {
        'one_file_each': {'prompt': 'a cat, EasyNegative, bad_hands and watercolor'},
        'repeated': {'prompt': 'EasyNegative EasyNegative, a dog'},
        'emphasis': {'fragments': [['a ', 1.0], ['EasyNegative', 1.2], [', ', 1.0], ['bad_hands', 1 / 1.1],
                                   [' house', 1.1]],
                     'prompt': 'a (EasyNegative:1.2), [bad_hands] (house)'},
        'no_embedding': {'prompt': 'a cat, easy negative, bad hands'},
    }
    with torch.no_grad():
        for name, e in encode.items():
            text = ''.join(f[0] for f in e['fragments']) if 'fragments' in e else e['prompt']
            pe, _ = pipe.encode_prompt(text, 'cpu', 1, False)
            if 'fragments' in e:
                pe = a1111_emphasis(pe, fragment_weights(tok, pipe, [tuple(f) for f in e['fragments']]))
            T[f'encode.{name}.prompt_embeds'] = pe
        runs = {}
        for name, (cls, steps, prompt, neg, seed, cfg) in {
                'euler6': (EulerDiscreteScheduler, 6, 'a watercolor house', 'EasyNegative, bad_hands', 31, 7.0),
                'dpm5': (DPMSolverMultistepScheduler, 5, 'bad_hands, a cat', 'EasyNegative', 77, 5.5)}.items():
            pipe.scheduler = cls.from_config(base)
            gen = torch.Generator('cpu').manual_seed(seed)
            noise = torch.randn((1, 4, 8, 8), generator=torch.Generator('cpu').manual_seed(seed))
            pe, ne = pipe.encode_prompt(prompt, 'cpu', 1, True, neg)
            lat = pipe(prompt, negative_prompt=neg, num_inference_steps=steps, guidance_scale=cfg, generator=gen,
                       height=16, width=16, output_type='latent').images
            dec = vae.decode(lat / vae.config.scaling_factor).sample
            T.update({f'run.{name}.prompt_embeds': torch.cat([ne, pe]), f'run.{name}.initial_noise': noise,
                      f'run.{name}.final_latents': lat, f'run.{name}.image': (dec / 2 + 0.5).clamp(0, 1)})
            runs[name] = {'scheduler': cls.__name__, 'num_inference_steps': steps, 'prompt': prompt,
                          'negative_prompt': neg, 'seed': seed, 'guidance_scale': cfg, 'height': 16, 'width': 16}
    save_file({k: v.contiguous() for k, v in T.items()}, folder + '/golden_textual_inversion.safetensors')
    json.dump({'textual_inversion': 'diffusers 0.27.2 load_textual_inversion on the tiny SD 1.x pipeline '
                                    '(generate/gen_textual_inversion.py)',
               'family': 'sd1', 'models': {'unet': '../unet_sd15_tiny', 'vae': '../vae_tiny',
                                           'text_encoder': '../clip_tiny'},
               'embedding_dir': 'embeddings', 'scheduler_base_config': base,
               'encode': encode, 'runs': runs}, open(folder + '/config.json', 'w'), indent=1)


def sdxl():
    folder = OUT + '/textual_inversion_sdxl'
    emb_dir = folder + '/embeddings'
    os.makedirs(emb_dir, exist_ok=True)
    root = G + '/sdxl_tiny'
    te1 = CLIPTextModel.from_pretrained(root + '/text_encoder').eval()
    te2 = CLIPTextModelWithProjection.from_pretrained(root + '/text_encoder_2').eval()
    tok1, tok2 = tokenizer(root + '/tokenizer'), tokenizer(root + '/tokenizer_2')
    g = torch.Generator().manual_seed(6101)
    files = {}
    for name, n in [('xl_negative', 2), ('xl_style', 1)]:
        files[name] = {'clip_l': randn_like_tokens(te1.text_model.embeddings.token_embedding.weight.detach(), n, g),
                       'clip_g': randn_like_tokens(te2.text_model.embeddings.token_embedding.weight.detach(), n, g)}
        save_file(files[name], f'{emb_dir}/{name}.safetensors')
    pipe = StableDiffusionXLPipeline.from_pretrained(root, text_encoder=te1, text_encoder_2=te2, tokenizer=tok1,
                                                     tokenizer_2=tok2)
    for name, f in files.items():
        pipe.load_textual_inversion(f['clip_l'], token=name, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
        pipe.load_textual_inversion(f['clip_g'], token=name, text_encoder=pipe.text_encoder_2,
                                    tokenizer=pipe.tokenizer_2)

    def pooled_at_eos(text):
        text = pipe.maybe_convert_prompt(text, pipe.tokenizer_2)
        ids = pipe.tokenizer_2(text, padding='max_length', max_length=77, truncation=True,
                               return_tensors='pt').input_ids
        out = te2(ids, output_hidden_states=True)
        eos = (ids == 49407).int().argmax(-1)
        return te2.text_projection(out.last_hidden_state[torch.arange(ids.shape[0]), eos])

    T = {}
    encode = {'both_files': {'prompt': 'xl_style, a castle, xl_negative'},
              'emphasis': {'fragments': [['a castle, ', 1.0], ['xl_negative', 1.3]], 'prompt': 'a castle, (xl_negative:1.3)'}}
    with torch.no_grad():
        for name, e in encode.items():
            text = ''.join(f[0] for f in e['fragments']) if 'fragments' in e else e['prompt']
            pe, _, pooled, _ = pipe.encode_prompt(text, device='cpu', num_images_per_prompt=1,
                                                  do_classifier_free_guidance=False)
            if 'fragments' in e:
                # A1111 applies the emphasis per embedder (sd_hijack_clip), each encoder's own mean.
                d1 = te1.config.hidden_size
                frs = [tuple(f) for f in e['fragments']]
                pe = torch.cat([a1111_emphasis(pe[..., :d1], fragment_weights(pipe.tokenizer, pipe, frs)),
                                a1111_emphasis(pe[..., d1:], fragment_weights(pipe.tokenizer_2, pipe, frs))], -1)
            T[f'encode.{name}.prompt_embeds'] = pe
            T[f'encode.{name}.pooled_prompt_embeds'] = pooled_at_eos(text)
        runs = {}
        prompt, neg, seed, steps, cfg = 'xl_style, a castle', 'xl_negative', 19, 5, 6.0
        pe, ne, _, _ = pipe.encode_prompt(prompt, device='cpu', num_images_per_prompt=1,
                                          do_classifier_free_guidance=True, negative_prompt=neg)
        pp, npool = pooled_at_eos(prompt), pooled_at_eos(neg)
        gen = torch.Generator('cpu').manual_seed(seed)
        lat = pipe(prompt_embeds=pe, negative_prompt_embeds=ne, pooled_prompt_embeds=pp,
                   negative_pooled_prompt_embeds=npool, num_inference_steps=steps, guidance_scale=cfg, generator=gen,
                   height=32, width=32, output_type='latent').images
        vae = pipe.vae
        dec = vae.decode(lat / vae.config.scaling_factor).sample
        T.update({'run.euler5.prompt_embeds': torch.cat([ne, pe]), 'run.euler5.pooled_prompt_embeds': torch.cat([npool, pp]),
                  'run.euler5.final_latents': lat, 'run.euler5.image': (dec / 2 + 0.5).clamp(0, 1)})
        runs['euler5'] = {'scheduler': 'EulerDiscreteScheduler', 'num_inference_steps': steps, 'prompt': prompt,
                          'negative_prompt': neg, 'seed': seed, 'guidance_scale': cfg, 'height': 32, 'width': 32}
    save_file({k: v.contiguous() for k, v in T.items()}, folder + '/golden_textual_inversion.safetensors')
    json.dump({'textual_inversion': 'diffusers 0.27.2 load_textual_inversion (clip_l into text_encoder, clip_g into '
                                    'text_encoder_2) on the tiny SDXL pipeline (generate/gen_textual_inversion.py)',
               'family': 'sdxl', 'model': '../sdxl_tiny', 'embedding_dir': 'embeddings',
               'scheduler_base_config': json.load(open(root + '/scheduler/scheduler_config.json')),
               'encode': encode, 'runs': runs}, open(folder + '/config.json', 'w'), indent=1)


sd15()
sdxl()
