"""NVFP4, LongLive-2's KV cache format: its bytes (:mod:`.format`), the codec (:mod:`.codec`) and its Triton
window decoder (:mod:`.triton_decode`)."""

from .codec import NVFP4Config
from .format import E2M1_GRID, NVFP4Packed, e2m1_codes, e2m1_values, pack_pairs

__all__ = ["E2M1_GRID", "NVFP4Config", "NVFP4Packed", "e2m1_codes", "e2m1_values", "pack_pairs"]
