"""``gtr-retrieval index drift-watch`` and ``index await-generation`` (issue #24).

drift-watch: start ``index rollout --retrain`` when the serving generation's PQ error
ratio stays above a threshold for a window (:mod:`services.generations.drift`); off
unless run (the chart's ``index.drift.autoRollout.enabled``).
await-generation: a generation's shard pods wait until it may serve, then publish its
addresses (:mod:`services.generations.standby`; the chart's init container).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from services.cli.common import group_commands


def add_cli(sub: Any) -> None:
    """Add the two actions to the ``index`` command (it exists: index_commands adds it)."""
    isub = group_commands(sub, "index")

    watch = isub.add_parser(
        "drift-watch",
        help="Start `index rollout --retrain` when the quantizer drift ratio stays above a "
        "threshold for a window (off unless run).",
        description="Polls every --interval seconds the Stats of every replica of the "
        "serving generation (its addresses in the registry, {gtr}:addrs; g1 falls back to "
        "--shards) for index_pq_error_ratio (PQ reconstruction error of recent adds over "
        "the error at training). When the highest ratio stays above --threshold for the "
        "whole --window (a reading at or below it, a switch, a running rollout or no "
        "reading for 3 polls restarts the window), it runs `gtr-retrieval index rollout "
        "--retrain --yes` with the same Redis (or --run-dir) and every --rollout-arg, waits "
        "for it, and starts watching the new generation. A rollout it started and did not "
        "see end (the watcher was restarted) is resumed at start; a rollout someone else "
        "runs is left alone. Metrics gtr_drift_* on --metrics-port.",
    )
    where = watch.add_mutually_exclusive_group(required=True)
    where.add_argument("--redis-url", help="The document store's Redis (or Redis Cluster).")
    where.add_argument("--redis-url-file", help="A file holding the Redis URL (first line).")
    where.add_argument("--run-dir", help="A local stack's run directory (`gtr-retrieval up`).")
    watch.add_argument(
        "--threshold",
        type=_positive_float,
        required=True,
        help="Ratio above which the quantizer counts as drifted (the alert uses 1.5).",
    )
    watch.add_argument(
        "--window",
        type=_duration,
        required=True,
        help="How long it must stay above, in seconds or with a unit (90s, 30m, 2h).",
    )
    watch.add_argument(
        "--interval", type=_duration, default=30.0, help="Seconds between polls (30)."
    )
    watch.add_argument(
        "--shards",
        default="",
        help="g1's shard addresses when the registry holds none for it (the gateway's "
        "--shards syntax); also the rollout's --source-shards.",
    )
    watch.add_argument(
        "--rollout-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="One more argument of the rollout, e.g. --rollout-arg=--index-root=/data (repeat it).",
    )
    watch.add_argument("--metrics-port", type=int, default=None, help="Serve gtr_drift_* here.")
    watch.add_argument("--metrics-host", default="0.0.0.0", help="Address of the metrics.")
    watch.add_argument(
        "--once", action="store_true", help="One poll, print the reading as JSON, exit."
    )
    _add_tls(watch)
    watch.set_defaults(handler=_drift_watch)

    wait = isub.add_parser(
        "await-generation",
        help="Wait until a generation may serve, then record its shard addresses.",
        description="The init container of a generation's shard pods in the chart: waits "
        "until the registry records GENERATION with a trained index (g1: at once), checks "
        "that its index_dir is --index-dir and its shard count --shards, and writes "
        "--addresses into {gtr}:addrs. Exits 2 with the reason when the generation is "
        "retired or failed, or its index or shard count is another.",
    )
    wait.add_argument("generation", help="The generation (g1, g2, ...).")
    wait.add_argument("--addresses", required=True, help="Its shards (the --shards syntax).")
    wait_where = wait.add_mutually_exclusive_group(required=True)
    wait_where.add_argument("--redis-url", help="The document store's Redis.")
    wait_where.add_argument("--redis-url-file", help="A file holding the Redis URL.")
    wait.add_argument("--index-dir", default=None, help="Where this pod reads the index.")
    wait.add_argument(
        "--shards", type=int, default=None, help="The shard count this pod is one of."
    )
    wait.add_argument("--timeout", type=_duration, default=None, help="Give up after this.")
    wait.set_defaults(handler=_await_generation)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """Seconds: ``90``, ``90s``, ``30m``, ``2h``, ``1d``."""
    unit = _UNITS.get(text[-1:]) if text else None
    number = text[:-1] if unit is not None else text
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90, 90s, 30m, 2h)") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a duration >= 0")
    return value


def _add_tls(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-ca", default=None, help="PEM CA of the shards: talk TLS (the rollout it starts too)."
    )
    parser.add_argument("--tls-client-cert", default=None, help="PEM client certificate.")
    parser.add_argument("--tls-client-key", default=None, help="PEM key of it.")


def _redis_url(args: argparse.Namespace) -> str:
    if getattr(args, "run_dir", None):
        from services.stack.endpoints import read_endpoints

        endpoints = read_endpoints(args.run_dir)
        if endpoints is None:
            raise SystemExit(f"gtr-retrieval index: no local stack runs in {args.run_dir}")
        return endpoints.redis_url_with_secrets()
    if args.redis_url_file:
        from services.process.redis_client import read_redis_url

        try:
            return read_redis_url(args.redis_url_file)
        except ValueError as exc:
            raise SystemExit(f"gtr-retrieval index: {exc}") from None
    return str(args.redis_url)


def rollout_argv(args: argparse.Namespace) -> list[str]:
    """The rollout the watcher starts: the same store, --retrain, no question asked."""
    argv = [sys.executable, "-m", "services.cli.main", "index", "rollout", "--retrain", "--yes"]
    if args.run_dir:
        argv.append(f"--run-dir={args.run_dir}")
    elif args.redis_url_file:  # keeps a password off the rollout's command line too
        argv.append(f"--redis-url-file={args.redis_url_file}")
    else:
        argv.append(f"--redis-url={args.redis_url}")
    extra = list(args.rollout_arg)
    if args.shards and not any(a.startswith("--source-shards") for a in extra):
        # --retrain exports the serving replicas' vectors; g1's may be in no registry entry
        argv.append(f"--source-shards={args.shards}")
    for name in ("tls-ca", "tls-client-cert", "tls-client-key"):  # the replicas' TLS too
        value = getattr(args, name.replace("-", "_"), None)
        if value and not any(a.startswith(f"--{name}") for a in extra):
            argv.append(f"--{name}={value}")
    return argv + extra


def _drift_watch(args: argparse.Namespace) -> int:
    import json

    from services.generations.drift import (
        ChildRunner,
        DriftWatcher,
        WatchConfig,
        read_with_asyncio,
        watch_until_sigterm,
    )
    from services.generations.registry import Registry
    from services.process.redis_client import sync_client
    from services.rpc.tls import ClientTLS

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader's INFO lines
    try:
        tls = ClientTLS.from_paths(args.tls_ca, args.tls_client_cert, args.tls_client_key)
        config = WatchConfig.of(
            args.threshold, args.window, args.interval, _fallback_shards(args), rollout_argv(args)
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    registry = Registry(sync_client(_redis_url(args)))
    runner = ChildRunner()
    metrics = None if args.once else _drift_metrics(args)
    watcher = DriftWatcher(config, registry, read_with_asyncio(tls), runner, metrics=metrics)
    if args.once:
        print(json.dumps(watcher.once()))
        return 0
    logging.getLogger(__name__).info(
        "watching the serving generation: rollout --retrain when the PQ error ratio stays "
        "above %s for %.0f s (polls every %.0f s)",
        args.threshold,
        args.window,
        args.interval,
    )
    watch_until_sigterm(watcher, runner)
    return 0


def _fallback_shards(args: argparse.Namespace) -> str:
    """--shards, else the local stack's shards (--run-dir), for g1 without addresses."""
    if args.shards or not args.run_dir:
        return str(args.shards)
    from services.stack.endpoints import read_endpoints

    endpoints = read_endpoints(args.run_dir)
    return "" if endpoints is None else ";".join(",".join(r) for r in endpoints.shards)


def _drift_metrics(args: argparse.Namespace) -> Any:
    """gtr_drift_* served on --metrics-port (None without it)."""
    if args.metrics_port is None:
        return None
    from prometheus_client import CollectorRegistry

    from services.generations.drift import DriftMetrics
    from services.rpc.metrics import serve_metrics

    prom = CollectorRegistry()
    metrics = DriftMetrics(prom)
    serve_metrics(prom, args.metrics_port, args.metrics_host)
    return metrics


def _await_generation(args: argparse.Namespace) -> int:
    from services.common.errors import FailedPrecondition
    from services.generations.registry import Registry
    from services.generations.standby import await_generation
    from services.process.redis_client import sync_client

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    registry = Registry(sync_client(_redis_url(args)))
    try:
        gen = await_generation(
            registry,
            args.generation,
            args.addresses,
            index_dir=args.index_dir,
            num_shards=args.shards,
            timeout_s=args.timeout,
        )
    except (FailedPrecondition, TimeoutError) as exc:
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    state = "not recorded yet (its shards record it)" if gen is None else gen.state
    print(f"generation {args.generation}: {state}; addresses recorded: {args.addresses}")
    return 0
