"""The layers of ARCHITECTURE.md, checked on the imports: the adapters see the runtime
and the request vocabulary, never the scheduler, the engine's MLX modules or mlx itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The engine modules an adapter may reach: plain Python over the tokenizer and settings.
MLX_FREE_ENGINE = {
    "engine", "engine.blas", "engine.prompts", "engine.tool_prompts", "engine.sampler_settings",
    "engine.profiles",
}

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "engine")
                        or m == "mtplxd.scheduler" or m == "mtplxd.jobs")))
"""


def _loaded_by(modules: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _adapter_modules() -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (ROOT / "adapters").rglob("*.py"))


def test_adapters_import_neither_mlx_nor_the_scheduler():
    modules = _adapter_modules()
    assert len(modules) > 20  # the walk found the adapters
    loaded = _loaded_by([*modules, "mtplxd.runtime", "mtplxd.requests"])
    assert loaded - MLX_FREE_ENGINE == set()


def test_the_probe_sees_mlx_when_a_module_loads_it():
    """Negative control: the scheduler runs the engine, so importing it loads mlx."""
    loaded = _loaded_by(["mtplxd.scheduler"])
    assert {"mlx.core", "mtplxd.scheduler", "engine.engine"} <= loaded
