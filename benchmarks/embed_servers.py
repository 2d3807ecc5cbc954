"""The servers the embedding benchmark loads, each started on a free loopback port and stopped.

- microbatch embedded: `microbatch serve` with no Redis URL (gateway and worker in one process);
- microbatch with Redis: redis-server on a free port (as tests/conftest.py starts it), one
  `microbatch worker` (its /metrics on a port of its own) and one `microbatch gateway`;
- infinity-emb: `infinity_emb v2` from its own virtual environment, torch engine on the CPU
  (or the benchmark's `--device`),
  serving the same local model folder. Its cut is sentence-transformers' `max_seq_length`
  (256 in the model's `sentence_bert_config.json`); for 512 it serves a copy of the folder
  (links to the same files) whose config says 512.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.batching import env_with, free_port, microbatch, started
from benchmarks.embed_workload import MODEL_NAME

INFINITY_INSTALL = (
    "python3 -m venv {venv} && {venv}/bin/pip install torch==2.13.0 && "
    "{venv}/bin/pip install 'infinity-emb[server,torch]'"
)


class ArmUnavailable(RuntimeError):
    """An arm that cannot run on this machine; the message says why, the run goes on."""


@dataclass(frozen=True, slots=True)
class Server:
    arm: str  # the benchmark arm it serves
    url: str  # http://127.0.0.1:PORT, serving /v1/embeddings
    port: int
    metrics_url: str | None  # where the worker's microbatch_batch_* histograms are; None: unknown


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    """Until `url` answers 200; a process that exits first fails at once, with its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise ArmUnavailable(f"{proc.args[0]} exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise ArmUnavailable(f"{url} not ready after {timeout_s:.0f} s; log in {log}")


@contextmanager
def microbatch_serve(arm: str, tmp: Path, **settings: object) -> Iterator[Server]:
    """`microbatch serve`, embedded store; its /metrics holds the worker's histograms too."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    with started(microbatch("serve"), env_with(port=port, **settings), log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/readyz", proc, log)
        yield Server(arm, url, port, url)


@contextmanager
def microbatch_redis(arm: str, tmp: Path, **settings: object) -> Iterator[Server]:
    """redis-server + `microbatch worker` + `microbatch gateway`, each a process of its own."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ArmUnavailable("redis-server is not installed (apt-get install -y redis-server)")
    rport, gport, mport = free_port(), free_port(), free_port()
    redis_args = [binary, "--port", str(rport), "--bind", "127.0.0.1", "--save", ""]
    redis_args += ["--appendonly", "no", "--dir", str(tmp)]
    common = {"redis_url": f"redis://127.0.0.1:{rport}/0", **settings}
    url = f"http://127.0.0.1:{gport}"
    with ExitStack() as stack:
        stack.enter_context(started(redis_args, dict(os.environ), tmp / f"redis-{rport}.log"))
        worker_env = env_with(metrics_port=mport, **common)
        stack.enter_context(started(microbatch("worker"), worker_env, tmp / f"worker-{rport}.log"))
        log = tmp / f"gateway-{gport}.log"
        gateway = stack.enter_context(
            started(microbatch("gateway"), env_with(port=gport, **common), log)
        )
        wait_http(f"{url}/readyz", gateway, log)
        yield Server(arm, url, gport, f"http://127.0.0.1:{mport}")


def model_with_cut(source: Path, cut: int, folder: Path) -> Path:
    """A folder of links to `source`'s files whose sentence-transformers config cuts at `cut`."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "sentence_bert_config.json" and not (folder / item.name).exists():
            (folder / item.name).symlink_to(item.resolve())
    config = json.loads((source / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**config, "max_seq_length": cut}))
    return folder


@contextmanager
def infinity(
    arm: str,
    tmp: Path,
    venv: Path,
    model: Path,
    cut: int | None,
    device: str = "cpu",
    dtype: str = "float32",
) -> Iterator[Server]:
    """infinity-emb's own server on the torch engine on `device` (its --device takes cpu or
    cuda) in `dtype` (its --dtype: float32, bfloat16, float16); `cut` None keeps the model's
    own cut."""
    binary = venv / "bin" / "infinity_emb"
    if not binary.is_file():
        raise ArmUnavailable(
            f"infinity-emb is not installed in {venv}: " + INFINITY_INSTALL.format(venv=venv)
        )
    folder = model_with_cut(model, cut, tmp / f"model-cut-{cut}") if cut else model
    port = free_port()
    args = [str(binary), "v2", "--model-id", str(folder), "--served-model-name", MODEL_NAME]
    args += ["--engine", "torch", "--device", device.split(":")[0], "--dtype", dtype]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    args += ["--url-prefix", "/v1", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROBATCH_")}
    env.update(HF_HUB_OFFLINE="1", INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1")
    log = tmp / f"infinity-{port}.log"
    with started(args, env, log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/v1/models", proc, log)
        yield Server(arm, url, port, None)
