"""Self-Forcing / CausVid / LongLive checkpoints (original Wan key layout) loaded into ``WanTransformer3DModel``.

The causal generators are trained as Wan2.1 models; their ``.pt`` files keep the original Wan parameter names
(``blocks.N.self_attn.q.weight``, ...) under ``generator_ema`` (and ``generator``), prefixed with ``model.`` by
the training wrapper. The renames are the ones diffusers' ``scripts/convert_wan_to_diffusers.py`` applies,
written as whole-segment prefix rules so that no substring can be renamed by accident (note the norm swap:
the original calls its norms norm1, norm3, norm2 in forward order, diffusers norm1, norm2, norm3).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from diffusers import WanTransformer3DModel

from .upstream_numerics import enable_upstream_numerics

# Renames of keys outside the transformer blocks (prefix of the original key -> prefix of the diffusers key).
TOP_LEVEL_RENAMES: tuple[tuple[str, str], ...] = (
    ("patch_embedding.", "patch_embedding."),
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("img_emb.proj.0.", "condition_embedder.image_embedder.norm1."),
    ("img_emb.proj.1.", "condition_embedder.image_embedder.ff.net.0.proj."),
    ("img_emb.proj.3.", "condition_embedder.image_embedder.ff.net.2."),
    ("img_emb.proj.4.", "condition_embedder.image_embedder.norm2."),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("head.head.", "proj_out."),
    ("head.modulation", "scale_shift_table"),
)

# Renames inside ``blocks.N.`` (applied to the rest of the key).
BLOCK_RENAMES: tuple[tuple[str, str], ...] = (
    ("self_attn.q.", "attn1.to_q."),
    ("self_attn.k.", "attn1.to_k."),
    ("self_attn.v.", "attn1.to_v."),
    ("self_attn.o.", "attn1.to_out.0."),
    ("self_attn.norm_q.", "attn1.norm_q."),
    ("self_attn.norm_k.", "attn1.norm_k."),
    ("cross_attn.q.", "attn2.to_q."),
    ("cross_attn.k.", "attn2.to_k."),
    ("cross_attn.v.", "attn2.to_v."),
    ("cross_attn.o.", "attn2.to_out.0."),
    ("cross_attn.norm_q.", "attn2.norm_q."),
    ("cross_attn.norm_k.", "attn2.norm_k."),
    ("cross_attn.k_img.", "attn2.add_k_proj."),
    ("cross_attn.v_img.", "attn2.add_v_proj."),
    ("cross_attn.norm_k_img.", "attn2.norm_added_k."),
    ("norm3.", "norm2."),
    ("norm2.", "norm3."),
    ("ffn.0.", "ffn.net.0.proj."),
    ("ffn.2.", "ffn.net.2."),
    ("modulation", "scale_shift_table"),
)

# Prefixes added by training wrappers (DDP, FSDP, activation checkpointing, torch.compile) and by the
# Self-Forcing ``WanDiffusionWrapper`` (``model.``).
WRAPPER_SEGMENTS = frozenset({"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
STATE_DICT_ENTRIES = ("generator_ema", "generator", "model", "state_dict")


class CheckpointKeyError(ValueError):
    """A checkpoint whose parameters do not match the transformer config (wrong file or wrong config)."""


def _rename(key: str, rules: tuple[tuple[str, str], ...]) -> str | None:
    for old, new in rules:
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def _strip_wrappers(key: str) -> str:
    parts = [part for part in key.split(".") if part not in WRAPPER_SEGMENTS]
    return ".".join(parts[1:] if parts[0] == "model" else parts)


def convert_wan_original_to_diffusers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an original-layout Wan transformer state dict to ``WanTransformer3DModel`` names.

    Keys that no rule knows are kept as they are, so that loading reports them as unexpected.
    """
    converted: dict[str, torch.Tensor] = {}
    for raw_key, tensor in state_dict.items():
        key = _strip_wrappers(raw_key)
        if key.startswith("blocks."):
            _, index, rest = key.split(".", 2)
            renamed = _rename(rest, BLOCK_RENAMES)
            new_key = f"blocks.{index}.{renamed}" if renamed is not None else key
        else:
            new_key = _rename(key, TOP_LEVEL_RENAMES) or key
        if new_key in converted:
            raise CheckpointKeyError(f"checkpoint key {raw_key!r} maps to {new_key!r}, which another key already gave")
        converted[new_key] = tensor
    return converted


