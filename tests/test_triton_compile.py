"""The kernels compile for an H100/H200 (sm_90) without a GPU: Triton's frontend, PTX and ptxas all run.

The interpreter tests check arithmetic but never lower a kernel; this catches what only compilation finds
(unsupported ops, type errors in branches the interpreter folds) and checks the PTX for what bit-identity
with the reference needs: IEEE division and, in the decoder, no fused multiply-adds. The test session runs
Triton's interpreter (conftest), which defines kernels as interpreted functions, so the compilation runs
in a child process without ``TRITON_INTERPRET``: ``python tests/test_triton_compile.py``.
"""

import os
import re
import subprocess
import sys

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


def residual_quantizer_compiles() -> None:
    from diffusers_qvg.codecs.qvg.triton import quantize

    pointers = {
        "x_ptr": "*bf16", "ids_ptr": "*u8", "cent_ptr": "*fp8e4nv", "cscale_ptr": "*fp32", "need_ptr": "*fp32",
        "alpha_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8", "zeros_ptr": "*u8", "shift_ptr": "*fp32",
    }  # fmt: skip
    compile_sm90(quantize._head_extent_kernel, pointers, dict(QVG_INT2, BLOCK=16))
    codes = dict(QVG_INT2, GROUP_BYTES=13, BITS=2, TRITS=True, SCALE_E4M3=True, FMT_MAX=448.0, CANDIDATES=14, BLOCK=16)
    assert_ieee_division(compile_sm90(quantize._residual_codes_kernel, pointers, codes))


def kmeans_kernels_compile() -> None:
    from diffusers_qvg.codecs.qvg.triton import assign, centroid_update

    common = dict(D=128, D_PAD=128)
    compile_sm90(
        assign._assign_kernel,
        {"x_ptr": "*fp32", "c_ptr": "*fp32", "ids_ptr": "*i32"},
        dict(common, BLOCK_N=64, BLOCK_K=32, PRECISION="tf32x3"),
    )
    pointers = {n: "*i32" for n in ("order_ptr", "start_ptr", "count_ptr")} | {
        n: "*fp32" for n in ("x_ptr", "old_ptr", "out_ptr")
    }
    compile_sm90(centroid_update._centroid_update_kernel, pointers, dict(common, BLOCK_N=32))


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

