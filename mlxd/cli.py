"""Command line: ``mlxd serve``, ``reload``, ``status``, ``check-config``, ``demo-model``,
``pull``.

Nothing here imports MLX at module level: on Linux the BLAS library has to be
chosen (possibly by re-executing the process once) before MLX is loaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from mlxd import __version__
from mlxd.config import ConfigError, ConfigIssue, Settings, effective_toml, load_settings
from mlxd.config.registry import describe
from mlxd.logs import EscapingFormatter
from mlxd.modelcheck import missing_extras, registry_problems

logger = logging.getLogger("mlxd")

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # One line per request is the dashboard's job, not the log's.
    logging.getLogger("uvicorn.access").setLevel(
        logging.INFO if level.lower() == "debug" else logging.WARNING
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd",
        description=(
            "An MLX inference daemon: OpenAI-compatible routes, continuous batching, "
            "live TOML policy."
        ),
    )
    parser.add_argument("--version", action="version", version=f"mlxd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground (Ctrl-C or SIGTERM stops it)",
        description="Run the daemon in the foreground. It binds its port first, then loads "
        "the model. Ctrl-C or SIGTERM shuts it down gracefully; `mlxd reload` re-reads "
        "the config.",
    )
    _target_flags(serve, "run with")
    serve.add_argument("--model", help="override [model] path (a local mlx-lm model directory)")
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="override [server] log_level",
    )

    for name, what in (
        ("reload", "ask the running daemon to re-read its config file and apply it"),
        ("status", "show the running daemon's state, model, rows and config version"),
    ):
        control = sub.add_parser(
            name,
            help=what,
            description=f"{what[0].upper()}{what[1:]}. The daemon is the one the config names "
            "([server] host and port, flags and MLXD_* variables win), reached through its "
            "admin API with the config's admin token, if any. Exit status 0 when "
            + (
                "the reload was applied, unchanged or needs a restart"
                if name == "reload"
                else "it is ready"
            )
            + ", 1 otherwise or when no daemon answers.",
        )
        _target_flags(control, "find the daemon with")
        control.add_argument(
            "--json", action="store_true", help="print the daemon's JSON answer as it is"
        )

    check = sub.add_parser(
        "check-config",
        help="validate a config file and print the effective config",
        description="Validate a config file and print the effective config: "
        "`mlxd check-config mlxd.toml` or, as the other commands take it, "
        "`mlxd check-config --config mlxd.toml` (default: $MLXD_CONFIG).",
    )
    check.add_argument("path", type=Path, nargs="?", help="the TOML config file to check")
    check.add_argument(
        "--config", type=Path, default=None, help="the TOML config file to check (as a flag)"
    )

    pull = sub.add_parser(
        "pull",
        help="download a model from the Hugging Face hub into its cache, after a fit check",
        description="Download a model repo (org/name) into the shared Hugging Face cache "
        "(HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN apply). First the fit check: the "
        "weights and the KV cache per token against the config's [memory] budget beside "
        "the models it pins; a model that does not fit is refused before its weights are "
        "fetched (--force downloads it anyway). Resumes an interrupted download; prints "
        "the snapshot directory last.",
    )
    pull.add_argument("repo", help="the repo, org/name")
    pull.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    pull.add_argument(
        "--force", action="store_true", help="download even when the fit check says no"
    )
    pull.add_argument(
        "--config",
        type=Path,
        default=None,
        help="the config to check the fit against (default: $MLXD_CONFIG, else defaults)",
    )

    demo = sub.add_parser(
        "demo-model", help="prepare the built-in demo model and print its directory"
    )
    demo.add_argument(
        "--dtype",
        choices=["auto", "q4", "bfloat16", "float32"],
        default=None,
        help="weights to prepare (default: [model] demo_dtype of --config, else auto)",
    )
    demo.add_argument(
        "--config", type=Path, default=None, help="read [model] demo_dtype from this file"
    )
    return parser


def _target_flags(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"TOML config file to {verb} (default: $MLXD_CONFIG, else built-in defaults)",
    )
    parser.add_argument("--host", help="override [server] host")
    parser.add_argument("--port", type=int, help="override [server] port")


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if getattr(args, "host", None):
        out.setdefault("server", {})["host"] = args.host
    if getattr(args, "port", None):
        out.setdefault("server", {})["port"] = args.port
    if getattr(args, "log_level", None):
        out.setdefault("server", {})["log_level"] = args.log_level
    if getattr(args, "model", None):
        out.setdefault("model", {})["path"] = args.model
    return out


def _config_path(args: argparse.Namespace) -> Path | None:
    if args.config is not None:
        return args.config
    env = os.environ.get("MLXD_CONFIG")
    return Path(env) if env else None


def _check_config(args: argparse.Namespace) -> int:
    if args.path is not None and args.config is not None and args.path != args.config:
        print(
            f"two config files given ({args.path}, --config {args.config}): give one",
            file=sys.stderr,
        )
        return 2
    path = args.path or _config_path(args)
    if path is None:
        print(
            "no config file: mlxd check-config --config mlxd.toml (or $MLXD_CONFIG)",
            file=sys.stderr,
        )
        return 2
    try:
        settings = load_settings(path)
        problems = registry_problems(settings)
        if problems:
            raise ConfigError(str(path), [ConfigIssue(k, r) for k, r in problems])
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    for warning in missing_extras(settings):
        print(f"warning: {warning}", file=sys.stderr)
    sys.stdout.write(f"# {path}: valid. Effective config (defaults filled in, secrets masked):\n")
    sys.stdout.write("# Models (the registry):\n")
    sys.stdout.write("".join(f"#{line}\n" for line in describe(settings)))
    sys.stdout.write(effective_toml(settings))
    return 0


def _prepare_runtime(settings: Settings) -> bool:
    """Pick the BLAS before MLX loads (may re-execute this process once).

    Returns False (after logging why) when the configured BLAS is unusable.
    """
    from mlxd.runtime import blas

    try:
        blas.ensure_blas(settings.runtime.blas, settings.runtime.threads, sys.argv)
    except blas.BlasError as exc:
        logger.error("[runtime] blas: %s", exc)
        return False
    return True


def _demo_model(args: argparse.Namespace) -> int:
    setup_logging("info")
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    if not _prepare_runtime(settings):
        return 2
    import platform

    import mlx.core  # noqa: F401  (loaded so the mapped BLAS can be read)

    from mlxd import demo
    from mlxd.runtime.blas import mapped_blas

    dtype = demo.resolve_demo_dtype(
        args.dtype or settings.model.demo_dtype,
        system=platform.system(),
        optimized_blas=mapped_blas().optimized,
    )
    try:
        path = demo.prepare_demo_model(dtype)
    except demo.DemoModelUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    path = _config_path(args)
    overrides = _overrides(args)
    try:
        settings = load_settings(path, overrides=overrides)
    except ConfigError as exc:
        setup_logging("error")
        for line in str(exc).splitlines():  # one log line each: a log line never holds a newline
            logger.error("%s", line.strip())
        return 2
    setup_logging(settings.server.log_level)
    if not _prepare_runtime(settings):
        return 2
    from mlxd.process import exit_now
    from mlxd.server import serve

    exit_now(serve(settings, config_path=path, overrides=overrides))
    return 0  # not reached


def _pull(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from mlxd.config.sections import ModelSettings

    try:
        ModelSettings(repo=args.repo, revision=args.revision)
    except ValidationError as exc:
        print(exc.errors()[0]["msg"].removeprefix("Value error, "), file=sys.stderr)
        return 2
    try:
        settings = load_settings(_config_path(args))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    from mlxd import pull

    return pull.run(args, settings)


def _control(args: argparse.Namespace) -> int:
    import json

    from mlxd import control

    path = _config_path(args)
    target = control.find_target(path, host=args.host, port=args.port)
    if target.recorded:
        print(f"note: {target.recorded}", file=sys.stderr)
    method, route = ("POST", "/admin/reload") if args.command == "reload" else ("GET", "/stats")
    try:
        status, body = control.call(target, method, route)
    except control.Unreachable as exc:
        if target.note:
            print(f"note: {target.note}; using {target.url}", file=sys.stderr)
        print(f"{exc}: {control.unreachable_hint(path, args.command)}", file=sys.stderr)
        return 1
    rejected = args.command == "reload" and bool((body.get("reload") or body).get("issues"))
    if target.note and not rejected:  # a rejected reload lists the same issues itself
        print(f"note: {target.note}; using {target.url}", file=sys.stderr)
    if args.json:
        print(json.dumps(body, indent=1))
    if args.command == "reload":
        lines, code = control.reload_lines(status, body)
    elif status != 200:
        lines, code = [f"status refused (HTTP {status}): {control.message(body)}"], 1
    else:
        lines, code = control.status_lines(target.url, body)
    if not args.json:
        print("\n".join(lines))
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("reload", "status"):
        return _control(args)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "demo-model":
        return _demo_model(args)
    if args.command == "pull":
        return _pull(args)
    return _serve(args)
