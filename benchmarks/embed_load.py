"""Load for the embedding benchmark: wrk for closed loops, Poisson processes for the open loop.

Closed loop (N clients, each sending its next request when the last is answered): wrk, a C
client, with a generated Lua script that walks the workload's bodies in order, counts the
real tokens it sent and reads the `X-Microbatch-*` headers of the answers: batch size,
compute time, and, from the batch id and each answer's `usage.prompt_tokens`, the padded and
real tokens of every batch all of whose members it saw answered. Its CPU is read from
`getrusage(RUSAGE_CHILDREN)` around the run.

Open loop (Poisson arrivals at a fixed rate, whatever the answers do): `procs` processes, each
with its own seed and `rate / procs` (the sum of Poisson streams is a Poisson stream), each a
raw keep-alive HTTP/1.1 client (`benchmarks.overload.RawClient`, microseconds a request). An
arrival that finds all of a process's connections busy is shed and counted. Each process
reports its own CPU time.

One client (each request sent when the last is answered, on one keep-alive connection): a
blocking socket in this process, which times every request and knows which text it carried,
so the 1-client goal compares each text's latency with that text's own compute time. One
request at a time costs it tens of microseconds; wrk's own latencies at one connection did
not add up here (its mean latency times its requests per second came to 1.26 seconds per
second on the mixed texts), and it cannot say which text a latency belongs to.

Every server is reached at `/v1/embeddings` on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.embed_workload import MODEL_NAME, Workload
from benchmarks.overload import RawClient, request_head

PATH = "/v1/embeddings"
WRK_SCRIPT = """
local bodies, tokens = {}, {}
for line in io.lines("BODIES") do
  local n, body = line:match("^(%d+)\\t(.*)$")
  tokens[#tokens + 1] = tonumber(n)
  bodies[#bodies + 1] = body
end
local headers = {["Content-Type"] = "application/json"}
local threads, open = {}, {}
sent, sent_tokens, ok, batch_sum, batch_n, compute_ms = 0, 0, 0, 0, 0, 0
full_batches, full_real, full_padded = 0, 0, 0

function setup(thread) table.insert(threads, thread) end

function request()
  local i = (sent % #bodies) + 1
  sent = sent + 1
  sent_tokens = sent_tokens + tokens[i]
  return wrk.format("POST", "PATH", headers, bodies[i])
end

-- A batch whose every member was answered here is padded to its longest member: its
-- padded and real tokens are exact. Batches cut by the start or end of the run are left out.
local function count_batch(id, size, n)
  local b = open[id] or {seen = 0, longest = 0, real = 0}
  b.seen, b.real, b.longest = b.seen + 1, b.real + n, math.max(b.longest, n)
  if b.seen < size then open[id] = b; return end
  open[id] = nil
  full_batches, full_real = full_batches + 1, full_real + b.real
  full_padded = full_padded + size * b.longest
end

function response(status, h, body)
  if status ~= 200 then return end
  ok = ok + 1
  local size = tonumber(h["x-microbatch-batch-size"] or h["X-Microbatch-Batch-Size"] or "")
  if not size then return end
  batch_sum, batch_n = batch_sum + size, batch_n + 1
  compute_ms = compute_ms + tonumber(h["x-microbatch-compute-ms"] or h["X-Microbatch-Compute-Ms"])
  local id = h["x-microbatch-batch-id"] or h["X-Microbatch-Batch-Id"]
  local n = tonumber(body:match('"prompt_tokens":%s*(%d+)') or "")
  if id and n then count_batch(id, size, n) end
end

function done(summary, latency, requests)
  local t = {sent = 0, sent_tokens = 0, ok = 0, batch_sum = 0, batch_n = 0, compute_ms = 0,
             full_batches = 0, full_real = 0, full_padded = 0}
  for _, thread in ipairs(threads) do
    for k, _ in pairs(t) do t[k] = t[k] + (thread:get(k) or 0) end
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"duration_us": %d, "sent": %d, "sent_tokens": %d, "ok": %d, "batch_sum": %d, ' ..
    '"batch_n": %d, "compute_ms": %f, "full_batches": %d, "full_real": %d, ' ..
    '"full_padded": %d, "p50_us": %f, "p99_us": %f, "mean_us": %f, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}}\\n',
    summary.duration, t.sent, t.sent_tokens, t.ok, t.batch_sum, t.batch_n, t.compute_ms,
    t.full_batches, t.full_real, t.full_padded,
    latency:percentile(50), latency:percentile(99), latency.mean,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def wrk_script(workload: Workload, folder: Path) -> Path:
    """The Lua script and its bodies file (`tokens<TAB>json` per line) for this workload."""
    bodies = folder / f"bodies-{workload.mix}.tsv"
    lines = (f"{n}\t{b.decode()}" for n, b in zip(workload.tokens, workload.bodies(), strict=True))
    bodies.write_text("\n".join(lines) + "\n")
    script = folder / f"post-{workload.mix}.lua"
    script.write_text(WRK_SCRIPT.replace("BODIES", str(bodies)).replace("PATH", PATH))
    return script


def closed_loop(url: str, script: Path, clients: int, duration_s: int) -> dict:
    """`clients` keep-alive connections, one request in flight on each, for `duration_s`."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed: apt-get install -y wrk")
    args = [wrk, "-t1", f"-c{clients}", f"-d{duration_s}s", "--timeout", "120s", "-s", str(script)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([*args, url + PATH], capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next(x for x in out.splitlines() if x.startswith("WRK_JSON "))
    raw = json.loads(line.removeprefix("WRK_JSON "))
    elapsed_s = raw["duration_us"] / 1e6
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "texts_per_s": raw["ok"] / elapsed_s,
        "p50_ms": raw["p50_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "mean_ms": raw["mean_us"] / 1000,
        "ok": raw["ok"],
        "sent": raw["sent"],
        "sent_tokens": raw["sent_tokens"],
        "to_compute": raw["sent"] - raw["errors"]["status"],  # answered 200 or abandoned
        "errors": {k: v for k, v in raw["errors"].items() if v},
        "elapsed_s": elapsed_s,
        "padded_per_real": raw["full_padded"] / raw["full_real"] if raw["full_real"] else None,
        "full_batches": raw["full_batches"],
        "header_batch_size_mean": raw["batch_sum"] / raw["batch_n"] if raw["batch_n"] else None,
        "header_compute_ms_mean": raw["compute_ms"] / raw["batch_n"] if raw["batch_n"] else None,
        "loadgen_cpu_s": cpu_s,
        "loadgen_cpu_share": cpu_s / elapsed_s,
    }


def _header(head: bytes, name: bytes) -> bytes | None:
    found = re.search(rb"(?im)^" + name + rb": *([^\r\n]*)", head)
    return found.group(1) if found else None


def one_client(port: int, workload: Workload, duration_s: float, timeout_ms: int = 120_000) -> dict:
    """One keep-alive connection walking the workload in order for `duration_s`: the closed
    loop's figures, plus every answered request's text index and latency (`per_text`)."""
    bodies = workload.bodies()
    head = request_head(timeout_ms)
    per_text: list[tuple[int, float]] = []
    compute_ms: list[float] = []
    sizes: list[int] = []
    errors: dict[str, int] = {}
    cpu = time.process_time()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_ms / 1000) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rb")
        start = time.perf_counter()
        sent = 0
        while time.perf_counter() - start < duration_s:
            index = sent % len(bodies)
            body = bodies[index]
            t0 = time.perf_counter()
            sock.sendall(head + str(len(body)).encode() + b"\r\n\r\n" + body)
            answer = b""
            while not answer.endswith(b"\r\n\r\n"):
                line = stream.readline()
                if not line:
                    raise ConnectionError("the server closed the connection")
                answer += line
            stream.read(int(_header(answer, b"content-length") or 0))
            latency_ms = (time.perf_counter() - t0) * 1000
            sent += 1
            status = int(answer[9:12])
            if status != 200:
                errors[str(status)] = errors.get(str(status), 0) + 1
                continue
            per_text.append((index, latency_ms))
            size, compute = (
                _header(answer, b"x-microbatch-batch-size"),
                _header(answer, b"x-microbatch-compute-ms"),
            )
            if size is not None and compute is not None:
                sizes.append(int(size))
                compute_ms.append(float(compute))
        elapsed_s = time.perf_counter() - start
    cpu_s = time.process_time() - cpu
    latencies = sorted(latency for _, latency in per_text)
    ok = len(per_text)
    return {
        "texts_per_s": ok / elapsed_s,
        "p50_ms": _pct([x / 1000 for x in latencies], 0.50),
        "p99_ms": _pct([x / 1000 for x in latencies], 0.99),
        "mean_ms": statistics.mean(latencies) if latencies else None,
        "ok": ok,
        "sent": sent,
        "sent_tokens": sum(workload.tokens[i % len(bodies)] for i in range(sent)),
        "to_compute": sent - sum(errors.values()),
        "errors": errors,
        "elapsed_s": elapsed_s,
        # one request at a time: a batch holds one text, unless another client joined it
        "padded_per_real": 1.0 if sizes and max(sizes) == 1 else None,
        "header_batch_size_mean": statistics.mean(sizes) if sizes else None,
        "header_compute_ms_mean": statistics.mean(compute_ms) if compute_ms else None,
        "per_text": per_text,
        "loadgen_cpu_s": cpu_s,
        "loadgen_cpu_share": cpu_s / elapsed_s,
    }


Arrival = tuple[int, float, float, int]  # body index, sent at (perf_counter s), latency s, status


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenLoopJob:
    """What one open-loop process sends (perf_counter is CLOCK_MONOTONIC: shared by processes)."""

    port: int
    bodies: list[bytes]
    rate: float  # this process's arrivals per second
    duration_s: float
    seed: int
    offset: int  # index of its first body, so processes do not send the same texts in step
    connections: int  # its in-flight cap; an arrival beyond it is shed


async def _poisson(job: OpenLoopJob, client: RawClient) -> tuple[list[Arrival], int]:
    rng = random.Random(job.seed)
    arrivals: list[Arrival] = []
    tasks: set[asyncio.Task] = set()
    shed, i = 0, job.offset
    start = next_at = time.perf_counter()

    async def one(index: int) -> None:
        answer = await client.post(job.bodies[index])
        arrivals.append((index, answer.sent_s, answer.latency_s, answer.status))

    while next_at < start + job.duration_s:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        if client.reserve():
            task = asyncio.create_task(one(i % len(job.bodies)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        else:
            shed += 1
        i += 1
        next_at += rng.expovariate(job.rate)
    if tasks:
        await asyncio.gather(*tasks)
    client.close()
    return arrivals, shed


def _open_loop_process(job: OpenLoopJob) -> tuple[list[Arrival], int, float]:
    """One load process: its arrivals, its shed count and its own CPU seconds."""
    cpu = time.process_time()
    client = RawClient(job.port, timeout_ms=120_000, connections=job.connections)
    arrivals, shed = asyncio.run(_poisson(job, client))
    return arrivals, shed, time.process_time() - cpu


def open_loop(
    port: int, workload: Workload, rate: float, duration_s: float, procs: int, connections: int
) -> dict:
    """Poisson arrivals at `rate` texts/s for `duration_s`, then every answer awaited."""
    bodies = workload.bodies()
    jobs = [
        OpenLoopJob(
            port=port,
            bodies=bodies,
            rate=rate / procs,
            duration_s=duration_s,
            seed=k,
            offset=k * len(bodies) // procs,
            connections=connections // procs,
        )
        for k in range(procs)
    ]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        results = pool.map(_open_loop_process, jobs)
    arrivals = [a for arrived, _, _ in results for a in arrived]
    shed = sum(s for _, s, _ in results)
    cpu_s = sum(c for _, _, c in results)
    ok = sorted(latency for _, _, latency, status in arrivals if status == 200)
    elapsed_s = max(at + lat for _, at, lat, _ in arrivals) - min(at for _, at, _, _ in arrivals)
    errors: dict[str, int] = {}
    for _, _, _, status in arrivals:
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
    return {
        "texts_per_s": len(ok) / elapsed_s,
        "p50_ms": _pct(ok, 0.50),
        "p99_ms": _pct(ok, 0.99),
        "mean_ms": sum(ok) / len(ok) * 1000 if ok else None,
        "ok": len(ok),
        "sent": len(arrivals),
        "sent_tokens": sum(workload.tokens[i] for i, _, _, _ in arrivals),
        "to_compute": len(ok),
        "ok_tokens": sum(workload.tokens[i] for i, _, _, status in arrivals if status == 200),
        "offered_per_s": (len(arrivals) + shed) / duration_s,
        "shed": shed,
        "errors": errors,
        "elapsed_s": elapsed_s,
        "loadgen_cpu_s": cpu_s,
        "loadgen_cpu_share": cpu_s / elapsed_s,
    }


def _pct(sorted_s: list[float], q: float) -> float | None:
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1000 if sorted_s else None


def server_counters(metrics_url: str) -> dict[str, float]:
    """Worker counters summed over label sets: padded tokens, entries and batches, compute s."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    pattern = r"^microbatch_(batch_tokens|batch_size|compute_seconds)_(sum|count)\{[^}]*\} (\S+)$"
    for name, kind, value in re.findall(pattern, text, re.M):
        key = f"{name}_{kind}"
        found[key] = found.get(key, 0.0) + float(value)
    cancelled = re.search(r"^microbatch_cancelled_total (\S+)$", text, re.M)
    found["cancelled_total"] = float(cancelled.group(1)) if cancelled else 0.0
    return found


def wait_idle(url: str, timeout_s: float = 300, fast_s: float = 0.25) -> float:
    """Until two probes in a row answer within `fast_s`: a server that keeps computing what an
    earlier load left behind (infinity does not drop abandoned requests) would otherwise slow
    the next measurement. Returns the seconds waited."""
    body = {"input": "idle probe", "model": MODEL_NAME}
    started = time.monotonic()
    fast = 0
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        while fast < 2 and time.monotonic() - started < timeout_s:
            sent = time.monotonic()
            client.post(PATH, json=body)
            fast = fast + 1 if time.monotonic() - sent < fast_s else 0
    return time.monotonic() - started
