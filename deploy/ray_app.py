"""The Ray Serve application: an ingress and N engine replicas with prefix-affinity routing.

    serve run deploy.ray_app:app_builder replicas=2 max_num_seqs=32      # or: ladder serve --ray --replicas 2

`app_builder` takes flat arguments (from `serve run key=value` or a Serve config file's `args:`): the
application's own settings below, and any field of the engine's EngineConfig or the server's
ServerSettings by name.

API key: the `api_key` argument, or else $LADDER_API_KEY where the application is built, as `ladder
serve` reads it (deploy/k8s/rayservice.yaml sets it on every Ray pod from a Secret, so the key never
appears in the Serve config). The ingress checks it before reading a request's body, and every replica's
server checks it again. An empty key is refused rather than taken as none.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from deploy.ingress import LadderIngress
from deploy.prefix_router import DEFAULT_IMBALANCE_THRESHOLD, PrefixAffinityRouter
from deploy.replica import LadderReplica
from engine.config import EngineConfig
from server.app import ServerSettings

# No access log line per request: at a few hundred requests a second it costs a share of a core.
QUIET = {"enable_access_log": False}
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
SERVER_FIELDS = {f.name: f for f in dataclasses.fields(ServerSettings) if f.name != "created"}
API_KEY_ENV = "LADDER_API_KEY"


@dataclass(frozen=True)
class RayAppConfig:
    replicas: int = 1  # the fixed count, or the first count when autoscaling
    # Autoscaling when max_replicas is given: Serve adds a replica when replicas average more than
    # `target_queue` requests each (default: the engine's max_num_seqs, i.e. once requests start to wait
    # in the engines' queues), and removes one when they average less.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_queue: int | None = None
    num_cpus_per_replica: float = 1.0  # also the replica's torch threads (at least 1)
    num_gpus_per_replica: float = 0.0
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD
    step_timeout: float | None = 300.0
    shutdown_timeout: float = 30.0  # seconds a stopping replica waits for its in-flight requests
    engine: dict = field(default_factory=dict)  # EngineConfig fields, resolved on each replica
    server: dict = field(default_factory=dict)  # ServerSettings fields

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.max_replicas is None and (self.min_replicas is not None or self.target_queue is not None):
            raise ValueError("min_replicas and target_queue apply when autoscaling: give max_replicas too")
        if self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            if not 0 <= low <= self.replicas <= self.max_replicas:
                raise ValueError(f"need min_replicas <= replicas <= max_replicas, got {low} <= {self.replicas} "
                                 f"<= {self.max_replicas}")
        if self.target_queue is not None and self.target_queue < 1:
            raise ValueError(f"target_queue must be at least 1, got {self.target_queue}")
        if self.num_cpus_per_replica < 0 or self.num_gpus_per_replica < 0:
            raise ValueError("num_cpus_per_replica and num_gpus_per_replica must not be negative")
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be at least 0, got {self.imbalance_threshold}")
        if self.step_timeout is not None and self.step_timeout <= 0:
            raise ValueError(f"step_timeout must be positive (or None: no watchdog), got {self.step_timeout}")
        for name, given, known in (("engine", self.engine, ENGINE_FIELDS), ("server", self.server, SERVER_FIELDS)):
            unknown = sorted(set(given) - set(known))
            if unknown:
                raise ValueError(f"unknown {name} settings: {', '.join(unknown)}")
        if self.server.get("api_key") == "":  # `ladder serve` would take "" as a key that "Bearer " matches
            raise ValueError("api_key is empty: give a key, or leave it (and $LADDER_API_KEY) unset to serve "
                             "without one")
        ServerSettings(**self.server)  # its own checks, here rather than on every replica

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine.get("max_num_seqs", ENGINE_FIELDS["max_num_seqs"].default))

    @property
    def max_queue(self) -> int:
        return int(self.server.get("max_queue", SERVER_FIELDS["max_queue"].default))

    @property
    def max_body_bytes(self) -> int:
        return int(self.server.get("max_body_bytes", SERVER_FIELDS["max_body_bytes"].default))

    @property
    def api_key(self) -> str | None:
        return self.server.get("api_key")

    def autoscaling(self) -> AutoscalingConfig | None:
        if self.max_replicas is None:
            return None
        return AutoscalingConfig(min_replicas=self.min_replicas if self.min_replicas is not None else 1,
                                 initial_replicas=self.replicas, max_replicas=self.max_replicas,
                                 target_ongoing_requests=self.target_queue or self.max_num_seqs)

    @classmethod
    def from_args(cls, args: dict) -> RayAppConfig:
        """Flat `key: value` arguments (values may be strings, as `serve run` passes them)."""
        own = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("engine", "server")}
        values: dict = {"engine": {}, "server": {}}
        for key, value in args.items():
            if key in own:
                values[key] = coerce(key, value, own[key].type)
            elif key in ENGINE_FIELDS:
                values["engine"][key] = coerce(key, value, ENGINE_FIELDS[key].type)
            elif key == "api_key":  # taken as given: coerce() would turn "", "none" or "null" into no key at all
                values["server"][key] = value
            elif key in SERVER_FIELDS:
                values["server"][key] = coerce(key, value, SERVER_FIELDS[key].type)
            else:
                raise ValueError(f"unknown argument {key!r} of the ladder Ray application")
        return cls(**values)


def coerce(key: str, value: object, annotation: str) -> object:
    """`value` as the annotated type (annotations are strings here: `int`, `float | None`, `bool`...)."""
    if not isinstance(value, str):
        return value
    kinds = [part.strip() for part in str(annotation).split("|")]
    if "None" in kinds and value.lower() in ("none", "null", ""):
        return None
    try:
        if "bool" in kinds:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if "int" in kinds:
            return int(value)
        if "float" in kinds:
            return float(value)
    except ValueError:
        raise ValueError(f"{key}: expected {annotation}, got {value!r}") from None
    return value


def build_replicas(config: RayAppConfig) -> Application:
    """The engine replicas alone, routed by the prefix router of whichever process holds their handle (the
    ingress deployment, or `ladder serve --ray`'s own HTTP server)."""
    replica = serve.deployment(LadderReplica).options(
        name="LadderReplica",
        num_replicas="auto" if config.max_replicas is not None else config.replicas,
        autoscaling_config=config.autoscaling(),
        ray_actor_options={"num_cpus": config.num_cpus_per_replica, "num_gpus": config.num_gpus_per_replica},
        # The replica's app answers 429 past its own queue limit, so Serve never holds a request back.
        max_ongoing_requests=config.max_queue,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
        health_check_period_s=5, health_check_timeout_s=30,
        logging_config=QUIET,
        request_router_config=RequestRouterConfig(
            # By import path: the router is built inside the ingress process, which imports it there.
            request_router_class=f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__name__}",
            request_router_kwargs={"imbalance_threshold": config.imbalance_threshold}),
    )
    threads = max(1, int(config.num_cpus_per_replica))
    return replica.bind(config.engine, config.server, threads, config.step_timeout)


def build_app(config: RayAppConfig) -> Application:
    """The whole application behind Serve's HTTP proxy: the ingress deployment and the replicas."""
    # One ingress: its router sends every request, so the router's own in-flight counts are exact loads.
    ingress = serve.deployment(LadderIngress).options(
        name="LadderIngress", num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config=QUIET,
        max_ongoing_requests=config.max_queue * (config.max_replicas or config.replicas) + 64,
    )
    return ingress.bind(build_replicas(config), config.max_body_bytes, config.api_key)


def with_api_key_from_env(args: dict, environ=os.environ) -> dict:
    """`args`, with $LADDER_API_KEY as its `api_key` when it gives none and the variable is set."""
    if "api_key" not in args and API_KEY_ENV in environ:
        return {**args, "api_key": environ[API_KEY_ENV]}
    return args


def app_builder(args: dict) -> Application:
    """Serve's application builder: `serve run deploy.ray_app:app_builder key=value ...` (Serve calls it
    with the arguments alone). Without an `api_key` argument the key is $LADDER_API_KEY, when set."""
    return build_app(RayAppConfig.from_args(with_api_key_from_env(args)))
