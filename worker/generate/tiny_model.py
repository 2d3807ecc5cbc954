"""`write_tiny_model`: a small random-weight Llama causal LM, written the Hugging Face way.

Generation is tried and tested offline with it: a standard architecture (LlamaForCausalLM),
safetensors weights, a byte-level BPE tokenizer trained on a corpus derived from a fixed seed,
a chat template, all from one seed, so two builds are identical. Nothing here is special to
microbatch: the folder loads with `AutoModelForCausalLM.from_pretrained` like any other.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "be",
    "da",
    "fe",
    "gi",
    "ho",
    "ju",
    "ke",
    "la",
    "me",
    "ni",
    "po",
    "qu",
    "re",
    "si",
    "tu",
    "va",
    "we",
    "xi",
    "ya",
    "zo",
    "an",
    "el",
    "in",
    "on",
    "un",
    "ar",
    "er",
    "ir",
    "or",
    "ur",
    "ch",
    "sh",
    "th",
    "ph",
    "st",
    "tr",
    "pl",
    "gr",
    "br",
    "cr",
]
_EXTRA = ["é", "ü", "ß", "ñ", "ø", "€", "✓", "→", "日本", "语", "한", "🙂", "😀"]


@dataclass(frozen=True, slots=True)
class TinyShape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab_size: int = 512
    max_positions: int = 1024


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-text: words of syllables, some punctuation and non-ASCII."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 14)):
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.05:
                word += rng.choice(_EXTRA)
            words.append(word)
        out.append(" ".join(words) + rng.choice(".,!?;:"))
    return out


def build_tokenizer(vocab_size: int, seed: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    # A corpus this small cannot fill a large vocabulary with merges; reserved tokens make up
    # the rest so ids and the model's vocabulary agree (a real model's vocab has them too).
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)]
        )
    return tokenizer


def write_tiny_model(path: Path, shape: TinyShape = TinyShape(), seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and generation config into `path`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size, seed)
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id(SPECIAL_TOKENS[0])
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    # A wider init than the default 0.02 gives logits with real spread, so greedy decoding
    # has clear winners instead of near-ties decided by rounding.
    config.initializer_range = 0.2
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": shape.max_positions,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[0]}, indent=2)
    )
    return path
