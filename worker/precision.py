"""`serving_dtype`: the dtype a model is served in, with `auto` resolved where the kernels are.

Why `auto` differs by kind: a causal LM decodes memory-bound, so bfloat16 halves the bytes each
step reads, and CUDA, AMX and AVX-512 BF16 run its matmuls natively (elsewhere a CPU emulates
them, slower than float32). An encoder's answers are promised equal to transformers' float32
ones, so its `auto` stays float32 and half precision is the operator's explicit choice.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the host offers bfloat16: native matrix units (AMX) or vector instructions."""

    amx: bool = False
    avx512_bf16: bool = False


def serving_dtype(requested: str, *, causal_lm: bool, device: str, hardware: Hardware) -> str:
    """`requested` itself unless `auto`; then bfloat16 for a causal LM on CUDA or a CPU with
    native bfloat16, float32 otherwise (every encoder, MPS, and CPUs without it)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {DTYPES}, not {requested!r}")
        return requested
    if not causal_lm:
        return "float32"
    native = device.startswith("cuda") or (
        device == "cpu" and (hardware.amx or hardware.avx512_bf16)
    )
    return "bfloat16" if native else "float32"


def host_hardware() -> Hardware:
    """This CPU's bfloat16 support, as torch's own dispatch sees it (cpuinfo, any OS)."""
    import torch

    probe = torch.cpu
    amx = getattr(probe, "_is_amx_tile_supported", lambda: False)
    bf16 = getattr(probe, "_is_avx512_bf16_supported", lambda: False)
    return Hardware(amx=bool(amx()), avx512_bf16=bool(bf16()))
