"""The `mtplxd` command line.

Each subcommand is two small functions, one adding its arguments and one
running it (returning the exit code), registered in COMMANDS. To add one:

    def _doctor_args(p: argparse.ArgumentParser) -> None: ...
    def _doctor(args: argparse.Namespace) -> int: ...
    COMMANDS["doctor"] = Command("check the installation", _doctor_args, _doctor)

Import what a subcommand needs inside its run function, so that `mtplxd
--help` and quick commands stay fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from engine.profiles import PROFILE_NAMES


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="checkpoint folder (Hugging Face layout)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _inspect(args: argparse.Namespace) -> int:
    from mtplxd.commands import inspect as inspect_cmd

    return inspect_cmd.run(args.path, args.json)


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model", help="model to measure decoding on (default: the configured one)")
    p.add_argument("--no-model", action="store_true", help="skip the model: installation checks only")


def _doctor(args: argparse.Namespace) -> int:
    from mtplxd.commands import doctor
    from mtplxd.config import load_settings

    model = None if args.no_model else (args.model or str(load_settings({}).model_path))
    return doctor.run(args.json, model)


# -- start / stop / status ------------------------------------------------------

# `start` flags that are settings (dest == Settings field); see mtplxd/config.py.
_SETTING_FLAGS: dict[str, dict[str, Any]] = {
    "--model": dict(metavar="MODEL", help="checkpoint folder, name in the models folder or pulled "
                    "repository id (default: the embedded model)"),
    "--host": dict(help="address to listen on (default 127.0.0.1; others need --api-key)"),
    "--port": dict(type=int, help="TCP port (default 8765; 0 picks a free one)"),
    "--state-dir": dict(metavar="DIR", help="pid, address, logs, caches (default: MTPLXD_HOME or the user state folder)"),
    "--profile": dict(choices=PROFILE_NAMES, help="decoding profile (default: chosen from the model)"),
    "--depth": dict(metavar="K", type=int, help="force a speculative depth (default: the profile's measured choice)"),
    "--api-key": dict(metavar="KEY", help="require this bearer token from clients"),
    "--log-level": dict(metavar="LEVEL", help="debug, info, warning, error (default info)"),
    "--ranks": dict(metavar="N", type=int, help="split the model over N processes on this machine "
                    "(mx.distributed ring backend on loopback; default 1)"),
}


def _start_args(p: argparse.ArgumentParser) -> None:
    for flag, options in _SETTING_FLAGS.items():
        p.add_argument(flag, **options)
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: <state dir>/config.toml)")
    p.add_argument("--detach", action="store_true", help="run in the background; print the URL once it answers")
    p.add_argument("--no-stderr-log", action="store_true", help=argparse.SUPPRESS)  # set by --detach


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _start(args: argparse.Namespace) -> int:
    from mtplxd import client
    from mtplxd.config import ConfigError, launched_rank, load_settings

    try:
        settings = load_settings({_dest(f): getattr(args, _dest(f)) for f in _SETTING_FLAGS}, args.config)
        rank = launched_rank()
    except ConfigError as e:
        print(f"mtplxd: {e}", file=sys.stderr)
        return 2
    if rank is not None:  # mlx.launch started this process: rank 0 serves, the others follow
        return _launched(settings, rank)
    running = client.owner_pid(settings.state_dir)
    if running is not None:  # refuse before the slow imports; the daemon's lock decides races
        where = client.daemon_url(settings.state_dir) or "(still starting)"
        print(f"mtplxd is already running at {where} (pid {running}); stop it with: "
              f"mtplxd stop --state-dir {settings.state_dir}", file=sys.stderr)
        return 1
    if args.detach:
        return _start_detached(args, settings)
    from mtplxd import daemon

    return daemon.run(settings, log_to_stderr=not args.no_stderr_log)


def _launched(settings: Any, rank: int) -> int:
    from mtplxd.ranks.world import World

    world = World(rank, "any")  # mlx.launch set what mx.distributed.init reads
    if rank > 0:
        return _follow_as(world, settings.state_dir, settings.log_level)
    if settings.ranks > 1:
        print("mtplxd: --ranks starts ranks on this machine; under mlx.launch the launcher starts them",
              file=sys.stderr)
        return 2
    from mtplxd import daemon

    return daemon.run(settings, world=world)


def _follow_args(p: argparse.ArgumentParser) -> None:
    _state_dir_args(p)
    p.add_argument("--log-level", default="info", help="debug, info, warning, error (default info)")


def _follow(args: argparse.Namespace) -> int:
    from mtplxd.config import ConfigError, launched_rank, resolve_state_dir
    from mtplxd.ranks.world import World

    try:
        rank = launched_rank()
    except ConfigError as e:
        print(f"mtplxd: {e}", file=sys.stderr)
        return 2
    if not rank:
        print("mtplxd: follow runs as a rank above 0 (MLX_RANK), started by `mtplxd start --ranks N` "
              "or mlx.launch", file=sys.stderr)
        return 2
    return _follow_as(World(rank, "any"), resolve_state_dir(args.state_dir), args.log_level)


def _follow_as(world: Any, state_dir: Any, level: str) -> int:
    import logging

    from mtplxd.ranks.follower import follow

    logging.basicConfig(level=level.upper(), format=f"%(asctime)s rank{world.rank} %(name)s %(levelname)s %(message)s")
    return follow(world, state_dir)


def _start_detached(args: argparse.Namespace, settings) -> int:
    from mtplxd import client

    child = ["--state-dir", str(settings.state_dir)]  # the folder this process waits on
    for flag in _SETTING_FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None and flag not in ("--state-dir", "--api-key"):
            child += [flag, str(settings.model if flag == "--model" else value)]  # the resolved folder
    if args.config:
        child += ["--config", args.config]
    # The key travels in the environment: a long-lived process's argv is public (ps).
    env = {"MTPLXD_API_KEY": args.api_key} if args.api_key else None
    code, message = client.spawn(settings.state_dir, child, settings.api_key, env=env)
    if code != 0:
        print(f"mtplxd: {message}", file=sys.stderr)
        return code
    print(message)
    for hint in (settings.missing_model_hint(), settings.default_model_note()):
        if hint:
            print(f"mtplxd: warning: {hint}", file=sys.stderr)
    return 0


def _state_dir_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="DIR", help="the daemon's state dir (default: as for start)")


def _stop(args: argparse.Namespace) -> int:
    from mtplxd import client
    from mtplxd.config import resolve_state_dir

    code, message = client.stop(resolve_state_dir(args.state_dir))
    print(message, file=sys.stdout if code == 0 else sys.stderr)
    return code


def _status_args(p: argparse.ArgumentParser) -> None:
    _state_dir_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _status(args: argparse.Namespace) -> int:
    import json

    from mtplxd import client
    from mtplxd.config import ConfigError, load_settings, resolve_state_dir

    try:  # the key, where one is configured, in case /health asks for it
        settings = load_settings({"state_dir": args.state_dir})
        state_dir, api_key = settings.state_dir, settings.api_key
    except ConfigError:
        state_dir, api_key = resolve_state_dir(args.state_dir), None
    report = client.status(state_dir, api_key)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_status(report)
    if not report["running"]:
        return 3
    return 1 if "url" in report and report.get("health") is None else 0


def _print_status(report: dict) -> None:
    if not report["running"]:
        print(f"mtplxd is not running (state dir {report['state_dir']})")
        return
    if "url" not in report:
        print(f"mtplxd is starting (pid {report['pid']}, state dir {report['state_dir']})")
        return
    print(f"mtplxd is running at {report['url']} (pid {report['pid']}, version {report.get('version')})")
    print(f"  page: {report['page']} (mtplxd open)")
    for warning in report.get("warnings", []):  # degraded but serving (a full disk): say it first
        print(f"  warning: {warning}")
    rows = [("state dir", report["state_dir"]), ("uptime", _duration(report.get("uptime_s")))]
    health = report.get("health")
    if health is None:
        rows.append(("health", "not answering"))
    for key, value in (health or {}).items():  # whatever /health reports, flattened one level
        if key == "warnings":
            continue  # printed above
        items = value.items() if isinstance(value, dict) else [(None, value)]
        rows += [(f"{key}.{sub}" if sub else key, _show(v)) for sub, v in items]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _open(args: argparse.Namespace) -> int:
    """Open the running daemon's page in the user's browser."""
    import webbrowser

    from mtplxd import client
    from mtplxd.config import resolve_state_dir

    report = client.status(resolve_state_dir(args.state_dir), None)
    if "page" not in report:
        print("mtplxd is not running: start it with `mtplxd start`", file=sys.stderr)
        return 3
    print(f"opening {report['page']}")
    if not webbrowser.open(report["page"]):
        print("no browser could be started here: open that address yourself", file=sys.stderr)
    return 0


def _show(value: object) -> str:
    import json

    if isinstance(value, float):
        return f"{value:.3g}"
    return value if isinstance(value, str) else json.dumps(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = int(seconds)
    return f"{s // 3600}h {s // 60 % 60:02d}m {s % 60:02d}s" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", action="store_true",
                   help="time interactive completions alone and behind 4 normal streams, over HTTP")
    p.add_argument("--streams", metavar="N,N",
                   help="aggregate tok/s and latencies at N concurrent streams, batching on and off (e.g. 1,4,8)")
    p.add_argument("--ranks", metavar="N,N",
                   help="decode tok/s and MTP/AR per world size, the model split over N processes here (e.g. 1,2)")
    p.add_argument("--shares", action="store_true",
                   help="4 streaming chats with and without 4 editors sending interactive completions back to "
                        "back: the chats' answer rate and first-token p99, the editors' p95 (the scheduler's shares)")
    p.add_argument("--seconds", type=float, default=15.0, metavar="S", help="--shares: length of each phase")
    p.add_argument("--patience", type=int, metavar="N",
                   help="--shares: the daemon's patience_normal (default: the setting's default)")
    p.add_argument("--sessions", action="store_true",
                   help="time to first token of a ~2,000-token prompt: cold, warm from RAM, warm from disk "
                        "after a restart, and an 8-turn chat (the session bank)")
    p.add_argument("--model", metavar="MODEL",
                   help="checkpoint folder, models-folder name or pulled repository id (default: the embedded model)")
    p.add_argument("--requests", type=int, default=20, metavar="N", help="--serve: interactive requests per phase")
    p.add_argument("--prompts", type=int, default=4, metavar="N", help="held-out prompts per configuration")
    p.add_argument("--rounds", type=int, default=3, metavar="N", help="A B A B rounds over all configurations")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens generated per run")
    p.add_argument("--depths", default="1,2,3", metavar="K,K", help="MTP depths to compare with AR")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="also write the figures as JSON to FILE (stdout without FILE)")
    p.add_argument("--profile", choices=PROFILE_NAMES,
                   help="profile to measure (default: chosen from the model)")
    p.add_argument("--no-save", action="store_true",
                   help="do not store the measurement (by default the daemon's profiles use it to pick the depth)")


def _bench(args: argparse.Namespace) -> int:
    as_json = args.json is not None
    if args.model:
        from mtplxd.config import resolve_state_dir
        from mtplxd.store.models import ModelError, resolve_model

        try:
            args.model = str(resolve_model(args.model, resolve_state_dir()))
        except ModelError as e:
            print(f"mtplxd bench: {e}", file=sys.stderr)
            return 2
    if args.shares:
        from mtplxd.bench import shares as bench_shares

        settings = {} if args.patience is None else {"patience_normal": args.patience}
        return bench_shares.run(args.model, args.rounds, args.seconds, settings, as_json)
    if args.sessions:
        from mtplxd.bench import sessions as bench_sessions

        return bench_sessions.run(args.model, as_json)
    if args.streams:
        from mtplxd.bench import streams as bench_streams

        counts = [int(n) for n in args.streams.split(",") if n.strip()]
        return bench_streams.run(args.model, counts, args.rounds, args.max_tokens, as_json)
    if args.ranks:
        from mtplxd.bench import ranks as bench_ranks

        sizes = [int(n) for n in args.ranks.split(",") if n.strip()]
        depth = int(args.depths.split(",")[-1]) if args.depths else 2
        return bench_ranks.run(args.model, sizes, args.rounds, args.max_tokens, depth, as_json)
    if args.serve:
        from mtplxd.bench import serve as bench_serve

        return bench_serve.run(args.model, args.requests, as_json)
    from mtplxd.bench import decode as bench

    from mtplxd.config import resolve_state_dir

    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    state_dir = None if args.no_save else resolve_state_dir()
    return bench.run(args.model, args.prompts, args.rounds, args.max_tokens, depths, args.json,
                     args.profile, state_dir)


def _train_args(p: argparse.ArgumentParser) -> None:
    from mtplxd.commands import train as train_cmd

    train_cmd.add_arguments(p)


def _train(args: argparse.Namespace) -> int:
    from mtplxd.commands import train as train_cmd

    return train_cmd.run(args)


def _lsp_args(p: argparse.ArgumentParser) -> None:
    from mtplxd.shims import lsp_bridge

    lsp_bridge.add_arguments(p)


def _lsp(args: argparse.Namespace) -> int:
    from mtplxd.shims import lsp_bridge

    return lsp_bridge.run(args.state_dir, args.model)


def _mcp_args(p: argparse.ArgumentParser) -> None:
    from mtplxd.shims import mcp_shim  # standard library only at import: the parser stays fast

    mcp_shim.add_arguments(p)


def _mcp(args: argparse.Namespace) -> int:
    from mtplxd.shims import mcp_shim

    return mcp_shim.main(args)


def _models_command(adder: str, runner: str) -> tuple[Callable, Callable]:
    """Arguments and run of a models_cmd subcommand, imported only when used."""

    def add_arguments(p: argparse.ArgumentParser) -> None:
        from mtplxd.commands import models as models_cmd

        getattr(models_cmd, adder)(p)

    def run(args: argparse.Namespace) -> int:
        from mtplxd.commands import models as models_cmd

        return getattr(models_cmd, runner)(args)

    return add_arguments, run


COMMANDS: dict[str, Command] = {
    "bench": Command(
        "AR against MTP at depths 1..3 on held-out code (decode tok/s, acceptance, speedup); "
        "--serve: interactive latency under load; --sessions: the session bank",
        _bench_args,
        _bench,
    ),
    "start": Command(
        "start the daemon (foreground unless --detach)",
        _start_args,
        _start,
    ),
    "follow": Command(
        "run as a follower rank of a daemon split over several processes (started for you)",
        _follow_args,
        _follow,
    ),
    "stop": Command("stop the running daemon (not running is not an error)", _state_dir_args, _stop),
    "status": Command(
        "show the running daemon: model, state, uptime, queue, memory (exit 3 if not running)",
        _status_args,
        _status,
    ),
    "open": Command("open the running daemon's page (status, plots, playground) in the browser",
                    _state_dir_args, _open),
    "inspect": Command(
        "classify a checkpoint: family, MTP heads, depth range, status "
        "(exit 0 supported, 3 ar-only, 4 unsupported, 2 unreadable)",
        _inspect_args,
        _inspect,
    ),
    "doctor": Command(
        "check the installation: MLX device, which BLAS serves it, matmul GFLOP/s, memory "
        "bandwidth, and what decoding the model reads per token and achieves",
        _doctor_args,
        _doctor,
    ),
    "train": Command(
        "train the small MTP code model, or MTP heads for a checkpoint without them (--heads-only)",
        _train_args,
        _train,
    ),
    "pull": Command(
        "download a Hugging Face model with MTP heads and convert it (trunk 4/8-bit, heads kept) "
        "into the models folder",
        *_models_command("add_pull_arguments", "run_pull"),
    ),
    "convert": Command(
        "convert a local checkpoint folder with MTP heads (trunk 4/8-bit, heads kept) into --out DIR",
        *_models_command("add_convert_arguments", "run_convert"),
    ),
    "models": Command(
        "list the models folder: name, family, heads, size, quantization, last used",
        *_models_command("add_models_arguments", "run_models"),
    ),
    "rm": Command("remove a model from the models folder", *_models_command("add_rm_arguments", "run_rm")),
    "lsp": Command(
        "language server for editors on stdio: bridges to the daemon, starting it if none runs",
        _lsp_args,
        _lsp,
    ),
    "mcp": Command(
        "MCP server for coding agents on stdio: forwards to the daemon, starting it if none runs",
        _mcp_args,
        _mcp,
    ),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtplxd")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtplxd", description="Local MLX inference daemon with multi-token-prediction decoding."
    )
    parser.add_argument("--version", action="version", version=f"mtplxd {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code = COMMANDS[args.command].run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`mtplxd inspect M | head -1`): stop quietly, and point
        # stdout at /dev/null so the interpreter's own flush at exit does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
