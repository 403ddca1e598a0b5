"""Editor-completion latency: replay typing into `mtplxd lsp`, idle and under load.

    python -m mtplxd.bench.lsp                    # the embedded model, a scratch daemon
    python -m mtplxd.bench.lsp --model PATH       # any checkpoint with FIM tokens
    python -m mtplxd.bench.lsp --state-dir DIR    # a daemon already running there

A held-out standard-library function (`colorsys.rgb_to_hls` by default: the
shipped model never trained on colorsys) is typed character by character, every
`--key-ms` (80 ms), into the file it comes from, through a real pygls client
speaking to `mtplxd lsp` as an editor does: each keystroke is a didChange plus an
automatic inlineCompletion request. Enter inserts the next line's indentation with
it (as editors auto-indent) and is followed by a `--pause-ms` pause, the moment a
user reads a suggestion. Twice: alone, then while an HTTP client streams one long
generation at normal priority.

Reported per phase: keystroke-to-completion latency p50/p95 (request sent -> items
received, for the requests that got items; also for those the engine answered,
without the type-ahead hits), requests by outcome, and the connection's engine
jobs started, cancelled and completed (`mtplxd.status`). Target: loaded p95 within
1.5x of idle p95. On a shared machine the figures are noisy: compare runs, not digits.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient

from mtplxd import client as daemon_client
from mtplxd.config import load_settings


@dataclass
class Phase:
    name: str
    keystrokes: int = 0
    with_items: int = 0
    empty: int = 0
    cancelled: int = 0
    errors: int = 0
    latency_ms: dict = field(default_factory=dict)  # requests answered with items
    engine_latency_ms: dict = field(default_factory=dict)  # ... of those, not from type-ahead
    connection: dict = field(default_factory=dict)  # mtplxd.status counters for the phase
    background_tokens: int = 0


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50": round(statistics.median(ordered), 1), "p95": round(p95, 1)}


def trace(function: str) -> tuple[str, str, list[str]]:
    """(text before the function, text after it, keystrokes typing it)."""
    module_name, _, name = function.rpartition(".")
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    body = inspect.getsource(getattr(module, name))
    start = source.index(body)
    keys, i = [], 0
    while i < len(body):
        if body[i] == "\n":  # Enter, and the editor's auto-indent
            j = i + 1
            while j < len(body) and body[j] in " \t":
                j += 1
            keys.append(body[i:j])
            i = j
        else:
            keys.append(body[i])
            i += 1
    return source[:start], source[start + len(body):], keys


async def replay(lsp: LanguageClient, phase: Phase, before: str, after: str, keys: list[str],
                 key_ms: float, pause_ms: float, uri: str) -> None:
    lsp.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", 1, before + after)))
    line, column, version = before.count("\n"), len(before) - (before.rfind("\n") + 1), 1
    pending = []
    start = await status(lsp)
    next_at = time.perf_counter()
    for key in keys:
        now = time.perf_counter()
        if next_at > now:
            await asyncio.sleep(next_at - now)
        version += 1
        position = types.Position(line, column)
        lsp.text_document_did_change(types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(version=version, uri=uri),
            [types.TextDocumentContentChangePartial(range=types.Range(position, position), text=key)]))
        if "\n" in key:
            line, column = line + key.count("\n"), len(key) - key.rfind("\n") - 1
        else:
            column += len(key)  # ASCII source: UTF-16 units are characters
        sent = time.perf_counter()
        future = lsp.protocol.send_request_async(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionParams(
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
            text_document=types.TextDocumentIdentifier(uri), position=types.Position(line, column)))
        pending.append(asyncio.ensure_future(_timed(future, sent)))
        phase.keystrokes += 1
        next_at = max(next_at, sent) + (key_ms + (pause_ms if "\n" in key else 0)) / 1000
    results = await asyncio.gather(*pending)
    end = await status(lsp)
    lsp.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
    shown = []
    for outcome, ms in results:
        if outcome == "items":
            phase.with_items += 1
            shown.append(ms)
        else:
            setattr(phase, outcome, getattr(phase, outcome) + 1)
    phase.latency_ms = percentiles(shown)
    # An automatic request the engine answers waits for the debounce first; type-ahead ones do not.
    debounce = end["options"]["debounceMs"]
    phase.engine_latency_ms = percentiles([ms for ms in shown if ms >= debounce])
    phase.connection = {k: end["connection"][k] - start["connection"][k] for k in end["connection"]}


async def _timed(future, sent: float) -> tuple[str, float]:
    try:
        result = await future
    except JsonRpcException as e:
        return ("cancelled" if e.code in (-32800, -32801) else "errors"), 0.0
    ms = (time.perf_counter() - sent) * 1000
    return ("items" if result and result.items else "empty"), ms


async def status(lsp: LanguageClient) -> dict:
    result = await lsp.workspace_execute_command_async(types.ExecuteCommandParams("mtplxd.status"))
    if result is None:
        raise RuntimeError("mtplxd.status returned no result")
    return result


def _daemon_url(state_dir: Path) -> str:
    """The running daemon's URL (the LSP server's requests started it)."""
    url = daemon_client.daemon_url(state_dir)
    if url is None:
        raise RuntimeError(f"no running daemon in {state_dir}")
    return url


class Background(threading.Thread):
    """One long generation streamed over HTTP (normal priority), restarted until stopped."""

    def __init__(self, base_url: str, api_key: str | None):
        super().__init__(daemon=True)
        self.base_url, self.api_key = base_url, api_key
        self.stopping = threading.Event()
        self.tokens = 0

    def run(self) -> None:
        body = json.dumps({"model": "default", "prompt": "def main():\n", "max_tokens": 3000, "stream": True,
                           "ignore_eos": True, "temperature": 0.7}).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"}
                                                             if self.api_key else {})}
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while not self.stopping.is_set():
            request = urllib.request.Request(f"{self.base_url}/v1/completions", body, headers)
            try:
                with opener.open(request, timeout=600) as response:
                    for line in response:
                        if self.stopping.is_set():
                            break
                        if line.startswith(b"data: {"):
                            self.tokens += 1
            except OSError as e:
                print(f"background stream: {e}", file=sys.stderr)
                self.stopping.wait(1.0)


async def bench(args: argparse.Namespace, env: dict, state_dir: Path) -> list[Phase]:
    before, after, keys = trace(args.function)
    keys = keys[: args.max_keys] if args.max_keys else keys
    workspace = Path(tempfile.mkdtemp(prefix="mtplxd-bench-"))
    lsp = LanguageClient("mtplxd-bench", "1")
    await lsp.start_io(sys.executable, "-m", "mtplxd", "lsp", "--state-dir", str(state_dir), env=env)
    capabilities = types.ClientCapabilities(text_document=types.TextDocumentClientCapabilities(
        inline_completion=types.InlineCompletionClientCapabilities()))
    await asyncio.wait_for(lsp.initialize_async(types.InitializeParams(
        capabilities=capabilities, workspace_folders=[types.WorkspaceFolder(workspace.as_uri(), "bench")])), 120)
    lsp.initialized(types.InitializedParams())
    phases = []
    try:
        name = args.function.rpartition(".")[0].replace(".", "/") + ".py"
        # warm-up: one explicit request (loads the model, first prefill)
        warm = (workspace / f"warm-{Path(name).name}").as_uri()
        lsp.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(warm, "python", 1, before)))
        end = before.count("\n")
        await asyncio.wait_for(lsp.protocol.send_request_async(types.TEXT_DOCUMENT_INLINE_COMPLETION,
            types.InlineCompletionParams(context=types.InlineCompletionContext(
                trigger_kind=types.InlineCompletionTriggerKind.Invoked),
                text_document=types.TextDocumentIdentifier(warm), position=types.Position(end, 0))), 300)
        lsp.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(warm)))

        idle = Phase("idle")
        await replay(lsp, idle, before, after, keys, args.key_ms, args.pause_ms,
                     (workspace / f"idle-{Path(name).name}").as_uri())
        phases.append(idle)

        loaded = Phase("loaded (1 HTTP stream)")
        api_key = load_settings({"state_dir": str(state_dir)}).api_key  # as the daemon there reads it
        background = Background(_daemon_url(state_dir), api_key)
        background.start()
        await asyncio.sleep(1.0)  # the stream is generating
        await replay(lsp, loaded, before, after, keys, args.key_ms, args.pause_ms,
                     (workspace / f"loaded-{Path(name).name}").as_uri())
        background.stopping.set()
        loaded.background_tokens = background.tokens
        phases.append(loaded)
        await lsp.shutdown_async(None)
        lsp.exit(None)
    finally:
        await asyncio.wait_for(lsp.stop(), 30)
    return phases


def report(phases: list[Phase], args: argparse.Namespace) -> None:
    for p in phases:
        c = p.connection
        print(f"{p.name}: {p.keystrokes} keystrokes, {p.with_items} with items ({c.get('cache_hits', 0)} type-ahead), "
              f"{p.empty} empty, {p.cancelled} cancelled, {p.errors} errors")
        print(f"  keystroke-to-completion p50 {p.latency_ms.get('p50')} ms, p95 {p.latency_ms.get('p95')} ms"
              f" (engine-answered: p50 {p.engine_latency_ms.get('p50')} ms, p95 {p.engine_latency_ms.get('p95')} ms,"
              f" n={p.engine_latency_ms.get('n')})")
        print(f"  engine jobs: {c.get('jobs_started')} started, {c.get('jobs_cancelled')} cancelled, "
              f"{c.get('jobs_completed')} completed" +
              (f"; background stream: {p.background_tokens} chunks" if p.background_tokens else ""))
    if len(phases) == 2 and phases[0].latency_ms.get("p95") and phases[1].latency_ms.get("p95"):
        ratio = phases[1].latency_ms["p95"] / phases[0].latency_ms["p95"]
        engine = (phases[1].engine_latency_ms.get("p95") or 0) / (phases[0].engine_latency_ms.get("p95") or 1)
        print(f"loaded/idle p95: {ratio:.2f} (engine-answered {engine:.2f}); target <= 1.5")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="PATH", help="checkpoint for a scratch daemon (default: embedded)")
    parser.add_argument("--state-dir", metavar="DIR", help="use the daemon running there (default: a scratch one)")
    parser.add_argument("--function", default="colorsys.rgb_to_hls", help="module.function to type")
    parser.add_argument("--key-ms", type=float, default=80.0, help="time between keystrokes")
    parser.add_argument("--pause-ms", type=float, default=1500.0, help="extra pause after Enter (reading the suggestion)")
    parser.add_argument("--max-keys", type=int, default=0, help="type only the first N keystrokes")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    scratch = None
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTPLXD_") or k == "MTPLXD_API_KEY"}
    if args.state_dir:
        state_dir = Path(args.state_dir).expanduser().absolute()
    else:
        scratch = tempfile.TemporaryDirectory(prefix="mtplxd-bench-state-")
        state_dir = Path(scratch.name)
        env["MTPLXD_PORT"] = "0"
        if args.model:
            env["MTPLXD_MODEL"] = str(Path(args.model).expanduser().absolute())
    try:
        phases = asyncio.run(bench(args, env, state_dir))
    finally:
        if scratch is not None:
            daemon_client.stop(state_dir)
            scratch.cleanup()
    if args.json:
        print(json.dumps([asdict(p) for p in phases], indent=2))
    else:
        report(phases, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
