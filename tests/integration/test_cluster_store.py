"""The cluster client against a real one-node Redis Cluster: its commands are packed in C.

redis-py's asyncio clients pack commands in Python; the store packs them with hiredis, which
was about a sixth of a worker's CPU per single-text request. A cluster client builds each
node it discovers from its own connection settings, so the packing must reach those too.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common import streams
from common.settings import Settings
from common.store import close_store, open_store, pipeline
from tests.conftest import cluster_port, wait_until


@pytest.fixture
def one_node_cluster(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: .ci/run installs it with apt")
    port = cluster_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")]
    proc = subprocess.Popen(
        [binary, *args, "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(port=port)

        def listening() -> bool:
            with contextlib.suppress(redis.ConnectionError):
                return bool(client.ping())
            return False

        wait_until(listening, 10, f"redis-server on port {port}")
        client.execute_command("CLUSTER ADDSLOTSRANGE", 0, 16383)
        wait_until(
            lambda: client.cluster("info")["cluster_state"],
            10,
            "the one-node cluster ok",
            until=lambda state: state == "ok",
        )
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def test_a_cluster_store_packs_every_node_s_commands_with_hiredis(
    one_node_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hiredis

    packed: list[tuple] = []
    real = hiredis.pack_command
    monkeypatch.setattr(hiredis, "pack_command", lambda args: packed.append(args) or real(args))
    store = open_store(Settings(redis_url=one_node_cluster, redis_cluster=True))
    stream = "mb:{noop}:req:128"

    async def exchange() -> list:
        await store.xadd(stream, {streams.FIELD: b"\x00\xff"})  # one command
        pipe = pipeline(store)
        pipe.xlen(stream)
        pipe.xrange(stream)
        xlen, entries = await pipe.execute()  # a pipeline, grouped by node
        nodes = store.get_nodes()
        await close_store(store)
        return [xlen, entries, nodes]

    xlen, entries, nodes = asyncio.run(exchange())
    assert xlen == 1 and entries[0][1] == {streams.FIELD.encode(): b"\x00\xff"}
    names = [args[0] for args in packed]
    assert b"XADD" in names and b"XLEN" in names and b"XRANGE" in names
    for node in nodes:  # discovered from CLUSTER SLOTS, not only the seed the URL named
        assert node.connection_class.__name__.startswith("Hiredis"), node.connection_class
