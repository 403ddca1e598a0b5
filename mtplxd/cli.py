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
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="checkpoint folder (Hugging Face layout)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _inspect(args: argparse.Namespace) -> int:
    from mtplxd import inspect_cmd

    return inspect_cmd.run(args.path, args.json)


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _doctor(args: argparse.Namespace) -> int:
    from mtplxd import doctor

    return doctor.run(args.json)


# -- start / stop / status ------------------------------------------------------

# `start` flags that are settings (dest == Settings field); see mtplxd/config.py.
_SETTING_FLAGS = {
    "--model": dict(metavar="PATH", help="checkpoint folder (default: the embedded model)"),
    "--host": dict(help="address to listen on (default 127.0.0.1; others need --api-key)"),
    "--port": dict(type=int, help="TCP port (default 8765; 0 picks a free one)"),
    "--state-dir": dict(metavar="DIR", help="pid, address, logs, caches (default: MTPLXD_HOME or the user state folder)"),
    "--profile": dict(metavar="P", help="decoding profile"),
    "--depth": dict(metavar="K", type=int, help="default speculative depth (default 2)"),
    "--api-key": dict(metavar="KEY", help="require this bearer token from clients"),
    "--log-level": dict(metavar="LEVEL", help="debug, info, warning, error (default info)"),
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
    from mtplxd.config import ConfigError, load_settings

    try:
        settings = load_settings({_dest(f): getattr(args, _dest(f)) for f in _SETTING_FLAGS}, args.config)
    except ConfigError as e:
        print(f"mtplxd: {e}", file=sys.stderr)
        return 2
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


def _start_detached(args: argparse.Namespace, settings) -> int:
    from mtplxd import client

    child = ["--state-dir", str(settings.state_dir)]  # the folder this process waits on
    for flag in _SETTING_FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None and flag not in ("--state-dir", "--api-key"):
            child += [flag, str(value)]
    if args.config:
        child += ["--config", args.config]
    # The key travels in the environment: a long-lived process's argv is public (ps).
    env = {"MTPLXD_API_KEY": args.api_key} if args.api_key else None
    code, message = client.spawn(settings.state_dir, child, settings.api_key, env=env)
    if code != 0:
        print(f"mtplxd: {message}", file=sys.stderr)
        return code
    print(message)
    hint = settings.missing_model_hint()
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
    rows = [("state dir", report["state_dir"]), ("uptime", _duration(report.get("uptime_s")))]
    health = report.get("health")
    if health is None:
        rows.append(("health", "not answering"))
    for key, value in (health or {}).items():  # whatever /health reports, flattened one level
        items = value.items() if isinstance(value, dict) else [(None, value)]
        rows += [(f"{key}.{sub}" if sub else key, _show(v)) for sub, v in items]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


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
    p.add_argument("--model", metavar="PATH", help="checkpoint to serve (default: the embedded model)")
    p.add_argument("--requests", type=int, default=20, metavar="N", help="interactive requests per phase")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def _bench(args: argparse.Namespace) -> int:
    if not args.serve:
        print("mtplxd bench: only --serve exists so far", file=sys.stderr)
        return 2
    from mtplxd import bench_serve

    return bench_serve.run(args.model, args.requests, args.json)


# -- train ---------------------------------------------------------------------

_TRAIN_HELP = """\
Train a small MiMo-layout code model (trunk + MTP heads) from scratch, or, with
--heads-only, new MTP heads for an existing MiMo / Qwen2 / Llama-style
checkpoint that has none (its trunk frozen, heads distilled from its own
next-token distribution; the output folder is the original files plus
mtp.safetensors and an updated config.json).

Defaults (the shipped model): byte-level BPE vocab 4096, hidden 256, 10 layers
(FFN 768, 4 attention / 2 KV heads, tied embeddings), 2 MTP heads: 10.8M
parameters, 21.5 MB in bfloat16; seq-len 256, batch 8, 1600 steps, lr 2e-3
(warmup, cosine decay to 10%), corpus: this Python's standard library minus
tests and a fixed held-out list. Heads-only defaults: 2 heads, 600 steps,
lr 1e-3, seq-len 256, batch 8.

Checkpoints every --save-every steps and on Ctrl-C; --resume continues from
the last one (data order, optimizer state and schedule included). Progress,
losses and held-out metrics: <out>/train_state/log.jsonl.
"""


def _train_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = _TRAIN_HELP
    p.add_argument("--out", metavar="DIR", required=True, help="output checkpoint folder")
    p.add_argument("--corpus", metavar="DIR", help="folder of *.py files (default: the standard library)")
    p.add_argument("--max-corpus-mb", metavar="MB", type=float, help="cap the corpus size (default: all)")
    p.add_argument("--heads-only", action="store_true", help="train MTP heads for --model, trunk frozen")
    p.add_argument("--model", metavar="PATH", help="checkpoint to add heads to (with --heads-only)")
    p.add_argument("--vocab", metavar="N", type=int, help="tokenizer vocabulary (default 4096)")
    p.add_argument("--layers", metavar="N", type=int, help="trunk layers (default 10)")
    p.add_argument("--hidden", metavar="N", type=int, help="hidden size (default 256)")
    p.add_argument("--heads", metavar="N", type=int, help="MTP heads (default 2)")
    p.add_argument("--steps", metavar="N", type=int, help="optimizer steps (default 1600; heads-only 600)")
    p.add_argument("--seq-len", metavar="N", type=int, help="tokens per sequence (default 256)")
    p.add_argument("--batch", metavar="N", type=int, help="sequences per step (default 8)")
    p.add_argument("--lr", metavar="X", type=float, help="peak learning rate (default 2e-3; heads-only 1e-3)")
    p.add_argument("--seed", metavar="S", type=int, help="seed for init, FIM and data order (default 0)")
    p.add_argument("--save-every", metavar="N", type=int, help="checkpoint interval in steps (default 100)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--no-compile", action="store_true", help="do not mx.compile the training step")


def _train(args: argparse.Namespace) -> int:
    import engine  # noqa: F401  (the fast BLAS before MLX)
    from engine import train
    from engine.checkpoint import CheckpointError

    given = {
        "corpus": args.corpus, "vocab": args.vocab, "layers": args.layers, "hidden": args.hidden,
        "heads": args.heads, "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
        "lr": args.lr, "seed": args.seed, "save_every": args.save_every,
        "max_corpus_bytes": int(args.max_corpus_mb * 1e6) if args.max_corpus_mb else None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.no_compile:
        given["compile"] = False
    try:
        if args.resume:
            ignored = sorted(set(given) - set(train.RESUMABLE))
            if ignored or args.model:
                print(f"mtplxd: --resume continues the saved run; ignoring "
                      f"{', '.join('--' + k.replace('_', '-') for k in ignored + (['model'] if args.model else []))}",
                      file=sys.stderr)
            result = train.resume_training(args.out, **{k: v for k, v in given.items() if k in train.RESUMABLE})
        elif args.heads_only:
            if not args.model:
                print("mtplxd: --heads-only needs --model PATH", file=sys.stderr)
                return 2
            wrong = sorted({"vocab", "layers", "hidden"} & set(given))
            if wrong:
                print(f"mtplxd: --heads-only keeps the model's trunk; drop --{', --'.join(wrong)}", file=sys.stderr)
                return 2
            result = train.train_heads(train.HeadsSettings(model=args.model, out=args.out, **given))
        else:
            if args.model:
                print("mtplxd: --model is for --heads-only", file=sys.stderr)
                return 2
            result = train.train_model(train.ModelSettings(out=args.out, **given))
    except KeyboardInterrupt:
        print(f"mtplxd: interrupted; the last checkpoint is in {args.out} "
              f"(continue with: mtplxd train --out {args.out} --resume)", file=sys.stderr)
        return 130
    except (OSError, ValueError, CheckpointError) as e:
        print(f"mtplxd: {e}", file=sys.stderr)
        return 1
    last = result.evals[-1] if result.evals else {}
    extra = "".join(f", {k} {v:.3f}" for k, v in last.items() if k != "step")
    print(f"trained {result.step}/{result.steps} steps at {result.tokens_per_s:,.0f} tokens/s{extra}; "
          f"checkpoint: {result.out}")
    return 0


COMMANDS: dict[str, Command] = {
    "bench": Command("benchmarks: --serve times interactive requests under load", _bench_args, _bench),
    "start": Command(
        "start the daemon (foreground unless --detach)",
        _start_args,
        _start,
    ),
    "stop": Command("stop the running daemon (not running is not an error)", _state_dir_args, _stop),
    "status": Command(
        "show the running daemon: model, state, uptime, queue, memory (exit 3 if not running)",
        _status_args,
        _status,
    ),
    "inspect": Command(
        "classify a checkpoint: family, MTP heads, depth range, status "
        "(exit 0 supported, 3 ar-only, 4 unsupported, 2 unreadable)",
        _inspect_args,
        _inspect,
    ),
    "doctor": Command(
        "check the installation: MLX device, which BLAS serves it, measured matmul GFLOP/s",
        _doctor_args,
        _doctor,
    ),
    "train": Command(
        "train the small MTP code model, or MTP heads for a checkpoint without them (--heads-only)",
        _train_args,
        _train,
    ),
    # "lsp", "mcp", "bench": added here.
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
    return COMMANDS[args.command].run(args)
