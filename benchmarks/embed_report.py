"""The embedding benchmark's figures: one line per measurement, the run's setup, the goals.

`ratios()` turns the measurements into issue 6's goals, each with its value, its goal and
whether it is met (None when an arm it needs did not run). `embed_docs` writes them out.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.embed_workload import Workload

ARMS = {
    "offline-limit": "whole workload sorted by length, batched (≤ 16, split where padded/real "
    "would pass 1.3; the best of a few padded-token caps per batch), padded to the batch "
    "max, one process, batches computed as a loaded worker computes them (its streams and "
    "threads), longest first",
    "offline-ceiling": "32 requests in flight: each arrival window of 32 sorted and split so "
    "padded/real ≤ 1.3; computed as the limit is",
    "offline-single": "one text per forward on every core, as a worker computes a lone text "
    "(each text's own compute time)",
    "serve": "microbatch end to end, `microbatch serve` (embedded store)",
    "redis": "microbatch end to end, gateway + worker + redis-server",
    "serve-bs1": "`microbatch serve --max-batch-size 1`",
    "infinity-512": "infinity-emb, torch engine, cut at 512 (same truncation as microbatch)",
    "infinity-256": "infinity-emb, torch engine, its default cut at 256",
}
MICROBATCH = ("serve", "redis")
LOAD_NAMES = {"offline": "offline", "c1": "1 client", "c32": "32 clients", "open": "open loop"}


def fmt(value: object, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def line(arm: str, mix: str, load: str, f: dict) -> str:
    """One measurement as a line of the running log."""
    cpu = f.get("loadgen_cpu_share")
    parts = [
        f"{arm:<16}{mix:<7}{LOAD_NAMES[load]:<11}",
        f"{fmt(f.get('texts_per_s')):>7} texts/s",
        f"p50 {fmt(f.get('p50_ms'))} ms p99 {fmt(f.get('p99_ms'))} ms",
        f"padded/real {fmt(f.get('padded_per_real'), 2)}",
        f"batch {fmt(f.get('mean_batch_size'))}",
    ]
    if cpu is not None:
        parts.append(f"loadgen CPU {cpu * 100:.1f}% of a core")
    if f.get("errors"):
        parts.append(f"errors {f['errors']}")
    return "  ".join(parts)


def _version(command: list[str]) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0].split(" Copyright")[0] if text else None


def setup(cfg: Any, workloads: dict[str, Workload]) -> dict:
    """What a reader needs to repeat the run: machine, versions, settings, workload shape.

    `cfg` is the benchmark's Config dataclass (typed loosely: this module must not import
    the command that imports it)."""
    import torch

    infinity = cfg.infinity_venv / "bin" / "python"
    version = "import importlib.metadata as m; print(m.version('infinity-emb'))"
    config = dataclasses.asdict(cfg)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or None},
        "torch": torch.__version__,
        "device": cfg.device,
        "accelerator": _accelerator(cfg.device),
        "torch_threads": torch.get_num_threads(),
        "worker_parallelism": _parallelism(cfg.device),
        "wrk": _version([shutil.which("wrk") or "wrk", "-v"]),
        "infinity_emb": _version([str(infinity), "-c", version]) if infinity.is_file() else None,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in config.items()},
        "workloads": {
            mix: {
                "texts": len(w.texts),
                "mean_tokens": statistics.fmean(w.tokens),
                "min_tokens": min(w.tokens),
                "max_tokens": max(w.tokens),
            }
            for mix, w in workloads.items()
        },
    }


def figure(results: dict, arm: str, mix: str, load: str, key: str) -> float | None:
    value = results["arms"].get(arm, {}).get(mix, {}).get(load, {}).get(key)
    return value if isinstance(value, int | float) else None


def _ratio(name: str, num: float | None, den: float | None, goal: float | None) -> dict:
    value = num / den if num is not None and den else None
    met = None if value is None or goal is None else value >= goal
    return {"name": name, "value": value, "unit": "x", "goal": goal, "met": met}


def _p50_over_compute(results: dict, arm: str, mix: str) -> dict:
    """The median, over the requests one client sent, of each text's latency minus that text's
    own compute time (offline, one text per forward, as a worker computes a lone text)."""
    name = f"p50 at 1 client − model compute, {arm}, {mix} (ms)"
    c1 = results["arms"].get(arm, {}).get(mix, {}).get("c1", {})
    single = results["arms"].get("offline-single", {}).get(mix, {}).get("offline", {})
    per_text = single.get("text_compute_ms") or []
    over = [lat - per_text[i] for i, lat in c1.get("per_text") or [] if i < len(per_text)]
    value = statistics.median(over) if over else None
    met = None if value is None else value <= 2.0
    return {"name": name, "value": value, "unit": "ms", "goal": 2.0, "met": met, "le": True}


def _mean_over_worker_compute(results: dict, arm: str, mix: str) -> dict:
    """Mean latency at 1 client minus the worker's own compute time (X-Microbatch-Compute-Ms):
    what HTTP, tokenizing, the queue and the wait add, apart from a slower forward."""
    mean = figure(results, arm, mix, "c1", "mean_ms")
    compute = figure(results, arm, mix, "c1", "header_compute_ms_mean")
    value = mean - compute if mean is not None and compute is not None else None
    name = f"mean at 1 client − worker compute, {arm}, {mix} (ms)"
    return {"name": name, "value": value, "unit": "ms", "goal": None, "met": None}


def ratios(results: dict) -> list[dict]:
    """Every goal of issue 6 that this run's arms can answer."""
    mixes = list(results["setup"]["workloads"])
    out: list[dict] = []
    for arm in MICROBATCH:
        for mix in mixes:
            tps = figure(results, arm, mix, "c32", "texts_per_s")
            ceiling = figure(results, "offline-ceiling", mix, "offline", "texts_per_s")
            out.append(_ratio(f"{arm} / offline ceiling, {mix}, 32 clients", tps, ceiling, 0.9))
            open_tps = figure(results, arm, mix, "open", "texts_per_s")
            limit = figure(results, "offline-limit", mix, "offline", "texts_per_s")
            out.append(_ratio(f"{arm} open loop / offline limit, {mix}", open_tps, limit, 0.9))
            for inf, goal in (("infinity-512", 2.0), ("infinity-256", None)):
                other = figure(results, inf, mix, "c32", "texts_per_s")
                out.append(_ratio(f"{arm} / {inf} texts/s, {mix}, 32 clients", tps, other, goal))
                p99 = figure(results, arm, mix, "c32", "p99_ms")
                other_p99 = figure(results, inf, mix, "c32", "p99_ms")
                goal_p99 = 1.0 if goal else None
                name = f"{inf} p99 / {arm} p99, {mix}, 32 clients"
                out.append(_ratio(name, other_p99, p99, goal_p99))
            out.append(_p50_over_compute(results, arm, mix))
            out.append(_mean_over_worker_compute(results, arm, mix))
        for load in ("c32", "open"):
            value = figure(results, arm, "mixed", load, "padded_per_real")
            met = None if value is None else value <= 1.3
            name = f"padded / real tokens, {arm}, mixed, {LOAD_NAMES[load]}"
            out.append(
                {"name": name, "value": value, "unit": "x", "goal": 1.3, "met": met, "le": True}
            )
    bs1 = figure(results, "serve-bs1", "short", "c32", "texts_per_s")
    serve = figure(results, "serve", "short", "c32", "texts_per_s")
    out.append(_ratio("serve / serve-bs1, short, 32 clients", serve, bs1, 2.5))
    return out


