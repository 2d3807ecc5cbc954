"""Cache-aware routing policy: send a prompt to the worker that holds its prefix, within a
load bound.

Each gateway keeps an approximate index from its own history: the chained names of a
prompt's blocks (`common.prefix`) mapped to the worker that answered it, least recently
used forgotten first. A new prompt walks its names; the longest known prefix names its
worker. An explicit session key (the `X-Microbatch-Session` header, else OpenAI's `user`)
maps to the worker that served the session last, and wins over the prefix. Affinity yields
to load: past `max_imbalance` sequences above the least loaded live worker, or to a worker
not live, the prompt goes to the shared streams, which whoever has room reads (the shortest
queue, in effect). As in SGLang's cache-aware router and vLLM production-stack's
prefix-aware routing; the index is per gateway and never exact, which costs only a miss.

Pure policy: no Redis, no HTTP.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.prefix import prefix_names

ROUTING_BLOCK = 32  # tokens per routing name: coarse is enough to tell conversations apart


@dataclass(slots=True)
class PrefixIndex:
    capacity: int = 200_000  # names remembered, about 3 MB
    _owner: OrderedDict[bytes, str] = field(default_factory=OrderedDict)

    def learn(self, names: Sequence[bytes], worker: str) -> None:
        for name in names:
            self._owner[name] = worker
            self._owner.move_to_end(name)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def owner(self, names: Sequence[bytes]) -> tuple[str | None, int]:
        """The worker of the longest known prefix, and how many names it matched."""
        best: tuple[str | None, int] = (None, 0)
        for i, name in enumerate(names):
            worker = self._owner.get(name)
            if worker is None:
                break
            best = (worker, i + 1)
        return best


def names_of(tokens: Sequence[int], model: str, session: str | None) -> list[bytes]:
    """The names a prompt is routed and remembered by: its session's alone, if it has one."""
    if session:
        digest = hashlib.blake2b(model.encode() + b"\0session\0", digest_size=16)
        digest.update(session.encode())
        return [digest.digest()]
    return prefix_names(tokens, ROUTING_BLOCK, model.encode())


def choose(owner: str | None, loads: Mapping[str, int], max_imbalance: int) -> str | None:
    """The worker to send to, or None for the shared streams."""
    if owner is None or owner not in loads:
        return None
    if loads[owner] - min(loads.values()) > max_imbalance:
        return None
    return owner


@dataclass(slots=True)
class AffinityRouter:
    """One gateway's routing state: the index, and each model's live workers with their
    load: sequences held, as their heartbeats report it, plus the prompts this gateway has
    routed to them and not seen answered (a burst between two reports counts at once)."""

    max_imbalance: int
    index: PrefixIndex = field(default_factory=PrefixIndex)
    _reported: dict[str, dict[str, int]] = field(default_factory=dict)
    _in_flight: dict[tuple[str, str], int] = field(default_factory=dict)
    _laned: dict[str, frozenset[str]] = field(default_factory=dict)

    def update_loads(
        self, model: str, loads: Mapping[str, int], laned: frozenset[str] = frozenset()
    ) -> None:
        """`laned`: the workers that read a tenant's prompts routed to them in its lane."""
        self._reported[model] = dict(loads)
        self._laned[model] = laned

    def reads_lanes(self, model: str, worker: str) -> bool:
        return worker in self._laned.get(model, frozenset())

    def loads(self, model: str) -> dict[str, int]:
        return {
            w: n + self._in_flight.get((model, w), 0)
            for w, n in self._reported.get(model, {}).items()
        }

    def route(self, model: str, names: Sequence[bytes], known: str | None = None) -> str | None:
        """The worker for a prompt: `known` (the worker another gateway saw answer the
        conversation's last turn, where one is stored) before this gateway's own index."""
        owner = known or self.index.owner(names)[0]
        worker = choose(owner, self.loads(model), self.max_imbalance)
        if worker is not None:
            self._in_flight[(model, worker)] = self._in_flight.get((model, worker), 0) + 1
        return worker

    def answered(self, model: str, worker: str) -> None:
        """A prompt `route` sent to `worker` has its answer (or failed)."""
        left = self._in_flight.get((model, worker), 0) - 1
        if left > 0:
            self._in_flight[(model, worker)] = left
        else:
            self._in_flight.pop((model, worker), None)

    def learn(self, names: Sequence[bytes], worker: str) -> None:
        self.index.learn(names, worker)