def read_checkpoint_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The generator's state dict from a ``.pt``/``.pth``/``.safetensors`` file.

    Training checkpoints hold several state dicts; the EMA generator is preferred, as Self-Forcing's
    ``inference.py --use_ema`` does.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, Mapping):
        raise CheckpointKeyError(f"{path!r} holds a {type(blob).__name__}, not a state dict")
    for entry in STATE_DICT_ENTRIES:
        if isinstance(blob.get(entry), Mapping):
            return dict(blob[entry])
    if blob and all(isinstance(v, torch.Tensor) for v in blob.values()):
        return dict(blob)
    raise CheckpointKeyError(
        f"{path!r} has no generator state dict: expected one of {list(STATE_DICT_ENTRIES)} or a flat state dict, "
        f"found top-level entries {sorted(blob)[:10]}"
    )


def _check_keys(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(state_dict))
        if state_dict[k].shape != expected[k].shape
    ]
    if not (missing or unexpected or wrong_shape):
        return

    def listing(title: str, items: list[str]) -> str:
        shown = ", ".join(items[:12]) + (f", ... ({len(items) - 12} more)" if len(items) > 12 else "")
        return f"\n  {title} ({len(items)}): {shown}" if items else ""

    raise CheckpointKeyError(
        f"{source} does not fit this WanTransformer3DModel config"
        + listing("missing keys", missing)
        + listing("unexpected keys", unexpected)
        + listing("shape mismatches", wrong_shape)
        + "\n  Pass a Self-Forcing/CausVid/LongLive generator checkpoint (original Wan layout) and the config of the "
        "base model it was trained from (e.g. Wan2.1-T2V-1.3B's transformer/config.json)."
    )


def cast_keeping_fp32_modules(model: WanTransformer3DModel, dtype: torch.dtype) -> None:
    """Cast like ``from_pretrained(torch_dtype=...)``: ``_keep_in_fp32_modules`` (norms, time embedder, ...) stay fp32."""
    keep = set(model._keep_in_fp32_modules or ())
    for name, param in model.named_parameters():
        if param.is_floating_point():
            param.data = param.data.to(torch.float32 if keep & set(name.split(".")) else dtype)


def load_causal_wan_transformer(
    checkpoint: str | os.PathLike,
    config: str | os.PathLike | Mapping,
    torch_dtype: torch.dtype | None = None,
    upstream_numerics: bool = True,
) -> WanTransformer3DModel:
    """Build a ``WanTransformer3DModel`` from ``config`` and load an original-layout causal Wan checkpoint.

    ``config``: a diffusers model folder (the base pipeline folder or its ``transformer`` subfolder) or a
    config dict. Every parameter must be present with the right shape, else :class:`CheckpointKeyError`
    lists the missing, unexpected and mis-shaped keys. ``upstream_numerics`` installs the hooks of
    :func:`enable_upstream_numerics` (fp32 Q/K norms, fp64 timestep embedding), as the checkpoint was trained.
    """
    from accelerate import init_empty_weights

    if not isinstance(config, Mapping):
        folder = os.fspath(config)
        subfolder = "transformer" if os.path.isfile(os.path.join(folder, "transformer", "config.json")) else None
        config = WanTransformer3DModel.load_config(folder, subfolder=subfolder)
    state_dict = convert_wan_original_to_diffusers(read_checkpoint_state_dict(checkpoint))
    with init_empty_weights():
        model = WanTransformer3DModel.from_config(config)
    _check_keys(model, state_dict, f"checkpoint {os.fspath(checkpoint)!r}")
    model.load_state_dict(state_dict, strict=True, assign=True)
    if torch_dtype is not None:
        cast_keeping_fp32_modules(model, torch_dtype)
    if upstream_numerics:
        enable_upstream_numerics(model)
    return model.eval()
