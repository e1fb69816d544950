"""The kernels compile for an H100/H200 (sm_90) without a GPU: Triton's frontend, PTX and ptxas all run.

The interpreter tests check arithmetic but never lower a kernel; this catches what only compilation finds
(unsupported ops, type errors in branches the interpreter folds) and checks the PTX for what bit-identity
with the reference needs: IEEE division and, in the decoder, no fused multiply-adds. The test session runs
Triton's interpreter (conftest), which defines kernels as interpreted functions, so the compilation runs
in a child process without ``TRITON_INTERPRET``: ``python tests/test_triton_compile.py``.
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
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
QVG_INT2 = dict(D=128, D_PAD=128, GROUP=64, STAGES=1, CENT_SCALED=True, SYMMETRIC=True, QMAX=1)


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict):
    """Pointers (``*_ptr``) typed as given, constexprs as given, strides (``s_*``) i64, other scalars i32."""
    names = kernel.arg_names
    signature = {
        n: "constexpr" if n in constexprs else pointers[n] if n.endswith("_ptr") else "i64" if n.startswith("s_") else "i32"
        for n in names
    }
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(source, target=SM90, options={"enable_fp_fusion": False})
    assert compiled.asm["cubin"]  # ptxas ran
    return compiled.asm["ptx"]


def assert_ieee_division(ptx: str) -> None:
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

    from diffusers_qvg.codecs.qvg.triton import dequantize

    launched, run, guard = [], JITFunction.run, dequantize.check_runnable

    def compile_only(self, *args, grid, warmup, **kwargs):
        report = io.StringIO()
        with contextlib.redirect_stdout(report):  # TRITON_DUMP_PTXAS_LOG: ptxas -v prints registers and spills
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append((self, kernel, report.getvalue()))
        return kernel

    saved = getattr(driver, "_active", None)
    driver.set_active(MockSM90Driver())
    JITFunction.run, dequantize.check_runnable = compile_only, lambda *tensors: None
    try:
        yield launched
    finally:
        JITFunction.run, dequantize.check_runnable = run, guard
        driver._active = saved


def dequantize_compiles_without_fused_multiply_adds(variant: str, rotary: bool) -> None:
    from diffusers_qvg.codecs.qvg.triton import dequantize

    e4m3 = variant == "int2-trits-e4m3"
    pointers = {
        "out_ptr": "*bf16", "seg_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "codes_ptr": "*u8",
        "scales_ptr": "*fp8e4nv" if e4m3 else "*fp16", "zeros_ptr": "*fp8e4nv" if e4m3 else "*fp16",
        "ids_ptr": "*u8", "cent_ptr": "*fp8e4nv" if e4m3 else "*bf16", "cscale_ptr": "*fp32", "shift_ptr": "*fp32",
    }  # fmt: skip
    constexprs = dict(
        QVG_INT2,
        GROUP_BYTES=13 if e4m3 else 32,
        BITS=2 if e4m3 else 4,
        TRITS=e4m3,
        SYMMETRIC=e4m3,
        QMAX=1 if e4m3 else 15,
        CENT_SCALED=e4m3,
        ROTARY=rotary,
        SOFTWARE_BF16=False,
        BLOCK=8,
    )
    ptx = compile_sm90(dequantize._dequantize_kernel, pointers, constexprs)
    assert_ieee_division(ptx)
    assert "fma.rn.f32" not in ptx  # the reference's order of roundings, exactly


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
    division in ternary codes (only the shift's), IEEE division elsewhere."""
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
        assert_ieee_division(kernel.asm["ptx"])
    ternary, int4_codes = codes[0].asm["ptx"], codes[2].asm["ptx"]
    assert len(re.findall(r"div\.rn\.f32", ternary)) <= 1, "ternary codes divide per element"  # the shift's
    assert len(re.findall(r"div\.rn\.f32", int4_codes)) > 1  # the general path keeps the reference's divisions


def kmeans_kernels_compile() -> None:
    """The whole encoder at real launches: no kernel spills, and a later chunk (other token start, slot, item
    count, even another chunk length) compiles nothing new: the runtime ints are not specialised on."""
    import diffusers_qvg as dq
    from diffusers_qvg.codecs.status import WriteStatus

    config = dq.QVGConfig()
    first = encoder_launches(lambda: config.quantize_batch_into(meta_writes(config, 2, 4680), status=WriteStatus("meta")))
    assert len(first) == 13
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
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["compiled"] * 7


if __name__ == "__main__":
    for variant in ("int2-trits-e4m3", "int4-asym-fp16-bf16-centroids"):
        for rotary in (False, True):
            dequantize_compiles_without_fused_multiply_adds(variant, rotary)
            print("compiled")
    residual_quantizer_compiles()
    print("compiled")
    kmeans_kernels_compile()
    print("compiled", "compiled")

