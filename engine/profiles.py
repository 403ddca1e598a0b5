"""Decode profiles, and the measured choice of MTP depth per model and machine.

A profile is a small typed object; the daemon picks one for the model it
loads (`auto_profile`) unless `--profile` or a request names another:

    sustained  the default: long contexts, chunked prefill (bounded memory per
               step, so other requests interleave), depth up to 2
    burst      short contexts, lowest latency: big prefill chunks, depth up to 3
    turbo      quantized models: the deepest profitable depth (up to 3)

Which depth a profile decodes with is not guessed: `mtplxd bench` (or the
daemon's own background calibration) measures AR against MTP at each depth
and temperature, and the result is stored per model and machine in
`<state_dir>/calibration.json` (engine/calibration_store.py). `Calibration.choose`
then takes the fastest measured configuration within the profile's depth limit, and
AR whenever no MTP depth beat AR by a clear margin (MTP_MARGIN): a profile is never
slower than plain decoding on the machine it was measured on.

Plain Python, no MLX: the adapters and the settings read the profile names here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.sampler_settings import SamplerSettings

PROFILE_NAMES = ("sustained", "burst", "turbo")
# Temperatures a calibration measures; a request uses the nearest one.
MEASURED_TEMPERATURES = {"t0": 0.0, "t0.6": 0.6}
# The sampler measured at each (mtplxd bench and the background calibration alike):
# greedy, or nucleus sampling as chat clients use it.
MEASURED_SAMPLERS = {key: SamplerSettings(temperature=t, top_p=0.95 if t > 0 else 1.0)
                     for key, t in MEASURED_TEMPERATURES.items()}
# Batched decoding is measured at this one temperature, at these batch sizes.
BATCH_TEMPERATURE = "t0.6"
MEASURED_BATCH_SIZES = (2, 4, 8)
# MTP must beat AR by this much to be chosen, for one row and for a batch: the short
# background measurement varies by +-10-15% on a busy machine, and on a near-tie plain AR
# is the better bet (its step time does not depend on acceptance, its caches need no cutting).
MTP_MARGIN = 1.1


@dataclass(frozen=True)
class Profile:
    name: str
    prefill_chunk: int  # prompt tokens per scheduler step
    max_depth: int  # deepest MTP depth the profile may choose
    default_depth: int  # used until a calibration exists for this model and machine

    def describe(self) -> str:
        return f"{self.name}: prefill chunk {self.prefill_chunk}, depth <= {self.max_depth}"


PROFILES = {
    "sustained": Profile("sustained", prefill_chunk=512, max_depth=2, default_depth=2),
    "burst": Profile("burst", prefill_chunk=2048, max_depth=3, default_depth=1),
    "turbo": Profile("turbo", prefill_chunk=512, max_depth=3, default_depth=3),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILE_NAMES)}") from None


def auto_profile(config: dict) -> Profile:
    """Quantized trunks are memory-bound and cheap per step, which is where a deep
    cycle pays; everything else gets the safe default."""
    quantized = isinstance(config.get("quantization") or config.get("quantization_config"), dict)
    return PROFILES["turbo" if quantized else "sustained"]


@dataclass(frozen=True)
class DepthChoice:
    mode: Literal["ar", "mtp"]
    depth: int  # 0 for AR
    speedup: float | None  # measured MTP/AR decode speed; None: not measured
    source: Literal["measured", "default"]


@dataclass
class Calibration:
    """Measured decode speedups: temperature key -> {depth: MTP tok/s over AR tok/s}."""

    speedups: dict[str, dict[int, float]] = field(default_factory=dict)
    measured_at: float = 0.0
    detail: str = ""  # how it was measured (command, prompts, tokens)
    # Rows decoding in one batch (engine/batch.py), at BATCH_TEMPERATURE: batch size ->
    # {depth: MTP tok/s over AR tok/s, both batched}. A larger batch is more compute-bound,
    # so speculation pays less: this says from which size plain AR is faster.
    batched: dict[int, dict[int, float]] = field(default_factory=dict)

    @classmethod
    def from_speeds(cls, speeds: dict[tuple[str, str, int], float], measured_at: float,
                    detail: str) -> Calibration:
        """From decode tok/s keyed by (temperature key, "ar" | "mtp", depth)."""
        speedups: dict[str, dict[int, float]] = {}
        for key in MEASURED_TEMPERATURES:
            ar = speeds.get((key, "ar", 0))
            if ar:
                speedups[key] = {d: round(s / ar, 3) for (k, mode, d), s in speeds.items()
                                 if k == key and mode == "mtp"}
        return cls(speedups, measured_at, detail)

    @classmethod
    def from_bench(cls, result: dict, measured_at: float, detail: str) -> Calibration:
        """From a `mtplxd bench` report (its `runs`)."""
        keys = {t: k for k, t in MEASURED_TEMPERATURES.items()}
        speeds = {(keys[r["temperature"]], r["mode"], r["depth"] if r["mode"] == "mtp" else 0): r["decode_tok_s"]
                  for r in result["runs"] if r["temperature"] in keys}
        return cls.from_speeds(speeds, measured_at, detail)

    def choose(self, profile: Profile, temperature: float, n_heads: int) -> DepthChoice:
        if n_heads == 0:
            return DepthChoice("ar", 0, None, "default")
        measured = self.speedups.get(_nearest_key(temperature))
        if not measured:
            return DepthChoice("mtp", profile.default_depth, None, "default")
        allowed = {d: s for d, s in measured.items() if d <= profile.max_depth}
        if not allowed:
            return DepthChoice("mtp", profile.default_depth, None, "default")
        depth, speedup = max(allowed.items(), key=lambda kv: (kv[1], -kv[0]))
        if speedup <= MTP_MARGIN:
            return DepthChoice("ar", 0, speedup, "measured")
        return DepthChoice("mtp", depth, speedup, "measured")

    def batch_mtp(self, rows: int, depth: int) -> bool | None:
        """Whether `rows` rows decode faster batched with MTP at `depth` than plainly, at
        the nearest measured batch size (the larger on a tie); None when not measured."""
        if not self.batched:
            return None
        nearest = min(self.batched, key=lambda b: (abs(b - rows), -b))
        speedup = self.batched[nearest].get(depth)
        return None if speedup is None else speedup > MTP_MARGIN

    def to_json(self) -> dict:
        return {"speedups": {t: {str(d): s for d, s in by.items()} for t, by in self.speedups.items()},
                "batched": {str(b): {str(d): s for d, s in by.items()} for b, by in self.batched.items()},
                "measured_at": self.measured_at, "detail": self.detail}

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        speedups = {t: {int(d): float(s) for d, s in by.items()} for t, by in data["speedups"].items()}
        batched = {int(b): {int(d): float(s) for d, s in by.items()} for b, by in data.get("batched", {}).items()}
        return cls(speedups, float(data.get("measured_at", 0.0)), str(data.get("detail", "")), batched)


def _nearest_key(temperature: float) -> str:
    return min(MEASURED_TEMPERATURES, key=lambda k: abs(MEASURED_TEMPERATURES[k] - temperature))


@dataclass(frozen=True)
class DecodePlan:
    """How one request decodes."""

    profile: str
    mode: Literal["ar", "mtp"]
    depth: int  # MTP depth (for AR, what a later MTP request would use; unused)
    prefill_chunk: int
    source: Literal["request", "measured", "default"]


@dataclass
class DecodePlanner:
    """The daemon's profile and its model's calibration, turned into per-request plans."""

    profile: Profile
    n_heads: int
    calibration: Calibration | None = None
    forced_depth: int | None = None  # `--depth`: the operator's choice beats the measurement

    def plan(self, temperature: float, profile: str | None = None, mode: Literal["ar", "mtp"] | None = None,
             depth: int | None = None) -> DecodePlan:
        chosen = get_profile(profile) if profile else self.profile
        fixed = depth or self.forced_depth
        if self.n_heads == 0:
            return DecodePlan(chosen.name, "ar", 0, chosen.prefill_chunk, "default")
        pick = self._choice(chosen, temperature)
        depth = fixed or (pick.depth if pick.mode == "mtp" else chosen.default_depth)
        if mode is not None or fixed is not None:  # the client or the operator decided
            return DecodePlan(chosen.name, mode or "mtp", depth, chosen.prefill_chunk, "request")
        return DecodePlan(chosen.name, pick.mode, depth, chosen.prefill_chunk, pick.source)

    def _choice(self, profile: Profile, temperature: float) -> DepthChoice:
        if self.calibration is None:
            return DepthChoice("mtp", profile.default_depth, None, "default")
        return self.calibration.choose(profile, temperature, self.n_heads)

    def batch_depth(self, rows: int, depth: int) -> int:
        """The depth generations planned at `depth` decode with when `rows` of them share
        a batch: `depth` while batched MTP was measured faster than batched AR at that
        size (or not measured), else 0, plain AR."""
        if rows < 2 or depth == 0 or self.forced_depth is not None:
            return depth
        faster = self.calibration.batch_mtp(rows, depth) if self.calibration is not None else None
        return depth if faster is None or faster else 0

    def describe(self) -> dict:
        """For /health and the MCP status tool."""
        out: dict = {"profile": self.profile.name, "calibrated": self.calibration is not None}
        for key, t in MEASURED_TEMPERATURES.items():
            plan = self.plan(t)
            out[key] = {"mode": plan.mode, "depth": plan.depth if plan.mode == "mtp" else 0, "source": plan.source}
        plan = self.plan(MEASURED_TEMPERATURES[BATCH_TEMPERATURE])
        depth = plan.depth if plan.mode == "mtp" else 0
        out["batched_depth"] = {str(rows): self.batch_depth(rows, depth) for rows in (1, *MEASURED_BATCH_SIZES)}
        return out
