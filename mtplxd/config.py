"""The daemon's settings: one typed object, and the only code that reads the environment.

Precedence, lowest first: defaults < config file < environment < command-line flags.

- config file: TOML, `--config FILE`, else `<state_dir>/config.toml` when it exists;
  its keys are the field names below (`port = 8765`).
- environment: `MTPLXD_<FIELD>` (`MTPLXD_PORT=9000`); `MTPLXD_HOME` is the default state dir.
- flags: `mtplxd start --port 9000`.

Every problem is a ConfigError whose message is one line naming where the bad value came from.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from engine.profiles import PROFILE_NAMES

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MIN_BODY_BYTES = 1024  # smaller refuses ordinary requests


class ConfigError(ValueError):
    """A setting that cannot be used; str(e) is one line."""


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """MTPLXD_HOME, else the platform's per-user state folder."""
    env = os.environ if environ is None else environ
    if env.get("MTPLXD_HOME"):
        return Path(env["MTPLXD_HOME"]).expanduser().absolute()
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "mtplxd"
    xdg = env.get("XDG_STATE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else home / ".local" / "state"
    return base / "mtplxd"


def resolve_state_dir(flag: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The state dir without reading any config file: --state-dir, MTPLXD_STATE_DIR, default.
    (`mtplxd stop` must find the daemon even when the config file has gone bad.)"""
    env = os.environ if environ is None else environ
    chosen = flag or env.get("MTPLXD_STATE_DIR")
    return Path(chosen).expanduser().absolute() if chosen else default_state_dir(env)


# The real default model: `make real-model` imports it into the models folder
# (SmolLM2-135M-Instruct from its GGUF file, with the MTP heads mtplxd ships for it).
# Without it the embedded toy model serves, and the daemon says so.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def embedded_model_dir() -> Path:
    """engine/assets/, found without importing `engine` (that sets up BLAS and MLX)."""
    spec = importlib.util.find_spec("engine")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ConfigError("the `engine` package is not installed; reinstall mtplxd")
    return Path(locations[0]) / "assets"


def launched_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank when `mlx.launch` started it (MLX_RANK), else None."""
    env = os.environ if environ is None else environ
    value = env.get("MLX_RANK", "")
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"MLX_RANK: must be a rank number, got {value!r}")
    return int(value)


def rank_environment(rank: int, hostfile: Path) -> dict[str, str]:
    """This process's environment with what MLX's ring backend reads for `rank` (the
    variables mlx.launch sets): for a follower rank started here."""
    return {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}


def export_environment(variables: Mapping[str, str]) -> None:
    """Set variables for libraries that read the environment (mx.distributed.init)."""
    os.environ.update(variables)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8765
    state_dir: Path = field(default_factory=default_state_dir)
    model: Path | None = None  # None: the embedded default model (engine/assets/); see _resolve_model
    profile: str | None = None  # engine/profiles.py; None: chosen from the model
    depth: int | None = None  # None: the profile's measured choice (engine/profiles.py)
    api_key: str | None = None
    max_active: int = 8
    max_queued: int = 64
    interactive_reserve: int = 2
    # Continuous batching (engine/batch.py): at most this many decoding generations share one
    # forward pass; 1: every generation steps alone.
    batch_rows: int = 16
    # Admission also stops at this many bytes of KV cache held by open generations
    # (None: a quarter of physical memory); beyond it, requests queue.
    max_cache_bytes: int | None = None
    # Shares of the engine between the priority classes (mtplxd/shares.py): interactive work
    # (editor completions) goes first, but a class with work that has been passed over this
    # many passes in a row goes next, so it keeps at least 1 pass in patience + 1 whatever
    # the editors do. Lower favours chats and agents (normal) over editors; higher, editors.
    patience_normal: int = 3
    patience_background: int = 8  # warm-ups, prefetches, the calibration
    log_level: str = "info"
    # Largest HTTP request body, bytes (413 beyond): a 1M-token prompt is ~4 MiB of JSON.
    max_body_bytes: int = 16 * 2**20
    # Who may reach the HTTP API (adapters/http/guard.py). Host names clients use besides
    # loopback and the bound address; browser origins besides loopback ones (a web UI
    # served elsewhere), e.g. "https://chat.example.org".
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # Folders MCP tools may read and warm besides those the client declares as roots and
    # those editors open over LSP (adapters/mcp/paths.py).
    workspaces: tuple[str, ...] = ()
    # Session bank (engine/sessions/bank.py). Bytes; None: a default from the machine.
    session_ram_bytes: int | None = None  # None: 1/8 of physical memory (at most 32 GiB); 0: no bank
    # A cap: the bank writes only what leaves 64 MiB of the disk free (engine/sessions/room.py).
    session_disk_bytes: int | None = None  # None: 8 GiB or 1/4 of the free disk, the smaller; 0: RAM only
    session_write_delay_ms: int = 2000  # a new entry waits this long before its background write
    session_write_bps: int = 0  # cap on background write speed, bytes/s (0: none)
    watch_workspaces: int = 8  # workspaces watched for changed files at once (0: none)
    # Background calibration on a model's first start on this machine (mtplxd/calibrate.py):
    # tokens per AR/MTP run; 0: none (decode with the profile's defaults until `mtplxd bench`).
    calibrate_tokens: int = 32
    # Several ranks (mtplxd/ranks/): start this many on this machine, the model split over
    # them (ring backend on loopback); under mlx.launch the launcher decides instead.
    ranks: int = 1
    # A collective that has not returned after this long means a rank hangs: the ranks are
    # then out of service (requests 503, /health says why) until the daemon restarts.
    rank_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check(bool(self.host), "host: must not be empty")
        _check(0 <= self.port <= 65535, f"port: must be between 0 and 65535, got {self.port}")
        _check(self.depth is None or self.depth >= 1, f"depth: must be at least 1, got {self.depth}")
        _check(self.profile is None or self.profile in PROFILE_NAMES,
               f"profile: must be one of {', '.join(PROFILE_NAMES)}, got {self.profile!r}")
        _check(self.max_active >= 1, f"max_active: must be at least 1, got {self.max_active}")
        _check(self.max_queued >= 0, f"max_queued: must not be negative, got {self.max_queued}")
        _check(self.batch_rows >= 1, f"batch_rows: must be at least 1, got {self.batch_rows}")
        for name in ("patience_normal", "patience_background"):
            _check(getattr(self, name) >= 1, f"{name}: must be at least 1, got {getattr(self, name)}")
        _check(self.ranks >= 1, f"ranks: must be at least 1, got {self.ranks}")
        _check(self.rank_timeout_s > 0, f"rank_timeout_s: must be positive, got {self.rank_timeout_s}")
        _check(self.max_cache_bytes is None or self.max_cache_bytes > 0,
               f"max_cache_bytes: must be positive, got {self.max_cache_bytes}")
        _check(self.max_body_bytes >= MIN_BODY_BYTES,
               f"max_body_bytes: must be at least {MIN_BODY_BYTES}, got {self.max_body_bytes}")
        _check(
            self.interactive_reserve >= 0,
            f"interactive_reserve: must not be negative, got {self.interactive_reserve}",
        )
        for name in ("session_ram_bytes", "session_disk_bytes", "session_write_delay_ms", "session_write_bps",
                     "watch_workspaces", "calibrate_tokens"):
            value = getattr(self, name)
            _check(value is None or value >= 0, f"{name}: must not be negative, got {value}")
        _check(
            self.log_level in LOG_LEVELS,
            f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}",
        )
        # Anyone who can reach the port can run the model and read what it writes.
        _check(
            is_loopback(self.host) or bool(self.api_key),
            f"refusing to listen on {self.host} without an API key: anyone on the network could "
            "use the model; set --api-key (or MTPLXD_API_KEY), or listen on 127.0.0.1",
        )

    @property
    def model_path(self) -> Path:
        if self.model is not None:
            return self.model
        real = self.state_dir / "models" / DEFAULT_MODEL
        return real if (real / "config.json").is_file() else embedded_model_dir()

    @property
    def uses_embedded_model(self) -> bool:
        return self.model is None and self.model_path == embedded_model_dir()

    def default_model_note(self) -> str | None:
        """Why the toy serves, when no model was named and the real default is missing."""
        if not self.uses_embedded_model:
            return None
        return (f"the default model {DEFAULT_MODEL} is not in {self.state_dir / 'models'}: serving the embedded "
                "toy model, whose answers are noise (get the real one with `make real-model`, or "
                "mtplxd pull FILE.gguf)")

    def missing_model_hint(self) -> str | None:
        """What to tell a user whose default (embedded) model is not there."""
        if self.uses_embedded_model and not (self.model_path / "config.json").is_file():
            return (
                f"no embedded model is installed yet ({self.model_path} has no config.json); "
                "start with --model PATH (a Hugging Face checkpoint folder)"
            )
        return None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# -- loading ---------------------------------------------------------------------

