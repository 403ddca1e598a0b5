"""MTP heads that ship with mtplxd for released models that have none.

A released model without MTP heads runs AR-only. For the models in `engine/assets/heads/`
the project trained MiMo-style heads (`mtplxd train --heads-only`, the command and its
measured time in each folder's heads.json), and an import of a matching GGUF file
attaches them: the folder becomes a MiMo-layout checkpoint (config.json with
`num_nextn_predict_layers`, zero q/k/v biases for a Llama-style trunk, the heads in the
`mtp.safetensors` sidecar), exactly what `mtplxd train --heads-only` writes. Heads never
change what a model says, only how fast: sampling stays exact whatever they draft.

A GGUF matches a heads folder when every metadata value under `match` in its heads.json
is equal (architecture, model name, size and shape fields).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.head_export import HEADS_FILE

HEADS_DIR = Path(__file__).parent / "assets" / "heads"
INFO_FILE = "heads.json"


@dataclass(frozen=True)
class ShippedHeads:
    folder: Path
    info: dict[str, Any]

    @property
    def count(self) -> int:
        return int(self.info["heads"])

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def digest(self) -> str:
        """Of the heads file: an import made with other heads is redone (`mtplxd pull`)."""
        return hashlib.sha256((self.folder / HEADS_FILE).read_bytes()).hexdigest()[:16]


def shipped_heads(metadata: dict[str, Any], root: Path | None = None) -> ShippedHeads | None:
    """The shipped heads for a GGUF file with this metadata, if any (`root`: HEADS_DIR,
    read when called)."""
    root = HEADS_DIR if root is None else Path(root)
    if not root.is_dir():
        return None
    for folder in sorted(root.iterdir()):
        info_file = folder / INFO_FILE
        if not (info_file.is_file() and (folder / HEADS_FILE).is_file()):
            continue
        info = json.loads(info_file.read_text())
        if all(metadata.get(key) == value for key, value in info["match"].items()):
            return ShippedHeads(folder, info)
    return None


def attach_heads(folder: Path, heads: ShippedHeads) -> dict[str, Any]:
    """Turn the AR-only model folder into one with these MTP heads; returns the new config."""
    import mlx.core as mx

    from engine.backends.mimo import mimo_config
    from engine.checkpoint import read_config, weight_keys
    from engine.training.heads import ZERO_BIAS
    from engine.training.model import save_safetensors, write_json

    config, biases = mimo_config(read_config(folder), set(weight_keys(folder)), heads.count)
    config["mtplxd_shipped_heads"] = heads.name
    if biases:
        save_safetensors(folder / ZERO_BIAS, {k: mx.zeros(s, mx.bfloat16) for k, s in biases.items()}, None)
    shutil.copyfile(heads.folder / HEADS_FILE, folder / HEADS_FILE)
    write_json(folder / "config.json", config)
    return config
