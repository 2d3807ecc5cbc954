"""How an embedding worker spreads its cores over batches: a pure decision, no torch.

On a CPU, one batch on every core is fragile: intra-op threads meet at a barrier after each
operator, so any other process that takes a core for a moment (the gateway, Redis, the
load) stalls them all; on the 2-core box we measure on, a 2-thread forward ran 1.7x slower
beside a busy gateway than alone. Several batches at once, each on fewer threads (what
OpenVINO calls streams), share no barrier, and one thread per core wastes no time syncing:
two 1-thread batches gave ~1.4x the texts/s of one 2-thread batch even on a quiet machine.

Streams cost latency when there is no queue, though: a lone text on one core takes longer
than on all of them. So under load each batch gets `threads_per_stream`, and a batch that
starts with no other running and nothing else held gets every core (`adaptive`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from worker.cores import usable_cores

if TYPE_CHECKING:
    from common.settings import Settings


@dataclass(frozen=True, slots=True)
class Parallelism:
    cores: int
    streams: int  # batches computing at once
    threads_per_stream: int  # each batch's threads while others may run
    adaptive: bool  # a lone batch, with nothing else held, takes every core

    @classmethod
    def choose(
        cls,
        cores: int,
        streams: int | Literal["auto"],
        threads: int | None,
        *,
        concurrent_ok: bool,
    ) -> Parallelism:
        """`streams` "auto": one per core up to 4 cores, else one per 4 cores; one where
        batches cannot run side by side (`concurrent_ok` False: a GPU, a generation engine,
        the noop model). `threads` None: cores split evenly, and
        adaptive."""
        if not concurrent_ok:
            count = 1
        elif streams == "auto":
            count = cores if cores <= 4 else cores // 4
        else:
            count = streams
        count = max(1, count)
        if threads is not None:
            return cls(cores, count, threads, adaptive=False)
        return cls(cores, count, max(1, cores // count), adaptive=count > 1)

    @classmethod
    def from_settings(cls, settings: Settings, *, concurrent_ok: bool) -> Parallelism:
        """What a worker with these settings chooses on the cores this process may use."""
        return cls.choose(
            usable_cores(),
            settings.compute_streams,
            settings.torch_threads,
            concurrent_ok=concurrent_ok and settings.device == "cpu",
        )

    def threads_for(self, running: list[int], more_held: bool) -> int | None:
        """Threads for the batch about to start, given the threads of those running, or None
        while it must wait for one of them (every stream busy, or every core taken)."""
        if len(running) >= self.streams:
            return None
        if self.adaptive and not running and not more_held:
            return self.cores
        if sum(running) + self.threads_per_stream > max(self.cores, self.threads_per_stream):
            return None
        return self.threads_per_stream
