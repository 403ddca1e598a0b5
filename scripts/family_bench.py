"""Fixture -> `mtplxd train --heads-only --replace-heads` -> `mtplxd bench`, per MTP family,
and one markdown table of the results (docs/performance.md, "MTP families on their fixtures").

    .venv/bin/python scripts/family_bench.py [--families deepseek_v3,qwen3_5] [--work DIR]

Every family that has a tiny checkpoint writer in tests/checkpoints and that the
descriptors report supported is taken (MiMo included: its own heads take the MiMo
path). For each:

1. the fixture is written with --heads MTP heads (random weights, real Hugging Face
   layout, the fixtures' 60-token character tokenizer);
2. its own heads are distilled towards its frozen trunk on the standard library
   (`mtplxd train --heads-only --replace-heads`, --max-corpus-mb of it);
3. `mtplxd bench` runs the trained folder: AR against MTP at each depth, at
   temperature 0 and 0.6, on the held-out prompts.

A family that fails a step gets a row saying where and why; the others go on.
Each command runs in its own process, as a user would run it; the table goes to
stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.checkpoints: the fixture writers


@dataclass
class Settings:
    heads: int = 2
    steps: int = 600
    seq_len: int = 128
    batch: int = 4
    lr: float = 3e-3
    corpus_mb: float = 1.0
    depths: str = "1,2,3"
    prompts: int = 4
    rounds: int = 2
    max_tokens: int = 64


@dataclass
class Outcome:
    family: str
    heads: int = 0
    problem: str = ""  # the step that failed and its last line of output
    train_s: float = 0.0
    kl: tuple[float, float] = (0.0, 0.0)  # summed head KL at the first and last step
    untrained: float | None = None  # depth-1 acceptance at T=0 of the fixture's own random heads
    bench: dict = field(default_factory=dict)  # mtplxd bench --json


def families() -> list[str]:
    from tests.checkpoints import FAMILIES

    return list(FAMILIES)


def run_family(family: str, work: Path, s: Settings) -> Outcome:
    from engine.backends.descriptors import inspect_checkpoint
    from tests.checkpoints import write

    outcome = Outcome(family)
    fixture, trained = work / f"{family}-fixture", work / f"{family}-trained"
    try:
        write(family, fixture, mtp_heads=s.heads)
    except Exception as e:  # a writer another change is still building
        outcome.problem = f"fixture: {type(e).__name__}: {e}"
        return outcome
    report = inspect_checkpoint(fixture)
    outcome.heads = report.mtp_heads
    if report.status != "supported":
        outcome.problem = f"not supported: {report.reason}"
        return outcome
    before = _bench(fixture, work / f"{family}-untrained.json", s, depths="1")
    if isinstance(before, str):
        outcome.problem = f"bench (untrained): {before}"
        return outcome
    first = _run(before, "mtp", 1, 0.0)
    outcome.untrained = first["acceptance_by_depth"][0] if first else None
    started = time.perf_counter()
    problem = _mtplxd(["train", "--heads-only", "--replace-heads", "--model", str(fixture), "--out", str(trained),
                       "--steps", str(s.steps), "--seq-len", str(s.seq_len), "--batch", str(s.batch),
                       "--lr", str(s.lr), "--max-corpus-mb", str(s.corpus_mb), "--save-every", str(s.steps)])
    outcome.train_s = time.perf_counter() - started
    if problem:
        outcome.problem = f"train: {problem}"
        return outcome
    outcome.kl = _kl_first_last(trained)
    after = _bench(trained, work / f"{family}-bench.json", s, s.depths)
    if isinstance(after, str):
        outcome.problem = f"bench: {after}"
        return outcome
    outcome.bench = after
    return outcome


def _bench(folder: Path, result: Path, s: Settings, depths: str) -> dict | str:
    """`mtplxd bench --json`'s figures, or why it failed."""
    problem = _mtplxd(["bench", "--model", str(folder), "--depths", depths, "--prompts", str(s.prompts),
                       "--rounds", str(s.rounds), "--max-tokens", str(s.max_tokens), "--no-save",
                       "--json", str(result)])
    return problem or json.loads(result.read_text())


def _mtplxd(args: list[str]) -> str:
    """Run `mtplxd ARGS`; '' when it succeeded, else its last line of output."""
    print(f"$ mtplxd {' '.join(args)}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "mtplxd", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode == 0:
        return ""
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {done.returncode}"


def _kl_first_last(trained: Path) -> tuple[float, float]:
    """The summed head KL (the training loss) at the first and the last step."""
    steps = [json.loads(line) for line in (trained / "train_state" / "log.jsonl").read_text().splitlines()]
    losses = [entry["loss"] for entry in steps if "loss" in entry]
    return losses[0], losses[-1]


def table(outcomes: list[Outcome], s: Settings) -> str:
    rows = ["| family | heads | head KL, first -> last step | train | untrained: depth 1, T=0 | depth | "
            "acceptance by depth, T=0 | acceptance by depth, T=0.6 | MTP/AR tok/s, T=0 | MTP/AR tok/s, T=0.6 |",
            "| --- | ---: | --- | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    for o in outcomes:
        if o.problem:
            rows.append(f"| {o.family} | {o.heads} | {o.problem.replace('|', '/')} | | | | | | | |")
            continue
        for depth in (int(d) for d in s.depths.split(",")):
            cells = [_run(o.bench, "mtp", depth, t) for t in (0.0, 0.6)]
            ratios = [_ratio(o.bench, depth, t) for t in (0.0, 0.6)]
            first = depth == int(s.depths.split(",")[0])
            kl = f"{o.kl[0]:.2f} -> {o.kl[1]:.2f}" if first else ""
            took = f"{o.train_s:.0f} s" if first else ""
            untrained = f"{o.untrained:.2f}" if first and o.untrained is not None else ""
            rows.append(f"| {o.family if first else ''} | {o.heads if first else ''} | {kl} | {took} | {untrained} | "
                        f"{depth} | "
                        + " | ".join(_acceptance(c) for c in cells) + " | "
                        + " | ".join(f"{r:.2f}" if r else "" for r in ratios) + " |")
    return "\n".join(rows)


def _run(bench: dict, mode: str, depth: int, temperature: float) -> dict | None:
    return next((r for r in bench["runs"] if r["mode"] == mode and r["temperature"] == temperature
                 and (mode == "ar" or r["depth"] == depth)), None)


def _acceptance(run: dict | None) -> str:
    return " / ".join(f"{a:.2f}" for a in run["acceptance_by_depth"]) if run else ""


def _ratio(bench: dict, depth: int, temperature: float) -> float | None:
    mtp, ar = _run(bench, "mtp", depth, temperature), _run(bench, "ar", 0, temperature)
    return mtp["decode_tok_s"] / ar["decode_tok_s"] if mtp and ar and ar["decode_tok_s"] else None


def main(argv: list[str] | None = None) -> int:
    s = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", help="comma-separated (default: every family with a fixture writer)")
    p.add_argument("--work", type=Path, help="keep fixtures, trained folders and bench JSON here "
                                             "(default: a temporary folder, removed)")
    for name, value in vars(s).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, help=f"default {value}")
    args = p.parse_args(argv)
    s = Settings(**{name: getattr(args, name) for name in vars(s)})
    chosen = args.families.split(",") if args.families else families()
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        outcomes = []
        for family in chosen:
            outcomes.append(run_family(family, work, s))
            print(f"{family}: {outcomes[-1].problem or 'done'}", file=sys.stderr, flush=True)
    print(table(outcomes, s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
