"""Embedding throughput and latency, side by side: the model alone, microbatch, infinity-emb.

    .venv/bin/python benchmarks/embeddings.py                 # everything, ~45 min on 2 cores
    .venv/bin/python benchmarks/embeddings.py --quick         # every arm, ~4 min
    .venv/bin/python benchmarks/embeddings.py --quick --arms serve,offline-single --mixes short
    .venv/bin/python benchmarks/embeddings.py --device cuda --arms offline-limit,serve --repeat 1

Needs wrk and redis-server (`apt-get install -y wrk redis-server`) and, for the infinity arms,
infinity-emb in a virtual environment of its own (torch first, so pip takes the CPU build from
local disk; the `torch` extra brings the sentence-transformers its torch engine needs):

    python3 -m venv .bench/infinity-venv
    .bench/infinity-venv/bin/pip install torch==2.13.0
    .bench/infinity-venv/bin/pip install 'infinity-emb[server,torch]'

An arm that cannot run says why in the table and the run goes on.

One deterministic workload per mix (fixed seed; `short`: 8-48 tokens, `mixed`: 60% 8-48,
25% 49-200, 15% 201-500, in random order; `--texts` of them), token counts checked with
all-MiniLM-L6-v2's own tokenizer; the model is served at its full 512 positions. The offline
arms run the workload once; every load cycles through the same texts in the same order, so
every arm sees one sample. The arms (`--arms`, default all):

  offline-limit    the whole workload sorted by length, batched (<= 16, cut where padded/real
                   would pass 1.3; the best of a few padded-token caps), padded to the batch
                   max, one process (the worker's TorchRunner, its batches computed as a
                   loaded worker computes them: so many at once, on so many threads each,
                   longest first): what the hardware allows
  offline-ceiling  the same with 32 requests in flight: each arrival window of 32 sorted
                   and split so padded/real <= 1.3
  offline-single   one text per forward on every core: each text's own compute time
  serve            microbatch end to end, `microbatch serve` (embedded store)
  redis            microbatch end to end, gateway + worker + redis-server
  serve-bs1        `microbatch serve --max-batch-size 1`
  infinity-512     infinity-emb (own venv, .bench/infinity-venv), torch engine, cut at 512
  infinity-256     the same at its default cut, 256

`--device cuda` runs the microbatch servers' worker (`MICROBATCH_DEVICE`) and the offline arms
on that device, one compute stream as a worker there has, with `--warm-passes` (1 off the CPU)
untimed passes over each offline plan first, so the offline figures leave out the per-shape
kernel compilation and tuning a GPU does on first sight; infinity-emb is given the same device.
`--dtype bfloat16` runs the worker (its `dtype` setting), the offline arms and infinity-emb
(its `--dtype`) in bfloat16. `--max-batch-size` sets the servers' max_batch_size and the
offline arms' cap together. A GPU computes in a blink what a CPU takes seconds for: give it
more `--texts`, longer loads and more `--loadgen-procs`. The run ends by printing each
microbatch arm's share of the offline limit and ceiling: the share of the device's own
throughput the served path reaches.

Each server arm is loaded by a closed loop at 1 and 32 clients (wrk) and an open-loop Poisson
run (`--loads`) offered `--open-factor` x the offline limit, so it saturates. Printed, and
written to `--out-dir` (docs/ by default, .bench/embeddings-quick/ with --quick) as
benchmarks.md with data/benchmarks.json and data/benchmarks.png: texts/s, p50/p99,
padded/real tokens, mean batch size, the load generator's own CPU, and every ratio issue 6
sets a goal for.
`--repeat 3` (the default without --quick) runs every arm three times in interleaved rounds
(all arms, then all arms again, ...) and reports the median of each measurement: on a shared
machine whose speed drifts over half an hour, back-to-back repeats of one arm would put the
drift between arms, into the very ratios the goals are judged by, and a median of three
drops a round the host slowed down (one ran at half speed here; two rounds would average it).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import embed_docs as docs  # noqa: E402
from benchmarks import embed_offline as offline  # noqa: E402
from benchmarks import embed_report as report  # noqa: E402
from benchmarks.embed_args import (  # noqa: E402
    LOADS,
    OFFLINE_ARMS,
    SERVER_ARMS,
    Config,
    parse_args,
)
from benchmarks.embed_load import (  # noqa: E402
    closed_loop,
    one_client,
    open_loop,
    server_counters,
    wait_idle,
    wrk_script,
)
from benchmarks.embed_servers import (  # noqa: E402
    Server,
    infinity,
    microbatch_redis,
    microbatch_serve,
)
from benchmarks.embed_stats import median_of  # noqa: E402
from benchmarks.embed_workload import Workload, load_tokenizer, make_workload  # noqa: E402

LIMIT_CAPS = (1024, 2048)  # padded tokens per batch the offline limit also tries
WINDOW, MAX_RATIO = 32, 1.3  # the offline ceiling's requests in flight and padding bound


def run_offline(cfg: Config, workloads: dict[str, Workload], results: dict) -> None:
    """The offline arms in this process, each on the whole of each mix's workload."""
    wanted = [a for a in OFFLINE_ARMS if a in cfg.arms]
    if "open" in cfg.loads and cfg.open_rate is None and set(SERVER_ARMS) & set(cfg.arms):
        wanted = sorted(set(wanted) | {"offline-limit"}, key=OFFLINE_ARMS.index)
    if not wanted:
        return
    loaded = offline.load_runner(cfg.backend, cfg.device, cfg.dtype)
    for mix, workload in workloads.items():
        tokens = workload.tokens
        # The limit is the best of a few padded-token caps per batch: on one thread per
        # stream, a batch of long texts costs more per token than a smaller one.
        caps = sorted({cfg.max_batch_tokens, *(c for c in LIMIT_CAPS if c < cfg.max_batch_tokens)})
        limits: dict[str, tuple[int, offline.Plan]] = {}  # a cap that changes nothing: once
        for cap in caps:
            plan = offline.limit_plan(tokens, MAX_RATIO, cfg.offline_batch, cap)
            limits.setdefault(repr(plan), (cap, plan))
        caps = [cap for cap, _ in limits.values()]
        plans = {
            "offline-limit": [plan for _, plan in limits.values()],
            "offline-ceiling": [
                offline.ceiling_plan(
                    tokens, WINDOW, MAX_RATIO, cfg.offline_batch, cfg.max_batch_tokens
                )
            ],
            "offline-single": [offline.single_plan(tokens)],
        }
        for arm in wanted:
            # throughput arms run as the worker does under load; single as a lone batch
            parallel = None if arm == "offline-single" else offline.worker_parallelism(cfg.device)
            best: tuple[dict, list] | None = None
            arm_caps = caps if arm == "offline-limit" else [None]
            for plan, cap in zip(plans[arm], arm_caps, strict=True):
                measured = offline.run_plan(loaded, workload, plan, parallel, cfg.warm_passes)
                figures = dict(measured.figures)
                if cap is not None:
                    figures["batch_token_cap"] = cap
                if best is None or figures["texts_per_s"] > best[0]["texts_per_s"]:
                    best = (figures, measured)
            assert best is not None
            figures, measured = best
            if arm == "offline-single":  # per text, in order (rounds merge them item by item)
                figures["text_compute_ms"] = [s * 1000 for s in measured.batch_seconds]
            results["arms"].setdefault(arm, {})[mix] = {"offline": figures}
            print(report.line(arm, mix, "offline", figures), flush=True)
    loaded.compute.shutdown()
    del loaded
    gc.collect()


