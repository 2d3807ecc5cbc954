"""docker-compose.yml and the Dockerfile, checked as far as a machine without Docker allows."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import yaml
from typer.main import get_command

from common.cli import app
from common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
# the standard variables compose passes through (the SDK and common/tracing.py read them)
OTEL_VARIABLES = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"}
COMMANDS = set(get_command(app).commands)  # type: ignore[attr-defined]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_runs_redis_with_an_append_only_file() -> None:
    redis = compose()["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--save") + 1] == ""  # AOF only: no RDB snapshots
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-data" in compose()["volumes"]


def test_compose_gateway_listens_on_8000_and_points_at_redis() -> None:
    gateway = compose()["services"]["gateway"]
    assert gateway["ports"] == ["${MICROBATCH_PUBLISH:-127.0.0.1}:8000:8000"]  # loopback
    assert gateway["command"][0] == "gateway" and "0.0.0.0" in gateway["command"]
    assert gateway["environment"]["MICROBATCH_REDIS_URL"].startswith("redis://redis:")
    drain_s = Settings().drain_timeout_s  # compose leaves the drain at its default
    assert int(gateway["stop_grace_period"].removesuffix("s")) > drain_s


def test_compose_worker_can_be_scaled() -> None:
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker  # both would block --scale
    assert worker["command"][0] == "worker"
    assert worker["environment"]["MICROBATCH_REDIS_URL"].startswith("redis://redis:")
    assert worker["stop_signal"] == "SIGTERM"


def test_compose_commands_and_settings_exist() -> None:
    for service in compose()["services"].values():
        if service.get("image") != "microbatch:latest":
            continue
        assert service["command"][0] in COMMANDS
        for variable in service.get("environment", {}):
            if variable.startswith("OTEL_"):  # OpenTelemetry's own, read by its SDK
                assert variable in OTEL_VARIABLES, variable
                continue
            field = variable.removeprefix("MICROBATCH_").lower()
            assert field in Settings.model_fields, variable
        for option in (a for a in service["command"] if a.startswith("--")):
            assert option[2:].replace("-", "_") in Settings.model_fields, option


def dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            rows.append((instruction.upper(), rest.strip()))
    return rows


def test_dockerfile_copies_only_paths_that_exist() -> None:
    for instruction, rest in dockerfile():
        if instruction == "COPY":
            *sources, _dest = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), source


def test_dockerfile_arguments_are_declared_before_use_and_torch_is_pinned() -> None:
    declared: set[str] = set()
    rows = dockerfile()
    for instruction, rest in rows:
        if instruction == "ARG":
            declared.add(rest.split("=")[0])
        for used in re.findall(r"\$\{(\w+)\}", rest):
            assert used in declared, f"{used} used before ARG"
    assert rows[0][0] in ("ARG", "FROM")
    assert any("TORCH_VARIANT=cpu" in rest for i, rest in rows if i == "ARG")
    assert any('"torch==2.13.0"' in rest for i, rest in rows if i == "RUN")


def test_dockerfile_entrypoint_is_the_cli_and_the_default_command_serves() -> None:
    rows = dict(dockerfile())
    assert rows["ENTRYPOINT"] == '["microbatch"]'
    command = yaml.safe_load(rows["CMD"])
    assert command[0] in COMMANDS and command[0] == "serve"
    assert rows["EXPOSE"] == "8000"


def test_the_dashboard_queries_only_metrics_the_code_exports() -> None:
    import json

    from prometheus_client import Counter
    from prometheus_client.metrics import MetricWrapperBase

    from common import metrics
    from common.tallies import Tally, TallyHistogram

    exported = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            name = value._name
            exported |= {name + "_total"} if isinstance(value, Counter) else {name}
            exported |= {f"{name}_{s}" for s in ("bucket", "sum", "count")}
        elif isinstance(value, Tally | TallyHistogram):  # families kept as plain numbers
            for family in value.describe():
                exported |= {f"{family.name}_{s}" for s in ("total", "bucket", "sum", "count")}
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/microbatch.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"microbatch_\w+", target["expr"])
    }
    assert len(queried) >= 10
    assert queried <= exported, queried - exported


def test_compose_provisions_prometheus_and_grafana_from_checked_in_files() -> None:
    services = compose()["services"]
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), source
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["gateway"]["static_configs"][0]["targets"]  # its port: the test below
    worker_env = services["worker"]["environment"]
    assert jobs["worker"]["dns_sd_configs"][0]["port"] == int(worker_env["MICROBATCH_METRICS_PORT"])


def test_prometheus_scrapes_the_gateway_on_its_admin_port_which_is_not_published() -> None:
    """With an admin port the gateway serves /metrics there only (404 on the API port), and
    it needs no API key there: Prometheus reaches it on compose's network, the host never."""
    gateway = compose()["services"]["gateway"]
    command = gateway["command"]
    api_port = int(command[command.index("--port") + 1])
    admin_port = Settings(admin_port=gateway["environment"]["MICROBATCH_ADMIN_PORT"]).admin_port
    assert admin_port is not None and admin_port != api_port
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["gateway"]["static_configs"] == [{"targets": [f"gateway:{admin_port}"]}]
    published = [p.split(":")[-1].split("/")[0] for p in gateway.get("ports", [])]
    assert published == [str(api_port)]
    # the healthcheck asks the admin port: a gateway whose admin port is down is unhealthy
    (url,) = re.findall(r"http://[\w.]+:\d+/healthz", " ".join(gateway["healthcheck"]["test"]))
    assert url == f"http://127.0.0.1:{admin_port}/healthz"


