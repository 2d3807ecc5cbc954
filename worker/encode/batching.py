"""Batching policy: a pure function of the local bucket queues, the clock, the limits and load.

`next_batch` answers "what should the model run now?" with a `Batch` or a `Wait`. It is asked
only when the model is free. Within a bucket the batch is built around its anchor — the
oldest interactive entry, else the oldest batch entry; one passed over for `starvation_s`
counts as interactive — by adding the anchor's neighbours in length order while the batch
stays worth it: under the worker's fitted cost model, while real tokens per second do not
drop; before there is one, while padding stays under `max_padding_ratio` of its tokens. So a
batch holds similar lengths, every entry is served once it is the oldest, and padding on
mixed lengths stays low. A bucket is ready when its batch is full (`max_batch_size`), the
padded-token budget (`max_batch_tokens`) or the length rule stops it growing, its anchor is
interactive, or waiting no longer pays: after `max_wait_s` from its oldest entry, or, with
`max_wait_s=None` ("auto"), at once while no other batch computes (the machine is idle: a
batch run now delays no later one, and a closed-loop client sends its next request only
once answered, so waiting for it waits for nothing), else as soon as the next arrival is not
expected within the batch's fixed overhead per member (waiting for one more is then slower
than running now), within a quarter of `latency_slo_s`. Batches never mix buckets.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter

from common.protocol import PRIORITY_BACKGROUND, PRIORITY_INTERACTIVE
from common.settings import Settings
from worker.encode.cost import Cost


@dataclass(frozen=True, slots=True)
class Waiting:
    """What the policy sees of one queued entry."""

    key: int  # the consumer's handle for the entry
    n_tokens: int
    arrived_s: float  # monotonic time the worker queued it
    priority: int
    # its place in the order batches take rows (worker.lane_shares.FairOrder: tenants'
    # shares, never negative); UNPLACED: its arrival
    order: float = -1.0

    def __post_init__(self) -> None:
        if self.order < 0:
            object.__setattr__(self, "order", self.arrived_s)


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch_size: int
    max_batch_tokens: int  # padded: batch size x longest member
    max_wait_s: float | None  # None = auto: wait only while it pays
    latency_slo_s: float = 0.1  # auto waits at most a quarter of it
    max_padding_ratio: float = 0.5  # padding share of a batch's tokens, before a cost model
    starvation_s: float = 0.1  # batch traffic passed over this long is served as interactive

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        wait = settings.max_wait_ms
        return cls(
            settings.max_batch_size,
            settings.max_batch_tokens,
            None if wait == "auto" else wait / 1000,
            settings.latency_slo_ms / 1000,
            settings.max_padding_ratio,
            settings.starvation_ms / 1000,
        )

    def with_overrides(self, overrides: Mapping[str, str], min_tokens: int) -> Limits:
        """These limits with live overrides (`max_batch_size`, `max_batch_tokens`,
        `max_wait_ms` — a number or `auto` — as strings, as an operator or `tune` wrote them).
        Raises ValueError naming the first bad value; unknown names are errors too."""
        size, tokens, wait_s = self.max_batch_size, self.max_batch_tokens, self.max_wait_s
        for name, raw in overrides.items():
            if name == "max_batch_size":
                size = int(raw)
            elif name == "max_batch_tokens":
                tokens = int(raw)
            elif name == "max_wait_ms":
                wait_s = None if raw == "auto" else float(raw) / 1000
            else:
                raise ValueError(f"unknown live batching setting {name!r}")
        if size < 1 or tokens < min_tokens or not (wait_s is None or wait_s >= 0):
            raise ValueError(
                f"live batching settings out of range: max_batch_size {size}, "
                f"max_batch_tokens {tokens} (at least {min_tokens}), max_wait_ms {raw_ms(wait_s)}"
            )
        return Limits(
            size, tokens, wait_s, self.latency_slo_s, self.max_padding_ratio, self.starvation_s
        )


def raw_ms(wait_s: float | None) -> str:
    return "auto" if wait_s is None else f"{wait_s * 1000:g}"


# Background rows and online traffic (issue 36): a background row may make an online batch
# at most FILL_SHARE slower; while online traffic came within ONLINE_LIVE_S, a batch of
# background rows alone costs at most a fifth of the latency target (or a quarter of the
# batch size before a cost model), so an online row arriving meanwhile waits little.
FILL_SHARE = 0.2
ONLINE_LIVE_S = 1.0
BACKGROUND_SLICE = 0.2


@dataclass(frozen=True, slots=True)
class Load:
    """What the worker has measured: its batch cost (per bucket where fitted, else over all
    batches), arrivals per second per bucket, and how many batches are computing now.

    Per bucket, because a forward's cost grows faster than its padded tokens (attention is
    quadratic in length): one line through short and long batches puts the overhead of a
    short batch at half of what it is, and the policy then splits short batches it should
    keep whole.
    """

    cost: Cost | None = None
    arrivals_per_s: Mapping[int, float] = field(default_factory=dict)
    computing: int = 0
    bucket_costs: Mapping[int, Cost] = field(default_factory=dict)
    online_idle_s: float = float("inf")  # since the last online (not background) row came

    @property
    def online_live(self) -> bool:
        return self.online_idle_s < ONLINE_LIVE_S

    def cost_for(self, bucket: int) -> Cost | None:
        return self.bucket_costs.get(bucket, self.cost)


@dataclass(frozen=True, slots=True)
class Batch:
    bucket: int
    keys: tuple[int, ...]
    padded_tokens: int
    real_tokens: int
    trigger: str  # size | tokens | split | priority | wait | alone (a redelivered row)
    background: bool = False  # built around a background row: no online row was queued


@dataclass(frozen=True, slots=True)
class Wait:
    until_s: float | None  # None: nothing queued, wait for arrivals


def _urgent(w: Waiting, now_s: float, limits: Limits) -> bool:
    """Interactive, or batch traffic passed over too long; background rows never are: they
    take only what online traffic leaves."""
    if w.priority == PRIORITY_BACKGROUND:
        return False
    return w.priority == PRIORITY_INTERACTIVE or now_s - w.arrived_s >= limits.starvation_s


# "arrival" is a row's place in the fair order: its arrival, unless tenants share the worker
_BY_LENGTH = attrgetter("n_tokens", "order")
_BY_ARRIVAL = attrgetter("order", "key")  # ties (rows of one entry): queue order


def in_order(queue: Sequence[Waiting]) -> list[Waiting]:
    """A queue in the order batches grow through it: by length, then arrival (stable, so rows
    that tie stay in the order they were queued)."""
    return sorted(queue, key=_BY_LENGTH)


def _anchor(queue: Sequence[Waiting], now_s: float, limits: Limits) -> Waiting:
    """Among online rows (background ones only when there are no others): the oldest urgent
    row, else the oldest. The oldest is urgent when it is interactive or starved, and when it
    is not starved none is, so then only priority makes one urgent (C-level scans: this runs
    once per batch over every queued row)."""
    online = [w for w in queue if w.priority != PRIORITY_BACKGROUND] or queue
    oldest = min(online, key=_BY_ARRIVAL)
    if _urgent(oldest, now_s, limits):
        return oldest
    interactive = [w for w in online if w.priority == PRIORITY_INTERACTIVE]
    return min(interactive, key=_BY_ARRIVAL) if interactive else oldest


def _fill(
    members: Sequence[Waiting], spare: Sequence[Waiting], limits: Limits, cost: Cost | None
) -> list[Waiting]:
    """An online batch topped up with background rows (`spare`, in length order) while it
    stays worth it and, under a cost model, at most FILL_SHARE slower than without them:
    first those no longer than its longest member (longest first: the least padding), then
    longer ones, shortest first. So a background row only ever fills a batch that online
    traffic leaves partial, and never pushes an online row out of it."""
    batch = list(members)
    size, longest = len(batch), max(w.n_tokens for w in batch)
    real = sum(w.n_tokens for w in batch)
    most_s = None if cost is None else cost.seconds(longest * size) * (1 + FILL_SHARE)
    cut = bisect_left(spare, longest + 1, key=attrgetter("n_tokens"))
    for w in [*reversed(spare[:cut]), *spare[cut:]]:
        if size >= limits.max_batch_size:
            break
        wider = max(longest, w.n_tokens)
        if wider * (size + 1) > limits.max_batch_tokens:
            continue
        if most_s is not None and cost is not None and cost.seconds(wider * (size + 1)) > most_s:
            continue
        worth = _worth(real + w.n_tokens, wider * (size + 1), cost, limits)
        current = _worth(real, longest * size, cost, limits)
        if not (worth >= current if cost is not None else worth > float("-inf")):
            continue
        batch.append(w)
        size, longest, real = size + 1, wider, real + w.n_tokens
    return batch


def _worth(real: int, padded: int, cost: Cost | None, limits: Limits) -> float:
    """How good a batch is: real tokens per second under the cost model, else minus padding
    share (the larger the better); -inf when the padding rule forbids it."""
    if cost is not None:
        return real / cost.seconds(padded)
    padding = 1 - real / padded
    return -padding if padding <= limits.max_padding_ratio else float("-inf")


def _take(
    ordered: Sequence[Waiting], anchor: Waiting, limits: Limits, cost: Cost | None
) -> tuple[Sequence[Waiting], str | None]:
    """Grow a batch from the anchor through its neighbours in length order (`ordered` is the
    bucket's queue in that order).

    Returns the members and what stopped the growth: "tokens" (padded budget), "split"
    (the next neighbour would make the batch worse), or None (size reached or queue empty).
    Runs once per batch: plain locals, no per-step objects.
    """
    at = bisect_left(ordered, _BY_LENGTH(anchor), key=_BY_LENGTH)
    while ordered[at] is not anchor:  # identity: rows of one entry tie on length and arrival
        at += 1
    lo = hi = at
    real = longest = anchor.n_tokens
    size, end = 1, len(ordered)
    budget = limits.max_batch_tokens
    while size < limits.max_batch_size:
        if lo == 0 and hi + 1 == end:
            return ordered[lo : hi + 1], None
        current = _worth(real, longest * size, cost, limits)
        best, best_worth, over_budget = -1, 0.0, False
        # shorter: the longest member stays; longer: it becomes the longest
        for index in (lo - 1, hi + 1):
            if index < 0 or index == end:
                continue
            padded = max(longest, ordered[index].n_tokens) * (size + 1)
            if padded > budget:
                over_budget = True
                continue
            worth = _worth(real + ordered[index].n_tokens, padded, cost, limits)
            # With a cost model, a member joins only if the batch gets no worse; without one,
            # while padding stays within the limit.
            acceptable = worth >= current if cost is not None else worth > float("-inf")
            if acceptable and (best < 0 or worth > best_worth):
                best, best_worth = index, worth
        if best < 0:
            return ordered[lo : hi + 1], "tokens" if over_budget else "split"
        joining = ordered[best].n_tokens
        real, longest, size = real + joining, max(longest, joining), size + 1
        lo, hi = min(lo, best), max(hi, best)
    return ordered[lo : hi + 1], None


def _auto_wait_until(
    queue: Sequence[Waiting], size: int, now_s: float, limits: Limits, load: Load, bucket: int
) -> float | None:
    """With auto wait: until when waiting for one more arrival pays, or None to run now.

    Running n entries now costs the fixed overhead once more than running them together with
    the next arrival, which is expected in 1/rate seconds: waiting pays only while that gap
    is shorter than the fixed overhead's share per member, and only while another batch
    computes. With nothing computing, the rate can mislead: a closed-loop client's gaps
    include the waits themselves, and an overhead fitted on loaded batches overstates an
    idle one's, so at 1 client every request would wait for an arrival that cannot come.
    """
    rate = load.arrivals_per_s.get(bucket, 0.0)
    cost = load.cost_for(bucket)
    if cost is None or rate <= 0 or load.computing == 0:
        return None
    gap_s = 1.0 / rate
    if gap_s >= cost.fixed_s / size:
        return None
    oldest = min(w.arrived_s for w in queue)
    limit_s = oldest + limits.latency_slo_s / 4
    until = min(now_s + gap_s, limit_s)
    return until if until > now_s else None


def next_batch(
    queues: Mapping[int, Sequence[Waiting]],
    now_s: float,
    limits: Limits,
    load: Load | None = None,
    ordered: bool = False,
) -> Batch | Wait:
    """Pick the ready bucket whose anchor is most urgent: interactive (or starved) first, then
    the one waiting longest. `ordered`: each queue is already in length order (`in_order`), as
    a worker keeps it, so a decision costs no sort of everything queued."""
    load = load or Load()
    best: tuple[tuple[int, float], Batch] | None = None
    wake: float | None = None
    for bucket, queue in queues.items():
        if not queue:
            continue
        anchor = _anchor(queue, now_s, limits)
        urgent = _urgent(anchor, now_s, limits)
        by_length = queue if ordered else in_order(queue)
        members, stopped = _members(by_length, anchor, limits, load, bucket)
        if len(members) == limits.max_batch_size:
            trigger = "size"
        elif stopped is not None:
            trigger = stopped
        elif urgent:
            trigger = "priority"
        else:
            waited, until = _wait_trigger(queue, len(members), now_s, limits, load, bucket)
            if waited is None:
                wake = until if wake is None else min(wake, until)
                continue
            trigger = waited
        batch = Batch(
            bucket=bucket,
            keys=tuple(w.key for w in sorted(members, key=_BY_ARRIVAL)),
            padded_tokens=max(w.n_tokens for w in members) * len(members),
            real_tokens=sum(w.n_tokens for w in members),
            trigger=trigger,
            background=anchor.priority == PRIORITY_BACKGROUND,
        )
        rank = (
            0 if urgent else 2 if anchor.priority == PRIORITY_BACKGROUND else 1,
            anchor.order,
        )
        if best is None or rank < best[0]:
            best = (rank, batch)
    return best[1] if best is not None else Wait(wake)


def _members(
    ordered: Sequence[Waiting], anchor: Waiting, limits: Limits, load: Load, bucket: int
) -> tuple[Sequence[Waiting], str | None]:
    """The batch around `anchor`: grown through online rows only when it is online and
    background rows are queued, then topped up with those (`_fill`); a batch of background
    rows alone is a slice while online traffic is live (`_slice`)."""
    cost = load.cost_for(bucket)
    if anchor.priority == PRIORITY_BACKGROUND:
        sliced = _slice(limits, load, cost)
        members, stopped = _take(ordered, anchor, sliced, cost)
        full = sliced is not limits and stopped is None and len(members) == sliced.max_batch_size
        return members, "size" if full else stopped  # a whole slice is a full batch
    if all(w.priority != PRIORITY_BACKGROUND for w in ordered):
        return _take(ordered, anchor, limits, cost)
    online = [w for w in ordered if w.priority != PRIORITY_BACKGROUND]
    members, stopped = _take(online, anchor, limits, cost)
    spare = [w for w in ordered if w.priority == PRIORITY_BACKGROUND]
    filled = _fill(members, spare, limits, cost)
    return filled, stopped


def _slice(limits: Limits, load: Load, cost: Cost | None) -> Limits:
    """The limits of a batch of background rows: whole while no online row came for
    ONLINE_LIVE_S, else cut to what computes within BACKGROUND_SLICE of the latency target
    (a quarter of the batch size before a cost model; one row at least)."""
    if not load.online_live:
        return limits
    if cost is None:
        size = max(1, limits.max_batch_size // 4)
        return replace(limits, max_batch_size=size)
    budget_s = limits.latency_slo_s * BACKGROUND_SLICE - cost.fixed_s
    tokens = int(budget_s / cost.per_token_s) if budget_s > 0 else 0
    return replace(limits, max_batch_tokens=max(1, min(limits.max_batch_tokens, tokens)))


def _wait_trigger(
    queue: Sequence[Waiting], size: int, now_s: float, limits: Limits, load: Load, bucket: int
) -> tuple[str | None, float]:
    """("wait", now) when the wait is over; (None, wake time) while it goes on."""
    oldest = min(w.arrived_s for w in queue)
    if limits.max_wait_s is not None:
        deadline = oldest + limits.max_wait_s
        return ("wait", now_s) if now_s >= deadline else (None, deadline)
    until = _auto_wait_until(queue, size, now_s, limits, load, bucket)
    # starvation promotes the oldest before long; wake for that at the latest
    return ("wait", now_s) if until is None else (None, min(until, oldest + limits.starvation_s))
