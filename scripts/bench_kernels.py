"""Kernel benchmark (issue 4): quantize one chunk tensor and dequantize a 21-frame window, against anchors.

    python scripts/bench_kernels.py              # CUDA: Self-Forcing geometry, a few minutes
    python scripts/bench_kernels.py --small      # tiny sizes; on CPU the kernels run in Triton's interpreter

Same run, same inputs (video-derived K/V from ``diffusers_qvg.video_kv`` when it can be built, else a
clearly labelled synthetic fallback): our kernels, ``quant-videogen==0.1.0`` when it imports, a
``torch.compile``d unpack of plain 2-bit codes with per-group scales (what a user would write instead), the
torch reference decoder, and the copy roofline (a device-to-device copy of the bytes our decoder reads and
writes). Times are medians of warm repeats (CUDA events on GPU). Prints a markdown table, then JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch

QUANTIZE_TARGET_MS = 0.25  # one chunk tensor [1, 4680, 12, 128], k-means excluded
DEQUANTIZE_TARGET_MS = 0.10  # 7 segments x 4680 tokens, K and V
WINDOW_READ_TARGET_MS = 0.08  # issue 8: K (RoPE) + V of one layer's 21-frame window, one launch


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def load_kv(spec, chunks: int, device: torch.device) -> tuple[dict[str, torch.Tensor], str]:
    """Pre-RoPE keys, values and the window's RoPE tables; video-derived when possible."""
    try:
        from diffusers_qvg.video_kv import video_kv

        data = video_kv(spec, chunks=chunks)
        tensors = dict(key=data.key_pre_rope, value=data.value, cos=data.cos, sin=data.sin)
        source = f"video-derived (diffusers_qvg.video_kv, clips {', '.join(spec.clips)})"
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        g = torch.Generator().manual_seed(0)
        n, H, D = chunks * spec.tokens_per_chunk, spec.heads, spec.head_dim
        basis = torch.randn(16, H * D, generator=g)  # low-rank tokens plus noise: some structure for k-means

        def tensor() -> torch.Tensor:
            weights = torch.randn(n, 16, generator=g).cumsum(0) / n**0.5
            return (weights @ basis + 0.3 * torch.randn(n, H * D, generator=g)).view(1, n, H, D).bfloat16()

        angles = torch.arange(n, dtype=torch.float64)[:, None] * torch.logspace(0, -4, D // 2, dtype=torch.float64)
        rope = [f(angles).repeat_interleave(2, -1).float().view(1, n, 1, D) for f in (torch.cos, torch.sin)]
        tensors = dict(key=tensor(), value=tensor(), cos=rope[0], sin=rope[1])
        source = f"FALLBACK synthetic low-rank K/V, NOT video-derived (video_kv unavailable: {error})"
    return {k: v.to(device) for k, v in tensors.items()}, source


class Table:
    """The benchmark's rows. A row that raises is recorded with its error (``ms`` None) and the next rows run,
    so one failing comparison (a third-party kernel, say) cannot cost the rows after it."""

    def __init__(self, timer: Callable[[Callable[[], object]], float]) -> None:
        self.timer = timer
        self.rows: list[dict] = []

    def add(self, section: str, name: str, ms: float | None, *, nbytes: int | None = None,
            target: float | None = None, note: str = "", error: str | None = None) -> None:
        self.rows.append(dict(section=section, name=name, ms=ms, bytes=nbytes, target_ms=target, note=note, error=error))
        print(f"  {section} | {name}: {'-' if ms is None else f'{ms:.4f} ms'} {error or note}", file=sys.stderr)

    @contextmanager
    def guard(self, section: str, name: str) -> Iterator[None]:
        """Run the block; if it raises, the failure becomes the row ``name``."""
        try:
            yield
        except Exception as error:  # a benchmark row must not end the run: its failure is its figure
            self.add(section, name, None, error=f"{type(error).__name__}: {error}".strip())

    def time(self, section: str, name: str, fn: Callable[[], object], **fields) -> None:
        """The row ``name``: the median time of ``fn`` (or its failure)."""
        with self.guard(section, name):
            self.add(section, name, self.timer(fn), **fields)


def launch_rows(table: Table, call: str, fn: Callable[[], object], repeats: int) -> None:
    """Rows "launches": each kernel of ``fn`` with its median device time (PyTorch profiler, ``repeats`` runs
    after ``table.time``'s warm-up), then their sum, which the call's row less launch gaps should match: on a
    GPU this checks the static sm_90 estimates (docs/benchmarks.md) launch by launch. Without CUDA nothing
    runs on a device, and the one row says so."""
    from diffusers_qvg import device_times  # after main() has set TRITON_INTERPRET

    name = f"{call}: device time per launch"
    if not torch.cuda.is_available():  # the interpreter's runs would cost seconds and profile nothing
        table.add("launches", name, None, note="not run: no CUDA device, so no device kernels to profile")
        return
    with table.guard("launches", name):
        runs = [device_times.device_events(fn) for _ in range(min(repeats, 10))]
        launches = device_times.launch_medians(runs)
        if not launches:  # CUDA without the profiler's device activities (CUPTI missing): the row says so
            raise RuntimeError("the PyTorch profiler recorded no device activity")
        for i, (kernel, us) in enumerate(launches):
            table.add("launches", f"{call}: launch {i + 1} of {len(launches)}, {kernel}", us / 1e3,
                      note=f"device time, median of {len(runs)} profiled runs")
        table.add("launches", f"{call}: the {len(launches)} launches' device times, summed",
                  sum(us for _, us in launches) / 1e3, note="against the call's row: the rest is launch gaps")


@contextmanager
def ternary_codes_tile(tokens: int | None) -> Iterator[None]:
    """The codes kernel at ``tokens`` ternary tokens per program while the block runs (None: as shipped)."""
    from diffusers_qvg.codecs.qvg.triton import quantize

    shipped = quantize.BLOCK_TOKENS[True]
    quantize.BLOCK_TOKENS[True] = tokens or shipped
    try:
        yield
    finally:
        quantize.BLOCK_TOKENS[True] = shipped


def official_quantize(x: torch.Tensor) -> tuple[Callable[[], object] | None, str]:
    """quant-videogen's K+V compression of ``x`` (used as both K and V), or why it cannot run."""
    try:
        import quant_videogen
        from quant_videogen.compress import compress_kv_cache, get_quantize_fn
        from quant_videogen.sim.quant.quantize_config import QuantizeConfig

        qtype = "triton-nstages-kmeans-int2"
        cfg = QuantizeConfig(quant_type=qtype, num_prq_stages=1, quant_block_size=64, kmeans_max_iters=2)
        qfn = get_quantize_fn(qtype, cfg)
        bhsd = x.transpose(1, 2).contiguous()
        compress_kv_cache(bhsd, bhsd, qtype, cfg, qfn)  # fails here if its kernels do not build
        version = getattr(quant_videogen, "__version__", "?")
        return (lambda: compress_kv_cache(bhsd, bhsd, qtype, cfg, qfn)), f"quant-videogen {version}, K+V call / 2"
    except Exception as error:  # any failure of a third-party import or launch is reported, not fatal
        return None, f"quant-videogen does not run here: {type(error).__name__}: {error}"


def plain_unpack(device: torch.device) -> tuple[Callable, str]:
    """What a user would write: 2-bit codes (4 per byte) times per-group bf16 scales, compiled on CUDA."""

    def unpack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        shifts = torch.tensor([6, 4, 2, 0], dtype=torch.uint8, device=codes.device)
        u = (codes.unsqueeze(-1) >> shifts) & 3  # [B, W, H, D/4, 4]
        levels = u.flatten(-2).to(torch.float32) - 1.0
        return (levels.unflatten(-1, (scales.shape[-1], -1)) * scales.float().unsqueeze(-1)).flatten(-2).bfloat16()

    if device.type == "cuda":
        return torch.compile(unpack, dynamic=False), "torch.compile"
    return unpack, "eager (torch.compile is for the GPU run)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--small", action="store_true", help="tiny sizes (on CPU: Triton's interpreter), seconds")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 50 on CUDA, 2 small)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10 on CUDA, 1 small)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON to PATH")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.small:
            parser.error("no CUDA device: the kernels only run at small sizes under Triton's interpreter; pass --small")
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    repeats = args.repeats or (50 if device.type == "cuda" and not args.small else 2)
    warmup = args.warmup if args.warmup is not None else (10 if device.type == "cuda" and not args.small else 1)

    import triton

    import diffusers_qvg as dq
    from diffusers_qvg.codecs.qvg import backend
    from diffusers_qvg.codecs.qvg.kmeans import kmeans_init
    from diffusers_qvg.codecs.qvg.triton.assign import assign as triton_assign
    from diffusers_qvg.codecs.qvg.triton.centroid_update import lloyd as triton_lloyd
    from diffusers_qvg.codecs.qvg.triton.encoder import launch_count, quantize_residual_into, scale_fractions
    from diffusers_qvg.codecs.status import WriteStatus
    from diffusers_qvg.codecs.qvg.triton.dequantize import dequantize_into as triton_dequantize
    from diffusers_qvg.codecs.qvg.triton.dequantize import dequantize_pair_into as triton_pair
    from diffusers_qvg.rotary import rotary_pairs
    from diffusers_qvg.video_kv import VideoKVSpec

    spec = VideoKVSpec(height=32, width=48, patch=8, heads=2, head_dim=64) if args.small else VideoKVSpec()
    chunks = 3 if args.small else 7
    n = spec.tokens_per_chunk
    data, source = load_kv(spec, chunks, device)
    H, D = spec.heads, spec.head_dim
    configs = {"qvg-int2": dq.QVGConfig(), "official layout": dq.QVGConfig.official()}
    if args.small:  # one configuration, few centroids: the code paths, in seconds
        configs = {"qvg-int2": dq.QVGConfig(num_centroids=16, kmeans_iters=1, kmeans_init="strided")}
    table = Table(lambda fn: median_ms(fn, device, repeats, warmup))
    rows = table.rows

    # ---- Quantize one chunk tensor (K before RoPE, chunk 0); a layer's K and V in one batched call ----
    x = data["key"][:, :n].contiguous()
    v = data["value"][:, :n].contiguous()
    for name, config in configs.items():
        with table.guard("quantize", f"{name}: setup"), backend("triton"):
            no_kmeans = config.with_(kmeans_iters=0, kmeans_init="strided")
            for label, c, target in ((f"init {config.kmeans_init} + {config.kmeans_iters} Lloyd iters", config, None),
                                     ("no k-means: strided init, 0 iters", no_kmeans, QUANTIZE_TARGET_MS)):
                own = c.allocate(batch=1, capacity_tokens=n, heads=H, head_dim=D, num_slots=1, dtype=x.dtype, device=device)
                table.time("quantize", f"{name}: whole encoder, {label}",
                           lambda: c.quantize_into(own, x, token_start=0, slot=0), target=target,
                           note="codec verb: input validation included (values checked on the host: 1 sync)")
            kv = [config.allocate(batch=1, capacity_tokens=n, heads=H, head_dim=D, num_slots=1, dtype=x.dtype, device=device)
                  for _ in range(2)]
            status = WriteStatus(device)
            launches = launch_count(config)
            table.time("quantize", f"{name}: K and V of a layer, one quantize_batch_into call (ours)",
                       lambda: config.quantize_batch_into([(kv[0], x, 0, 0), (kv[1], v, 0, 0)], status=status),
                       note=f"as the cache writes: a device-side write status, no sync; {launches} launches")
            table.time("quantize", f"{name}: K and V of a layer, two quantize_into calls (ours)",
                       lambda: [config.quantize_into(s, t, token_start=0, slot=0, status=status) for s, t in zip(kv, (x, v))],
                       note="the same writes one by one")
            # The clean pass's call at the cache's default CacheConfig.encode_layers=3: a chunk is 10 of these at
            # 30 layers (issue 8's <= 3 ms per chunk); then the measured codec levers (docs/benchmarks.md).
            # The last row is the codes kernel's losing tile by the sm_90 estimate (32 ternary tokens per program
            # against 64: docs/benchmarks.md, "The codes kernel at 64 tokens per program"; at 32 tokens a group
            # spans threads again, "A thread per group"), for a GPU to settle.
            levers = {"": (config, None)}
            if name == "qvg-int2" and not args.small:  # the same call, other configs (seconds in the interpreter)
                levers |= {", kmeans_iters=4": (config.with_(kmeans_iters=4), None),
                           ", kmeans_iters=3": (config.with_(kmeans_iters=3), None),
                           ", scale_search='mse-coarse'": (config.with_(scale_search="mse-coarse"), None),
                           ", codes kernel at 32 tokens per program": (config, 32)}
            for lever, (c, codes_tokens) in levers.items():
                group = [c.allocate(batch=1, capacity_tokens=n, heads=H, head_dim=D, num_slots=1, dtype=x.dtype,
                                    device=device) for _ in range(6)]
                writes = [(st, t, 0, 0) for st, t in zip(group, (x, v) * 3)]

                def group_write(c=c, writes=writes, codes_tokens=codes_tokens):
                    with ternary_codes_tile(codes_tokens):
                        c.quantize_batch_into(writes, status=status)

                table.time("quantize", f"{name}{lever}: a layer group's K and V (3 layers), one quantize_batch_into call (ours)",
                           group_write, note="the clean pass's call per group of 3 layers: x 10 per chunk at 30 layers")
                if not lever:
                    launch_rows(table, f"{name}: a layer group's K and V", group_write, repeats)
            storage = config.allocate(batch=1, capacity_tokens=n, heads=H, head_dim=D, num_slots=1, dtype=x.dtype, device=device)
            config.quantize_into(storage, x, token_start=0, slot=0)  # ids and centroids for the residual kernels
            alphas = scale_fractions(config.scale_search, device)
            table.time("quantize", f"{name}: residual codes, 2 launches (ours)",
                       lambda: quantize_residual_into(storage, x, alphas, token_start=0, slot=0),
                       note="scale-need pass + codes kernel, from the segment's ids and centroids")
            points = x.float().permute(0, 2, 1, 3).reshape(H, n, D)
            init = kmeans_init(points, config.centroids, "strided", torch.Generator(device=device))
            table.time("quantize", f"{name}: nearest-centroid assignment (ours)", lambda: triton_assign(points, init))
            for precision in ("tf32x3", "bf16"):
                table.time("k-means", f"{name}: {config.kmeans_iters} Lloyd iters, deterministic Triton (ours, {precision})",
                           lambda: triton_lloyd(points, init, config.kmeans_iters, precision),
                           note="float32 points: the update splits them into 3 exact bf16 parts (the encoder's bf16 input: 1)")
            flash = f"{name}: {config.kmeans_iters} Lloyd iters, flash-kmeans batch_kmeans_Euclid"
            with table.guard("k-means", flash):  # CUDA only (on a CPU its failure is the row)
                from flash_kmeans import batch_kmeans_Euclid

                table.time("k-means", flash, lambda: batch_kmeans_Euclid(
                    points, config.centroids, max_iters=config.kmeans_iters, tol=0.0, init_centroids=init.clone()),
                    note="fp32 atomics (non-deterministic), host sync per iteration")
    if device.type == "cuda":
        official = "official quant-videogen: whole quantize, per tensor"
        with table.guard("quantize", official):
            run, note = official_quantize(x)
            table.add("quantize", official, None if run is None else table.timer(run) / 2, note=note)

    # ---- Dequantize the window: `chunks` segments of `n` tokens, K (rotated by RoPE) and V ----
    W = chunks * n
    segments = dq.segment_table([(i * n, n, i * n, i) for i in range(chunks)], device=device)
    rotary = (data["cos"], data["sin"])
    pairs = rotary_pairs(*rotary)  # what a cache plans once per layout: half the RoPE bytes
    out = {role: torch.empty(1, W, H, D, dtype=torch.bfloat16, device=device) for role in ("key", "value")}
    out_bytes = 2 * out["key"].numel() * out["key"].element_size()
    decoder_bytes = []  # per configuration: packed K/V read plus the dense window written
    def packed_window(config: dq.CodecConfig) -> tuple[dict[str, dq.Packed], int, str]:
        """The window's K and V packed chunk by chunk, their bytes, and the row note."""
        stores = {}
        for role in ("key", "value"):
            s = config.allocate(batch=1, capacity_tokens=W, heads=H, head_dim=D, num_slots=chunks, dtype=torch.bfloat16, device=device)
            for i in range(chunks):
                config.quantize_into(s, data[role][:, i * n : (i + 1) * n], token_start=i * n, slot=i)
            stores[role] = s
        packed_bytes = sum(s.nbytes for s in stores.values())
        return stores, packed_bytes, f"{packed_bytes / 2 / (W * H * D) * 8:.2f} bits/element incl. window-sized storage"

    for name, config in configs.items():
        with table.guard("dequantize", f"{name}: setup"):
            stores, packed_bytes, note = packed_window(config)
            decoder_bytes.append(packed_bytes + out_bytes)
            for rope in (True, False):
                def kernels():
                    triton_dequantize(stores["key"], segments, out["key"], rotary if rope else None)
                    triton_dequantize(stores["value"], segments, out["value"])

                table.time("dequantize", f"{name}: ours, 1 launch per tensor, K{' +RoPE' if rope else ''} and V", kernels,
                           nbytes=packed_bytes + out_bytes, target=DEQUANTIZE_TARGET_MS, note=note)
            table.time("dequantize", f"{name}: ours, K +RoPE (RotaryPairs) and V in 1 launch",
                       lambda: triton_pair(stores["key"], stores["value"], segments, out["key"], out["value"], pairs),
                       nbytes=packed_bytes + out_bytes + pairs.nbytes, target=WINDOW_READ_TARGET_MS, note=note)
            with backend("triton"):
                table.time("dequantize", f"{name}: ours via the codec verb dequantize_pair_into, K +RoPE and V",
                           lambda: config.dequantize_pair_into(stores["key"], stores["value"], segments, out["key"],
                                                               out["value"], pairs),
                           nbytes=packed_bytes + out_bytes + pairs.nbytes, note=note)
            for mode in ("triton", "torch"):
                def verb():
                    config.dequantize_into(stores["key"], segments, out["key"], rotary)
                    config.dequantize_into(stores["value"], segments, out["value"])

                label = "ours via the codec verb (segment-table check included)" if mode == "triton" else "torch reference decoder"
                with backend(mode):
                    table.time("dequantize", f"{name}: {label}, K +RoPE and V", verb, nbytes=packed_bytes + out_bytes,
                               note=note)

    # LongLive-2's format (NVFP4, four-over-six scales) through this package's kernel and reference decoder.
    with table.guard("dequantize", "nvfp4: setup"):
        fp4 = dq.NVFP4Config()
        own = fp4.allocate(batch=1, capacity_tokens=n, heads=H, head_dim=D, num_slots=1, dtype=x.dtype, device=device)
        status = WriteStatus(device)
        for mode, label in (("triton", "ours (Triton encoder)"), ("torch", "torch reference encoder")):
            with backend(mode):
                table.time("quantize", f"nvfp4 (LongLive-2's format): K and V of a layer, two quantize_into calls, {label}",
                           lambda: [fp4.quantize_into(own, t, token_start=0, slot=0, status=status) for t in (x, v)],
                           note="as the cache writes: a device-side write status, no sync")
        stores, packed_bytes, note = packed_window(fp4)
        for mode, label in (("triton", "ours, K +RoPE (RotaryPairs) and V in 1 launch"), ("torch", "torch reference decoder, K +RoPE and V")):
            with backend(mode):
                table.time("dequantize", f"nvfp4 (LongLive-2's format): {label}",
                           lambda: fp4.dequantize_pair_into(stores["key"], stores["value"], segments, out["key"], out["value"], pairs),
                           nbytes=packed_bytes + out_bytes + pairs.nbytes, target=WINDOW_READ_TARGET_MS if mode == "triton" else None,
                           note=note)

    plain_row = "plain 2-bit unpack x per-group scales, K and V"
    with table.guard("dequantize", plain_row):
        unpack, how = plain_unpack(device)
        g = torch.Generator(device=device).manual_seed(0)
        plain = [
            (torch.randint(0, 256, (1, W, H, D // 4), dtype=torch.uint8, device=device, generator=g),
             torch.rand(1, W, H, D // 64, device=device, generator=g).bfloat16())
            for _ in range(2)
        ]
        plain_bytes = sum(c.numel() + s.numel() * 2 for c, s in plain) + out_bytes
        table.time("dequantize", f"{plain_row} ({how})", lambda: [unpack(c, s) for c, s in plain], nbytes=plain_bytes,
                   note="no centroids, no RoPE")

    # ---- Copy roofline: one device-to-device copy moving as many bytes as our decoder reads plus writes ----
    src = torch.empty((decoder_bytes or [out_bytes])[0] // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    table.time("dequantize", "copy roofline: device copy of the same bytes", lambda: dst.copy_(src), nbytes=2 * src.numel())
    copy_ms = rows[-1]["ms"]
    bandwidth = 2 * src.numel() / (copy_ms * 1e-3) if copy_ms else None
    for r in rows:
        if r["bytes"] and r["ms"]:
            r["gb_per_s"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
            if bandwidth:
                r["fraction_of_copy"] = r["gb_per_s"] * 1e9 / bandwidth

    meta = dict(
        device=torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
        torch=torch.__version__, triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(["python", *sys.argv]), data=source, chunk_tokens=n, heads=H, head_dim=D, window_chunks=chunks,
        repeats=repeats, warmup=warmup,
    )
    print(f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['date']}; {meta['command']}")
    print(f"data: {source}; chunk [1, {n}, {H}, {D}] bf16, window {chunks} x {n} tokens; median of {repeats} warm repeats\n")
    print("| section | row | ms | target ms | GB/s | of copy bw | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ms = ("failed" if r["error"] else "not run") if r["ms"] is None else f"{r['ms']:.4f}"
        target = "" if r["target_ms"] is None else f"{r['target_ms']:.2f}" + (" (full size)" if args.small else "")
        gbs = f"{r['gb_per_s']:.0f}" if "gb_per_s" in r else ""
        frac = f"{100 * r['fraction_of_copy']:.0f}%" if "fraction_of_copy" in r else ""
        note = r["note"] if r["error"] is None else f"ERROR {r['error']}"
        print(f"| {r['section']} | {r['name']} | {ms} | {target} | {gbs} | {frac} | {note} |")
    report = json.dumps(dict(meta=meta, rows=rows), indent=1)
    print("\n" + report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(report)



def window_read_for_sm90_profile(codec: str = "qvg-int2") -> None:
    """The cache's read of a 21-frame Self-Forcing window as ``layer.py`` makes it: 6 packed chunks of 4,680 tokens x
    12 heads x 128 (allocated only), K with the plan's RotaryPairs and V in one ``dequantize_pair_into``.
    For ``python ../shared/tools/sm90_profile.py --call scripts/bench_kernels.py:window_read_for_sm90_profile``."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.kernel_backend import backend
    from diffusers_qvg.rotary import RotaryPairs

    config, n, H, D, packed = dq.resolve_codec(codec), 4680, 12, 128, 6
    W = (packed + 1) * n
    kv = [config.allocate(batch=1, capacity_tokens=packed * n, heads=H, head_dim=D, num_slots=packed,
                          dtype=torch.bfloat16, device="cpu", role=role) for role in ("key", "value")]
    outs = [torch.empty(1, W, H, D, dtype=torch.bfloat16) for _ in range(2)]
    table = dq.segment_table([(i * n, n, i * n, i) for i in range(packed)])
    with backend("triton"):
        config.dequantize_pair_into(kv[0], kv[1], table, *outs, RotaryPairs(torch.rand(1, W, 1, D)))


def nvfp4_window_read_for_sm90_profile() -> None:
    """The same read of LongLive-2's format (``--call scripts/bench_kernels.py:nvfp4_window_read_for_sm90_profile``)."""
    window_read_for_sm90_profile("nvfp4")


def nvfp4_quantize_for_sm90_profile() -> None:
    """One chunk tensor [1, 4680, 12, 128] bf16 encoded as LongLive-2's format, as the cache's clean pass writes it
    (``--call scripts/bench_kernels.py:nvfp4_quantize_for_sm90_profile``)."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.kernel_backend import backend

    config = dq.NVFP4Config()
    storage = config.allocate(batch=1, capacity_tokens=4680, heads=12, head_dim=128, num_slots=1, dtype=torch.bfloat16, device="cpu")
    with backend("triton"):
        config.quantize_into(storage, torch.randn(1, 4680, 12, 128).bfloat16(), token_start=0, slot=0)


if __name__ == "__main__":
    main()
