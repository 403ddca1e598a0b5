"""`mtplxd bench`: AR against MTP at depths 1..3, side by side in one process.

Every round runs each prompt as AR and as MTP at each depth, one after the
other (A B A B ...), at temperature 0 and at 0.6 / top-p 0.95, so machine
noise hits every configuration alike. Figures are medians over rounds and
prompts; prompts come from the standard-library modules held out of the
embedded model's training. Each configuration also reports what a decoded
token costs: wall time, and CPU time of the thread that builds the graphs
and of the threads that run them (`python -m mtplxd.bench.cycle` takes one
cycle apart).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import engine  # BLAS before mlx
import mlx.core as mx

from engine.calibration_store import CalibrationStore
from engine.checkpoint import read_config
from engine.engine import Engine
from engine.generation import GenerationRequest
from engine.profiles import MEASURED_SAMPLERS, Calibration, DecodePlanner, auto_profile, get_profile
from mtplxd.calibrate import held_out_prompts



@dataclass
class Config:
    mode: Literal["ar", "mtp"]
    depth: int
    temperature: str


@dataclass
class Tally:
    decode_tok_s: list[float] = field(default_factory=list)
    prefill_tok_s: list[float] = field(default_factory=list)
    reached: list[int] = field(default_factory=lambda: [0] * 8)  # cycles that got to draft i
    accepted: list[int] = field(default_factory=lambda: [0] * 8)
    cycles: int = 0
    decoded: int = 0
    seconds: float = 0.0  # decoding wall time, summed over runs
    python_cpu: float = 0.0  # CPU seconds of the thread that builds the graphs (this one)
    worker_cpu: float = 0.0  # CPU seconds of every other thread: MLX's worker, BLAS


def run_once(engine_: Engine, ids: tuple[int, ...], config: Config, max_tokens: int, tally: Tally) -> None:
    sampler = MEASURED_SAMPLERS[config.temperature]
    gen = engine_.open(GenerationRequest(prompt=ids, sampler=sampler, mode=config.mode, depth=max(config.depth, 1),
                                         max_tokens=max_tokens, seed=0, prefill_chunk=4096))
    start = time.perf_counter()
    gen.step()  # the whole prompt (one chunk) and the first token
    first = time.perf_counter()
    python_start, process_start = time.thread_time(), time.process_time()
    while not gen.finished:
        result = gen.step()
        tally.decoded += len(result.tokens)
        tally.cycles += 1
        for i, ok in enumerate(result.accepted):
            tally.reached[i] += 1
            tally.accepted[i] += ok
            if not ok:
                break
    end = time.perf_counter()
    python_cpu = time.thread_time() - python_start
    tally.python_cpu += python_cpu
    tally.worker_cpu += time.process_time() - process_start - python_cpu
    tally.seconds += end - first
    gen.close()
    tally.prefill_tok_s.append(len(ids) / (first - start))
    if gen.generated > 1:
        tally.decode_tok_s.append((gen.generated - 1) / (end - first))


def configs(depths: list[int], temperature: str) -> list[Config]:
    """A B A B: AR before every MTP depth."""
    out = []
    for d in depths:
        out += [Config("ar", 0, temperature), Config("mtp", d, temperature)]
    return out


def bench(engine_: Engine, prompts: list[str], depths: list[int], rounds: int, max_tokens: int,
          progress=None) -> dict:
    tallies: dict[tuple, Tally] = {}
    encoded = [tuple(engine_.tokenizer.encode(p)) for p in prompts]
    mx.reset_peak_memory()
    usable = depths if engine_.backend.n_heads else []
    for _ in range(rounds):
        for temperature in MEASURED_SAMPLERS:
            plan = configs(usable, temperature) if usable else [Config("ar", 0, temperature)]
            for config in plan:
                for ids in encoded:
                    key = (config.mode, config.depth, config.temperature)
                    run_once(engine_, ids, config, max_tokens, tallies.setdefault(key, Tally()))
                    if progress:
                        progress.update(1)
    return report(engine_, tallies)


def report(engine_: Engine, tallies: dict[tuple, Tally]) -> dict:
    runs = []
    for (mode, depth, temperature), t in sorted(tallies.items(), key=lambda kv: (kv[0][2], kv[0][0] != "ar", kv[0][1])):
        acceptance = [a / r for a, r in zip(t.accepted, t.reached) if r][:depth] if mode == "mtp" else []
        runs.append({
            "mode": mode, "depth": depth, "temperature": float(MEASURED_SAMPLERS[temperature].temperature),
            "decode_tok_s": round(statistics.median(t.decode_tok_s), 2),
            "prefill_tok_s": round(statistics.median(t.prefill_tok_s), 1),
            "acceptance_by_depth": [round(a, 3) for a in acceptance],
            "tokens_per_cycle": round(t.decoded / t.cycles, 3) if t.cycles else 0.0,
            "ms_per_token": per_token(t),
        })
    speedup = {}
    for name, sampler in MEASURED_SAMPLERS.items():
        at = [r for r in runs if r["temperature"] == sampler.temperature]
        ar = next((r["decode_tok_s"] for r in at if r["mode"] == "ar"), None)
        best = max((r["decode_tok_s"] for r in at if r["mode"] == "mtp"), default=None)
        speedup[name] = round(best / ar, 3) if ar and best else None
    return {
        "model": str(engine_.path),
        "machine": machine(),
        "runs": runs,
        "speedup": speedup,
        "peak_memory_bytes": int(mx.get_peak_memory()),
    }


def per_token(t: Tally) -> dict[str, float]:
    """Wall and CPU milliseconds a decoded token costs, the CPU split between the
    thread that builds the graphs and the threads that run them: a decode step is
    as fast as the busier of the two."""
    n = max(t.decoded, 1)
    return {"wall": round(1e3 * t.seconds / n, 3), "python_cpu": round(1e3 * t.python_cpu / n, 3),
            "worker_cpu": round(1e3 * t.worker_cpu / n, 3)}


def machine() -> str:
    from engine import BLAS

    return f"{platform.system()} {platform.machine()}, {mx.default_device()}, BLAS {BLAS.library}"


def run(model: str | None, prompts: int, rounds: int, max_tokens: int, depths: list[int], json_path: str | None,
        profile: str | None = None, state_dir: Path | None = None) -> int:
    """`state_dir`: store the measurement there, where the daemon's profiles read it."""
    from tqdm import tqdm

    engine_ = Engine.load(model or engine.EMBEDDED_MODEL)
    chosen = get_profile(profile) if profile else auto_profile(read_config(engine_.path))
    texts = held_out_prompts(prompts)
    n_configs = 2 * len(depths) if engine_.backend.n_heads else 1
    with tqdm(total=rounds * len(MEASURED_SAMPLERS) * n_configs * len(texts), desc="bench", unit="run") as bar:
        result = bench(engine_, texts, depths, rounds, max_tokens, bar)
    result["profile"] = chosen.name
    print_table(result)
    if state_dir is not None and engine_.backend.n_heads:
        detail = f"mtplxd bench: {len(texts)} prompts x {rounds} rounds x {max_tokens} tokens, depths {depths}"
        calibration = Calibration.from_bench(result, time.time(), detail)
        CalibrationStore(state_dir).put(engine_.path, calibration)
        planner = DecodePlanner(chosen, engine_.backend.n_heads, calibration)
        print(f"stored for this model and machine in {state_dir}: the {chosen.name} profile decodes with "
              + ", ".join(f"{k}: {v['mode']}" + (f" depth {v['depth']}" if v["mode"] == "mtp" else "")
                          for k, v in planner.describe().items() if k.startswith("t")))
    if json_path == "-":
        print(json.dumps(result, indent=2))
    elif json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return 0


def print_table(result: dict) -> None:
    print(f"{result['model']} on {result['machine']}")
    print(f"{'mode':5} {'depth':>5} {'temp':>5} {'decode tok/s':>13} {'prefill tok/s':>14} {'tok/cycle':>10}"
          f" {'ms/token: wall':>15} {'python':>7} {'worker':>7}  acceptance")
    for r in result["runs"]:
        ms = r["ms_per_token"]
        print(f"{r['mode']:5} {r['depth']:>5} {r['temperature']:>5} {r['decode_tok_s']:>13} {r['prefill_tok_s']:>14}"
              f" {r['tokens_per_cycle']:>10} {ms['wall']:>15} {ms['python_cpu']:>7} {ms['worker_cpu']:>7}"
              f"  {r['acceptance_by_depth']}")
    print(f"speedup (best MTP / AR): {result['speedup']}; peak memory {result['peak_memory_bytes'] / 2**20:.0f} MiB")
