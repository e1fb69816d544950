"""Validity of cache writes checked on the device: no host sync per write, one read per chunk.

A codec asked to store a tensor must refuse NaN/Inf and magnitudes it cannot hold, and refuse *before*
it writes. Reading a device reduction on the host for every write would synchronise the device 60 times
per chunk (K and V of 30 layers), so a cache hands its codecs a :class:`WriteStatus`: each write folds its
own check into the status on the device, and every store of that write (and of every later write) is
predicated on the status still being clean. The cache reads the status once, when the chunk ends, and
raises the first failure with the message of the write that caused it. Without a status
(``status=None``, the public ``quantize`` API) a codec checks on the host and raises at once.

A status with a ``group`` (the ranks of a head-sharded cache, each holding some heads of the same writes)
gathers every check's verdict over the group on the device: a write that fails on one rank fails on all,
so every rank gates its stores on the same status and raises the same error when the chunk ends, instead
of one rank raising while the others wait for it in the next collective.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# Columns of the status tensor: the failing write's tag (0: none failed), the reason, the magnitude seen,
# how many writes were checked before it, how many have been checked in all, and the rank of the group
# whose part of the write failed first.
TAG, REASON, AMAX, BEFORE, CHECKED, RANK = range(6)
NONFINITE, TOO_LARGE, CONDITION = range(3)


class WriteStatus:
    """The first failed write since the last :meth:`raise_if_failed`, recorded on the device.

    ``tensor`` is float64 ``[6]``: ``(tag, reason, amax, before, checked, rank)``, ``tag == 0`` while every
    write passed; ``before`` counts the writes checked (and stored) before the failing one, so a caller knows
    whether anything was stored at all. Kernels read :meth:`ok` (a bool scalar on the device) to predicate
    their stores; PyTorch writes use :meth:`gated_copy_`. A tag stands for a ``what`` and stays the same for
    the life of the status (so a captured CUDA graph replays valid tags); the messages live on the host.

    ``group``: a process group whose ranks check the same writes in the same order (see the module's
    docstring); every check then costs one small all-gather on the device, no host read.
    """

    def __init__(self, device: torch.device | str, group: dist.ProcessGroup | None = None) -> None:
        self.tensor = torch.zeros(6, dtype=torch.float64, device=device)
        self.group = group
        self.tags: dict[tuple[str, float | None, tuple[str, ...]], int] = {}
        self.messages: list[tuple[str, float | None, tuple[str, ...]]] = []

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @contextmanager
    def bound(self, tensor: torch.Tensor) -> Iterator["WriteStatus"]:
        """Record into ``tensor`` inside the block: a compiled graph hands an op the status it mutates
        (possibly a functional copy it writes back afterwards), and the op must update that one."""
        own, self.tensor = self.tensor, tensor
        try:
            yield self
        finally:
            self.tensor = own

    def tag(self, what: str, limit: float | None, conditions: Sequence[str] = ()) -> int:
        """The tag of a write named ``what`` (its messages kept on the host); the same for the status's life."""
        key = (what, limit, tuple(conditions))
        if key not in self.tags:
            self.messages.append(key)
            self.tags[key] = len(self.messages)
        return self.tags[key]

    def check(
        self,
        x: torch.Tensor,
        what: str,
        limit: float | None,
        must_hold: Sequence[tuple[torch.Tensor, str]] = (),
    ) -> torch.Tensor:
        """Record a failure of ``x`` (NaN/Inf, or a magnitude above ``limit``) or of a ``must_hold``
        condition (a boolean device scalar and the message to raise), unless an earlier write failed.

        A handful of small device ops, no host read. ``what`` names the write in the eventual error. Returns
        the write's place in the order of checks (a device scalar, for :meth:`allows`).
        """
        if x.device != self.device:
            raise ValueError(f"{what} is on {x.device} but the cache's write status is on {self.device}")
        amax = x.detach().abs().amax().double().reshape(1)
        held = torch.stack([ok.to(torch.bool).reshape(()) for ok, _ in must_hold]).reshape(1, -1) if must_hold else None
        tags = torch.full_like(amax, self.tag(what, limit, [m for _, m in must_hold]))  # no H2D copy
        seq = self.tensor[CHECKED].clone()
        self.fold(amax, held, tags, limit)
        return seq

    def check_batch(
        self,
        magnitudes: torch.Tensor,
        whats: Sequence[str],
        limit: float | None,
        holds: torch.Tensor | None = None,
        conditions: Sequence[Sequence[str]] | None = None,
    ) -> torch.Tensor:
        """:meth:`check` for the items of one batched write whose largest magnitudes ``magnitudes`` (float [I],
        +inf or NaN where an item holds NaN/Inf) a kernel has already reduced, with ``holds`` (bool [I, C]) for
        their conditions (messages ``conditions[i]``). Returns, per item, whether it may store: no earlier
        write failed and no item before it (or itself) did, as if they were written one by one."""
        if magnitudes.device != self.device:
            raise ValueError(f"the batch's magnitudes are on {magnitudes.device} but the write status is on {self.device}")
        conditions = conditions or [()] * len(whats)
        tags = torch.tensor([float(self.tag(w, limit, c)) for w, c in zip(whats, conditions)], dtype=torch.float64)
        tags = tags.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else tags.to(self.device)
        return self.fold(magnitudes.double(), holds, tags, limit)

    def fold(
        self, amax: torch.Tensor, held: torch.Tensor | None, tags: torch.Tensor, limit: float | None
    ) -> torch.Tensor:
        """Fold the verdicts of ``I`` writes checked in order into the status (agreed over the group first);
        returns which of them may store (bool [I])."""
        bad = ~torch.isfinite(amax)
        reason = torch.where(bad, float(NONFINITE), float(TOO_LARGE))
        if limit is not None:
            bad = bad | (amax > limit)
        if held is not None:
            for i in range(held.shape[1]):
                failed = ~held[:, i]
                reason = torch.where(bad, reason, torch.where(failed, float(CONDITION + i), reason))
                bad = bad | failed
        bad, reason, amax, rank = self.agree(bad, reason, amax)
        t, n = self.tensor, amax.shape[0]
        order = torch.arange(n, device=amax.device)
        first = torch.where(bad, order, n).min()  # the first failing item (n: none)
        clean = t[TAG] == 0
        at = first.clamp(max=n - 1).reshape(1)  # a tensor index, never a Python int: no host read
        seq = (t[CHECKED] + first.double()).reshape(1)
        fields = torch.stack([tags, reason, amax, rank]).index_select(1, at).squeeze(1)
        record = torch.cat([fields[:3], seq, seq, fields[3:]])
        t.copy_(torch.where(clean & (first < n), record, t))
        t[CHECKED] += n
        return clean & (order < first)

    def agree(
        self, bad: torch.Tensor, reason: torch.Tensor, amax: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each check's verdict over the group (all [I]): failed if it failed on any rank, with the reason,
        magnitude and rank of the first rank where it did (without a group: this rank's own, rank 0)."""
        if self.group is None:
            return bad, reason, amax, torch.zeros_like(amax)
        rows = amax.new_zeros(dist.get_world_size(self.group), amax.shape[0], 3)  # a sum gathers every rank's row
        rows[dist.get_rank(self.group)] = torch.stack([bad.double(), reason, amax], dim=-1)
        rows = funcol.all_reduce(rows, "sum", self.group)
        if isinstance(rows, funcol.AsyncCollectiveTensor):
            rows = rows.wait()
        first = rows[:, :, 0].argmax(0)  # per check, the first failing rank (0 when none failed)
        pick = rows.gather(0, first.view(1, -1, 1).expand(1, -1, 3)).squeeze(0)
        return pick[:, 0] > 0, pick[:, 1], pick[:, 2], first.double()

    def allows(self, seq: torch.Tensor) -> torch.Tensor:
        """Whether the write :meth:`check` returned ``seq`` for may store (a bool device scalar): no write
        failed, or only one checked after it. A batch checked first and stored after stores as one by one."""
        t = self.tensor
        return (t[TAG] == 0) | (t[BEFORE] > seq)

    def ok(self) -> torch.Tensor:
        """True (a bool scalar on the device) while no write has failed: the predicate of every store."""
        return self.tensor[TAG] == 0

    def ok_on_host(self) -> bool:
        """:meth:`ok` read on the host: free on the CPU; on CUDA a sync (only the reference paths use it)."""
        return bool(self.ok())

    def gated_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` if no write has failed, else leave ``dst`` as it is (no host read)."""
        dst.copy_(torch.where(self.ok(), src, dst))

    def read(self) -> tuple[str | None, int]:
        """The message of the first failed write (``None``: none failed) and how many writes were stored
        before it (all checked writes when none failed); one host read."""
        tag, reason, amax, before, checked, rank = self.tensor.tolist()
        if tag == 0:
            return None, int(checked)
        return self.message(int(tag), reason, amax, int(rank)), int(before)

    def failure(self) -> str | None:
        """The message of the first failed write, or ``None`` (one host read)."""
        return self.read()[0]

    def message(self, tag: int, reason: float, amax: float, rank: int = 0) -> str:
        what, limit, conditions = self.messages[tag - 1]
        if self.group is not None:
            what = f"{what} (the heads of rank {rank} of {dist.get_world_size(self.group)})"
        if reason == NONFINITE:
            return f"NaN or Inf values in {what}; fix the model output before caching it"
        if reason == TOO_LARGE:
            return (
                f"values up to {amax:.3g} in {what}; the format stores magnitudes up to "
                f"2^{math.log2(limit):g} (~{limit:.2g}), beyond which float32 distances and scales overflow; "
                "rescale the tensor"
            )
        return conditions[int(reason) - CONDITION]

    def clear(self) -> None:
        """Forget the failure and the counts (the tags stay valid)."""
        self.tensor.zero_()

    def raise_if_failed(self) -> None:
        """Raise ``ValueError`` with the first failure's message (then start clean); one host read."""
        message = self.failure()
        self.clear()
        if message is not None:
            raise ValueError(message)