def _parallelism(device: str = "cpu") -> str:
    from benchmarks.embed_offline import worker_parallelism

    p = worker_parallelism(device)
    lone = f", a lone batch on {p.cores}" if p.adaptive else ""
    return f"{p.streams} stream(s) × {p.threads_per_stream} thread(s){lone}"


def _accelerator(device: str) -> str | None:
    """The device's name as torch reports it (None on the CPU)."""
    import torch

    if device == "cpu":
        return None
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return device


SHARE_LOADS = (("c32", "32 clients"), ("open", "open loop"))


def served_share(results: dict) -> list[dict]:
    """Each microbatch server arm's texts/s over the offline arms' (the device's own
    throughput through the worker's runner): the share of the device the served path uses."""
    out = []
    for arm in MICROBATCH:
        for mix in results["setup"]["workloads"]:
            for load, load_name in SHARE_LOADS:
                served = figure(results, arm, mix, load, "texts_per_s")
                for reference in ("offline-limit", "offline-ceiling"):
                    offline = figure(results, reference, mix, "offline", "texts_per_s")
                    if served is None or not offline:
                        continue
                    out.append(
                        {
                            "arm": arm,
                            "mix": mix,
                            "load": load_name,
                            "reference": reference,
                            "served_texts_per_s": served,
                            "offline_texts_per_s": offline,
                            "share": served / offline,
                        }
                    )
    return out


def served_share_text(results: dict) -> str:
    """The shares as the run's last lines, with the device they were measured on."""
    s = results["setup"]
    device = s.get("device", "cpu")
    where = "the CPU" if device == "cpu" else f"{s.get('accelerator') or device}, `{device}`"
    lines = [f"\nServed share of the device's offline throughput (on {where}):"]
    for r in results.get("served_share", []):
        lines.append(
            f"  SHARE {r['arm']:<6}{r['mix']:<7}{r['load']:<11} / {r['reference']:<16}"
            f"{r['served_texts_per_s']:>9.1f} / {r['offline_texts_per_s']:>9.1f} texts/s"
            f" = {r['share']:.3f}"
        )
    if len(lines) == 1:
        lines.append("  (none: a microbatch server arm and an offline arm must both run)")
    return "\n".join(lines)
