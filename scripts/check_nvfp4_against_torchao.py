"""NVFP4Config(scale_rule="static-6") bytes against torchao's ``nvfp4_quantize``, head by head; e2m1 rounding
against torchao's ``f32_to_f4_unpacked``. torchao is not a dependency (diffusers imports it whenever it is
installed), so this runs by hand, from a scratch folder:

    pip install --no-deps --target /tmp/taosite torchao==0.18.0
    PYTHONPATH=/tmp/taosite python scripts/check_nvfp4_against_torchao.py
"""
import torch

import diffusers_qvg as dq
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
from diffusers_qvg.codecs.nvfp4 import e2m1_codes
from diffusers_qvg.video_kv import VideoKVSpec, video_kv

data = video_kv(VideoKVSpec(), chunks=2)
g = torch.Generator().manual_seed(0)
tensors = {"video K": data.key[:, :4680], "video V": data.value[:, 4680:],
           "randn x 1e-3 bf16": (torch.randn(1, 512, 4, 64, generator=g) * 1e-3).bfloat16(),
           "heavy tails f32": torch.randn(1, 512, 4, 64, generator=g) ** 5}
config = dq.NVFP4Config(scale_rule="static-6")
for name, x in tensors.items():
    codes, scales, gs = config.encode(x)
    same = True
    for h in range(x.shape[2]):
        head = x[0, :, h].contiguous()
        t_scales, t_codes = nvfp4_quantize(head, 16, per_tensor_scale=gs[0, h])
        same &= torch.equal(t_codes.view(torch.uint8).reshape(codes[0, :, h].shape), codes[0, :, h])
        same &= torch.equal(t_scales.view(torch.uint8).reshape(scales[0, :, h].shape), scales[0, :, h].view(torch.uint8))
    print(f"{name}: codes and scales equal torchao's: {bool(same)}")
y = torch.cat([torch.linspace(-6, 6, 1_200_001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 0.0])])
print("e2m1 rounding equals f32_to_f4_unpacked on", y.numel(), "values:", torch.equal(e2m1_codes(y), f32_to_f4_unpacked(y).view(torch.uint8)))
