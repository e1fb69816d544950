"""The kernels compile for an H100/H200 (sm_90) without a GPU: Triton's frontend, PTX and ptxas all run.

The interpreter tests check arithmetic but never lower a kernel; this catches what only compilation finds
(unsupported ops, type errors in branches the interpreter folds) and checks the PTX for what bit-identity
with the reference needs: IEEE division and, in the decoder, fused multiply-adds only where the product is
exact. The window decoder is compiled *as a real launch specialises it*: its own launcher runs against a
mock sm_90 driver with Triton's launches switched to compile-only (warmup), on meta tensors of the real
shapes, so ints below 2^31 are i32, strides equal to 1 constants and aligned pointers divisible, exactly as
on a GPU; ptxas's report must show no spills. The test session runs Triton's interpreter (conftest), which
defines kernels as interpreted functions, so the compilation runs in a child process without
``TRITON_INTERPRET``: ``python tests/test_triton_compile.py``.
"""

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

SM90 = GPUTarget("cuda", 90, 32)


def assert_ieee_division(ptx: str, reciprocals: bool = False) -> None:
    """No approximate division; with ``reciprocals``, but for ``1 / x`` (the codes kernel's per-group
    reciprocals, which ``numerics.quotient`` turns into the IEEE quotient from within 2 ulps)."""
    if reciprocals:
        ones = set(re.findall(r"mov\.b32\s+(%r\d+), 0f3F800000;", ptx))
        ptx = "\n".join(line for line in ptx.splitlines()
                        if not (m := re.search(r"div\.full\.f32\s+%r\d+, (%r\d+),", line)) or m.group(1) not in ones)  # fmt: skip
    assert not re.search(r"div\.(full|approx)\.f32", ptx)


class MockSM90Driver:
    """Just enough of Triton's driver interface to compile (never launch) for an H100/H200."""

    class utils:
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def __init__(self) -> None:
        self.target = SM90

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    @staticmethod
    def is_active():
        return True