def drained(
    metrics_url: str, before: dict[str, float], entries: int, slack: int
) -> dict[str, float]:
    """Counter deltas once `entries` were computed or dropped, or within `slack` of it and
    still for 1.5 s (wrk counts a request it generated but stopped before writing), or
    after 10 s without change."""
    last, changed = server_counters(metrics_url), time.monotonic()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        delta = {k: v - before.get(k, 0.0) for k, v in last.items()}
        done = delta.get("batch_size_sum", 0) + delta.get("cancelled_total", 0)
        still_s = time.monotonic() - changed
        if done >= entries or (done >= entries - slack and still_s > 1.5) or still_s > 10:
            break
        time.sleep(0.25)
        now = server_counters(metrics_url)
        if now != last:
            last, changed = now, time.monotonic()
    return {k: v - before.get(k, 0.0) for k, v in last.items()}


def settle(
    server: Server, before: dict[str, float] | None, figures: dict, clients: int = 0
) -> None:
    """Wait until the server has done what was sent, then add what its metrics say.

    wrk stops with requests in flight; microbatch computes them or drops those whose client
    left, so the next measurement waits until its counters account for every request sent.
    infinity has no such counters and keeps computing abandoned requests: it is probed until
    it answers at once. The open loop awaits every answer, so the worker's padded tokens over
    the answered requests' real tokens is exact; the closed loop's comes from wrk's script.
    """
    if server.metrics_url is None or before is None:
        figures["idle_wait_s"] = wait_idle(server.url)
        return
    delta = drained(server.metrics_url, before, figures["to_compute"], clients)
    if delta.get("batch_size_count"):
        figures["mean_batch_size"] = delta["batch_size_sum"] / delta["batch_size_count"]
        figures["model_busy_share"] = delta["compute_seconds_sum"] / figures["elapsed_s"]
        figures["computed"], figures["cancelled"] = (
            delta["batch_size_sum"],
            delta["cancelled_total"],
        )
        if figures.get("ok_tokens"):
            figures["padded_per_real"] = delta["batch_tokens_sum"] / figures["ok_tokens"]


def measure(
    server: Server, workload: Workload, load: str, script: Path, cfg: Config, rate: float
) -> dict:
    before = server_counters(server.metrics_url) if server.metrics_url else None
    clients = LOADS[load]
    if clients is None:
        figures = open_loop(
            server.port, workload, rate, cfg.duration_s, cfg.loadgen_procs, cfg.open_connections
        )
        figures["offered_rate_per_s"] = rate
    elif clients == 1:
        figures = one_client(server.port, workload, cfg.c1_duration_s)
    else:
        figures = closed_loop(server.url, script, clients, cfg.duration_s)
    settle(server, before, figures, clients or 0)
    return figures


