"""A tenant's per-minute quotas as paces (GCRA), and what a client is told about them.

A quota of Q per minute is a pace: one unit every 60/Q seconds, with a burst of Q/20 units
ahead of it. The pace (its theoretical arrival time, TAT) lives in Redis, so every gateway
charges the same one (`gateway.quota_store`); this module holds the numbers the script is
given and the headers it answers with. Pure: no I/O, no clock.

Why a twentieth: a bucket that starts full admits Q + burst in its first minute and Q in
every minute after, so any one-minute window stays within 5% of the quota (the issue's
bound), and a two-minute run within 2.5%. A single request larger than the burst passes
only on a rested pace (nothing charged ahead of now); one larger than the whole quota can
never pass and is a 400, not a 429 a client would retry forever.
"""

from __future__ import annotations

from dataclasses import dataclass

MINUTE_US = 60_000_000
BURST_SHARE = 20  # the burst is 1/BURST_SHARE of the per-minute quota
# A gateway leases a quarter of a burst ahead, spent without asking Redis, where the burst is
# large enough for it to matter (a small quota is checked every time, exactly); a lease not
# spent within LEASE_S is dropped, never handed back: the fleet only ever admits less.
LEASE_SHARE = 4
LEASE_MIN_BURST = 64
LEASE_S = 1.0
UNMETERED = 1 << 62  # what a gateway may spend of a pace a tenant does not have

RawHeaders = tuple[tuple[bytes, bytes], ...]  # lower-case names, latin-1: as Starlette holds them


@dataclass(frozen=True, slots=True)
class Pace:
    """One per-minute quota (None: unlimited) and what a request costs against it."""

    per_minute: int | None
    cost: int

    @property
    def interval_us(self) -> float:
        """Microseconds per unit (a fraction for a quota over 60M a minute); 0 when
        unlimited (the script then skips it)."""
        return 0 if self.per_minute is None else MINUTE_US / self.per_minute

    @property
    def burst(self) -> int:
        return 0 if self.per_minute is None else max(1, self.per_minute // BURST_SHARE)

    @property
    def lease(self) -> int:
        """Units a gateway takes ahead of this request, to spend on the next ones locally."""
        return self.burst // LEASE_SHARE if self.burst >= LEASE_MIN_BURST else 0

    def args(self) -> list[float]:
        return [self.interval_us, self.burst, self.cost, self.lease]


@dataclass(frozen=True, slots=True)
class Standing:
    """One pace after a check: what may still be used this minute, and when it is whole."""

    limit: int
    remaining: int
    reset_us: int  # until the pace is rested again (nothing charged ahead of now)


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    retry_after_us: int  # 0 when admitted
    requests: Standing | None  # None: no requests quota
    tokens: Standing | None
    refused_by: str = ""  # "requests" or "tokens" when refused
    leased: bool = False  # each pace's lease was charged too, to spend locally

    @classmethod
    def of(cls, reply: list[int], requests: Pace, tokens: Pace) -> Verdict:
        """The script's reply: [admitted, retry_after_us, refused_by (1 requests, 2 tokens),
        leased, remaining and reset per pace]."""
        admitted, retry, refused, leased, r_left, r_reset, t_left, t_reset = (int(x) for x in reply)

        def standing(pace: Pace, left: int, reset: int) -> Standing | None:
            if pace.per_minute is None:
                return None
            return Standing(pace.per_minute, max(0, left), max(0, reset))

        return cls(
            bool(admitted),
            max(0, retry),
            standing(requests, r_left, r_reset),
            standing(tokens, t_left, t_reset),
            {1: "requests", 2: "tokens"}.get(refused, ""),
            bool(leased),
        )

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers (and, when refused, `Retry-After` and the
        `retry-after-ms` the `openai` client prefers): per quota the tenant has."""
        out: dict[str, str] = {}
        for name, standing in (("requests", self.requests), ("tokens", self.tokens)):
            if standing is not None:
                out[f"x-ratelimit-limit-{name}"] = str(standing.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(standing.remaining)
                out[f"x-ratelimit-reset-{name}"] = go_duration(standing.reset_us)
        if not self.admitted:
            out["retry-after-ms"] = str(max(1, -(-self.retry_after_us // 1000)))
            out["Retry-After"] = str(max(1, -(-self.retry_after_us // 1_000_000)))
        return out

    def raw_headers(self) -> RawHeaders:
        """`headers()` encoded as a response holds them, once for every answer they go on."""
        return encoded(self.headers())


@dataclass(slots=True)
class Allowance:
    """What a gateway leased ahead from a tenant's paces, spent without asking Redis until
    `until_s`; answers carry the standing Redis gave with it (`headers`)."""

    requests: int
    tokens: int
    until_s: float
    headers: RawHeaders

    @classmethod
    def of(cls, headers: RawHeaders, requests: Pace, tokens: Pace, now_s: float) -> Allowance:
        def left(pace: Pace) -> int:
            return UNMETERED if pace.per_minute is None else pace.lease

        return cls(left(requests), left(tokens), now_s + LEASE_S, headers)

    def take(self, requests: int, tokens: int, now_s: float) -> bool:
        """Spend these if the lease still holds them."""
        if now_s >= self.until_s or requests > self.requests or tokens > self.tokens:
            return False
        self.requests -= requests
        self.tokens -= tokens
        return True


def encoded(headers: dict[str, str]) -> RawHeaders:
    return tuple((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())


def go_duration(us: int) -> str:
    """A duration as OpenAI writes its reset headers (Go's format): `20ms`, `1.5s`, `6m0s`."""
    if us < 1_000_000:
        return f"{max(0, us) // 1000}ms"
    seconds = us / 1_000_000
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


def too_large(tokens: Pace) -> str | None:
    """Why a request can never pass its tokens quota, or None when it can."""
    if tokens.per_minute is None or tokens.cost <= tokens.per_minute:
        return None
    return (
        f"this request costs {tokens.cost} tokens (prompt + max_tokens over every sequence), "
        f"more than its tenant's tokens_per_minute of {tokens.per_minute}: lower max_tokens "
        "or split the request"
    )
