"""deploy/k8s: every manifest validates against the Kubernetes OpenAPI schemas (bundled by
kubernetes-validate, so no cluster is needed), and what the manifests name exists: probe paths are the
server's routes, probe ports the port `ladder serve` listens on in the image, the drain fits the grace
period, the HPA's metric is one the server exports, and the RayService's import path and arguments load.
And what they lock down: every pod runs as the image's non-root user on a read-only root with writable
volumes where it writes, requires the API key's Secret, and Ray's control plane is behind its token and a
NetworkPolicy."""

from __future__ import annotations

import importlib
import importlib.util
import json
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_text import dockerfile_instructions
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSION = kubernetes_validate.latest_version()
MANIFESTS = sorted(K8S.glob("*.yaml"))
DEPLOYMENTS = ("deployment.yaml", "deployment-gpu.yaml")


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text(encoding="utf-8")) if doc]


def one(name: str, kind: str | None = None) -> dict:
    (doc,) = [doc for doc in documents(name) if kind is None or doc["kind"] == kind]
    return doc


def ray_templates() -> list[dict]:
    cluster = one("rayservice.yaml", "RayService")["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def pod_templates() -> dict[str, dict]:
    """Every pod template the manifests ship, by a name for the test's messages."""
    templates = {name: one(name)["spec"]["template"] for name in DEPLOYMENTS}
    templates.update({f"rayservice.yaml#{i}": template for i, template in enumerate(ray_templates())})
    return templates


def image_user() -> tuple[int, str]:
    """The uid of the image's last USER, and its HOME (the Dockerfile's ENV)."""
    user = [args for kind, args in dockerfile_instructions() if kind == "USER"][-1]
    env = " ".join(args for kind, args in dockerfile_instructions() if kind == "ENV")
    home = next(word.split("=", 1)[1] for word in env.split() if word.startswith("HOME="))
    return int(user.split(":")[0]), home


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

    service = one("rayservice.yaml", "RayService")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    for template in ray_templates():
        validate_as(template, "podtemplatespec-v1.json")
    validate_as(cluster["autoscalerOptions"]["securityContext"], "securitycontext-v1.json")
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


@pytest.mark.parametrize("name", sorted(pod_templates()))
def test_every_pod_runs_unprivileged_on_a_read_only_root(name):
    uid, home = image_user()
    spec = pod_templates()[name]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid != 0, "the image's own user, not root"
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    empty_dirs = {volume["name"] for volume in spec["volumes"] if "emptyDir" in volume}
    for container in spec["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
        assert context["readOnlyRootFilesystem"] is True
        assert "runAsUser" not in context or context["runAsUser"] == uid
        # The places the server, torch (its extensions directory under ~/.cache) and Ray write to.
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        writable = {"/tmp", home} | ({"/tmp/ray"} if name.startswith("rayservice") else set())
        assert writable <= mounts.keys(), f"{container['name']}: no volume at {writable - mounts.keys()}"
        assert {mounts[path] for path in writable} <= empty_dirs


@pytest.mark.parametrize("name", sorted(pod_templates()))
def test_every_server_requires_the_api_key_secret(name):
    """LADDER_API_KEY from the Secret, not optional: without it the pod does not start (fail closed)."""
    for container in pod_templates()[name]["spec"]["containers"]:
        (variable,) = [v for v in container["env"] if v["name"] == "LADDER_API_KEY"]
        reference = variable["valueFrom"]["secretKeyRef"]
        assert (reference["name"], reference["key"], reference["optional"]) == ("ladder-api-key", "key", False)
    # The RayService hands the key over by environment only: no key in its Serve config.
    (application,) = yaml.safe_load(one("rayservice.yaml", "RayService")["spec"]["serveConfigV2"])["applications"]
    assert "api_key" not in application["args"]


def test_rays_control_plane_needs_its_token_and_only_the_operator_reaches_the_dashboard():
    """The dashboard (jobs API) and the GCS run code for whoever reaches them. KubeRay's operator needs
    the dashboard on the head Service's `dashboard` port (the Serve REST API that deploys serveConfigV2),
    so it stays reachable, behind Ray's token and a NetworkPolicy that admits the operator alone."""
    cluster = one("rayservice.yaml", "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    assert tuple(map(int, cluster["rayVersion"].split("."))) >= (2, 52, 0)  # Ray's token authentication
    labels = {}
    for template in ray_templates():
        labels.update(template["metadata"]["labels"])
        for container in template["spec"]["containers"]:
            # Set here too: a Ray started without the operator's token fails instead of running open.
            assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"]
    policy = one("rayservice.yaml", "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    open_ports, dashboard_peers = set(), []
    for rule in policy["spec"]["ingress"]:
        ports = {port["port"] for port in rule.get("ports", [])}
        if "from" not in rule:
            open_ports |= ports
        elif 8265 in ports:
            dashboard_peers += rule["from"]
        else:  # a rule for every port: only the cluster's own pods
            assert not ports and rule["from"] == [{"podSelector": policy["spec"]["podSelector"]}]
    assert open_ports == {8000, 8080}  # the ladder API (its own key) and metrics; never 8265 nor 6379
    assert dashboard_peers == [{"namespaceSelector": {},
                                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}}}]
    # The head's probes read the dashboard's health endpoints, which Ray leaves open under the token.
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    probe = " ".join(head["readinessProbe"]["exec"]["command"])
    assert "8265/api/gcs_healthz" in probe and "52365/api/local_raylet_healthz" in probe
    ray = importlib.util.find_spec("ray")
    if ray is not None:
        dashboard = Path(ray.origin).parent / "dashboard"
        assert '"/api/gcs_healthz"' in (dashboard / "http_server_head.py").read_text(encoding="utf-8")
        assert '"/api/local_raylet_healthz"' in (dashboard / "http_server_agent.py").read_text(encoding="utf-8")
    # No Service of ours publishes Ray's ports.
    assert {port["targetPort"] for port in one("service.yaml")["spec"]["ports"]} == {"http"}