def server_settings(cfg: Config) -> dict[str, object]:
    """The microbatch servers' settings this run sets (the rest are the worker's defaults)."""
    settings: dict[str, object] = {"backend": cfg.backend}
    if cfg.dtype != "float32":
        settings["dtype"] = cfg.dtype
    if cfg.device != "cpu":
        settings["device"] = cfg.device
    if cfg.max_batch_size is not None:
        settings["max_batch_size"] = cfg.max_batch_size
    return settings


def start_server(arm: str, tmp: Path, cfg: Config) -> AbstractContextManager[Server]:
    from worker.models import default_model_path

    settings = server_settings(cfg)
    if arm == "serve":
        return microbatch_serve(arm, tmp, **settings)
    if arm == "serve-bs1":
        return microbatch_serve(arm, tmp, **{**settings, "max_batch_size": 1})
    if arm == "redis":
        return microbatch_redis(arm, tmp, **settings)
    cut = 512 if arm == "infinity-512" else None
    return infinity(
        arm, tmp, cfg.infinity_venv, default_model_path(), cut, cfg.device, dtype=cfg.dtype
    )


def open_rate(cfg: Config, results: dict, mix: str) -> float:
    if cfg.open_rate is not None:
        return cfg.open_rate
    return cfg.open_factor * results["arms"]["offline-limit"][mix]["offline"]["texts_per_s"]


def measure_mix(server: Server, workload: Workload, cfg: Config, rate: float, tmp: Path) -> dict:
    """A warm-up (not counted), then every load on this mix once (rounds repeat it)."""
    script = wrk_script(workload, tmp)
    settle(server, None, closed_loop(server.url, script, 32, cfg.warmup_s))
    by_load: dict = {}
    for load in cfg.loads:
        by_load[load] = measure(server, workload, load, script, cfg, rate)
        print(report.line(server.arm, workload.mix, load, by_load[load]), flush=True)
    return by_load


def run_server_arm(
    arm: str, cfg: Config, workloads: dict[str, Workload], results: dict, tmp: Path
) -> None:
    """Start the arm's server once and measure every mix on it.

    An arm that cannot start, or fails half-way, records why and the run goes on: one broken
    peer must not throw away half an hour of other arms' figures.
    """
    arm_results: dict = {}
    results["arms"][arm] = arm_results
    try:
        with start_server(arm, tmp, cfg) as server:
            for mix, workload in workloads.items():
                rate = open_rate(cfg, results, mix) if "open" in cfg.loads else 0.0
                arm_results[mix] = measure_mix(server, workload, cfg, rate, tmp)
    except Exception as exc:  # reported in the table, never hidden
        arm_results["unavailable"] = f"{type(exc).__name__}: {exc}"
        print(f"{arm}: unavailable: {arm_results['unavailable']}", flush=True)


def cpu_seconds() -> tuple[float, float, float]:
    """(wall, busy CPU s of the whole machine, CPU s of this process and its reaped children).

    Servers, wrk and the open-loop processes are all reaped by the end of an arm, so what the
    machine did beyond them in that span was someone else's: on a shared 2-core box that is
    what turns a figure into noise, and the report says so.
    """
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    machine = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return time.monotonic(), machine, own


def foreign_share(start: tuple[float, float, float]) -> float:
    """Share of the machine's CPUs used by other processes since `start`."""
    end = cpu_seconds()
    wall = end[0] - start[0]
    foreign = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, foreign) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


def run(cfg: Config) -> dict:
    from worker.models import default_model_path

    tokenizer = load_tokenizer(default_model_path())
    workloads = {mix: make_workload(mix, cfg.texts, tokenizer, cfg.seed) for mix in cfg.mixes}
    results: dict = {"setup": report.setup(cfg, workloads), "arms": {}, "foreign_cpu": {}}
    foreign: dict[str, list[float]] = {}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mb-embeddings-") as tmp:
        for k in range(cfg.repeat):
            if cfg.repeat > 1:
                print(f"--- round {k + 1} of {cfg.repeat}", flush=True)
            this: dict = {"arms": {}}
            start = cpu_seconds()
            run_offline(cfg, workloads, this)
            foreign.setdefault("offline", []).append(foreign_share(start))
            for arm in (a for a in SERVER_ARMS if a in cfg.arms):
                start = cpu_seconds()
                run_server_arm(arm, cfg, workloads, this, Path(tmp))
                foreign.setdefault(arm, []).append(foreign_share(start))
            rounds.append(this["arms"])
    results["arms"] = median_of(rounds)
    results["foreign_cpu"] = {arm: max(shares) for arm, shares in foreign.items()}
    results["ratios"] = report.ratios(results)
    results["served_share"] = report.served_share(results)
    return results


def main() -> None:
    cfg = parse_args(__doc__)
    results = run(cfg)
    docs.write(results, cfg.out_dir, " ".join(sys.argv[1:]))
    print(report.served_share_text(results), flush=True)


if __name__ == "__main__":
    main()
