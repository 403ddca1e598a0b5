"""Where measured calibrations are kept: `<state_dir>/calibration.json`, one entry per
model, machine and engine code.

A `Calibration` (engine/profiles.py) is valid for the weights it was measured with, on
the machine it was measured on, decoded by the engine code that measured it: the key
names all three (`model_id`, `machine_id`, `engine_id`). Reading the MLX device and
version and digesting the weight files is what keeps this out of the MLX-free
engine/profiles.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from engine.profiles import Calibration

CALIBRATION_FILE = "calibration.json"


def machine_id() -> str:
    """What makes timings comparable: OS, CPU architecture and count, MLX device."""
    import mlx.core as mx

    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu-{mx.default_device()}"


@lru_cache(maxsize=1)
def engine_id() -> str:
    """The decode code that produced a measurement: the engine's sources (the BLAS
    shim's included) and the MLX version. A new release measures again rather than
    keep a choice made for slower or faster code."""
    import mlx.core as mx

    root = Path(__file__).resolve().parent
    h = hashlib.sha256(mx.__version__.encode())  # type: ignore[attr-defined]  # not in mlx's stubs
    for path in sorted([*root.rglob("*.py"), *root.glob("native/*.c")]):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def model_id(folder: Path) -> str:
    """config.json and a cheap digest of every weight file (engine/sessions/arrays.py)."""
    from engine.sessions.arrays import hash_checkpoint_files

    h = hashlib.sha256()
    hash_checkpoint_files(h, folder)
    return h.hexdigest()[:32]


class CalibrationStore:
    """`<state_dir>/calibration.json`: one Calibration per (model, machine, engine)."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / CALIBRATION_FILE

    @staticmethod
    def key(model_folder: Path) -> str:
        return f"{model_id(Path(model_folder))}@{machine_id()}@{engine_id()}"

    def get(self, model_folder: Path) -> Calibration | None:
        entry = self._read().get(self.key(model_folder))
        try:
            return Calibration.from_json(entry) if entry else None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None  # a hand-edited or older file: measure again

    def put(self, model_folder: Path, calibration: Calibration) -> None:
        key = self.key(model_folder)
        model_and_machine = key.rsplit("@", 1)[0]
        # Measurements of this model and machine by other engine code are dropped
        # (keys without an engine part are from before it was recorded).
        data = {k: v for k, v in self._read().items()
                if model_and_machine not in (k, k.rsplit("@", 1)[0])}
        old = self._read().get(key)
        if not calibration.batched and isinstance(old, dict) and old.get("batched"):
            # `mtplxd bench` measures lone generations only: keep the batch sizes measured before.
            calibration = replace(calibration, batched=Calibration.from_json(old).batched)
        data[key] = calibration.to_json()
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
