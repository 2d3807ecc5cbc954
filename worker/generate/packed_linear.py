"""`pack_linears`: a bfloat16 model's linear layers with their weights in oneDNN's own layout.

Why: on a CPU, a plain bfloat16 matmul lets oneDNN reorder the weight into its blocked layout
on every call, a cost that grows with the weight and not with the batch, so a decode step of
one sequence ran slower in bfloat16 than in float32. Reordered once at load (as torch's own
compiler does when it freezes a model) the same kernels compute the same values, bit for
bit, 1.5-2x faster (benchmarks/gen_servers.py; docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

BATCH_HINT = 16  # the rows oneDNN lays the weight out for; any row count is computed right


class PackedLinear(nn.Module):
    """`linear`'s computation with its weight reordered once; the original weight is let go
    unless another module shares it (a tied embedding keeps its own)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packable(model: nn.Module, device: torch.device) -> bool:
    """bfloat16 weights on a CPU whose oneDNN runs bfloat16 natively."""
    mkldnn = torch.backends.mkldnn
    return (
        device.type == "cpu"
        and next(model.parameters()).dtype == torch.bfloat16
        and mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_linears(model: nn.Module, device: torch.device) -> int:
    """Swap every `nn.Linear` of `model` for a `PackedLinear` where it pays; how many."""
    if not packable(model, device):
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    try:
        packed = [(parent, name, PackedLinear(child)) for parent, name, child in swaps]
    except RuntimeError as exc:  # a oneDNN build without these kernels: plain matmuls
        log.warning("bfloat16 weights left unpacked: %s", exc)
        return 0
    for parent, name, module in packed:
        setattr(parent, name, module)
    return len(packed)
