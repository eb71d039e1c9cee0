"""Compile the kernels for an H100 (sm_90) on a machine without a GPU, with the ``ptxas`` that
Triton's wheel bundles, and print what ``test_compile.py`` checks as JSON.

Run as a script in a process without ``TRITON_INTERPRET`` (under the interpreter ``triton.jit``
makes no compilable kernels): ``python tests/ops/triton/sm90_compile.py``.
"""

from __future__ import annotations

import json
import os
import re
import sys

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvgraph.ops.triton.decode_kernel import decode_reduce_kernel, decode_split_kernel  # noqa: E402
from kvgraph.ops.triton.launch import FP32_SPLIT_PARTS, dot_precision  # noqa: E402
from kvgraph.ops.triton.prefill_kernel import prefill_kernel  # noqa: E402
from kvgraph.ops.triton.store_kernel import store_kv_kernel  # noqa: E402

POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int8: "*i8",
           torch.float8_e4m3fn: "*fp8e4nv"}
QUANT = {None: (0, 1.0), torch.int8: (1, 127.0), torch.float8_e4m3fn: (2, 448.0)}
FLOATS = {"qk_scale", "softcap"}
STORE = {"float": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
# (query dtype, cache storage, one scale per row) of the attention kernels; fp32 queries over a
# cache with one scale per row take split bf16 dots (``tile_kernel.split_dot``)
DECODE = {"fp32": (torch.float32, None, False), "bf16": (torch.bfloat16, None, False),
          "bf16-int8": (torch.bfloat16, torch.int8, False), "fp16-fp8": (torch.float16, torch.float8_e4m3fn, False),
          "fp32-int8": (torch.float32, torch.int8, False), "fp32-int8-row": (torch.float32, torch.int8, True),
          "fp32-fp8-row": (torch.float32, torch.float8_e4m3fn, True)}
PREFILL = {"bf16": (torch.bfloat16, None, False), "bf16-int8": (torch.bfloat16, torch.int8, False),
           "fp16-fp8": (torch.float16, torch.float8_e4m3fn, False), "fp32": (torch.float32, None, False),
           "fp32-int8-row": (torch.float32, torch.int8, True)}


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict[str, object], **options):
    """``kernel`` (a ``@triton.jit`` function, or an autotuned one) compiled for sm_90: pointers typed as
    ``pointers`` says, the other arguments int32 (fp32 for the softmax scale and cap)."""
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    names = fn.arg_names
    signature = {
        n: "constexpr" if n in constexprs else pointers[n] if n in pointers else "fp32" if n in FLOATS else "i32"
        for n in names
    }
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cache_pointers(cache: torch.dtype) -> dict[str, str]:
    return {"Cache": POINTER[cache], "Lookup": "*i32", "Scales": "*fp32", "CacheLengths": "*i32",
            "RowOffsets": "*i32"}


def quant_constexprs(storage: torch.dtype | None, head_dim: int, group: int) -> dict[str, object]:
    quant, qmax = QUANT[storage]
    groups = head_dim // group if storage is not None else 1
    return {"QUANT": quant, "QMAX": qmax, "QGROUP": group if storage is not None else 1, "GROUPS": groups,
            "GROUPS_PAD": triton.next_power_of_2(groups)}


def store(storage: torch.dtype | None) -> dict[str, object]:
    """The store kernel (head_dim 80 in two groups of 40) and what its PTX holds."""
    kernel = compile_sm90(
        store_kv_kernel, {"K": "*fp16", "V": "*fp16", **cache_pointers(torch.float16 if storage is None else storage)},
        {"HEAD_DIM": 80, "HEAD_DIM_PAD": 128, "PAGE_SIZE": 16, "BLOCK_T": 16, **quant_constexprs(storage, 80, 40)},
        num_warps=2, enable_fp_fusion=False,
    )
    ptx = kernel.asm["ptx"]
    return {"cubin_bytes": len(kernel.asm["cubin"]), "div_rn": "div.rn.f32" in ptx,
            "div_approx": "div.full.f32" in ptx or "div.approx" in ptx, "fma": bool(re.search(r"\bfma\.", ptx)),
            "rounder": "0f4B400000" in ptx}


def read_constexprs(dtype: torch.dtype, storage: torch.dtype | None, head_dim: int, per_row: bool) -> dict:
    """``QUANT`` and ``QGROUP`` as ``PagedLayer.read_constexprs`` gives them, and ``SPLIT`` as
    ``launch.dot_constexprs`` does for compiled kernels (two scales per row unless ``per_row``)."""
    quant = quant_constexprs(storage, head_dim, head_dim if per_row else head_dim // 2)
    split = FP32_SPLIT_PARTS if storage is not None and per_row and dtype == torch.float32 else 0
    return {"QUANT": quant["QUANT"], "QGROUP": quant["QGROUP"], "SPLIT": split}


def decode(dtype: torch.dtype, storage: torch.dtype | None, per_row: bool) -> dict[str, object]:
    split = compile_sm90(
        decode_split_kernel,
        {"Q": POINTER[dtype], "PartAcc": "*fp32", "PartMax": "*fp32", "PartSum": "*fp32",
         **cache_pointers(dtype if storage is None else storage)},
        {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "GROUP": 4, "BLOCK_H": 16, "PAGE_SIZE": 16,
         "DOT_PRECISION": dot_precision(dtype), "HAS_SOFTCAP": storage is not None,
         **read_constexprs(dtype, storage, 128, per_row), "BLOCK_N": 64},
        num_warps=4, num_stages=2,
    )
    reduce = compile_sm90(decode_reduce_kernel, {"Out": POINTER[dtype], "PartAcc": "*fp32", "PartMax": "*fp32",
                                                 "PartSum": "*fp32", "RowOffsets": "*i32"},
                          {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "SPLITS_PAD": 8}, num_warps=4)
    return {"cubin_bytes": len(split.asm["cubin"]) + len(reduce.asm["cubin"])}


def prefill(dtype: torch.dtype, storage: torch.dtype | None, per_row: bool) -> dict[str, object]:
    kernel = compile_sm90(
        prefill_kernel,
        {"Q": POINTER[dtype], "Out": POINTER[dtype], **cache_pointers(dtype if storage is None else storage)},
        {"HEAD_DIM": 64, "HEAD_DIM_PAD": 64, "GROUP": 4, "GROUP_PAD": 4, "PAGE_SIZE": 16,
         "DOT_PRECISION": dot_precision(dtype), "HAS_SOFTCAP": False,
         **read_constexprs(dtype, storage, 64, per_row), "BLOCK_Q": 16, "BLOCK_N": 64},
        num_warps=4, num_stages=2,
    )
    return {"cubin_bytes": len(kernel.asm["cubin"])}


def run(build) -> dict[str, object]:
    """``build()``'s report, or the error that stopped the compile."""
    try:
        return build()
    except Exception as e:  # the compiler's errors carry the kernel's source line
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    report = {f"store-{k}": run(lambda s=s: store(s)) for k, s in STORE.items()}
    report.update({f"decode-{k}": run(lambda a=a: decode(*a)) for k, a in DECODE.items()})
    report.update({f"prefill-{k}": run(lambda a=a: prefill(*a)) for k, a in PREFILL.items()})
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
