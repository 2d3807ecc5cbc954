"""The cores this process may compute on: its CPU affinity and its container's CPU quota.

A container's CPU limit (Kubernetes' `resources.limits.cpu`, `docker run --cpus`) is a CFS
quota, not a cpuset: the process still sees every core of the node and torch starts one
OpenMP thread per core, which the quota then throttles. OpenMP's barriers turn that into a
stall rather than a share: each parallel region waits for its descheduled threads. On the
2-core box we measure on, a generation beside one busy process ran 64 tokens in 11.6-21.5 s
on two threads and 2.6 s on one. So the quota, where one is set, bounds the threads, as the
JVM and Go's automaxprocs do. Read from /proc/self/cgroup and /sys/fs/cgroup (v1 and v2).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cores(
    cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int:
    """Cores this process may use: its affinity (a cpuset), bounded by its CFS quota."""
    cores = _affinity()
    try:
        quota = cpu_quota(cgroup.read_text(), root)
    except OSError:  # no cgroups here (not Linux, or not mounted): the affinity is all
        return cores
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def quota_threads() -> int | None:
    """The threads to compute on where a CPU quota allows fewer than the cores, else None
    (torch's own default: its physical cores)."""
    bounded = usable_cores()
    return bounded if bounded < _affinity() else None


def _affinity() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def cpu_quota(membership: str, root: Path) -> float | None:
    """CPUs the CFS quota of this process's cgroup allows (quota / period), None when it
    sets none. `membership` is /proc/self/cgroup's text; `root` where the hierarchies are
    mounted. Floor, not ceiling, at the caller: a thread past the quota stalls the rest."""
    for line in membership.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        where = path.lstrip("/")
        if hierarchy == "0" and not controllers:  # cgroup v2: "<quota|max> <period>"
            quota = _v2(root / where / "cpu.max")
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller
            mount = root / controllers
            quota = _v1(mount if mount.is_dir() else root / "cpu", where)
        else:
            continue
        if quota is not None:
            return quota
    return None


def _v2(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1(mount: Path, where: str) -> float | None:
    try:
        quota = int((mount / where / "cpu.cfs_quota_us").read_text())
        period = int((mount / where / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
