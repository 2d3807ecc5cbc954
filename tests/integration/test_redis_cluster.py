"""A real Redis Cluster (3 masters, 3 replicas): two models on it, and a master killed mid-load."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from redis.crc import key_slot

from common.streams import Keys
from tests.conftest import (
    ROOT,
    Processes,
    cluster_port,
    eventually,
    process_env,
    wait_ready,
    wait_until,
    wait_workers,
)

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

MODELS = ("noop", "noop2")  # slots 10577 and 12890: the second and third master
NODE_TIMEOUT_MS = 2000  # a dead master is failed over within a few seconds
DEADLINE_MS = 3000  # each request's X-Microbatch-Timeout-Ms under load
MARGIN_S = 3.0  # past its deadline, an answer this late counts as a hang


@dataclass
class LocalCluster:
    """Six loopback `redis-server --cluster-enabled yes`, joined by `redis-cli --cluster`."""

    dir: Path
    ports: list[int] = field(default_factory=lambda: [cluster_port() for _ in range(6)])
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"  # any node will do

    def start(self) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            pytest.fail("redis-server and redis-cli are not installed: .ci/run installs them")
        for port in self.ports:
            args = [
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.dir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--repl-diskless-sync-delay", "0",  # replicas in sync at once
                "--appendonly", "no",
                "--save", "",
                "--dir", str(self.dir),
            ]  # fmt: skip
            with (self.dir / f"{port}.log").open("wb") as log:
                self.procs[port] = subprocess.Popen(
                    [binary, *args], stdout=log, stderr=subprocess.STDOUT
                )
        for port in self.ports:
            wait_until(lambda p=port: self.ping(p), 10, f"redis-server on {port}")
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.wait_ok(self.ports)
        for port in self.ports:  # a replica never synced refuses to take over
            wait_until(lambda p=port: self.synced(p), 30, f"replication in sync on {port}")

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2)

    def ping(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError), self.client(port) as c:
            return bool(c.ping())
        return False

    def state_ok(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError), self.client(port) as c:
            return c.cluster("info")["cluster_state"] == "ok"
        return False

    def synced(self, port: int) -> bool:
        """A master with its replica attached, or a replica with its link up."""
        with contextlib.suppress(redis.RedisError), self.client(port) as c:
            info = c.info("replication")
            if info["role"] == "master":
                return info["connected_slaves"] >= 1
            return info["master_link_status"] == "up"
        return False

    def wait_ok(self, ports: list[int], timeout: float = 30) -> None:
        for port in ports:
            wait_until(lambda p=port: self.state_ok(p), timeout, f"cluster_state:ok on {port}")

    def master_of(self, slot: int) -> int:
        """The port of the master serving `slot`, as a live node sees it now."""
        alive = next(p for p in self.ports if self.procs[p].poll() is None)
        with self.client(alive) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise AssertionError(f"slot {slot} is not served")

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class Deployment:
    cluster: LocalCluster
    gateways: list


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The cluster, a worker per model and two gateways, started once for the module."""
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    procs = Processes(tmp_path_factory.mktemp("cluster-procs"))
    try:
        cluster.start()
        common = {
            "redis_url": cluster.url,
            "redis_cluster": "true",
            "model": "noop",
            "claim_idle_ms": 1000,
            "heartbeat_interval_ms": 200,
        }
        procs.start("worker", noop_compute_ms=5, **common)
        procs.start("worker", noop_compute_ms=5, served_model_name="noop2", **common)
        gateways = [procs.start("gateway", gateway_id=f"gw-{i}", **common) for i in range(2)]
        for gateway in gateways:
            wait_ready(gateway, models=2)
        for model in MODELS:
            wait_workers(gateways[0], model, 1)
        yield Deployment(cluster, gateways)
    finally:
        procs.stop_all()
        cluster.stop()


