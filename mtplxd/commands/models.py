"""`mtplxd pull | convert | models | rm`: from a Hugging Face repository id to a fast
local model with its MTP heads intact.

    pull REPO_ID    download (huggingface_hub: cache, token, offline mode, resume),
                    then convert into <state dir>/models/<name>/
    convert PATH    the same from a local folder, into --out DIR
    models          list the models folder
    rm NAME         delete one model from it

Every user error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

EXIT_USAGE = 2


# -- arguments -------------------------------------------------------------------------


def _quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default="4", choices=("4", "8", "none"),
                   help="trunk precision: 4 or 8 bits (mlx-lm's quantization), or none; the MTP heads "
                        "always stay in their float dtype (default 4)")
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), metavar="G",
                   help="quantization group size: 32, 64 or 128 (default 64)")


def _state_dir_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="DIR", help="state dir holding models/ (default: as for start)")


def add_pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo_id", metavar="REPO_ID|FILE.gguf",
                   help="Hugging Face repository, e.g. XiaomiMiMo/MiMo-7B-RL, or a local .gguf file")
    p.add_argument("--file", metavar="NAME.gguf", help="a GGUF file of the repository to import")
    p.add_argument("--revision", metavar="R", help="branch, tag or commit (default: main)")
    _quantize_arguments(p)
    p.add_argument("--name", help="name in the models folder (default: the repository's name + -4bit/-8bit)")
    _state_dir_argument(p)


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="checkpoint folder (Hugging Face layout) with MTP heads, "
                                                "or a .gguf file")
    p.add_argument("--out", metavar="DIR", required=True, help="output folder (must not exist)")
    _quantize_arguments(p)
    p.add_argument("--no-heads", action="store_true",
                   help="a .gguf file: the trunk alone, without the MTP heads mtplxd ships for it "
                        "(a model to train heads for: mtplxd train --heads-only)")


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    _state_dir_argument(p)


def add_rm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="a name listed by `mtplxd models`")
    _state_dir_argument(p)


# -- pull / convert ------------------------------------------------------------------------


def run_pull(args: argparse.Namespace) -> int:
    return _guarded("pull", lambda: _pull(args))


def run_convert(args: argparse.Namespace) -> int:
    return _guarded("convert", lambda: _convert(args))


def _guarded(command: str, body) -> int:
    """Run a pull or convert; its user errors become one line and exit code 2."""
    # transformers (imported by mlx-lm) would advise on stderr that PyTorch is absent: not needed.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import engine  # noqa: F401  (the fast BLAS before MLX)
    from engine.checkpoint import CheckpointError
    from mtplxd.store.hub import HubError
    from mtplxd.store.models import ModelError

    try:
        return body()
    except (CheckpointError, HubError, ModelError) as e:
        print(f"mtplxd {command}: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # disk full while writing, permissions
        where = f"{e.filename}: " if e.filename else ""
        print(f"mtplxd {command}: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mtplxd {command}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


def _spec(args: argparse.Namespace):
    from engine.conversion import QuantSpec

    return QuantSpec(None if args.quantize == "none" else int(args.quantize), args.group_size)


def _pull(args: argparse.Namespace) -> int:
    from engine.gguf_import import is_gguf

    if args.file or is_gguf(args.repo_id):
        return _pull_gguf(args)
    return _pull_repository(args)


def _pull_gguf(args: argparse.Namespace) -> int:
    """A local .gguf file, or one file of a repository: imported into the models folder."""
    from engine.gguf_import import GGUFError, is_gguf
    from mtplxd.config import resolve_state_dir
    from mtplxd.store import hub
    from mtplxd.store.models import check_name, check_repo_id, models_dir

    if args.file and not is_gguf(args.file):
        raise GGUFError(f"--file {args.file}: not a .gguf file")
    local = Path(args.repo_id).expanduser()
    if args.file:
        check_repo_id(args.repo_id)
    elif not local.is_file():
        raise GGUFError(f"{local}: no such file")
    name = check_name(args.name or Path(args.file or local.name).stem)
    dest = models_dir(resolve_state_dir(args.state_dir)) / name
    source = f"{args.repo_id}:{args.file}" if args.file else str(local.absolute())
    path = hub.download_file(args.repo_id, args.file, args.revision) if args.file else local
    if dest.exists() and _already_imported(dest, name, source, path):
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    return _import_gguf(path, dest, args, source, args.revision)


def _import_gguf(path: Path, dest: Path, args: argparse.Namespace, source: str, revision: str | None) -> int:
    """Import into `dest`; one there already (an import with older heads) is replaced
    only once the new one is complete."""
    import shutil

    from engine.gguf_import import import_gguf, read_gguf
    from mtplxd.store.models import new_record, write_record

    spec = _spec(args)
    plan = read_gguf(path)  # a bad file is refused in one line, before any progress is printed
    print(f"importing {path.name}", file=sys.stderr)
    fresh = dest.with_name(f".{dest.name}.new") if dest.exists() else dest
    if fresh != dest:
        shutil.rmtree(fresh, ignore_errors=True)
    result = import_gguf(plan, fresh, spec.bits, spec.group_size, source=source,
                         heads=not getattr(args, "no_heads", False))
    write_record(fresh, {**new_record(dest.name, source, revision, result),
                         "heads_digest": result.heads_digest, "file_sha256": _sha256(path)})
    if fresh != dest:
        old = dest.with_name(f".{dest.name}.old")
        os.replace(dest, old)
        os.replace(fresh, dest)
        shutil.rmtree(old, ignore_errors=True)
        result = dataclasses.replace(result, out=dest)
    quant = "quantized as in the file" if result.quantization else "float"
    heads = f"{result.mtp_heads} shipped MTP head(s)" if result.mtp_heads else "no MTP head (AR only)"
    print(f"{dest}: {result.family}, {heads}, {quant}, {_size(result.size_bytes)}; "
          f"start it with: mtplxd start --model {dest.name}")
    return 0


def _pull_repository(args: argparse.Namespace) -> int:
    from engine.conversion import convert_checkpoint
    from mtplxd.store import hub
    from mtplxd.config import resolve_state_dir
    from mtplxd.store.models import check_name, check_repo_id, default_name, models_dir, new_record, write_record

    spec = _spec(args)
    check_repo_id(args.repo_id)
    name = check_name(args.name or default_name(args.repo_id, spec.bits))
    dest = models_dir(resolve_state_dir(args.state_dir)) / name
    if dest.exists():
        return _already_there(dest, name, args.repo_id, spec)
    _check_before_download(args.repo_id, args.revision, spec, dest)
    snapshot = hub.download(args.repo_id, args.revision)
    commit = snapshot.name  # the cache's snapshots/<commit> folder
    print(f"converting {args.repo_id} ({commit[:12]}): trunk {spec.describe()}, MTP heads kept in float",
          file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    result = convert_checkpoint(snapshot, dest, spec, source=args.repo_id, revision=commit)
    write_record(dest, new_record(name, args.repo_id, commit, result))
    _print_result(result, f"mtplxd start --model {name}")
    return 0


def _already_there(dest: Path, name: str, repo_id: str, spec) -> int:
    from mtplxd.store.models import ModelError, read_record

    record = read_record(dest) or {}
    wanted = {"bits": spec.bits, "group_size": spec.group_size} if spec.bits else None
    if record.get("source") == repo_id and record.get("quantization") == wanted:
        print(f"{name} is already pulled ({dest}); start it with: mtplxd start --model {name}")
        return 0
    raise ModelError(f"{dest} already exists (from {record.get('source', 'elsewhere')}); "
                     f"choose another --name, or remove it with: mtplxd rm {name}")


def _already_imported(dest: Path, name: str, source: str, path: Path) -> bool:
    """True when `dest` is this file's import with the heads shipped now; False when it is
    one with other heads, or one of the same file from another place (to be redone); a
    model from elsewhere is an error. The file is known by its content: a clone elsewhere
    on disk pulls the same file under another path."""
    from engine.gguf_import import read_gguf
    from engine.shipped_heads import shipped_heads
    from mtplxd.store.models import ModelError, read_record

    record = read_record(dest) or {}
    if not _same_file(record, source, path):
        raise ModelError(f"{dest} already exists (from {record.get('source', 'elsewhere')}); "
                         f"choose another --name, or remove it with: mtplxd rm {name}")
    heads = shipped_heads(read_gguf(path).metadata)
    if record.get("heads_digest") != (heads.digest if heads else None):
        print(f"{name}: the MTP heads shipped for it changed; importing again", file=sys.stderr)
        return False
    if "file_sha256" not in record:
        print(f"{name}: imported before from {record.get('source')}; importing again", file=sys.stderr)
        return False
    print(f"{name} is already imported ({dest}); start it with: mtplxd start --model {name}")
    return True


def _same_file(record: dict, source: str, path: Path) -> bool:
    """Whether `record` is an import of the file at `path`: the same content, or (for a
    record older than content hashes) the same source or a .gguf file of the same name."""
    if "file_sha256" in record:
        return record["file_sha256"] == _sha256(path)
    old = str(record.get("source") or "")
    return old == source or (old.endswith(".gguf") and Path(old).name == path.name)


def _sha256(path: Path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_before_download(repo_id: str, revision: str | None, spec, dest: Path) -> None:
    """Online only: refuse a repository without weights or MTP head, or a disk without room,
    before the weights are fetched."""
    from engine.backends.descriptors import inspect_keys
    from engine.conversion import check_room, coarse_output_bytes, refuse_without_heads
    from mtplxd.store import hub

    remote = hub.list_remote(repo_id, revision)
    if remote is None:  # offline: the cache serves what it has
        return
    if not remote.weight_files:
        raise hub.HubError(f"{repo_id}: no safetensors weights (mtplxd converts safetensors checkpoints)")
    listing = hub.config_and_keys(repo_id, remote)
    if listing is not None:
        refuse_without_heads(repo_id, inspect_keys(*listing), f"\"$(hf download {repo_id})\"")
    output = coarse_output_bytes(remote.weight_bytes, spec)
    if hub.same_disk(hub.cache_dir(), dest.parent):
        check_room(dest.parent, remote.to_download + output, "the download and the converted model")
    else:
        check_room(hub.cache_dir(), remote.to_download, "the download")
        check_room(dest.parent, output, "the converted model")
    fetch = "nothing" if remote.to_download == 0 else _size(remote.to_download)
    print(f"pulling {repo_id}: {len(remote.sizes)} files, {fetch} to fetch into {hub.cache_dir()}",
          file=sys.stderr)


def _convert(args: argparse.Namespace) -> int:
    from engine.conversion import ConversionError, convert_checkpoint
    from engine.gguf_import import is_gguf
    from mtplxd.store.models import new_record, write_record

    spec = _spec(args)
    source = str(Path(args.path).expanduser().absolute())
    if is_gguf(source):
        out = Path(args.out).expanduser().absolute()
        if out.exists():
            raise ConversionError(f"{out}: already exists; remove it or choose another output folder")
        return _import_gguf(Path(source), out, args, source, None)
    result = convert_checkpoint(source, args.out, spec)
    write_record(result.out, new_record(result.out.name, source, None, result))
    _print_result(result, f"mtplxd start --model {result.out}")
    return 0


def _print_result(result, start: str) -> None:
    quant = f"{result.quantization['bits']}-bit" if result.quantization else "float"
    print(f"{result.out}: {result.family}, {result.mtp_heads} MTP head(s), {quant} trunk "
          f"({result.bits_per_weight:.2f} bits/weight), {_size(result.size_bytes)}; start it with: {start}")


# -- models / rm ---------------------------------------------------------------------------


def run_models(args: argparse.Namespace) -> int:
    from mtplxd.config import resolve_state_dir
    from mtplxd.store.models import list_models, models_dir

    state_dir = resolve_state_dir(args.state_dir)
    rows = [_row(entry) for entry in list_models(state_dir)]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no models in {models_dir(state_dir)} (get one with: mtplxd pull REPO_ID)")
    else:
        _print_table(rows)
    return 0


def _row(entry) -> dict:
    from mtplxd.store.models import folder_bytes

    record = entry.record or _inspected(entry.path)
    quant = record.get("quantization")
    return {
        "name": entry.name,
        "family": record.get("family", "?"),
        "heads": record.get("mtp_heads", "?"),
        "size_bytes": folder_bytes(entry.path),
        "quantization": f"{quant['bits']}-bit g{quant['group_size']}" if quant else "none",
        "last_used": record.get("last_used"),
        "source": record.get("source"),
        "path": str(entry.path),
    }


def _inspected(folder: Path) -> dict:
    """For a folder copied in by hand (no record): what inspection says, else nothing."""
    from engine.backends.descriptors import inspect_checkpoint
    from engine.checkpoint import CheckpointError, read_config
    from engine.quantized import quantization

    try:
        report = inspect_checkpoint(folder)
        return {"family": report.family, "mtp_heads": report.mtp_heads,
                "quantization": quantization(read_config(folder))}
    except (CheckpointError, OSError):
        return {}


def _print_table(rows: list[dict]) -> None:
    header = ("NAME", "FAMILY", "HEADS", "SIZE", "QUANTIZATION", "LAST USED")
    table = [header] + [
        (r["name"], r["family"], str(r["heads"]), _size(r["size_bytes"]), r["quantization"], _when(r["last_used"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def run_rm(args: argparse.Namespace) -> int:
    from mtplxd.config import resolve_state_dir
    from mtplxd.store.models import ModelError, remove_model

    try:
        path = remove_model(resolve_state_dir(args.state_dir), args.name)
    except ModelError as e:
        print(f"mtplxd rm: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"removed {args.name} ({path})")
    return 0


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(timestamp: float | None) -> str:
    if not timestamp:
        return "never"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")
