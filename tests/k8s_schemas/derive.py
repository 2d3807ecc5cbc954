"""Re-derive the vendored CRD schemas here from the cloudcoil model packages (see README.md).

Not run by the tests. Run it by hand when bumping a version:
    pip install --target /tmp/cc cloudcoil==0.6.0 cloudcoil-models-keda==2.16.1.0 \
        cloudcoil-models-prometheus-operator==0.80.1.0
    PYTHONPATH=/tmp/cc python tests/k8s_schemas/derive.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cloudcoil.models.keda import v1alpha1 as keda
from cloudcoil.models.prometheus_operator import v1 as monitoring

HERE = Path(__file__).resolve().parent
KINDS = {
    "scaledobject-keda.sh-v1alpha1.json": keda.ScaledObject,
    "podmonitor-monitoring.coreos.com-v1.json": monitoring.PodMonitor,
    "servicemonitor-monitoring.coreos.com-v1.json": monitoring.ServiceMonitor,
}


def closed(node: Any) -> Any:
    """Refuse unknown fields, as the API server does with strict field validation (the
    models, like the CRDs, leave objects open and the server prunes what they do not name)."""
    if isinstance(node, dict):
        node = {key: closed(value) for key, value in node.items()}
        if node.get("type") == "object" and "properties" in node:
            node.setdefault("additionalProperties", False)
        return node
    if isinstance(node, list):
        return [closed(value) for value in node]
    return node


def main() -> None:
    for name, model in KINDS.items():
        schema = closed(model.model_json_schema(by_alias=True, mode="validation"))
        (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
