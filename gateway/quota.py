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
# A gateway leases units ahead, spent without asking Redis for LEASE_S, where the burst is
# large enough for it to matter (a small quota is checked every time, exactly). A lease is
# sized to what this gateway used of its last one (`lease_size`), at most a quarter burst;
# what it left unspent is handed back with its next charge (a gateway that stops sending
# leaves it charged: the fleet only ever admits less).
LEASE_SHARE = 4
LEASE_MIN_BURST = 64
LEASE_S = 1.0
LEASE_FIRST = 8  # a first lease holds this many of the request's own cost
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
    def lease_cap(self) -> int:
        """The most units a gateway takes ahead of a request, to spend on the next ones
        locally (0: a small quota, checked every time)."""
        return self.burst // LEASE_SHARE if self.burst >= LEASE_MIN_BURST else 0

    def args(self, lease: int = 0, handed_back: int = 0) -> list[float]:
        """What the charge script takes of this pace: with `lease` units ahead, and
        `handed_back` units of an earlier lease returned first."""
        return [self.interval_us, self.burst, self.cost, lease, handed_back]


def lease_size(pace: Pace, used: int) -> int:
    """Units to lease ahead with a charge: twice what the last lease saw used (`used`: all
    of it when it ran out, so a lease spent too soon doubles), at least `LEASE_FIRST`
    requests' worth, at most a quarter burst. Sized to this gateway's own rate, a lease
    does not hold quota that no request here will use: a quarter burst leased each second
    by a gateway whose requests used a fortieth of it spent the tenant's pace 40 times
    faster than they did, and left its remaining-headers near zero."""
    cap = pace.lease_cap
    return min(cap, max(LEASE_FIRST * max(1, pace.cost), 2 * used)) if cap else 0


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

    requests: int  # left to spend
    tokens: int
    until_s: float
    headers: RawHeaders
    leased: tuple[int, int]  # what was leased of each pace (0: unmetered)
    per_minute: tuple[int | None, int | None]  # the paces it was leased of

    @classmethod
    def of(
        cls,
        headers: RawHeaders,
        requests: Pace,
        tokens: Pace,
        now_s: float,
        leases: tuple[int, int],
    ) -> Allowance:
        def left(pace: Pace, lease: int) -> int:
            return UNMETERED if pace.per_minute is None else lease

        return cls(
            left(requests, leases[0]),
            left(tokens, leases[1]),
            now_s + LEASE_S,
            headers,
            leases,
            (requests.per_minute, tokens.per_minute),
        )

    def take(self, requests: int, tokens: int, now_s: float) -> bool:
        """Spend these if the lease still holds them."""
        if now_s >= self.until_s or requests > self.requests or tokens > self.tokens:
            return False
        self.requests -= requests
        self.tokens -= tokens
        return True

    def used(self) -> tuple[int, int]:
        """What was spent of each pace's lease."""
        return (self.leased[0] - self._left(0), self.leased[1] - self._left(1))

    def unspent(self, requests: Pace, tokens: Pace) -> tuple[int, int]:
        """What to hand back of each pace: its lease's rest, where the pace is still the one
        leased from (a tenants file changed since: nothing, which only admits less)."""
        paces = (requests.per_minute, tokens.per_minute)

        def rest(i: int) -> int:
            same = paces[i] is not None and paces[i] == self.per_minute[i]
            return self._left(i) if same else 0

        return rest(0), rest(1)

    def merged(self, newer: Allowance) -> Allowance:
        """Two leases a gateway took at once (its requests raced to Redis), as one: neither
        is dropped unspent. The newer one's standing and expiry."""
        if newer.per_minute != self.per_minute:
            return newer
        return Allowance(
            _plus(self.requests, newer.requests),
            _plus(self.tokens, newer.tokens),
            max(self.until_s, newer.until_s),
            newer.headers,
            (self.leased[0] + newer.leased[0], self.leased[1] + newer.leased[1]),
            newer.per_minute,
        )

    def _left(self, pace: int) -> int:
        left = self.requests if pace == 0 else self.tokens
        return 0 if left >= UNMETERED // 2 else left


def _plus(a: int, b: int) -> int:
    return UNMETERED if max(a, b) >= UNMETERED // 2 else a + b


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
