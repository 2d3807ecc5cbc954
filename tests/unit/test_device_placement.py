"""The sampling path never mixes devices: checked in the code, since no GPU is here.

On a GPU, logits live on the device; a CPU generator, a CPU index or value tensor, or a
`.numpy()` of a device tensor fails there at the first request (all read in the code of
`worker/generate` once). So in the modules a step's sampling runs through, every tensor
factory names its device (or is moved with `.to(...)` at once), every generator is made on
the logits' device, and every `.numpy()` reads a `.cpu()` copy.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SAMPLING_PATH = [
    ROOT / "worker" / "generate" / name for name in ("sampling.py", "logprobs.py", "constraints.py")
]
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "arange", "empty", "Generator"}


def _offences(tree: ast.AST) -> list[str]:
    moved = {  # calls whose result is moved at once: x.to(...)
        id(node.func.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "to"
    }
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func, line = node.func, node.lineno
        if ast.unparse(func.value) == "torch":
            named = any(k.arg == "device" for k in node.keywords)
            if func.attr in FACTORIES and not named and id(node) not in moved:
                out.append(f"{line}: torch.{func.attr} without device=")
            if func.attr == "from_numpy" and id(node) not in moved:
                out.append(f"{line}: torch.from_numpy not moved with .to(device)")
        if func.attr == "numpy" and not (
            isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Attribute)
            and func.value.func.attr == "cpu"
        ):
            out.append(f"{line}: .numpy() of a tensor that may be on the device (use .cpu())")
    return out


@pytest.mark.parametrize("path", SAMPLING_PATH, ids=lambda p: p.name)
def test_the_sampling_path_names_every_tensor_s_device(path: Path) -> None:
    offences = _offences(ast.parse(path.read_text()))
    assert not offences, f"{path.relative_to(ROOT)}: {offences}"


def test_the_check_catches_each_way_to_mix_devices() -> None:
    code = (
        "g = torch.Generator()\n"
        "i = torch.tensor([1, 2])\n"
        "b = torch.from_numpy(x)\n"
        "v = logits.numpy()\n"
        "ok = torch.tensor([1], device=d)\n"
        "ok2 = torch.from_numpy(x).to(d)\n"
        "ok3 = logits.cpu().numpy()\n"
    )
    assert [o.split(":")[0] for o in _offences(ast.parse(code))] == ["1", "2", "3", "4"]
