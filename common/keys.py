"""`Keys`: every Redis key name microbatch uses, in one place.

Layout (prefix `mb` by default, `{model}` is a Redis Cluster hash tag):
    mb:{model}:req:<bucket>    request entries, consumer group `workers`
    mb:{model}:aff:<worker>    prompts routed to the generation worker caching their prefix
    mb:{model}:load            hash: generation worker -> its load and last beat
    mb:{model}:dead            dead letters
    mb:{model}:workers         sorted set: consumer name -> last consume-loop beat (ms)
    mb:{model}:batching        hash: live batching overrides workers apply within a beat
    mb:{model}:cancel          sorted set: entry id -> until (ms) for requests nobody awaits
    mb:{model}:cold_start      ms from a worker's process start to its registration, last seen
    mb:reply:<gateway id>      replies for one gateway process
    mb:models                  hash: model name -> ModelInfo
    mb:gateways                sorted set: reply stream -> its gateway's last beat (ms)
    mb:tokenizer:<sha256>      a registered tokenizer's JSON
    mb:{file-…}:file           hash: a stored file's metadata (`files_store=redis`)
    mb:{file-…}:chunk:<n>      its bytes, a chunk per key
    mb:files:<owner>           sorted set: an owner's file ids by creation (ms)
    mb:{batch_…}:batch         hash: a batch's record
    mb:{batch_…}:done          hash: custom_id -> "o" (answered) or "e" (failed)
    mb:{batch_…}:results       hash: custom_id -> its output or error line
    mb:{batch_…}:lease         the gateway driving the batch, while it drives it
    mb:batches:<owner>         sorted set: an owner's batch ids by creation (ms)
    mb:batches:active          set: batches not yet finished, for any gateway to drive
    mb:{resp_…}:response       hash: a stored response (`/v1/responses`)
    mb:{resp_…}:events         a background response's chunks, as its worker wrote them
    mb:responses:active        sorted set: background responses not yet finished -> deadline
    mb:idem:<owner>:<digest>   an Idempotency-Key's attempt: running, or its kept answer

Every `{model}` key of one model shares a Redis Cluster hash slot (the braces are its hash
tag), so commands over a model's streams never cross slots; a file's keys and a batch's
keys likewise share one slot each. An owner is the digest of the API key that created the
object ("-" when keys are off).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str

    def request(self, model: str, bucket: int) -> str:
        return f"{self.prefix}:{{{model}}}:req:{bucket}"

    def affinity(self, model: str, worker: str, tenant: str | None = None) -> str:
        """A generation worker's own stream: prompts whose prefix it caches; with `tenant`,
        that tenant's such prompts, read in the tenant's lane (by its fair share)."""
        own = f"{self.prefix}:{{{model}}}:aff:{worker}"
        return own if tenant is None else f"{own}:t:{tenant}"

    def laned_affinity(self, model: str) -> str:
        """The generation workers that read a tenant's affinity stream in its lane (a
        release from before them reads only its own affinity stream, one queue for all)."""
        return f"{self.prefix}:{{{model}}}:aff-lanes"

    def load(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:load"

    def dead(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dead"

    def workers(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:workers"

    def wire(self, model: str) -> str:
        """Each worker's newest wire version it reads (none: a release from before this)."""
        return f"{self.prefix}:{{{model}}}:wire"

    def reply(self, gateway_id: str) -> str:
        return f"{self.prefix}:reply:{gateway_id}"

    @property
    def models(self) -> str:
        return f"{self.prefix}:models"

    def batching(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:batching"

    def cold_start(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:cold_start"

    def cancel(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:cancel"

    @property
    def gateways(self) -> str:
        """Sorted set: reply stream -> its gateway's last beat (ms; an hour back once it left)."""
        return f"{self.prefix}:gateways"

    def tokenizer(self, sha256: str) -> str:
        return f"{self.prefix}:tokenizer:{sha256}"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:{{{file_id}}}:file"

    def file_chunk(self, file_id: str, index: int) -> str:
        return f"{self.prefix}:{{{file_id}}}:chunk:{index}"

    def files(self, owner: str) -> str:
        return f"{self.prefix}:files:{owner}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:{{{batch_id}}}:batch"

    def batch_done(self, batch_id: str) -> str:
        return f"{self.prefix}:{{{batch_id}}}:done"

    def batch_results(self, batch_id: str) -> str:
        return f"{self.prefix}:{{{batch_id}}}:results"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.prefix}:{{{batch_id}}}:lease"

    def batches(self, owner: str) -> str:
        return f"{self.prefix}:batches:{owner}"

    @property
    def active_batches(self) -> str:
        return f"{self.prefix}:batches:active"

    def response(self, response_id: str) -> str:
        return f"{self.prefix}:{{{response_id}}}:response"

    def response_events(self, response_id: str) -> str:
        return f"{self.prefix}:{{{response_id}}}:events"

    @property
    def active_responses(self) -> str:
        return f"{self.prefix}:responses:active"

    def idempotency(self, owner: str, digest: str) -> str:
        return f"{self.prefix}:idem:{owner}:{digest}"

    def quota(self, tenant: str, what: str) -> str:
        """A tenant's pace for one quota (`requests` or `tokens`): one hash slot per tenant,
        so one script checks both."""
        return f"{self.prefix}:{{tenant:{tenant}}}:quota:{what}"

    def backlog(self, tenant: str, model: str) -> str:
        """The requests a tenant has queued for a model, by deadline (a zset; `:tokens`
        beside it holds each one's tokens): its `max_queued_tokens`, in its hash slot."""
        return f"{self.prefix}:{{tenant:{tenant}}}:backlog:{model}"

    def lane(self, model: str, bucket: int, tenant: str) -> str:
        """A tenant's own request stream for one bucket: workers read a model's lanes by the
        tenants' fair shares, not in the order requests came."""
        return f"{self.prefix}:{{{model}}}:req:{bucket}:t:{tenant}"

    def lanes(self, model: str) -> str:
        """The tenants with lanes for a model, each with its weight (a hash)."""
        return f"{self.prefix}:{{{model}}}:lanes"

    def lane_news(self, model: str) -> str:
        """A stream a gateway writes to when it starts a lane: it wakes an idle worker to
        look at the registry now, not after its blocking read and its next refresh."""
        return f"{self.prefix}:{{{model}}}:lanes:new"
