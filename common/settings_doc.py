"""The settings reference table of docs/settings.md, rendered from `Settings` so it cannot drift.

Written by hand, the table fell behind the code: new fields went undocumented, defaults went
stale. So each row is rendered from the field itself: its meaning is the field's pydantic
`description` (common/settings.py), its default the real default (or a friendlier
`json_schema_extra={"default_doc": ...}` where the literal says less), and its section is
named in `SECTIONS` below, which keeps the docs' order. tests/unit/test_settings_doc.py fails
when docs/settings.md differs; `python -m common.settings_doc` rewrites it in place.
"""

from __future__ import annotations

from pathlib import Path

from pydantic.fields import FieldInfo

from common.settings import Settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
HEADING = "## Reference"
HEADER = ("| setting | default | meaning |", "|---|---|---|")

# Every field of `Settings` in exactly one section, in the order the table shows them.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Redis": ("redis_url", "redis_cluster", "prefix", "redis_socket_timeout_s", "read_block_ms"),
    "Gateway": (
        "host",
        "port",
        "admin_port",
        "public_docs",
        "api_keys",
        "tenants",
        "quota_on_redis_error",
        "tool_call_parser",
        "interactive_api_keys",
        "allow_unauthenticated",
        "rate_limit_per_key",
        "rate_limit_burst",
        "request_timeout_ms",
        "max_request_timeout_ms",
        "drain_timeout_s",
        "max_sequences_per_request",
        "max_tokens_per_request",
        "max_scored_prompt_tokens",
        "max_queue_depth",
        "cold_start_ms",
        "max_queued_tokens",
        "max_body_bytes",
        "max_inputs_per_request",
        "max_entry_rows",
        "inline_tokenize_chars",
        "reply_maxlen",
        "gateway_id",
        "processes",
    ),
    "Files, batches and responses": (
        "files_store",
        "files_dir",
        "files_s3_bucket",
        "files_s3_prefix",
        "files_s3_endpoint_url",
        "max_file_bytes",
        "max_batch_lines",
        "batch_window",
        "batch_queue_depth",
        "batch_lease_ms",
        "batch_output_ttl_s",
        "idempotency_ttl_s",
        "response_ttl_s",
        "response_events_ttl_s",
        "max_stored_response_bytes",
    ),
    "Worker: model and batching": (
        "model",
        "served_model_name",
        "matryoshka",
        "default_prompt_name",
        "buckets",
        "max_batch_size",
        "max_batch_tokens",
        "max_wait_ms",
        "latency_slo_ms",
        "max_padding_ratio",
        "starvation_ms",
        "sort_window",
    ),
    "Worker: compute": (
        "device",
        "compute_streams",
        "torch_threads",
        "backend",
        "torchscript",
        "dtype",
        "onnx_cache_dir",
        "quantize",
    ),
    "Worker: generation": (
        "engine",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_running_seqs",
        "max_step_tokens",
        "kv_cache_tokens",
        "kv_block_size",
        "prefix_caching",
        "chunked_prefill",
        "kv_cache_dtype",
        "cache_aware_routing",
        "affinity_max_imbalance",
        "cancel_poll_ms",
    ),
    "Worker: recovery and liveness": (
        "claim_idle_ms",
        "max_deliveries",
        "dead_letter_max_age_s",
        "max_batch_ms",
        "heartbeat_interval_ms",
        "worker_stale_ms",
        "gateway_stale_ms",
        "worker_id",
        "metrics_port",
        "profile_dir",
    ),
    "The `noop` model": ("noop_dim", "noop_compute_ms"),
    "Logging": ("log_level", "log_format"),
}


def problems() -> list[str]:
    """What keeps the table from covering `Settings`: fields without a section or a
    description, names that are no field, names in two sections."""
    fields = Settings.model_fields
    placed = [name for names in SECTIONS.values() for name in names]
    found = [f"{n}: no section in common/settings_doc.py" for n in fields if n not in placed]
    found += [f"{n}: not a Settings field" for n in placed if n not in fields]
    found += [f"{n}: in two sections" for n in sorted({n for n in placed if placed.count(n) > 1})]
    found += [f"{n}: no description" for n, f in fields.items() if not (f.description or "")]
    return found


def render_default(field: FieldInfo) -> str:
    """`none`, `empty`, or the default in backticks (`true`, `128,256,512`, `5` for 5.0)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "default_doc" in extra:
        return str(extra["default_doc"])
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, list | tuple):
        return f"`{','.join(map(str, value))}`" if value else "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def reference_table() -> str:
    """The whole markdown table, one row per field under bold section rows."""
    if found := problems():
        raise ValueError("settings reference incomplete: " + "; ".join(found))
    fields = Settings.model_fields
    lines = list(HEADER)
    for section, names in SECTIONS.items():
        lines.append(f"| **{section}** | | |")
        for name in names:
            meaning = str(fields[name].description).replace("|", "\\|")
            lines.append(f"| `{name}` | {render_default(fields[name])} | {meaning} |")
    return "\n".join(lines) + "\n"


def _table_span(lines: list[str]) -> tuple[int, int]:
    """Start and end (exclusive) of the table under the Reference heading."""
    try:
        start = lines.index(HEADING + "\n")
    except ValueError:
        raise ValueError(f"no {HEADING!r} heading") from None
    for first in range(start + 1, len(lines)):
        if lines[first].startswith("#"):
            break
        if lines[first].startswith("|"):
            end = first
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            return first, end
    raise ValueError(f"no table under {HEADING!r}")


def table_in(markdown: str) -> str:
    """The Reference table as the markdown has it now."""
    lines = markdown.splitlines(keepends=True)
    start, end = _table_span(lines)
    return "".join(lines[start:end])


def update(markdown: str) -> str:
    """The markdown with its Reference table replaced by the one the code renders."""
    lines = markdown.splitlines(keepends=True)
    start, end = _table_span(lines)
    return "".join([*lines[:start], reference_table(), *lines[end:]])


if __name__ == "__main__":
    text = DOC.read_text(encoding="utf-8")
    new = update(text)
    if new != text:
        DOC.write_text(new, encoding="utf-8")
    print(f"{DOC}: {'rewritten' if new != text else 'already up to date'}")
