"""`Keys`: every Redis key name microbatch uses, in one place.

Layout (prefix `mb` by default, `{model}` is a Redis Cluster hash tag):
    mb:{model}:req:<bucket>    request entries, consumer group `workers`
    mb:{model}:aff:<worker>    prompts routed to the generation worker caching their prefix
    mb:{model}:load            hash: generation worker -> its load and last beat
    mb:{model}:dead            dead letters
    mb:{model}:workers         sorted set: consumer name -> last consume-loop beat (ms)
    mb:{model}:batching        hash: live batching overrides workers apply within a beat
    mb:{model}:cancel          sorted set: entry id -> until (ms) for requests nobody awaits
    mb:reply:<gateway id>      replies for one gateway process
    mb:models                  hash: model name -> ModelInfo
    mb:gateways                sorted set: reply stream -> its gateway's last beat (ms)
    mb:tokenizer:<sha256>      a registered tokenizer's JSON

Every `{model}` key of one model shares a Redis Cluster hash slot (the braces are its hash
tag), so commands over a model's streams never cross slots.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str

    def request(self, model: str, bucket: int) -> str:
        return f"{self.prefix}:{{{model}}}:req:{bucket}"

    def affinity(self, model: str, worker: str) -> str:
        """A generation worker's own stream: prompts whose prefix it caches."""
        return f"{self.prefix}:{{{model}}}:aff:{worker}"

    def load(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:load"

    def dead(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dead"

    def workers(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:workers"

    def reply(self, gateway_id: str) -> str:
        return f"{self.prefix}:reply:{gateway_id}"

    @property
    def models(self) -> str:
        return f"{self.prefix}:models"

    def batching(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:batching"

    def cancel(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:cancel"

    @property
    def gateways(self) -> str:
        """Sorted set: reply stream -> its gateway's last beat (ms; an hour back once it left)."""
        return f"{self.prefix}:gateways"

    def tokenizer(self, sha256: str) -> str:
        return f"{self.prefix}:tokenizer:{sha256}"