# field name -> kind; "path" values are expanded (~) and made absolute, "?" allows None.
_KINDS = {
    "host": "str",
    "port": "int",
    "state_dir": "path",
    "model": "model?",  # a path, a models-folder name or a pulled repository id
    "profile": "str?",
    "depth": "int?",
    "api_key": "str?",
    "max_active": "int",
    "max_queued": "int",
    "interactive_reserve": "int",
    "batch_rows": "int",
    "max_cache_bytes": "int?",
    "patience_normal": "int",
    "patience_background": "int",
    "log_level": "str",
    "max_body_bytes": "int",
    "allowed_hosts": "list",
    "allowed_origins": "list",
    "workspaces": "list",
    "session_ram_bytes": "int?",
    "session_disk_bytes": "int?",
    "session_write_delay_ms": "int",
    "session_write_bps": "int",
    "watch_workspaces": "int",
    "calibrate_tokens": "int",
    "ranks": "int",
    "rank_timeout_s": "float",
}
assert set(_KINDS) == {f.name for f in fields(Settings)}


def load_settings(
    flags: Mapping[str, Any] | None = None,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the four layers. `flags` maps field names to values, None meaning "not given"."""
    env = os.environ if environ is None else environ
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = set(given) - set(_KINDS)
    if unknown:
        raise ConfigError(f"unknown setting {sorted(unknown)[0]!r}")
    values: dict[str, Any] = {}
    path, required = _config_path(config_file, given, env)
    values.update(_read_toml(path, required))
    values.update(_read_env(env))
    values.update({k: _coerce(k, v, f"--{k.replace('_', '-')}") for k, v in given.items()})
    if "state_dir" not in values:
        values["state_dir"] = default_state_dir(env)
    if "model" in values:
        source = "--model" if "model" in given else "MTPLXD_MODEL" if env.get("MTPLXD_MODEL") else str(path)
        values["model"] = _resolve_model(values["model"], values["state_dir"], source)
    return Settings(**values)


def _resolve_model(value: str, state_dir: Path, source: str) -> Path:
    """A path, a name in <state_dir>/models/ or a pulled repository id (mtplxd/store/models.py)."""
    from mtplxd.store.models import ModelError, resolve_model

    try:
        return resolve_model(value, state_dir)
    except ModelError as e:
        raise ConfigError(f"{source}: model: {e}")


def _config_path(config_file: Any, flags: Mapping[str, Any], env: Mapping[str, str]) -> tuple[Path, bool]:
    """The file named by --config (must exist), else <state_dir>/config.toml (may be absent)."""
    if config_file is not None:
        return Path(config_file).expanduser(), True
    return resolve_state_dir(flags.get("state_dir"), env) / "config.toml", False


def _read_toml(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path}: config file not found")
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})")
    for key in data:
        if key not in _KINDS:
            raise ConfigError(f"{path}: unknown key {key!r} (known: {', '.join(_KINDS)})")
    if "state_dir" in data and not required:  # the file was found through the state dir itself
        raise ConfigError(f"{path}: state_dir cannot be set in the state dir's own config file")
    return {k: _coerce(k, v, str(path), strict=True) for k, v in data.items()}


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    values = {}
    for name in _KINDS:
        var = f"MTPLXD_{name.upper()}"
        if env.get(var):  # an empty variable counts as unset
            values[name] = _coerce(name, env[var], var)
    return values


def _coerce(name: str, value: Any, source: str, strict: bool = False) -> Any:
    """Turn a raw value into the field's type. `strict` (TOML) refuses strings for numbers,
    since the file has real types; the environment and flags only have strings."""
    kind = _KINDS[name].rstrip("?")
    if kind == "list":  # a TOML array of strings, or a comma-separated environment variable
        items = value.split(",") if isinstance(value, str) and not strict else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{source}: {name}: expected a list of strings, got {value!r}")
        return tuple(i.strip() for i in items if i.strip())
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and not strict:
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{source}: {name}: expected an integer, got {value!r}")
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and not strict:
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{source}: {name}: expected a number, got {value!r}")
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{source}: {name}: expected a string, got {value!r}")
    if kind == "path":
        return Path(value).expanduser().absolute()
    if kind == "model":  # resolved once the state dir is known (load_settings)
        return str(value)
    return str(value).lower() if name == "log_level" else str(value)
