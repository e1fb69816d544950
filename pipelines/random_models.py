"""Causal Wan components built from configs with seeded random weights (no download needed).

Used by the CLI's embedded default, the tests and the end-to-end benchmark: speed and memory do not depend
on the weights, and everything else (shapes, cache traffic, decoding) is the real code path.
"""

from __future__ import annotations

import string

import torch
from diffusers import AutoencoderKLWan, FlowMatchLCMScheduler, WanTransformer3DModel

# Wan2.1-T2V-1.3B (the Self-Forcing / CausVid base): facts from diffusers' convert_wan_to_diffusers.py.
WAN_1_3B_TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)

# A causal Wan small enough for a CPU: 2 layers, 2 heads of 64 channels (QVG's default group of 64 fits).
TINY_TRANSFORMER_CONFIG = dict(WAN_1_3B_TRANSFORMER_CONFIG, num_attention_heads=2, attention_head_dim=64,
                               text_dim=32, ffn_dim=64, num_layers=2)

TINY_VAE_CONFIG = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                       temperal_downsample=[False, True, True])

TINY_TEXT_ENCODER_CONFIG = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16)


def self_forcing_scheduler() -> FlowMatchLCMScheduler:
    """x0 prediction then re-noising to the next sigma, timesteps warped with shift 5 (Self-Forcing's sampler)."""
    return FlowMatchLCMScheduler(num_train_timesteps=1000, shift=5.0)


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int, std: float = 0.02) -> torch.nn.Module:
    """Seeded weights from a private generator: N(0, std) matrices, unit norm scales, zero biases."""
    generator = None
    for name, param in module.named_parameters():
        if generator is None or generator.device != param.device:
            generator = torch.Generator(param.device).manual_seed(seed)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            param.zero_()
        elif leaf == "gamma" or (param.ndim == 1 and "norm" in name):
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
    return module


def tiny_tokenizer():
    """A character-level WordLevel tokenizer (T5-style special tokens), so any prompt encodes offline."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for char in string.ascii_lowercase + string.digits + string.punctuation:
        vocab[char] = len(vocab)
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_components(seed: int = 0) -> dict:
    """Every ``QVGCausalWanPipeline`` component at toy size, seeded: ``QVGCausalWanPipeline(**tiny_components())``."""
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TINY_TEXT_ENCODER_CONFIG))
    return dict(
        tokenizer=tokenizer,
        text_encoder=randomize_(text_encoder, seed).eval(),
        vae=randomize_(AutoencoderKLWan(**TINY_VAE_CONFIG), seed + 1).eval(),
        scheduler=self_forcing_scheduler(),
        transformer=randomize_(WanTransformer3DModel(**TINY_TRANSFORMER_CONFIG), seed + 2).eval(),
    )
