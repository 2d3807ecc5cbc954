"""The cores a worker computes on: its container's CPU quota bounds them (cgroup v1 and v2),
so torch never starts more OpenMP threads than the quota runs. Fake cgroup trees, no torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker.cores import cpu_quota, usable_cores


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [("200000 100000\n", 2.0), ("150000 100000", 1.5), ("50000 100000", 0.5), ("max 100000", None)],
)
def test_cgroup_v2_reads_cpu_max_of_the_process_own_cgroup(
    tmp_path: Path, cpu_max: str, quota: float | None
) -> None:
    _write(tmp_path / "kubepods/pod1/ctr/cpu.max", cpu_max)
    _write(tmp_path / "cpu.max", "100000 100000")  # the root's: not this process's
    assert cpu_quota("0::/kubepods/pod1/ctr\n", tmp_path) == quota


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpu"])
def test_cgroup_v1_reads_the_cpu_controllers_quota_and_period(tmp_path: Path, mount: str) -> None:
    """Hierarchies mounted joined (`cpu,cpuacct`, as Docker does) or one per controller."""
    where = tmp_path / mount / "docker/abc"
    _write(where / "cpu.cfs_quota_us", "300000\n")
    _write(where / "cpu.cfs_period_us", "100000\n")
    membership = f"4:memory:/docker/abc\n3:{mount}:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert cpu_quota(membership, tmp_path) == 3.0


def test_no_quota_where_v1_says_minus_one_or_files_are_missing(tmp_path: Path) -> None:
    _write(tmp_path / "cpu/cpu.cfs_quota_us", "-1")
    _write(tmp_path / "cpu/cpu.cfs_period_us", "100000")
    assert cpu_quota("2:cpu:/\n", tmp_path) is None
    assert cpu_quota("0::/gone\n", tmp_path) is None
    assert cpu_quota("garbage\n\n", tmp_path) is None


def test_the_quota_bounds_the_affinity_rounded_down_and_never_below_one(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    membership = tmp_path / "cgroup"
    membership.write_text("0::/\n")
    for quota, expected in ((0.5, 1), (1.9, 1), (cores + 4, cores)):
        _write(tmp_path / "fs/cpu.max", f"{int(quota * 100000)} 100000")
        assert usable_cores(membership, tmp_path / "fs") == expected
    assert usable_cores(tmp_path / "no-such-file", tmp_path / "fs") == cores
