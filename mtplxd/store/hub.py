"""Downloading a repository for `mtplxd pull`, through huggingface_hub.

Everything the Hugging Face client does is kept: its cache (HF_HOME /
HF_HUB_CACHE), the token (HF_TOKEN or `hf auth login`), offline mode
(HF_HUB_OFFLINE=1: the cached snapshot is used as is), HF_ENDPOINT, the
progress bars, and its retries: a connection dropped mid-file is resumed
from the last byte with an HTTP Range request, and files completed by an
interrupted pull are not fetched again.

Before the weights are fetched (online), `plan` lists the files and their
sizes (a dry run), refuses a repository whose index shows no MTP head, and
checks the disk has room for the download and the conversion.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# What a conversion reads: weights (safetensors only), configs, tokenizer files,
# the model card. Not: pickled weights (.bin/.pt), GGUF, ONNX, images.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.md"]
_SMALL_FILES = ["config.json", "model.safetensors.index.json"]


class HubError(Exception):
    """A download that cannot go ahead; str(e) is one line."""


@dataclass(frozen=True)
class RemoteFiles:
    """What a pull would fetch (from the Hub's listing, before any weight moves)."""

    commit: str
    sizes: dict[str, int]  # file -> bytes
    to_download: int  # bytes not yet in the cache

    @property
    def weight_files(self) -> list[str]:
        return sorted(f for f in self.sizes if f.endswith(".safetensors"))

    @property
    def weight_bytes(self) -> int:
        return sum(self.sizes[f] for f in self.weight_files)


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def list_remote(repo_id: str, revision: str | None) -> RemoteFiles | None:
    """The files a pull would fetch, or None when the Hub cannot be asked (offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import DryRunError

    if offline():
        return None
    try:
        with _quiet():  # the listing's own progress bar would only flash by
            files = _call(snapshot_download, repo_id, revision, allow_patterns=ALLOW_PATTERNS, dry_run=True)
    except HubError as e:
        if isinstance(e.__cause__, DryRunError):  # Hub unreachable: the cache may still serve
            return None
        raise
    sizes = {f.filename: int(f.file_size or 0) for f in files}
    to_download = sum(int(f.file_size or 0) for f in files if f.will_download)
    return RemoteFiles(files[0].commit_hash if files else "", sizes, to_download)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def config_and_keys(repo_id: str, remote: RemoteFiles) -> tuple[dict[str, Any], list[str]] | None:
    """(config, tensor names) from config.json and the index alone, fetched before the
    weights, when the index names every weight file; else None (the weights decide)."""
    from huggingface_hub import snapshot_download

    if "config.json" not in remote.sizes or "model.safetensors.index.json" not in remote.sizes:
        return None
    with _quiet():
        folder = Path(_call(snapshot_download, repo_id, remote.commit, allow_patterns=_SMALL_FILES))
    try:
        config = json.loads((folder / "config.json").read_text())
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a malformed file: let the conversion report it, with its path
    if not isinstance(config, dict) or not isinstance(weight_map, dict):
        return None
    # A sidecar (mtp.safetensors) that the index does not name may hold the head.
    if set(remote.weight_files) - set(weight_map.values()):
        return None
    return config, list(weight_map)


def download(repo_id: str, revision: str | None) -> Path:
    """The local snapshot folder of the repository (downloading what the cache lacks)."""
    from huggingface_hub import snapshot_download

    return Path(_call(snapshot_download, repo_id, revision, allow_patterns=ALLOW_PATTERNS))


def download_file(repo_id: str, filename: str, revision: str | None) -> Path:
    """One file of the repository (a GGUF), from the cache or downloaded into it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(_call(hf_hub_download, repo_id, revision, filename=filename))
    except HubError as e:
        if isinstance(e.__cause__, EntryNotFoundError):
            raise HubError(f"{repo_id} has no file {filename}") from e
        raise


def _call(function, repo_id: str, revision: str | None, **options):
    """Run a huggingface_hub call; its errors become one-line HubErrors."""
    try:
        return function(repo_id, revision=revision, **options)
    except Exception as e:  # noqa: BLE001  the client's many error types, each mapped below
        raise HubError(describe_error(e, repo_id, revision)) from e


def describe_error(e: Exception, repo_id: str, revision: str | None) -> str:
    from huggingface_hub import errors

    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    if isinstance(e, errors.HFValidationError):
        return f"{repo_id!r} is not a valid repository id (expected owner/name)"
    if isinstance(e, errors.GatedRepoError):
        return (f"{repo_id} is gated: accept its terms on the Hugging Face website, then log in "
                "(hf auth login, or set HF_TOKEN)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"{repo_id}: no such repository on the Hub (a private one needs a token: "
                "hf auth login, or set HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{repo_id}: no revision {revision!r}"
    if isinstance(e, errors.IncompleteSnapshotError):
        return (f"{where}: the cached download is incomplete and the Hub cannot be reached; "
                "run the same pull online to finish it")
    if isinstance(e, errors.LocalEntryNotFoundError) and offline():
        return (f"{where} is not in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE is set; "
                "pull it once online")
    if isinstance(e, errors.LocalEntryNotFoundError):
        return f"{where}: the Hub cannot be reached and the repository is not in the cache ({cache_dir()})"
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
        return f"{where}: the Hub answered HTTP {e.response.status_code}"
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{where}: download failed: {first_line}"


def same_disk(a: Path, b: Path) -> bool:
    """Whether two (possibly not yet created) folders sit on one file system."""
    return _device(a) == _device(b)


def _device(path: Path) -> int:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.stat(path).st_dev