def test_the_image_installs_the_extras_every_backend_needs() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    installs = [
        shlex.split(rest)
        for instruction, rest in dockerfile()
        if instruction == "RUN" and rest.startswith("pip install")
    ]
    defaults = dict(  # a build argument's default: what `docker build` alone installs
        rest.split("=", 1) for instruction, rest in dockerfile() if instruction == "ARG"
    )
    project = [
        re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], arg)
        for args in installs
        for arg in args
        if arg.startswith(".")
    ]
    assert project, "the image never installs the project"
    named = {e for arg in project for e in re.findall(r"\[([\w,-]+)\]", arg) for e in e.split(",")}
    assert "onnx" in extras and "onnx" in named  # backend onnx and auto import onnxruntime
    assert "vllm" in extras  # EXTRAS=onnx,vllm: an image for `engine vllm`


def test_compose_profiles_add_a_reranker_and_a_chat_model_beside_the_embedder() -> None:
    services = compose()["services"]
    assert "profiles" not in services["worker"]  # the embedder runs without a profile
    for name, profile in (("reranker", "rerank"), ("generator", "chat")):
        service = services[name]
        assert service["profiles"] == [profile] and service["command"] == ["worker"]
        assert service["environment"]["MICROBATCH_SERVED_MODEL_NAME"]
        assert any(v.endswith("/.cache/huggingface:ro") for v in service["volumes"])
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    assert {"worker", "reranker", "generator"} <= jobs


def test_compose_leaves_the_adaptive_wait_to_the_code() -> None:
    """Pinning MICROBATCH_MAX_WAIT_MS overrode the `auto` wait the benchmarks measured."""
    for service in compose()["services"].values():
        assert "MICROBATCH_MAX_WAIT_MS" not in service.get("environment", {})


def test_compose_publishes_nothing_unauthenticated_beyond_this_host() -> None:
    """The API (no keys by default), Prometheus and anonymous Grafana are published on the
    host's loopback only; the API goes wider only when asked (MICROBATCH_PUBLISH)."""
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith(("127.0.0.1:", "${MICROBATCH_PUBLISH:-127.0.0.1}:")), (
                name,
                port,
            )


def test_compose_is_valid_against_the_compose_specification() -> None:
    """tests/compose_schema/: the Compose Specification's JSON schema (Apache-2.0, as
    docker-compose 1.29.2 ships it); `docker compose config` does the same where Docker is."""
    schema = json.loads((ROOT / "tests/compose_schema/compose_spec.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)  # its $schema, with a stray "#"
    assert not [e.message for e in validator.iter_errors(compose())]
    broken = compose()
    broken["services"]["gateway"]["stop_grace_period"] = {"s": 40}
    assert list(validator.iter_errors(broken))  # the schema does check


def test_the_tracing_profile_adds_jaeger_and_every_role_passes_the_otlp_endpoint_through() -> None:
    services = compose()["services"]
    jaeger = services["jaeger"]
    assert jaeger["profiles"] == ["tracing"]
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name, service in services.items():
        if service.get("image") == "microbatch:latest":  # off unless the endpoint is set
            assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == (
                "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
            ), name
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    sources = ROOT / "deploy/grafana/provisioning/datasources"
    (jaeger_source,) = yaml.safe_load((sources / "jaeger.yml").read_text())["datasources"]
    assert jaeger_source["url"] == "http://jaeger:16686"
    (prometheus,) = yaml.safe_load((sources / "prometheus.yml").read_text())["datasources"]
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert (link["name"], link["datasourceUid"]) == ("trace_id", jaeger_source["uid"])
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/microbatch.json").read_text())
    latency = [p for p in dashboard["panels"] if p["title"].startswith("Latency")]
    assert any(t.get("exemplar") for p in latency for t in p["targets"])
