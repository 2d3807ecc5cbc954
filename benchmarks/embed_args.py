"""The embedding benchmark's options: which arms, mixes and loads it runs, for how long.

`benchmarks/embeddings.py` parses its command line here into a `Config`: each option given,
or else the full run's default or --quick's. The names of the arms and loads the run knows
live here too, since the options are checked against them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OFFLINE_ARMS = ("offline-limit", "offline-ceiling", "offline-single")
SERVER_ARMS = ("serve", "redis", "serve-bs1", "infinity-512", "infinity-256")
LOADS = {"c1": 1, "c32": 32, "open": None}  # closed-loop clients; None: open loop


@dataclass(frozen=True, slots=True)
class Config:
    arms: list[str]
    mixes: list[str]
    loads: list[str]
    texts: int  # workload size per mix: the offline arms run it once, loads cycle through it
    duration_s: int  # per closed loop at 32 clients and per open loop
    c1_duration_s: int
    warmup_s: int
    repeat: int
    seed: int
    offline_batch: int  # the offline arms' batch size cap (the worker's max_batch_size)
    max_batch_tokens: int  # and padded-token cap (the worker's max_batch_tokens)
    open_factor: float  # open-loop rate / offline limit
    open_rate: float | None  # texts/s; overrides open_factor
    loadgen_procs: int
    open_connections: int
    infinity_venv: Path
    out_dir: Path
    quick: bool
    backend: str = "torch"  # microbatch's engine, in its servers and its offline arms alike
    device: str = "cpu"  # where microbatch's worker and the offline arms compute
    dtype: str = "float32"  # what they compute in (infinity's --dtype too)
    max_batch_size: int | None = None  # the servers' max_batch_size; None: the worker's default
    warm_passes: int = 0  # untimed passes over each offline plan before the timed one


def _parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer texts, seconds-long runs")
    p.add_argument("--arms", default=",".join(OFFLINE_ARMS + SERVER_ARMS))
    p.add_argument("--mixes", default="short,mixed")
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument("--repeat", type=int, help="interleaved rounds, median kept (3; quick 1)")
    p.add_argument("--texts", type=int, help="workload size per mix (512; quick 128)")
    p.add_argument("--duration", type=int, help="seconds per 32-client and open run (20; quick 4)")
    p.add_argument("--c1-duration", type=int, help="seconds per 1-client run (10; quick 3)")
    p.add_argument("--warmup", type=int, help="seconds of warm-up per server and mix (5; quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline-batch", type=int, default=16, help="offline arms' batch cap (16)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        help="the servers' max_batch_size and the offline arms' cap (overrides --offline-batch)",
    )
    p.add_argument("--max-batch-tokens", type=int, default=16_384)
    p.add_argument("--open-factor", type=float, default=1.2, help="open-loop rate / offline limit")
    p.add_argument("--open-rate", type=float, help="open-loop texts/s, instead of the factor")
    p.add_argument("--loadgen-procs", type=int, default=1, help="open-loop client processes")
    p.add_argument("--open-connections", type=int, default=128, help="open loop's in-flight cap")
    p.add_argument("--infinity-venv", type=Path, default=ROOT / ".bench" / "infinity-venv")
    p.add_argument("--out-dir", type=Path, help="docs/ (quick: .bench/embeddings-quick/)")
    p.add_argument(
        "--backend",
        choices=["torch", "onnx", "auto"],
        default="torch",
        help="microbatch's engine, for its servers and the offline arms alike",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where microbatch's worker and the offline arms compute: cpu, cuda, cuda:1, ...",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="what microbatch's worker, the offline arms and infinity-emb compute in",
    )
    p.add_argument(
        "--warm-passes",
        type=int,
        help="untimed passes over each offline plan before the timed one (0; 1 off the CPU)",
    )
    return p


def parse_args(description: str, argv: list[str] | None = None) -> Config:
    """The options, with the full run's or --quick's defaults where none was given;
    `description` heads --help (the script's own docstring)."""
    p = _parser(description)
    a = p.parse_args(argv)
    q = a.quick

    def pick(value: int | None, full: int, quick: int) -> int:
        return value if value is not None else (quick if q else full)

    arms, mixes, loads = (s.split(",") for s in (a.arms, a.mixes, a.loads))
    for name, chosen, known in (
        ("arm", arms, OFFLINE_ARMS + SERVER_ARMS),
        ("mix", mixes, ("short", "mixed")),
        ("load", loads, tuple(LOADS)),
    ):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            p.error(f"unknown {name} {unknown}; choose from {', '.join(known)}")
    if a.device != "cpu" and a.backend != "torch":
        p.error(f"--backend {a.backend} runs on the CPU; --device {a.device} needs --backend torch")
    if a.dtype != "float32" and a.backend != "torch":
        p.error(f"--dtype {a.dtype} needs --backend torch")
    if a.max_batch_size is not None and a.max_batch_size < 1:
        p.error("--max-batch-size must be at least 1")
    return Config(
        arms=arms,
        mixes=mixes,
        loads=loads,
        texts=pick(a.texts, 512, 128),
        duration_s=pick(a.duration, 20, 4),
        c1_duration_s=pick(a.c1_duration, 10, 3),
        warmup_s=pick(a.warmup, 5, 2),
        repeat=pick(a.repeat, 3, 1),
        seed=a.seed,
        offline_batch=a.max_batch_size or a.offline_batch,
        max_batch_tokens=a.max_batch_tokens,
        open_factor=a.open_factor,
        open_rate=a.open_rate,
        loadgen_procs=a.loadgen_procs,
        open_connections=a.open_connections,
        infinity_venv=a.infinity_venv,
        out_dir=a.out_dir or (ROOT / (".bench/embeddings-quick" if q else "docs")),
        quick=q,
        backend=a.backend,
        device=a.device,
        dtype=a.dtype,
        max_batch_size=a.max_batch_size,
        warm_passes=a.warm_passes if a.warm_passes is not None else int(a.device != "cpu"),
    )
