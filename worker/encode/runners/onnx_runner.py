"""`OnnxRunner`: the same encoder exported once to ONNX and run by ONNX Runtime on the CPU.

Exported with torch's dynamo exporter (dynamic batch and length), cached on disk by the
model folder's content hash, so the export (seconds) happens once per model and machine.
Pooling is the same as `TorchRunner`'s, in numpy. Chosen with `--backend onnx`; the
benchmark decides whether it beats torch on a given machine.

Batches run side by side like the torch runner's: a session's intra-op thread count is fixed
when it is made, so there is one session per thread count a batch asks for. A 1-thread
session runs on the calling thread, and `run` is thread-safe, so each compute stream is one
such run. Each session holds its own copy of the weights (about 90 MB for MiniLM).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from worker.encode.collate import collate
from worker.encode.runners.base import RowResult, isolate_failures
from worker.models import ModelFiles, Pooling

log = logging.getLogger("microbatch.worker")
MAX_BATCH, MAX_LENGTH = 1024, 8192  # the exported graph's dynamic-shape ceilings


def model_digest(path: Path) -> str:
    """A hash of the files that decide the graph: config and weights, by name, size, mtime."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def export(path: Path, target: Path) -> Path:
    """Export the encoder's last hidden state for any batch and length; write atomically."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.ones((2, 16), dtype=torch.long)
    batch = torch.export.Dim("batch", max=MAX_BATCH)
    length = torch.export.Dim("length", max=MAX_LENGTH)
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    with warnings.catch_warnings():  # the exporter narrates its choices as UserWarnings
        warnings.simplefilter("ignore", UserWarning)
        _export(torch, Encoder().eval(), ids, shapes, partial)
    partial.replace(target)
    return target


def _export(torch, module, ids, shapes, partial: Path) -> None:
    torch.onnx.export(
        module,
        (ids, torch.ones_like(ids)),
        str(partial),
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
        dynamic_shapes=shapes,
        dynamo=True,
        optimize=True,
        external_data=False,
    )


def quantized(source: Path) -> Path:
    """The graph with int8 weights (ONNX Runtime's dynamic quantisation), made once."""
    target = source.with_name(source.stem + "-int8.onnx")
    if not target.is_file():
        from onnxruntime.quantization import QuantType, quantize_dynamic

        partial = target.with_suffix(f".{os.getpid()}.partial")
        quantize_dynamic(str(source), str(partial), weight_type=QuantType.QInt8, per_channel=True)
        partial.replace(target)
    return target


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling) -> np.ndarray:
    """`encoder.pool` in numpy: over real tokens only."""
    if pooling.mode == "cls":
        out = hidden[:, 0]
    elif pooling.mode == "max":
        out = np.where(mask[..., None] > 0, hidden, np.finfo(hidden.dtype).min).max(1)
    else:
        weights = mask[..., None].astype(hidden.dtype)
        out = (hidden * weights).sum(1) / np.clip(weights.sum(1), 1e-9, None)
    if pooling.normalize:
        out = out / np.clip(np.linalg.norm(out, axis=1, keepdims=True), 1e-12, None)
    return out


class OnnxRunner:
    concurrent = True  # one session per thread count; Run is thread-safe

    def __init__(
        self,
        files: ModelFiles,
        *,
        cache_dir: Path,
        threads: int | None = None,
        int8: bool = False,
    ) -> None:
        target = cache_dir / f"{files.path.name}-{model_digest(files.path)}.onnx"
        if not target.is_file():
            log.info("exporting %s to ONNX at %s (once)", files.name, target)
            export(files.path, target)
        self._graph = quantized(target) if int8 else target
        self._threads = threads  # fixed by the operator: every batch gets it
        self._sessions: dict[int | None, object] = {}
        self._lock = threading.Lock()
        self._session(threads)  # load now: a bad graph fails the start, not the first batch
        self._pooling = files.pooling
        self._pad_id = 0
        self.dim = files.dim

    def _session(self, threads: int | None):
        session = self._sessions.get(threads)
        if session is not None:
            return session
        import onnxruntime as ort

        with self._lock:
            if threads not in self._sessions:
                options = ort.SessionOptions()
                if threads:
                    options.intra_op_num_threads = threads
                if threads != 1:
                    # Pool threads that spin between runs take the cores other streams'
                    # batches run on; blocking costs a lone batch ~8% here.
                    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                self._sessions[threads] = ort.InferenceSession(
                    str(self._graph), options, providers=["CPUExecutionProvider"]
                )
            return self._sessions[threads]

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        session = self._session(self._threads if self._threads is not None else threads)
        return isolate_failures(partial(self._forward, session), rows)

    def _forward(self, session, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        ids, mask = collate(rows, self._pad_id)
        ids_np, mask_np = ids.numpy(), mask.numpy()
        (hidden,) = session.run(None, {"input_ids": ids_np, "attention_mask": mask_np})
        return list(pool(hidden, mask_np, self._pooling).astype(np.float32))
