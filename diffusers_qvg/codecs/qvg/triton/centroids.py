"""The stage-``t`` centroid row of every token, as float32: shared by the decoder and the quantizer."""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def stage_centroids(
    t, cols, mask, row_mask, id_rows, table_rows,
    ids_ptr, cent_ptr, cscale_ptr,
    s_ids_s, s_cent_stage, s_cent_k, s_cent_d, s_cscale_stage, s_cscale_k, cscale_rows,
    CENT_SCALED: tl.constexpr,
):
    """``float(centroids[slot, t, b, h, ids[t]]) * centroid_scale`` for rows whose id offsets are ``id_rows``.

    ``table_rows`` / ``cscale_rows`` are the rows' (slot, b, h) offsets into the centroids and their scales.
    """
    ids = tl.load(ids_ptr + id_rows + t * s_ids_s, mask=row_mask, other=0).to(tl.int64)
    cent_rows = table_rows + t * s_cent_stage + ids * s_cent_k
    # No `other=` (it cannot be cast to fp8); masked lanes are zeroed after the widening instead.
    term = tl.where(mask, tl.load(cent_ptr + cent_rows[:, None] + (cols * s_cent_d)[None, :], mask=mask).to(tl.float32), 0.0)
    if CENT_SCALED:
        term = term * tl.load(cscale_ptr + cscale_rows + t * s_cscale_stage + ids * s_cscale_k, mask=row_mask, other=0)[:, None]
    return term
