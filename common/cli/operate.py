"""Operator commands: `status`, `bench`, `tune`, `tiny-model` — they watch and load a running
system; `register` adds them to the one typer app. Tables are drawn by `render`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from common.cli.options import EXTRA, settings_from_context
from common.cli.render import status_table, summary_table, tenants_table

RedisUrl = Annotated[str | None, typer.Option(help="redis:// or rediss:// URL")]
Url = Annotated[str, typer.Option(help="Gateway base URL")]
Workload = Annotated[str, typer.Option(help="short | mixed | long | a file with one text per line")]


async def run_load(
    url: str,
    bodies: list[dict],
    *,
    clients: int,
    rate: float,
    duration_s: float,
    metrics_url: str,
    show_progress: bool,
) -> tuple[list, dict]:
    """One measured run: closed loop with `clients`, or open loop when `rate` > 0."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from common.cli import loadgen

    before = loadgen.padding_from_metrics(await loadgen.metrics_page(metrics_url))
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[done]} answers"),
        TimeElapsedColumn(),
        disable=not show_progress,
        transient=True,
    ) as progress:
        task = progress.add_task("load", total=duration_s, done=0)
        started = time.perf_counter()
        count = 0

        def on_sample(_sample: Any) -> None:
            nonlocal count
            count += 1
            progress.update(task, completed=time.perf_counter() - started, done=count)

        if rate > 0:
            samples, elapsed = await loadgen.open_loop(
                url, bodies, rate=rate, duration_s=duration_s, on_sample=on_sample
            )
        else:
            samples, elapsed = await loadgen.closed_loop(
                url, bodies, clients=clients, duration_s=duration_s, on_sample=on_sample
            )
    after = loadgen.padding_from_metrics(await loadgen.metrics_page(metrics_url))
    summary = loadgen.summarize(samples, elapsed)
    runs = after[1] - before[1]
    summary["padding_ratio"] = (after[0] - before[0]) / runs if runs > 0 else None
    return samples, summary


def status(
    ctx: typer.Context,
    redis_url: RedisUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts")] = False,
    watch: Annotated[float, typer.Option(help="Refresh every N seconds (0 = once)")] = 0.0,
    tenants: Annotated[
        bool, typer.Option("--tenants", help="Also each tenant's lane: what it has queued")
    ] = False,
) -> None:
    """Queue depth, lag, pending, oldest age, dead letters per model and bucket; workers;
    with --tenants, what each tenant's lane holds."""
    from redis.exceptions import RedisError
    from rich.console import Console

    from common.status import collect, to_json
    from common.store import close_store, open_store

    settings = settings_from_context(ctx, redis_url=redis_url)
    if settings.embedded:
        raise typer.BadParameter("status needs --redis-url (or MICROBATCH_REDIS_URL)")

    async def snapshot() -> list:
        store = open_store(settings)
        try:
            return await collect(store, settings.prefix, settings.buckets, settings.worker_stale_ms)
        finally:
            await close_store(store)

    console = Console(width=140)
    while True:
        try:
            models = asyncio.run(snapshot())
        except RedisError as exc:
            console.print(f"[red]cannot read Redis at {settings.redis_url_redacted}: {exc}[/red]")
            raise typer.Exit(1) from None
        if as_json:
            print(json.dumps(to_json(models)))
        else:
            if watch:
                console.clear()
            console.print(status_table(models))
            if tenants:
                console.print(tenants_table(models))
        if not watch:
            return
        time.sleep(watch)


