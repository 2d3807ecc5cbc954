"""Writes tests/wire/v5/*.msgpack: one message of every kind as wire version 5 writes it.

`python -m tests.wire.write_fixtures`, with the frozen copy of that release's codec
(`tests/wire/v5/protocol_v5.py`): the bytes a process of the previous release sends, which
`tests/unit/test_wire_versions.py` reads. Every optional field is set off its default, so a
reader that drops or misreads one is caught.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.wire.v5 import protocol_v5 as p

HERE = Path(__file__).resolve().parent


def messages() -> dict[str, p.Message]:
    tokens = p.pack_tokens([101, 7592, 102])
    return {
        "req": p.RequestEntry(
            id="g1.0", request_id="r1", model="m", kind="embed", tokens=tokens,
            lengths=np.array([3], "<u4").tobytes(), deadline_ms=2_000_000_000_000, priority=0,
            reply_to="mb:reply:old", enqueued_ms=1_999_999_999_000,
        ),
        "genreq": p.GenerateEntry(
            id="g2.0", request_id="r2", model="lm", tokens=tokens, deadline_ms=2_000_000_000_000,
            priority=1, reply_to="mb:reply:old", enqueued_ms=1_999_999_999_000, max_tokens=8,
            temperature=0.5, top_p=0.9, seed=7, stop=["\n"], stream=True, presence_penalty=0.1,
            frequency_penalty=0.2, repetition_penalty=1.1,
            bias_tokens=p.pack_tokens([5]), bias_values=np.array([1.5], "<f4").tobytes(),
            min_tokens=1, stop_token_ids=p.pack_tokens([2]), ignore_eos=True, top_k=4,
            min_p=0.05, n=2, logprobs=1, prompt_logprobs=0, response_format="json_schema",
            json_schema='{"type": "object"}',
        ),
        "gen": p.GenerationChunk(
            id="g2.0", attempt="w:1-0:0", index=0, text="hi", tokens=p.pack_tokens([9]),
            finish_reason="length", prompt_tokens=3, completion_tokens=1, cached_tokens=0,
            queue_ms=1.5, worker="w", choice=1, logprobs=np.array([-0.5], "<f4").tobytes(),
            top_ids=p.pack_tokens([9]), top_logprobs=np.array([-0.5], "<f4").tobytes(),
            prompt_logprobs=np.array([np.nan, -1, -2], "<f4").tobytes(),
            prompt_top_ids=b"", prompt_top_logprobs=b"",
        ),
        "emb": p.EmbeddingResult(
            id="g1.0", embeddings=np.array([[0.5, -0.5]], "<f4").tobytes(), rows=1, n_tokens=3,
            batch_ids=["w:1"], batch_size=1, bucket=128, queue_ms=0.5, compute_ms=2.0,
            worker="w",
        ),
        "err": p.ErrorReply(
            id="g1.0", status=503, type="service_unavailable", code="overloaded", message="x",
            worker="w",
        ),
        "dead": p.DeadLetter(
            stream="mb:{m}:req:128", entry_id="1-0", reason="r", deliveries=4, payload=b"\x01",
            worker="w",
        ),
        "model": p.ModelInfo(
            name="m", kind="classifier", dim=2, max_tokens=512, vocab_size=30522,
            tokenizer_sha256="ab" * 32, chat_template="{{ x }}", bos_token="<s>",
            eos_token="</s>", aliases=["m2"], fingerprint="f", labels=["a", "b"],
            activation="softmax", normalized=True, matryoshka=True, matryoshka_dims=[1, 2],
            prompts={"query": "q: "}, default_prompt="query",
        ),
    }  # fmt: skip


def main() -> None:
    folder = HERE / f"v{p.VERSION}"
    folder.mkdir(exist_ok=True)
    for tag, message in messages().items():
        (folder / f"{tag}.msgpack").write_bytes(p.encode(message))
    print(f"wrote {len(messages())} messages of wire version {p.VERSION} to {folder}")


if __name__ == "__main__":
    main()
