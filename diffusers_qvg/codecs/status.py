"""Validity of cache writes checked on the device: no host sync per write, one read per chunk.

A codec asked to store a tensor must refuse NaN/Inf and magnitudes it cannot hold, and refuse *before*
it writes. Reading a device reduction on the host for every write would synchronise the device 60 times
per chunk (K and V of 30 layers), so a cache hands its codecs a :class:`WriteStatus`: each write folds its
own check into the status on the device, and every store of that write (and of every later write) is
predicated on the status still being clean. The cache reads the status once, when the chunk ends, and
raises the first failure with the message of the write that caused it. Without a status
(``status=None``, the public ``quantize`` API) a codec checks on the host and raises at once.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

# Columns of the status tensor: the failing write's tag (0: none failed), the reason, the magnitude seen.
TAG, REASON, AMAX = range(3)
NONFINITE, TOO_LARGE, CONDITION = range(3)


class WriteStatus:
    """The first failed write since the last :meth:`raise_if_failed`, recorded on the device.

    ``tensor`` is float64 ``[3]``: ``(tag, reason, amax)``, ``tag == 0`` while every write passed. Kernels
    read :meth:`ok` (a bool scalar on the device) to predicate their stores; PyTorch writes use
    :meth:`gated_copy_`. Tags index :attr:`messages`, which lives on the host.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.tensor = torch.zeros(3, dtype=torch.float64, device=device)
        self.messages: list[tuple[str, float | None, tuple[str, ...]]] = []

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def check(
        self,
        x: torch.Tensor,
        what: str,
        limit: float | None,
        must_hold: Sequence[tuple[torch.Tensor, str]] = (),
    ) -> int:
        """Record a failure of ``x`` (NaN/Inf, or a magnitude above ``limit``) or of a ``must_hold``
        condition (a boolean device scalar and the message to raise), unless an earlier write failed.

        A handful of small device ops, no host read. ``what`` names the write in the eventual error.
        Returns the write's tag (1, 2, ... in the order of the checks; see :meth:`allows`).
        """
        tag = float(self.register(x, what, limit, [message for _, message in must_hold]))
        amax = x.detach().abs().amax().double()
        reason = torch.where(torch.isfinite(amax), float(TOO_LARGE), float(NONFINITE))
        bad = ~torch.isfinite(amax)
        if limit is not None:
            bad = bad | (amax > limit)
        for i, (ok, _) in enumerate(must_hold):
            failed = ~ok.to(torch.bool)
            reason = torch.where(bad, reason, torch.where(failed, float(CONDITION + i), reason))
            bad = bad | failed
        fail = bad & (self.tensor[TAG] == 0)
        record = torch.stack([amax.new_tensor(tag), reason.double(), amax])
        self.tensor.copy_(torch.where(fail, record, self.tensor))
        return len(self.messages)

    def register(self, x: torch.Tensor, what: str, limit: float | None, conditions: Sequence[str] = ()) -> int:
        """The host half of :meth:`check`: give the write its tag and remember its messages, no device op.

        Kernels that fold the check into their own passes call this instead of :meth:`check` and then
        write the record themselves, by the same rule: if ``tensor[TAG] == 0`` and the write fails, store
        ``(tag, reason, amax)`` with reason NONFINITE, TOO_LARGE or ``CONDITION + i``.
        """
        if x.device != self.device:
            raise ValueError(f"{what} is on {x.device} but the cache's write status is on {self.device}")
        self.messages.append((what, limit, tuple(conditions)))
        return len(self.messages)

    def ok(self) -> torch.Tensor:
        """True (a bool scalar on the device) while no write has failed: the predicate of every store."""
        return self.tensor[TAG] == 0

    def allows(self, tag: int) -> torch.Tensor:
        """True (a bool scalar on the device) while the write tagged ``tag`` may store: no write failed, or
        only a later one. A batch of writes is checked first, then stored: write ``i``'s stores are
        predicated on this, so each write sees only the failures of the writes before it, as one by one."""
        failed = self.tensor[TAG]
        return (failed == 0) | (failed > tag)

    def ok_on_host(self) -> bool:
        """:meth:`ok` read on the host: free on the CPU; on CUDA a sync (only the reference paths use it)."""
        return bool(self.ok())

    def gated_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` if no write has failed, else leave ``dst`` as it is (no host read)."""
        if self.device.type == "cpu":
            if self.ok_on_host():
                dst.copy_(src)
            return
        dst.copy_(torch.where(self.ok(), src, dst))

    def failure(self) -> str | None:
        """The message of the first failed write, or ``None`` (one host read)."""
        tag, reason, amax = self.tensor.tolist()
        if tag == 0:
            return None
        what, limit, conditions = self.messages[int(tag) - 1]
        if reason == NONFINITE:
            return f"{what} contains NaN or Inf values; fix the model output before caching it"
        if reason == TOO_LARGE:
            return (
                f"{what} has values up to {amax:.3g}; the format stores magnitudes up to "
                f"2^{math.log2(limit):g} (~{limit:.2g}), beyond which float32 distances and scales overflow; "
                "rescale the tensor"
            )
        return conditions[int(reason) - CONDITION]

    def clear(self) -> None:
        self.tensor.zero_()
        self.messages.clear()

    def raise_if_failed(self) -> None:
        """Raise ``ValueError`` with the first failure's message (then start clean); one host read."""
        message = self.failure()
        self.clear()
        if message is not None:
            raise ValueError(message)