@contextlib.contextmanager
def launches_compile_for_sm90():
    """Inside: every Triton launch compiles for sm_90 as that call site specialises it and does not run.

    Yields the list of ``(jit_function, compiled_kernel, ptxas_report)`` of each launch. The package's CUDA
    guard is lifted so that meta tensors reach the launchers (nothing reads them)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from diffusers_qvg.codecs import window_tiles  # the window decoders' shared host checks

    launched, run, guard = [], JITFunction.run, window_tiles.check_runnable

    def compile_only(self, *args, grid, warmup, **kwargs):
        report = io.StringIO()
        with contextlib.redirect_stdout(report):  # TRITON_DUMP_PTXAS_LOG: ptxas -v prints registers and spills
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append((self, kernel, report.getvalue()))
        return kernel

    saved = getattr(driver, "_active", None)
    driver.set_active(MockSM90Driver())
    JITFunction.run, window_tiles.check_runnable = compile_only, lambda *tensors: None
    try:
        yield launched
    finally:
        JITFunction.run, window_tiles.check_runnable = run, guard
        driver._active = saved


def fma_count(ptx: str) -> int:
    return len(re.findall(r"\bfma\.rn\.f32\b", ptx))


def mul_count(ptx: str) -> int:
    return len(re.findall(r"\bmul\.(rn\.)?f32\b", ptx))


def window_decoder_compiles_as_launched() -> None:
    """A 21-frame and a 240-frame Self-Forcing window (6 and 79 packed chunks of 4,680 tokens x 12 heads x 128,
    qvg-int2), batch 1 and 2 (CFG), keys with RoPE and values in one launch: one binary, no spills, vector
    stores, no recompile for a new window length, batch or segment count; RoPE adds no fused multiply-add."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.qvg import backend
    from diffusers_qvg.codecs.qvg.triton.dequantize import BLOCK_T, NUM_WARPS, _window_kernel
    from diffusers_qvg.rotary import RotaryPairs

    cfg, chunk, H, D = dq.QVGConfig(), 4680, 12, 128
    with launches_compile_for_sm90() as launched, backend("triton"):
        for packed, batch in ((6, 1), (79, 1), (6, 2), (79, 2)):
            W = (packed + 1) * chunk
            kv = [cfg.allocate(batch=batch, capacity_tokens=packed * chunk, heads=H, head_dim=D, num_slots=packed,
                               dtype=torch.bfloat16, device="meta", role=r) for r in ("key", "value")]
            outs = [torch.empty(batch, W, H, D, dtype=torch.bfloat16, device="meta") for _ in range(2)]
            table = dq.segment_table([(i * chunk, chunk, i * chunk, i) for i in range(packed)])
            rotary = RotaryPairs(torch.empty(1, W, 1, D, device="meta"))
            cfg.dequantize_pair_into(kv[0], kv[1], table, outs[0], outs[1], rotary)
        cfg.dequantize_into(kv[1], table, outs[1])  # values alone: no RoPE
    pair, alone = launched[:4], launched[4]
    assert all(fn is _window_kernel for fn, _, _ in launched)
    assert len({k.hash for _, k, _ in pair}) == 1, "a window length or batch recompiled the decoder"
    assert sum(len(cache[0]) for cache in _window_kernel.device_caches.values()) == 2  # pair (RoPE) + values alone
    for _, kernel, report in (pair[0], alone):
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(a == b == "0" for a, b in spills), report
        registers = int(re.search(r"Used (\d+) registers", report).group(1))
        assert registers <= 128, report  # at least 4 CTAs of 4 warps per SM
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.enable_fp_fusion is False
        assert_ieee_division(ptx)
        assert "st.global.v4.b32" in ptx and not re.search(r"st\.global\.b16", ptx)  # 16-byte stores only
    # No implicit contraction (enable_fp_fusion=False above). The explicit FMAs are the two exact-product ones per
    # decoded channel (centroid x power-of-two scale, level x step), in each of the block's two copies (full and
    # masked); RoPE's rounded products stay separate multiplies: 4 per channel pair in each copy LLVM keeps.
    elements = BLOCK_T * D // (32 * NUM_WARPS)  # per thread and block
    assert fma_count(alone[1].asm["ptx"]) == 2 * 2 * elements
    rope_muls = mul_count(pair[0][1].asm["ptx"]) - mul_count(alone[1].asm["ptx"])
    assert rope_muls > 0 and rope_muls % (4 * elements // 2) == 0
    registers = re.search(r"Used (\d+) registers", pair[0][2]).group(1)
    print(f"window decoder (K+V, RoPE): {registers} registers, no spills")


def nvfp4_decoder_compiles_as_launched() -> None:
    """LongLive-2's format at the same windows and batches, keys with RoPE and values in one launch: one binary, no
    spills, at most 64 registers (8 CTAs of 4 warps per SM), 16-byte stores only, no fused multiply-add at all
    (the reference rounds every product and sum)."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.kernel_backend import backend
    from diffusers_qvg.codecs.nvfp4.triton_decode import _window_kernel
    from diffusers_qvg.rotary import RotaryPairs

    cfg, chunk, H, D = dq.NVFP4Config(), 4680, 12, 128
    with launches_compile_for_sm90() as launched, backend("triton"):
        for packed, batch in ((6, 1), (79, 1), (6, 2), (79, 2)):
            W = (packed + 1) * chunk
            kv = [cfg.allocate(batch=batch, capacity_tokens=packed * chunk, heads=H, head_dim=D, num_slots=packed,
                               dtype=torch.bfloat16, device="meta") for _ in range(2)]
            outs = [torch.empty(batch, W, H, D, dtype=torch.bfloat16, device="meta") for _ in range(2)]
            table = dq.segment_table([(i * chunk, chunk, i * chunk, i) for i in range(packed)])
            cfg.dequantize_pair_into(kv[0], kv[1], table, outs[0], outs[1], RotaryPairs(torch.empty(1, W, 1, D, device="meta")))
    assert [fn for fn, _, _ in launched] == [_window_kernel] * 4
    assert len({k.hash for _, k, _ in launched}) == 1, "a window length or batch recompiled the decoder"
    _, kernel, report = launched[0]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(a == b == "0" for a, b in spills), report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= 64, report
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.enable_fp_fusion is False and fma_count(ptx) == 0
    assert ".ftz" not in ptx  # e2m1's 0 and 1/2 are built as float32 subnormals: nothing may flush them
    assert "st.global.v4.b32" in ptx and not re.search(r"st\.global\.b16", ptx)
    print(f"nvfp4 window decoder (K+V, RoPE): {registers} registers, no spills")


def nvfp4_encoder_compiles_as_launched() -> None:
    """LongLive-2's format written as the clean pass writes it, chunks of 4,680 and 1,560 tokens (a first frame):
    one binary for both (the token count is not specialised), no spills, IEEE divisions only, no FMA."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.kernel_backend import backend
    from diffusers_qvg.codecs.nvfp4 import triton_encode

    config, guard = dq.NVFP4Config(), triton_encode.check_runnable
    triton_encode.check_runnable = lambda *tensors: None
    try:
        with launches_compile_for_sm90() as launched, backend("triton"):
            for tokens in (4680, 1560):
                storage = config.allocate(batch=1, capacity_tokens=tokens, heads=12, head_dim=128, num_slots=1,
                                          dtype=torch.bfloat16, device="meta")
                triton_encode.encode_blocks(torch.empty(1, tokens, 12, 128, dtype=torch.bfloat16, device="meta"),
                                            storage.tensor_scale[0], "four-over-six")
    finally:
        triton_encode.check_runnable = guard
    assert [fn for fn, _, _ in launched] == [triton_encode._encode_kernel] * 2
    assert launched[0][1].hash == launched[1][1].hash, "a chunk length recompiled the encoder"
    _, kernel, report = launched[0]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(a == b == "0" for a, b in spills), report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= 128, report
    assert kernel.metadata.enable_fp_fusion is False and fma_count(kernel.asm["ptx"]) == 0
    assert_ieee_division(kernel.asm["ptx"])
    print(f"nvfp4 encoder: {registers} registers, no spills")


def encoder_launches(calls) -> list:
    """The launches of ``calls()`` (QVG encoder writes on meta tensors), each compiled for sm_90 as launched."""
    from diffusers_qvg.codecs.qvg import backend
    from diffusers_qvg.codecs.qvg.triton import encoder

    guard = encoder.check_runnable
    encoder.check_runnable = lambda *tensors: None
    try:
        with launches_compile_for_sm90() as launched, backend("triton"):
            calls()
    finally:
        encoder.check_runnable = guard
    return launched


def resource_usage(kernel) -> dict[str, int]:
    """ptxas's registers and local memory (spills) of a compiled kernel: ``cuobjdump -res-usage`` of its cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        report = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", report)}


def meta_writes(config, items: int, tokens: int, capacity: int = 9360, slot: int = 0, heads: int = 12):
    """``items`` writes of a Self-Forcing chunk tensor [1, tokens, heads, 128] bf16 into storages of 2 slots."""
    storages = [config.allocate(batch=1, capacity_tokens=capacity, heads=heads, head_dim=128, num_slots=2,
                                dtype=torch.bfloat16, device="meta") for _ in range(items)]  # fmt: skip
    x = torch.empty(1, tokens, heads, 128, dtype=torch.bfloat16, device="meta")
    return [(s, x, slot * tokens, slot) for s in storages]


def residual_quantizer_compiles() -> None:
    """The codes kernel at a real launch (a layer's K and V of a Self-Forcing chunk, qvg-int2, checked
    writes; then a single unchecked write, and INT4 asymmetric fp16-scale codes): no spills, no per-element
    division in ternary codes (only the shift's) and no shuffle (a thread per group), their scale candidates
    rounded by the conversion instruction, IEEE division elsewhere."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.qvg.triton.encoder import quantize_residual_into, scale_fractions
    from diffusers_qvg.codecs.qvg.triton.quantize import _residual_codes_kernel
    from diffusers_qvg.codecs.status import WriteStatus

    int2, int4 = dq.QVGConfig(), dq.QVGConfig(bits=4, symmetric=False, scale_dtype="fp16", stages=2, centroid_dtype="bfloat16")

    def calls():
        int2.quantize_batch_into(meta_writes(int2, 2, 4680), status=WriteStatus("meta"))
        storage, x, start, slot = meta_writes(int2, 1, 4680)[0]  # an unchecked write (the values host-checked)
        quantize_residual_into(storage, x, scale_fractions("mse", x.device), token_start=start, slot=slot)
        int4.quantize_batch_into(meta_writes(int4, 2, 4680), status=WriteStatus("meta"))

    codes = [k for fn, k, _ in encoder_launches(calls) if fn is _residual_codes_kernel]
    assert len(codes) == 3
    for kernel in codes:
        usage = resource_usage(kernel)
        assert usage["LOCAL"] == 0 and usage["REG"] <= 128, usage  # no spills; at least 4 CTAs of 4 warps per SM
        assert_ieee_division(kernel.asm["ptx"], reciprocals=True)
    ternary, int4_codes = codes[0].asm["ptx"], codes[2].asm["ptx"]
    assert len(re.findall(r"div\.rn\.f32", ternary)) <= 1, "ternary codes divide per element"  # the shift's
    # A thread holds whole groups (quantize.arrangement): the candidates' group sums take no shuffle.
    assert "shfl.sync" not in ternary, "a ternary group spans threads: the residual's axes do not match this Triton"
    # The e4m3 scale candidates round by the conversion instruction (numerics.round_scale), not bit arithmetic.
    assert "cvt.rn.satfinite.e4m3x2.f32" in ternary
    # The general levels divide by multiplying with the step's reciprocal (numerics.quotient): one per group a
    # thread holds (two: 16 tokens x 2 groups spread over 128 threads) for each of 14 candidates and the codes.
    assert len(re.findall(r"div\.rn\.f32", int4_codes)) <= 1, "INT4 codes divide per element"  # the shift's
    assert len(re.findall(r"div\.full\.f32", int4_codes)) <= 2 * 15, "INT4 codes take a reciprocal per element"


def kmeans_kernels_compile() -> None:
    """The whole encoder at real launches: no kernel spills, and a later chunk (other token start, slot, item
    count, even another chunk length) compiles nothing new: the runtime ints are not specialised on."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.qvg.triton.encoder import launch_count
    from diffusers_qvg.codecs.status import WriteStatus

    config = dq.QVGConfig()
    first = encoder_launches(lambda: config.quantize_batch_into(meta_writes(config, 2, 4680), status=WriteStatus("meta")))
    assert len(first) == launch_count(config) == 14
    binaries = {k.hash for _, k, _ in first}
    for _, kernel, _ in first:
        usage = resource_usage(kernel)
        assert usage["LOCAL"] == 0, (kernel.name, usage)

    def later_chunks():
        for items, tokens, slot in ((2, 4680, 1), (1, 4680, 1), (3, 3120, 1), (2, 1560, 0)):
            config.quantize_batch_into(meta_writes(config, items, tokens, slot=slot), status=WriteStatus("meta"))

    functions = {fn for fn, _, _ in first}
    cached = sum(len(cache[0]) for fn in functions for cache in fn.device_caches.values())
    later = encoder_launches(later_chunks)
    assert {k.hash for _, k, _ in later} == binaries, "a runtime int recompiled an encoder kernel"
    assert sum(len(cache[0]) for fn in functions for cache in fn.device_caches.values()) == cached


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:  # a fresh cache: every binary goes through ptxas and reports
        env.update(TRITON_CACHE_DIR=cache, TRITON_DUMP_PTXAS_LOG="1")
        run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [line for line in run.stdout.split() if line == "compiled"] == ["compiled"] * 6


if __name__ == "__main__":
    window_decoder_compiles_as_launched()
    print("compiled")
    nvfp4_decoder_compiles_as_launched()
    print("compiled")
    nvfp4_encoder_compiles_as_launched()
    print("compiled")
    residual_quantizer_compiles()
    print("compiled")
    kmeans_kernels_compile()
    print("compiled", "compiled")