def embed(url: str, model: str, text: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": text}, timeout=30)


def test_two_models_serve_on_a_cluster_each_in_its_own_slot(deployment: Deployment) -> None:
    cluster = deployment.cluster
    for gateway in deployment.gateways:
        for model in MODELS:
            r = embed(gateway.base_url, model, f"hello {model}")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
    keys = Keys("mb")
    slots = {model: key_slot(keys.request(model, 128).encode()) for model in MODELS}
    masters = {model: cluster.master_of(slot) for model, slot in slots.items()}
    assert masters["noop"] != masters["noop2"], "the two models should sit on two masters"
    for model, slot in slots.items():
        with cluster.client(masters[model]) as c:
            assert c.cluster("keyslot", keys.request(model, 512)) == slot
            stored = {str(k) for k in c.cluster("getkeysinslot", slot, 100)}
        # Streams, group registry and beats of one model: one slot, one master.
        assert {keys.request(model, 128), keys.workers(model)} <= stored
        assert all(k.startswith(f"mb:{{{model}}}:") for k in stored)
    # The operator's view works on a cluster too: `microbatch status` lists both models.
    status = subprocess.run(
        [sys.executable, "-m", "common.cli", "status", "--json", "--redis-cluster"],
        cwd=ROOT,
        env=process_env(redis_url=cluster.url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert all(f'"{model}"' in status.stdout for model in MODELS), status.stdout
    # Reply streams hash by gateway id, spread over the masters, and live where they hash.
    for gateway_id in ("gw-0", "gw-1"):
        reply = keys.reply(gateway_id)
        with cluster.client(cluster.master_of(key_slot(reply.encode()))) as c:
            assert c.exists(reply)


@dataclass
class Outcome:
    status: int | str  # an HTTP status, or "hang" past the deadline and margin
    model: str
    at: float  # monotonic time the request was sent
    took: float
    body: str = ""


async def load(url: str, stop_at: float, outcomes: list[Outcome], model: str, tag: str) -> None:
    """One client sending requests back to back until `stop_at`."""
    headers = {"X-Microbatch-Timeout-Ms": str(DEADLINE_MS)}
    limit = DEADLINE_MS / 1000 + MARGIN_S
    async with httpx.AsyncClient(base_url=url, timeout=limit) as client:
        i = 0
        while time.monotonic() < stop_at:
            body = {"model": model, "input": f"{tag} {i}"}
            sent = time.monotonic()
            try:
                r = await client.post("/v1/embeddings", json=body, headers=headers)
                status, text = r.status_code, "" if r.status_code == 200 else r.text
            except httpx.TimeoutException:
                status, text = "hang", ""
            except httpx.TransportError as exc:
                status, text = "transport", repr(exc)
            outcomes.append(Outcome(status, model, sent, time.monotonic() - sent, text))
            i += 1
            if status != 200:
                await asyncio.sleep(0.05)  # as a client honouring a short Retry-After would


def test_a_master_killed_under_load_fails_over_and_every_request_is_answered(
    deployment: Deployment,
) -> None:
    cluster = deployment.cluster
    victim_model = "noop"
    slot = key_slot(Keys("mb").request(victim_model, 128).encode())
    victim = cluster.master_of(slot)
    outcomes: list[Outcome] = []

    async def scenario() -> tuple[float, float]:
        stop_at = time.monotonic() + 16
        clients = [
            asyncio.create_task(load(gw.base_url, stop_at, outcomes, model, f"{model}-{c}"))
            for gw in deployment.gateways
            for model in MODELS
            for c in range(2)
        ]
        await eventually(  # within 10 s of the 16 s of load: the rest is for the failover
            lambda: Counter(o.model for o in outcomes if o.status == 200),
            10,
            "both models answered through the cluster before the kill",
            until=lambda answered: all(answered[model] >= 10 for model in MODELS),
        )
        killed_at = time.monotonic()
        cluster.kill(victim)
        survivors = [p for p in cluster.ports if p != victim]
        await eventually(
            lambda: cluster.master_of(slot),
            20,
            "a failover: the replica serving the killed master's slot",
            until=lambda master: master != victim,
            interval_s=0.1,
        )
        promoted_at = time.monotonic()
        await asyncio.to_thread(cluster.wait_ok, survivors)
        await asyncio.gather(*clients)
        return killed_at, promoted_at

    killed_at, promoted_at = asyncio.run(scenario())
    counts = Counter(str(o.status) for o in outcomes)
    print(
        f"\nfailover counts: {dict(counts)}; master :{victim} killed, replica promoted after "
        f"{promoted_at - killed_at:.1f} s"
    )
    for o in outcomes:
        if o.status != 200:
            print(f"  {o.status} {o.model} at +{o.at - killed_at:.1f}s took {o.took:.1f}s {o.body}")
    # Every request got an answer: a result, or a clear 503/504 in the OpenAI error shape.
    assert set(counts) <= {"200", "503", "504"}, counts
    for o in outcomes:
        assert o.took < DEADLINE_MS / 1000 + MARGIN_S
        if o.status in (503, 504):
            assert '"error"' in o.body and '"message"' in o.body, o.body
    # Before the kill all was well, and after the failover both models serve again.
    before = [o for o in outcomes if o.at + o.took < killed_at]
    assert before and all(o.status == 200 for o in before)
    settled = promoted_at + 5
    for model in MODELS:
        late = [o for o in outcomes if o.model == model and o.at > settled]
        assert late and all(o.status == 200 for o in late), [o.status for o in late]
    for gateway in deployment.gateways:
        for model in MODELS:
            assert embed(gateway.base_url, model, "after").status_code == 200
