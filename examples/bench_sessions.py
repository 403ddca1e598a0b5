"""The session-bank benchmark on a random medium checkpoint (or any model).

    python examples/bench_sessions.py                 # a random d=256, 8-layer MiMo-layout model
    python examples/bench_sessions.py --model PATH    # any checkpoint folder
    mtplxd bench --sessions                           # the embedded model

Run from the repository root (the random checkpoint is written with the test
suite's writer, tests/checkpoints). Figures are wall-clock times on a shared
machine: compare them within one run, not across machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def random_checkpoint(folder: Path) -> Path:
    import tests.checkpoints.mimo as mimo

    mimo.D, mimo.LAYERS, mimo.HEADS, mimo.KV_HEADS, mimo.FFN = 256, 8, 4, 2, 768
    folder.mkdir(parents=True, exist_ok=True)
    mimo.write_checkpoint(folder, mtp_heads=1)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", metavar="PATH", help="checkpoint folder (default: a random medium one)")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from mtplxd import bench_sessions

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(random_checkpoint(Path(scratch) / "medium"))
        result = bench_sessions.run_bench(model, args.prompt_tokens, args.repeats)
    print(json.dumps(asdict(result), indent=2) if args.json else bench_sessions.render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
