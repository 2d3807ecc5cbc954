"""Admission: a pure decision on whether a request may be queued, from plain numbers."""

from __future__ import annotations

from dataclasses import dataclass

MAX_RETRY_AFTER_S = 60.0
# The share of a deadline the queue ahead may take. The rest pays for the request's own batch
# and reply, and keeps admitted entries from expiring in the queue: a worker skips those at
# read speed, which would make the measured rate look higher than the work it does.
QUEUE_SHARE_OF_DEADLINE = 0.8


@dataclass(frozen=True, slots=True)
class QueueState:
    depth: int  # rows waiting or in progress for the model, as last measured
    live_workers: int
    # Rows/s the model's workers take off its streams, measured under a backlog; None
    # while nothing trustworthy has been measured (no backlog, or a store that cannot say).
    service_rate_per_s: float | None = None
    # With no live worker: how long one takes to start (measured, else the operator's
    # `cold_start_ms`); None: unknown, and such a request is refused.
    cold_start_ms: int | None = None

    def __post_init__(self) -> None:
        if self.service_rate_per_s is not None and self.service_rate_per_s <= 0:
            raise ValueError("a measured service rate is positive; report None when unknown")


class PerModelMean:
    """A moving mean of one ratio per model, over this gateway's recent requests.

    Redis counts entries (XLEN, entries read) while admission counts rows (an embedding
    request's inputs travel several to an entry) and, for generation, tokens (a sequence
    costs its prompt plus its `max_tokens`); the gateway converts with what it sent: rows
    per entry, tokens per sequence.
    """

    WEIGHT = 0.05  # of each request in the moving mean

    def __init__(self, default: float | None) -> None:
        self._mean: dict[str, float] = {}
        self._default = default

    def observe(self, model: str, amount: float, count: int) -> float | None:
        """Fold `amount` over `count` in; the model's mean now."""
        if count:
            mean = self._mean.get(model, amount / count)
            self._mean[model] = mean + self.WEIGHT * (amount / count - mean)
        return self.of(model)

    def of(self, model: str) -> float | None:
        return self._mean.get(model, self._default)


@dataclass(frozen=True, slots=True)
class TokenAsk:
    """What a generation request adds in tokens, against the model's token budget."""

    tokens: int  # prompt + max_tokens over every sequence it starts
    tokens_per_row: float  # the backlog's tokens per sequence (a `PerModelMean`)
    max_queued_tokens: int


@dataclass(frozen=True, slots=True)
class Admitted:
    pass


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str  # the `rejected_total{reason}` label
    message: str
    retry_after_s: float
    code: str = "overloaded"  # the error body's `code`, which clients branch on


def admit(
    state: QueueState,
    n_inputs: int,
    max_queue_depth: int,
    timeout_ms: int | None = None,
    tokens: TokenAsk | None = None,
) -> Admitted | Rejected:
    """Refuse fast, with a retry hint, rather than queue work that will only time out. Rows
    bound every model's queue; a generation model's is bounded in tokens too, since one
    sequence may cost a 4-token prompt or a whole context."""
    if state.live_workers == 0:
        cold = state.cold_start_ms
        if cold is None or timeout_ms is None or cold > QUEUE_SHARE_OF_DEADLINE * timeout_ms:
            return _no_workers(cold, timeout_ms)
        # else queued durably below: the queue's lag wakes a worker (scale from zero)
    if state.depth + n_inputs > max_queue_depth:
        message = (
            f"queue for this model holds {state.depth} inputs; adding {n_inputs} would exceed "
            f"max_queue_depth {max_queue_depth}"
        )
        return Rejected("queue_full", message, 1.0)
    if tokens is not None:
        backlog = round(state.depth * tokens.tokens_per_row)
        if backlog + tokens.tokens > tokens.max_queued_tokens:
            message = (
                f"queue for this model holds about {backlog} tokens (prompts + max_tokens); "
                f"adding {tokens.tokens} would exceed max_queued_tokens "
                f"{tokens.max_queued_tokens}"
            )
            return Rejected("queue_full", message, 1.0)
    if timeout_ms is not None and state.service_rate_per_s is not None:
        return _feasible(state.depth, n_inputs, state.service_rate_per_s, timeout_ms)
    return Admitted()


def _no_workers(cold_start_ms: int | None, timeout_ms: int | None) -> Rejected:
    """Refused at once: no worker, and none can start within this request's deadline."""
    if cold_start_ms is None:
        message = "no live worker serves this model right now"
        return Rejected("no_workers", message, 1.0, code="no_workers")  # not "queue full"
    message = (
        f"no live worker serves this model right now, and one takes about {cold_start_ms} ms "
        f"to start: more than this request's {timeout_ms} ms deadline allows"
    )
    retry_after_s = min(MAX_RETRY_AFTER_S, max(1.0, cold_start_ms / 1000))
    return Rejected("no_workers", message, retry_after_s, code="no_workers")


def _feasible(depth: int, n_inputs: int, rate_per_s: float, timeout_ms: int) -> Admitted | Rejected:
    """Admit only if the backlog ahead, at the measured rate, drains well before the deadline.

    A request queued behind more work than its deadline allows would only die in the queue
    (a 504 after the full wait, and an entry the worker must still skip); refusing it now
    gives the client the answer and a retry hint while it can still act on them.
    """
    wait_s = (depth + n_inputs) / rate_per_s
    allowed_s = QUEUE_SHARE_OF_DEADLINE * timeout_ms / 1000
    if wait_s <= allowed_s:
        return Admitted()
    excess_s = wait_s - allowed_s  # how long until enough of the backlog has drained
    message = (
        f"queue for this model holds {depth} inputs, served at {rate_per_s:.1f} inputs/s: "
        f"about {wait_s:.1f} s of waiting, more than this request's {timeout_ms} ms deadline "
        f"allows"
    )
    retry_after_s = min(MAX_RETRY_AFTER_S, max(1.0, excess_s))
    return Rejected("deadline_infeasible", message, retry_after_s, code="deadline_infeasible")


def tenant_backlog(tenant: str, queued: int, tokens: int, cap: int) -> Rejected | None:
    """A tenant's own cap on a model's backlog (`max_queued_tokens` in the tenants file):
    the tokens (prompts + max_tokens) it has `queued` there, plus this request's. One tenant
    cannot hold the whole queue; the model's own `max_queued_tokens` bounds everyone's."""
    if queued + tokens <= cap:
        return None
    message = (
        f"tenant {tenant!r} has {queued} tokens (prompts + max_tokens) queued for this "
        f"model; adding {tokens} would exceed its max_queued_tokens {cap}"
    )
    return Rejected("tenant_queue_full", message, 1.0, code="tenant_queue_full")
