"""`mtplxd inspect PATH [--json]`: classify a checkpoint folder.

Reads config.json and safetensors headers only. Exit codes: 0 supported
(MTP decoding), 3 ar-only (plain autoregressive decoding), 4 unsupported,
2 unreadable checkpoint (one line on stderr).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXIT_CODES = {"supported": 0, "ar-only": 3, "unsupported": 4}
EXIT_UNREADABLE = 2


def run(path: str, as_json: bool) -> int:
    from engine.backends.descriptors import inspect_checkpoint
    from engine.checkpoint import CheckpointError
    from engine.gguf_import import is_gguf

    if is_gguf(path):
        return _inspect_gguf(path, as_json)
    try:
        report = inspect_checkpoint(Path(path))
    except CheckpointError as e:
        return _fail(str(e))
    except OSError as e:  # unreadable file or folder (permissions, I/O)
        return _fail(f"{e.filename or path}: {e.strerror or e}")
    print(json.dumps(report.to_json(), indent=2) if as_json else format_report(report))
    return EXIT_CODES[report.status]


def format_report(report) -> str:
    if report.status == "supported":
        low = report.descriptor.depth_range[0] if report.descriptor else 1
        depth = f"{low}-{report.depth_max}"
    else:
        depth = "none (no MTP decoding)"
    rows = [
        ("family", report.family),
        ("MTP heads", str(report.mtp_heads)),
        ("depth", depth),
        ("status", report.status),
        ("reason", report.reason),
    ]
    if report.descriptor is not None:
        rows.append(("backend", report.descriptor.backend_module))
    return "\n".join(f"{name + ':':<11}{value}" for name, value in rows)


def _inspect_gguf(path: str, as_json: bool) -> int:
    """What importing the file (`mtplxd pull FILE.gguf`) would make of it, from its header."""
    from engine.checkpoint import CheckpointError
    from engine.gguf_import import read_gguf
    from engine.shipped_heads import shipped_heads

    try:
        plan = read_gguf(path)
    except CheckpointError as e:
        return _fail(str(e))
    heads = shipped_heads(plan.metadata)
    status = "supported" if heads else "ar-only"
    lines = plan.describe(4, 64)
    report: dict[str, object] = {
        "format": "gguf",
        "architecture": plan.architecture,
        "name": plan.metadata.get("general.name"),
        "family": "mimo" if heads else plan.config["model_type"],
        "mtp_heads": heads.count if heads else 0,
        "status": status,
        "reason": (f"mtplxd ships {heads.count} MTP heads for this model ({heads.name}); import attaches them"
                   if heads else f"no MTP heads in a GGUF file, and none shipped for this model: "
                   f"{plan.architecture} runs autoregressively"),
        "import": lines,
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        rows = [(k.replace("_", " "), str(report[k])) for k in ("format", "architecture", "name", "family",
                                                                "mtp_heads", "status", "reason")]
        rows += [("import", line) for line in lines]
        print("\n".join(f"{name + ':':<14}{value}" for name, value in rows))
    return EXIT_CODES[status]


def _fail(message: str) -> int:
    print(f"mtplxd inspect: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_UNREADABLE
