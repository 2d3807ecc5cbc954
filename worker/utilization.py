"""Device utilisation for `microbatch_device_utilization`: NVML on a GPU, process CPU otherwise."""

from __future__ import annotations

import os
import time
from typing import Any


class Utilization:
    """`sample()` returns the share (0..1) of the device busy since the previous call."""

    def __init__(self, device: str) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        if device.startswith("cuda"):
            self._open_nvml(int(device.partition(":")[2] or 0))
        self._cpus = os.cpu_count() or 1
        self._last = (time.monotonic(), time.process_time())

    def _open_nvml(self, index: int) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # no NVML library or no driver: fall back to process CPU
            self._nvml = None

    def sample(self) -> float:
        if self._nvml is not None:
            return self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100
        wall, cpu = time.monotonic(), time.process_time()
        last_wall, last_cpu = self._last
        self._last = (wall, cpu)
        if wall <= last_wall:
            return 0.0
        return min(1.0, (cpu - last_cpu) / (wall - last_wall) / self._cpus)
