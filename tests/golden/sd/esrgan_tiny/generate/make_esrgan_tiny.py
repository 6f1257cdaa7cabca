#!/usr/bin/env python3
"""Reference cases for the ESRGAN upscaler (unet/model/esrgan.h): tiny random RRDBNets run by PyPI's spandrel 0.4.2.

Three networks, each saved as a torch.save .pth and as .safetensors:
  new_x4      Real-ESRGAN / basicsr key layout (conv_first, body.N.rdbK.convJ, conv_body, conv_up1/2, conv_hr,
              conv_last); the .pth wraps the state dict as {"params_ema": ..., "params": ...} as basicsr saves it
  old_x4      the original ESRGAN layout 4x-UltraSharp uses (model.0, model.1.sub.N.RDBK.convJ.0, model.3, ...)
  new_x2_unshuffle  Real-ESRGAN x2plus: pixel-unshuffle by 2 in front (12 input channels), two 2x upsamplings
Each runs on float32 inputs of a few sizes (odd ones included: the unshuffle model pads them by reflection and crops,
as spandrel does). golden.safetensors holds every input (`input_<image>`) and every raw network output
(`out_<model>_<image>`, not clamped); cases.json lists what each case is made of.

spandrel's ESRGAN has the growth channels fixed at 32 (as every published RRDBNet), so gc is 32 here; nf and nb are
small. The new-layout files are converted from spandrel's old-layout state dict by the key mapping of basicsr's
RRDBNet, then loaded back through spandrel's own loader, and both must give the same outputs.

Run (CPU, float32, one thread):
  python3 -m venv --system-site-packages /tmp/desr   # Debian's python3-torch 1.13.1
  /tmp/desr/bin/pip install --no-deps spandrel==0.4.2 einops safetensors==0.4.3 typing_extensions
  /tmp/desr/bin/python make_esrgan_tiny.py OUT_DIR
spandrel imports torchvision for two unrelated architectures (LaMa, RestoreFormer) when it is imported; torchvision is
not installed beside Debian's torch, so a stub module with those two names is put in its place (never called).
"""
import collections
import json
import sys
import types
from pathlib import Path

import torch

# The stub: spandrel's registry imports these names at import time; no ESRGAN code path uses them.
tv = types.ModuleType("torchvision")
tvt = types.ModuleType("torchvision.transforms")
tvf = types.ModuleType("torchvision.transforms.functional")
tvf.InterpolationMode = type("InterpolationMode", (), {})
tvf.rotate = tvf.normalize = lambda *a, **k: None
tv.transforms, tvt.functional = tvt, tvf
sys.modules.update({"torchvision": tv, "torchvision.transforms": tvt, "torchvision.transforms.functional": tvf})

import spandrel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from spandrel.architectures.ESRGAN import ESRGAN  # noqa: E402

torch.set_num_threads(1)
torch.set_grad_enabled(False)


def old_to_new(sd: dict, nb: int, n_up: int) -> "collections.OrderedDict[str, torch.Tensor]":
    """spandrel's old-layout names -> basicsr RRDBNet names."""
    out = collections.OrderedDict()
    for k, v in sd.items():
        p = k.split(".")
        if p[1] == "0":
            name = "conv_first." + p[-1]
        elif p[1] == "1" and p[3] == str(nb):
            name = "conv_body." + p[-1]
        elif p[1] == "1":  # model.1.sub.N.RDBk.convj.0.weight
            name = f"body.{p[3]}.rdb{p[4][3:]}.{p[5]}.{p[-1]}"
        else:
            i = int(p[1])
            if i == 3 * n_up + 2:
                name = "conv_hr." + p[-1]
            elif i == 3 * n_up + 4:
                name = "conv_last." + p[-1]
            else:
                assert i % 3 == 0, k
                name = f"conv_up{i // 3}." + p[-1]
        out[name] = v.clone().contiguous()
    return out


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    models = {
        # name: (constructor args, layout, seed, number of 2x upsamplings)
        "new_x4": (dict(in_nc=3, out_nc=3, num_filters=16, num_blocks=2, scale=4), "new", 1, 2),
        "old_x4": (dict(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4), "old", 2, 2),
        "new_x2_unshuffle": (dict(in_nc=12, out_nc=3, num_filters=16, num_blocks=1, scale=4, shuffle_factor=2), "new",
                             3, 2),
    }
    g = torch.Generator().manual_seed(1234)
    images = {"12x16": torch.rand(1, 3, 12, 16, generator=g), "13x9": torch.rand(1, 3, 13, 9, generator=g),
              "b2_7x10": torch.rand(2, 3, 7, 10, generator=g)}
    golden = {f"input_{k}": v for k, v in images.items()}
    cases = []
    for name, (args, layout, seed, n_up) in models.items():
        torch.manual_seed(seed)
        net = ESRGAN(**args).eval()
        # He-style weights (std sqrt(2 / fan_in)) and small biases keep the outputs a function of the image in about
        # [0, 1] rather than of the biases (PyTorch's default init gives near-constant outputs here); the last conv's
        # bias centres them, so the clamped [0, 1] image has most pixels unclamped.
        for k, p in net.named_parameters():
            if p.dim() == 4:
                p.copy_(torch.randn(p.shape) * (2.0 / (p.shape[1] * 9)) ** 0.5)
            else:
                p.copy_(torch.randn(p.shape) * 0.02)
        last = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        last.weight.mul_(0.25)
        last.bias.fill_(0.5)
        sd = collections.OrderedDict((k, v.clone().contiguous()) for k, v in net.state_dict().items())
        if layout == "new":
            sd = old_to_new(sd, args["num_blocks"], n_up)
            torch.save({"params_ema": sd, "params": sd}, out_dir / f"{name}.pth")
        else:
            torch.save(sd, out_dir / f"{name}.pth")
        save_file(dict(sd), str(out_dir / f"{name}.safetensors"))
        # What a user's file gives through spandrel's own detection and loader.
        desc = spandrel.ModelLoader().load_from_file(str(out_dir / f"{name}.pth"))
        desc.model.eval()
        assert desc.architecture.id == "ESRGAN", desc.architecture.id
        for img, x in images.items():
            y = desc.model(x)
            y2 = net(x)
            assert torch.equal(y, y2), (name, img, (y - y2).abs().max())
            golden[f"out_{name}_{img}"] = y.contiguous()
            print(name, img, "output range", y.min().item(), y.max().item(), "share in (0, 1)",
                  ((y > 0) & (y < 1)).float().mean().item(), "std", y.std().item())
        cases.append({"name": name, "files": [f"{name}.pth", f"{name}.safetensors"], "layout": layout,
                      "scale": desc.scale, "in_channels": desc.input_channels, "out_channels": desc.output_channels,
                      "nf": args["num_filters"], "nb": args["num_blocks"], "gc": 32,
                      "shuffle_factor": args.get("shuffle_factor", 1),
                      "images": list(images.keys())})
    save_file(golden, str(out_dir / "golden.safetensors"))
    meta = {"kind": "esrgan", "generated_with": {"spandrel": spandrel.__version__, "torch": torch.__version__,
                                                 "threads": 1, "dtype": "float32"},
            "tolerance": {"atol": 1e-5, "rtol": 1e-4}, "cases": cases}
    (out_dir / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent))