def bench(
    url: Url = "http://127.0.0.1:8000",
    model: Annotated[
        str | None, typer.Option(help="Model to ask for (gateway default if unset)")
    ] = None,
    workload: Workload = "short",
    clients: Annotated[int, typer.Option(help="Closed loop: concurrent clients")] = 32,
    rate: Annotated[
        float, typer.Option(help="Open loop: Poisson arrivals per second (0 = closed loop)")
    ] = 0.0,
    duration: Annotated[float, typer.Option(help="Seconds of load")] = 20.0,
    metrics_url: Annotated[
        str | None, typer.Option(help="Where batch metrics live (default: --url)")
    ] = None,
    seed: int = 0,
    as_json: Annotated[
        Path | None, typer.Option("--json", help="Write results as JSON here")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG: latency distribution, throughput")
    ] = None,
) -> None:
    """Load a running gateway with embeddings; print a summary, optionally JSON and a plot."""
    from rich.console import Console

    from common.cli import loadgen, plots

    texts = loadgen.workload(workload, 4096, seed)
    bodies = [{"input": t, **({"model": model} if model else {})} for t in texts]
    samples, summary = asyncio.run(
        run_load(
            url,
            bodies,
            clients=clients,
            rate=rate,
            duration_s=duration,
            metrics_url=metrics_url or url,
            show_progress=True,
        )
    )
    mode = f"open loop {rate:g}/s" if rate > 0 else f"closed loop, {clients} clients"
    title = f"{workload} workload, {mode}, {duration:g}s"
    Console(width=140).print(summary_table(title, summary))
    if as_json is not None:
        run = {"url": url, "workload": workload, "clients": clients, "rate": rate}
        result = {**run, "mode": "open" if rate > 0 else "closed", "duration_s": duration}
        as_json.write_text(json.dumps({**result, **summary}, indent=2))
    if plot is not None:
        plots.bench_plot(samples, title, plot)


def tune(
    ctx: typer.Context,
    redis_url: RedisUrl = None,
    url: Url = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model whose workers are tuned")] = None,
    waits: Annotated[str, typer.Option(help="max_wait_ms values to sweep")] = "0,2,5,10,20",
    sizes: Annotated[str, typer.Option(help="max_batch_size values to sweep")] = "1,4,8,16,32",
    workload: Workload = "short",
    rate: Annotated[float, typer.Option(help="Offered load, requests/s (open loop)")] = 50.0,
    duration: Annotated[float, typer.Option(help="Seconds per setting")] = 10.0,
    p99_target_ms: Annotated[float, typer.Option(help="Latency target for the pick")] = 200.0,
    keep: Annotated[bool, typer.Option(help="Leave the best setting applied")] = False,
    apply: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Only apply NAME=VALUE live (max_batch_size, max_wait_ms, max_batch_tokens); "
            "'clear' resets",
        ),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write the throughput-latency frontier PNG")
    ] = None,
    as_json: Annotated[
        Path | None, typer.Option("--json", help="Write the table as JSON here")
    ] = None,
) -> None:
    """Sweep batching settings live (no restart) at a load; pick the best under a p99 target."""
    from rich.console import Console

    settings = settings_from_context(ctx, redis_url=redis_url, model=model)
    if settings.embedded:
        raise typer.BadParameter("tune needs --redis-url: settings reach workers through Redis")
    console = Console(width=140)
    if apply is not None:
        values = {} if apply == ["clear"] else dict(a.split("=", 1) for a in apply)
        asyncio.run(_set_live(settings, values))
        console.print(f"live batching settings for {settings.model}: {values or 'cleared'}")
        return
    rows = asyncio.run(_sweep(settings, url, waits, sizes, workload, rate, duration, console))
    best = _report_tune(console, rows, p99_target_ms, plot, as_json)
    keep_best = best is not None and keep
    final = (
        {"max_wait_ms": f"{best['max_wait_ms']:g}", "max_batch_size": str(best["max_batch_size"])}
        if keep_best
        else {}
    )
    asyncio.run(_set_live(settings, final))


def tiny_model(
    path: Annotated[Path, typer.Argument(help="Folder to write the model into")],
    kind: Annotated[
        str, typer.Option(help="causal-lm, cross-encoder (a reranker) or classifier")
    ] = "causal-lm",
    labels: Annotated[str, typer.Option(help="classifier: its labels, comma-separated")] = (
        "negative,neutral,positive"
    ),
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 512,
    max_positions: int = 1024,
    seed: int = 0,
) -> None:
    """Write a small random-weight model (safetensors + a real tokenizer), fixed seed: a Llama
    causal LM, or a BERT cross-encoder or classifier (--kind).

    The SmolLM2-135M shape: --layers 30 --hidden 576 --heads 9 --kv-heads 3
    --intermediate 1536 --vocab-size 49152 --max-positions 2048.
    """
    if kind in ("cross-encoder", "classifier"):
        from worker.encode.tiny_classifier import write_tiny_classifier

        names = tuple(n.strip() for n in labels.split(",") if n.strip())
        write_tiny_classifier(path, names if kind == "classifier" else (), seed=seed)
        typer.echo(f"wrote a random-weight {kind} to {path}: serve it with --model {path}")
        return
    if kind != "causal-lm":
        raise typer.BadParameter(f"--kind {kind!r}: causal-lm, cross-encoder or classifier")
    from worker.generate.tiny_model import TinyShape, write_tiny_model

    shape = TinyShape(layers, hidden, heads, kv_heads, intermediate, vocab_size, max_positions)
    write_tiny_model(path, shape, seed)
    typer.echo(f"wrote a random-weight causal LM to {path}: serve it with --model {path}")


