"""deploy/k8s: every manifest validates against the Kubernetes OpenAPI schemas (bundled by
kubernetes-validate, so no cluster is needed), and what the manifests name exists: probe paths are the
server's routes, probe ports the port `ladder serve` listens on in the image, the drain fits the grace
period, the HPA's metric is one the server exports, and the RayService's import path and arguments load."""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from dockerfile_text import dockerfile_instructions

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSION = kubernetes_validate.latest_version()
MANIFESTS = sorted(K8S.glob("*.yaml"))
DEPLOYMENTS = ("deployment.yaml", "deployment-gpu.yaml")


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text(encoding="utf-8")) if doc]


def one(name: str) -> dict:
    (doc,) = documents(name)
    return doc


def validate_as(instance: dict, schema_file: str) -> None:
    """Validate a fragment (a pod template inside a custom resource) against one core schema, strictly."""
    directory = f"kubernetes-json-schema/v{VERSION}-local-strict"
    schema = schema_contents(f"{directory}/{schema_file}", VERSION)
    definitions = schema_contents(f"{directory}/_definitions.json", VERSION)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(instance)


def serve_args(container: dict) -> object:
    """The image's ENTRYPOINT plus the container's args, parsed by the real `ladder` parser."""
    from ladder.cli import build_parser

    (entrypoint,) = [json.loads(args) for kind, args in dockerfile_instructions() if kind == "ENTRYPOINT"]
    assert entrypoint[:2] == ["ladder", "serve"] and "command" not in container
    return build_parser().parse_args(entrypoint[1:] + container.get("args", []))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schemas(path):
    docs = documents(path.name)
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("ray.io/"):
            continue  # a custom resource: its pod templates are checked below
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_catches_a_wrong_field():
    bad = one("deployment.yaml")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)
    with pytest.raises(jsonschema.ValidationError):
        validate_as({"spec": {"containers": [{"name": "x", "imagePullPolicy": "Always", "gpus": 1}]}},
                    "podtemplatespec-v1.json")
    validate_as({"spec": {"containers": [{"name": "x", "imagePullPolicy": "Always"}]}}, "podtemplatespec-v1.json")


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_probes_and_drain_match_the_server(name):
    from server.app import ServerSettings, ServerState, create_app

    deployment = one(name)
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = serve_args(container)
    assert args.host == "0.0.0.0"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["http"] == args.port
    routes = {route.path for route in create_app(ServerState(ServerSettings())).routes if "GET" in route.methods}
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" in routes
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" in routes
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in (ports["http"], "http")
    # SIGTERM drains for --shutdown-timeout after the preStop pause; the grace period must cover both.
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pause + args.shutdown_timeout
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.port)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] in routes
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    if name == "deployment-gpu.yaml":
        assert args.device == "cuda" and container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_service_and_autoscaler_point_at_the_deployment_and_its_metric():
    from engine.stats import EngineStats
    from server.metrics import ServerMetrics

    deployment, service, hpa = one("deployment.yaml"), one("service.yaml"), one("hpa.yaml")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    # The server exports it (a gauge of each pod's /metrics) ...
    exported = ServerMetrics(lambda: EngineStats(), lambda: True).render().decode()
    assert f"\n{name} " in exported and f"# TYPE {name} gauge" in exported
    # ... and the adapter's rule serves it under that name.
    rules = yaml.safe_load(one("custom-metrics-adapter.yaml")["data"]["config.yaml"])["rules"]
    assert any(name in rule["seriesQuery"] and rule["name"]["as"] == name for rule in rules)


def test_rayservice_templates_import_path_and_version():
    from deploy.ray_app import RayAppConfig

    service = one("rayservice.yaml")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        validate_as(template, "podtemplatespec-v1.json")
    # The Ray in the image is the one the ray extra pins.
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert extra["ray"] == [f"ray[serve]=={cluster['rayVersion']}"]
    # Serve imports this path on the cluster and calls it with these arguments.
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, _, attribute = application["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attribute)
    config = RayAppConfig.from_args(application["args"])
    assert config.max_replicas and config.autoscaling().target_ongoing_requests == config.max_num_seqs
    assert builder.__name__ == "app_builder"
    worker_cpus = float(cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
                        ["requests"]["cpu"])
    assert config.num_cpus_per_replica <= worker_cpus  # a replica fits on a worker pod
