"""`ladder serve --ray`: the same endpoints from N engine replicas on Ray Serve (deploy/ray_app.py).

Without --ray-address a local Ray instance starts with this machine's cores and stops on exit. SIGTERM
or Ctrl-C shuts Serve down: each replica finishes its in-flight requests for up to --shutdown-timeout.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading

log = logging.getLogger("ladder.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group("Ray Serve replicas (needs the ray extra: pip install 'ladder[ray]')")
    ray.add_argument("--ray", action="store_true", help="serve from engine replicas on Ray Serve")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas (with --max-replicas: the first count)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default 1)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="autoscale on queue depth up to this many replicas: a replica is added when replicas "
                          "hold more than --max-num-seqs requests each on average")
    ray.add_argument("--cpus-per-replica", type=float, default=None,
                     help="CPUs Ray reserves for each replica, also its torch threads (default: the cores / replicas)")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs for each replica (default 0)")
    ray.add_argument("--ray-ingress", choices=("process", "serve"), default="process",
                     help="who answers HTTP: this process, routing to the replicas itself (one relay hop per "
                          "streamed event), or Serve's HTTP proxy and an ingress deployment, as `serve run "
                          "deploy.ray_app:app_builder` runs it (two hops) (default process)")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (default: start a local Ray instance with this machine's cores)")


def run(args: argparse.Namespace, engine_kwargs: dict, server_kwargs: dict) -> int:
    try:
        import ray
        from ray import serve

        from deploy.ingress import LadderIngress, ingress_asgi_app
        from deploy.ray_app import RayAppConfig, build_app, build_replicas
    except ImportError as error:
        raise ValueError(f"ladder serve --ray needs Ray Serve ({error.name} is missing): "
                         "pip install 'ladder[ray]'") from None
    if not args.ray_address:  # the replicas load the model on this machine: a bad path is refused here, in one line
        from model.loader import check_source

        check_source(args.model)
    replicas = args.max_replicas or args.replicas
    cpus = args.cpus_per_replica if args.cpus_per_replica is not None else max(1, (os.cpu_count() or 1) // replicas)
    config = RayAppConfig(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                          num_cpus_per_replica=cpus, num_gpus_per_replica=args.gpus_per_replica,
                          step_timeout=args.step_timeout or None, shutdown_timeout=args.shutdown_timeout,
                          engine=engine_kwargs, server=server_kwargs)
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level=args.log_level.upper())
    else:
        # Ray starts its workers at niceness 15, below everything else on the machine; here the workers are
        # the engines, the reason the machine runs at all.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # Serve's controller loop and every actor's metrics export run every 0.1 s by default, a share of a
        # core that a small machine's engines need; at 0.5 s and 1 s less of it goes there. Dead replicas
        # are still found and replaced, half a second later at most.
        os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
        os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=args.log_level.upper())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.ray_ingress == "process":
            # No Serve proxy: this process's HTTP server runs the ingress over the replicas' handle, whose
            # prefix router lives here.
            serve.start(proxy_location="Disabled")
            replicas_handle = deploy_or_explain(lambda: serve.run(build_replicas(config), name="ladder",
                                                                  route_prefix=None))
            log.info("serving from %d replica(s) on Ray Serve at http://%s:%d (this process routes)", args.replicas,
                     args.host, args.port)
            ingress = LadderIngress(replicas_handle, config.max_body_bytes, config.api_key)
            serve_http(ingress_asgi_app(ingress), args.host, args.port)
        else:
            serve.start(http_options={"host": args.host, "port": args.port})
            deploy_or_explain(lambda: serve.run(build_app(config), name="ladder", route_prefix="/"))
            log.info("serving from %d replica(s) on Ray Serve at http://%s:%d", args.replicas, args.host, args.port)
            stop.wait()
        log.info("stopping: replicas finish in-flight requests for up to %.0f s", args.shutdown_timeout)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def deploy_or_explain(deploy):
    """`deploy()`, with Serve's failure to start the replicas (a RuntimeError whose cause is in the
    replicas' log lines above it) turned into the command line's one-line error."""
    try:
        return deploy()
    except RuntimeError as error:
        if not str(error).startswith("Deploying application"):
            raise
        raise ValueError(f"the replicas did not start (their error is in Ray's log above): {error}") from None


def serve_http(app, host: str, port: int) -> None:
    """Answer HTTP with `app` until SIGINT or SIGTERM (uvicorn's own handlers; it then re-raises the
    signal to the handlers installed before it, which only set an event here)."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False,
                                  log_level="warning")).run()


def engine_kwargs_of(config, device: str, quantization: str) -> dict:
    """The engine's settings for the replicas: device and quantization as asked, resolved on each replica."""
    return {**dataclasses.asdict(config), "device": device, "quantization": quantization}