def batches(
    ctx: typer.Context,
    redis_url: RedisUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts")] = False,
) -> None:
    """The fleet's unfinished batches: status, lines answered, failed and pending, driver."""
    from rich.console import Console

    from common import streams
    from common.cli.render import batches_table
    from common.store import close_store, open_store
    from gateway.batch_records import BatchRecords, batch_object

    settings = settings_from_context(ctx, redis_url=redis_url)
    if settings.embedded:
        raise typer.BadParameter("batches needs --redis-url (or MICROBATCH_REDIS_URL)")

    async def snapshot() -> list[dict]:
        store = open_store(settings)
        try:
            records = BatchRecords(store, streams.Keys(settings.prefix))
            found = []
            for record in await records.active_records():
                body = batch_object(record)
                body["driver"] = await records.driver(record["id"])
                found.append(body)
            return found
        finally:
            await close_store(store)

    found = asyncio.run(snapshot())
    if as_json:
        print(json.dumps(found))
    else:
        Console(width=140).print(batches_table(found))


def register(app: typer.Typer) -> None:
    """Add the operator commands to the one typer app."""
    app.command(context_settings=EXTRA)(status)
    app.command(context_settings=EXTRA)(batches)
    app.command()(bench)
    app.command(context_settings=EXTRA)(tune)
    app.command("tiny-model")(tiny_model)


async def _set_live(settings: Any, values: dict[str, str]) -> None:
    from common import streams
    from common.store import close_store, open_store

    store = open_store(settings)
    try:
        await streams.set_live_batching(
            store, streams.Keys(settings.prefix), settings.model, values
        )
    finally:
        await close_store(store)


async def _sweep(
    settings: Any,
    url: str,
    waits: str,
    sizes: str,
    workload: str,
    rate: float,
    duration: float,
    console: Any,
) -> list[dict]:
    from common.cli import loadgen
    from common.cli.tune import grid

    texts = loadgen.workload(workload, 4096)
    bodies = [{"input": t, "model": settings.model} for t in texts]
    combos = grid([float(w) for w in waits.split(",")], [int(s) for s in sizes.split(",")])
    rows = []
    for values in combos:
        await _set_live(settings, values)
        await asyncio.sleep(2.5 * settings.heartbeat_interval_ms / 1000)  # workers apply on a beat
        _, summary = await run_load(
            url,
            bodies,
            clients=0,
            rate=rate,
            duration_s=duration,
            metrics_url=url,
            show_progress=False,
        )
        row = {
            "max_wait_ms": float(values["max_wait_ms"]),
            "max_batch_size": int(values["max_batch_size"]),
            **summary,
        }
        console.print(
            f"max_wait_ms={values['max_wait_ms']:>4} max_batch_size={values['max_batch_size']:>3}: "
            f"{row['requests_per_s']:.1f} req/s, p99 {row['p99_ms'] or 0:.1f} ms"
        )
        rows.append(row)
    return rows


def _report_tune(
    console: Any, rows: list[dict], p99_target_ms: float, plot: Path | None, as_json: Path | None
) -> dict | None:
    """Print the sweep, write what was asked for, and return the best row under the target."""
    from common.cli import plots
    from common.cli.render import tune_table
    from common.cli.tune import best_under

    best = best_under(rows, p99_target_ms)
    console.print(tune_table(rows, best, p99_target_ms))
    if as_json is not None:
        as_json.write_text(
            json.dumps({"rows": rows, "best": best, "p99_target_ms": p99_target_ms}, indent=2)
        )
    if plot is not None:
        plots.frontier_plot(rows, best, p99_target_ms, plot)
    return best
