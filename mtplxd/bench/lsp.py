"""Editor completions, before and after: replay typing into `mtplxd lsp`, side by side.

    python -m mtplxd.bench.lsp                    # the embedded model, a scratch daemon
    python -m mtplxd.bench.lsp --model PATH       # any checkpoint (prefix-only without FIM tokens)
    python -m mtplxd.bench.lsp --state-dir DIR    # a daemon already running there
    python -m mtplxd.bench.lsp --phases idle,loaded --streams 8   # also under 8 HTTP streams

Held-out standard-library functions (the shipped model never trained on these modules)
are typed character by character, every `--key-ms`, into the file they come from (the
function cut out), through a real pygls client speaking to `mtplxd lsp` as an editor
does: each keystroke is a didChange plus an automatic inlineCompletion request. The
other typed modules are open in the same workspace, each visited at its own function
(an empty edit there: what the user looked at), for cross-file context. Enter inserts
the next line's indentation (as editors auto-indent) and is followed by a pause of
`--pause-ms`: the user waits for the suggestion, reads it for `--read-ms` from its arrival, accepts it
whole, sees the suggestion after it, then undoes the accept and types on.

Two sides, each its own connection and workspace (so its own session-bank namespace),
alternating which goes first from one function to the next:
- before: the behaviour before issue 25 through initializationOptions: no prefetch,
  the fixed `debounceMs` (120), one length (`maxTokens` 64) everywhere, no cross-file
  context (`workspaceContextTokens` 0), a block shown whole (`timeBudgetMs` 500);
- after: the defaults.

Reported per side: pause-to-suggestion p50/p95 (the request sent with Enter -> items;
each file's first apart: its prompt is cold),
after-accept p50/p95 (the request at the end of the accepted suggestion -> items),
prefetch hit rate (after-accept requests answered from the prefetch), median suggestion
length in characters, tokens generated (every job of the connection, prefetches and
cancelled ones included) per character of the suggestions the engine answered, and the
first-line exact-match rate at the pauses (the suggestion's first line against the real
next line, whitespace at the ends aside), and the share of the suggested characters at the
pauses that a user keeps (their common start with the real code that follows). On a shared machine the figures are noisy:
compare the sides of one run, not digits across runs.
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

FUNCTIONS = "colorsys.rgb_to_hls,shlex.split,statistics.median,fnmatch.filter"
BEFORE = {"prefetch": False, "adaptiveDebounce": False, "lineMaxTokens": 64, "maxTokens": 64,
          "workspaceContextTokens": 0, "timeBudgetMs": 500}
SIDES = {"before": BEFORE, "after": {}}


@dataclass
class Side:
    """One side's samples over a phase."""

    name: str
    keystrokes: int = 0
    cancelled: int = 0
    errors: int = 0
    pause_ms: list[float] = field(default_factory=list)
    cold_ms: list[float] = field(default_factory=list)  # each file's first pause: its prompt not yet cached
    accept_ms: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # of every suggestion received at a pause or after an accept
    exact: int = 0  # pauses whose suggestion's first line is the real next line
    judged: int = 0  # pauses with a real next line to compare with
    suggested_chars: int = 0  # of the suggestions at the pauses
    kept_chars: int = 0  # of those, the ones a user keeps: the common start with the real code
    accepts: int = 0
    counters: dict = field(default_factory=dict)  # mtplxd.status counters, summed over the connections

    def add_counters(self, start: dict, end: dict) -> None:
        for group in ("connection", "prefetchJobs"):
            for key, value in end[group].items():
                name = f"{group}.{key}"
                self.counters[name] = self.counters.get(name, 0) + value - start[group].get(key, 0)

    def figures(self) -> dict:
        c = self.counters
        tokens = c.get("connection.tokens_generated", 0) + c.get("prefetchJobs.tokens_generated", 0)
        shown = c.get("connection.shown_chars", 0)
        prompt, cached = c.get("connection.prompt_tokens", 0), c.get("connection.cached_tokens", 0)
        jobs = c.get("connection.jobs_completed", 0)
        return {
            "pause_ms": percentiles(self.pause_ms),
            "cold_pause_ms": percentiles(self.cold_ms),
            "after_accept_ms": percentiles(self.accept_ms),
            "prefetch_hit_rate": ratio(c.get("connection.prefetch_hits", 0), self.accepts),
            "median_chars": statistics.median(self.lengths) if self.lengths else None,
            "tokens_per_shown_char": ratio(tokens, shown),
            "first_line_exact": ratio(self.exact, self.judged),
            "accepted_char_share": ratio(self.kept_chars, self.suggested_chars),
            "cached_share": ratio(cached, prompt),  # of the prompt tokens of the jobs that ended
            "prefilled_per_job": ratio(prompt - cached, jobs),
            "judged": self.judged, "accepts": self.accepts, "keystrokes": self.keystrokes,
            "cancelled": self.cancelled, "errors": self.errors,
        }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50": round(statistics.median(ordered), 1), "p95": round(p95, 1)}


@dataclass(frozen=True)
class Trace:
    module: str  # dotted
    path: str  # relative, as in the workspace
    before: str  # the file's text before the function
    after: str  # ... and after it
    keys: list[str]  # keystrokes typing the function (Enter with the next line's indentation)
    lines: list[str]  # the function's lines


def trace(function: str) -> Trace:
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
    path = module_name.replace(".", "/") + ".py"
    return Trace(module_name, path, source[:start], source[start + len(body):], keys, body.split("\n"))


class Editor:
    """One document of one connection, as an editor holds it: text, version, cursor."""

    def __init__(self, lsp: LanguageClient, uri: str, text: str):
        self.lsp, self.uri, self.version = lsp, uri, 1
        lsp.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", 1, text)))

    def insert(self, line: int, column: int, text: str, end: tuple[int, int] | None = None) -> tuple[int, int]:
        """Replace (line, column)..`end` (default: nothing) with `text`; the position after it."""
        self.version += 1
        start = types.Position(line, column)
        stop = types.Position(*end) if end else start
        self.lsp.text_document_did_change(types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(version=self.version, uri=self.uri),
            [types.TextDocumentContentChangePartial(range=types.Range(start, stop), text=text)]))
        rows = text.split("\n")
        return line + len(rows) - 1, (column if len(rows) == 1 else 0) + len(rows[-1])  # ASCII: UTF-16 = chars

    def ask(self, line: int, column: int) -> asyncio.Future:
        return self.lsp.protocol.send_request_async(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionParams(
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
            text_document=types.TextDocumentIdentifier(self.uri), position=types.Position(line, column)))

    def close(self) -> None:
        self.lsp.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(self.uri)))


async def timed(future: asyncio.Future, sent: float) -> tuple[str, float, str]:
    """(outcome, ms from `sent`, the suggestion)."""
    try:
        result = await future
    except JsonRpcException as e:
        return ("cancelled" if e.code in (-32800, -32801) else "errors"), 0.0, ""
    ms = (time.perf_counter() - sent) * 1000
    text = result.items[0].insert_text if result and result.items else ""
    return ("items" if text else "empty"), ms, str(text)


async def type_function(lsp: LanguageClient, side: Side, target: Trace, others: list[Trace], workspace: Path,
                        args: argparse.Namespace) -> None:
    """Open the other modules (each visited at its function), then type `target` in its file."""
    opened = []
    for other in others:
        editor = Editor(lsp, (workspace / other.path).as_uri(), other.before + "\n".join(other.lines) + other.after)
        line = other.before.count("\n")
        editor.insert(line, 0, "")  # the user was there
        opened.append(editor)
    editor = Editor(lsp, (workspace / target.path).as_uri(), target.before + target.after)
    line, column = target.before.count("\n"), 0
    pending = []
    row = 0  # the function's line being typed
    cold = True  # no suggestion in this file yet: its prompt is not in the session bank
    next_at = time.perf_counter()
    for key in target.keys:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        line, column = editor.insert(line, column, key)
        sent = time.perf_counter()
        side.keystrokes += 1
        if "\n" not in key:
            pending.append(asyncio.ensure_future(timed(editor.ask(line, column), sent)))
            next_at = sent + args.key_ms / 1000
            continue
        outcome, ms, text = await timed(editor.ask(line, column), sent)  # the pause: the user waits
        _count(side, outcome)
        row += 1
        real = target.lines[row] if row < len(target.lines) else ""
        if real.strip():
            side.judged += 1
            side.exact += bool(text) and text.split("\n")[0].strip() == real.strip()
            side.suggested_chars += len(text)
            side.kept_chars += _common_start(text, "\n".join(target.lines[row:]).lstrip(" \t"))
        if text:
            (side.cold_ms if cold else side.pause_ms).append(ms)
            cold = False
            side.lengths.append(len(text))
            await accept(editor, side, line, column, text, sent + ms / 1000, args)
        next_at = sent + (args.key_ms + args.pause_ms) / 1000
    for outcome, _, _ in await asyncio.gather(*pending):
        if outcome in ("cancelled", "errors"):
            _count(side, outcome)
    for e in [editor, *opened]:
        e.close()


def _common_start(a: str, b: str) -> int:
    """How many leading characters two texts share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def accept(editor: Editor, side: Side, line: int, column: int, text: str, shown_at: float,
                 args: argparse.Namespace) -> None:
    """After reading, accept `text` whole, wait for the next suggestion, then undo the accept."""
    await asyncio.sleep(max(0.0, shown_at + args.read_ms / 1000 - time.perf_counter()))
    end = editor.insert(line, column, text)
    side.accepts += 1
    sent = time.perf_counter()
    outcome, ms, after = await timed(editor.ask(*end), sent)
    _count(side, outcome)
    if after:
        side.accept_ms.append(ms)
        side.lengths.append(len(after))
    editor.insert(line, column, "", end)  # undo: back to the real code


def _count(side: Side, outcome: str) -> None:
    if outcome in ("cancelled", "errors"):
        setattr(side, outcome, getattr(side, outcome) + 1)


async def status(lsp: LanguageClient) -> dict:
    result = await lsp.workspace_execute_command_async(types.ExecuteCommandParams("mtplxd.status"))
    if result is None:
        raise RuntimeError("mtplxd.status returned no result")
    return result


async def connect(env: dict, state_dir: Path, workspace: Path, options: dict) -> LanguageClient:
    lsp = LanguageClient("mtplxd-bench", "1")
    await lsp.start_io(sys.executable, "-m", "mtplxd", "lsp", "--state-dir", str(state_dir), env=env)
    capabilities = types.ClientCapabilities(text_document=types.TextDocumentClientCapabilities(
        inline_completion=types.InlineCompletionClientCapabilities()))
    await asyncio.wait_for(lsp.initialize_async(types.InitializeParams(
        capabilities=capabilities, initialization_options={"mtplxd": options},
        workspace_folders=[types.WorkspaceFolder(workspace.as_uri(), workspace.name)])), 300)
    lsp.initialized(types.InitializedParams())
    return lsp


async def disconnect(lsp: LanguageClient) -> None:
    try:
        await asyncio.wait_for(lsp.shutdown_async(None), 30)
        lsp.exit(None)
    finally:
        await asyncio.wait_for(lsp.stop(), 30)


async def one_side(side: Side, options: dict, target: Trace, others: list[Trace], env: dict, state_dir: Path,
                   args: argparse.Namespace) -> None:
    """`target` typed on a fresh connection and workspace (a cold session-bank namespace)."""
    workspace = Path(tempfile.mkdtemp(prefix=f"mtplxd-bench-{side.name}-"))
    lsp = await connect(env, state_dir, workspace, options)
    try:
        start = await status(lsp)
        await type_function(lsp, side, target, others, workspace, args)
        await asyncio.sleep(0.5)  # the last prefetch settles into the counters
        side.add_counters(start, await status(lsp))
    finally:
        await disconnect(lsp)


async def warm_up(env: dict, state_dir: Path, target: Trace) -> None:
    """One explicit request: the daemon starts and loads the model, the first prefill."""
    workspace = Path(tempfile.mkdtemp(prefix="mtplxd-bench-warm-"))
    lsp = await connect(env, state_dir, workspace, {})
    try:
        editor = Editor(lsp, (workspace / target.path).as_uri(), target.before)
        await asyncio.wait_for(lsp.protocol.send_request_async(types.TEXT_DOCUMENT_INLINE_COMPLETION,
            types.InlineCompletionParams(context=types.InlineCompletionContext(
                trigger_kind=types.InlineCompletionTriggerKind.Invoked),
                text_document=types.TextDocumentIdentifier(editor.uri),
                position=types.Position(target.before.count("\n"), 0))), 300)
    finally:
        await disconnect(lsp)


async def bench(args: argparse.Namespace, env: dict, state_dir: Path) -> dict[str, dict[str, Side]]:
    traces = [trace(f) for f in args.functions.split(",")]
    await warm_up(env, state_dir, traces[0])
    results: dict[str, dict[str, Side]] = {}
    for phase in args.phases.split(","):
        background = []
        if phase == "loaded":
            api_key = load_settings({"state_dir": str(state_dir)}).api_key  # as the daemon there reads it
            background = [Background(_daemon_url(state_dir), api_key) for _ in range(args.streams)]
            for stream in background:
                stream.start()
            await asyncio.sleep(1.0)  # the streams are generating
        sides = {name: Side(name) for name in SIDES}
        turn = 0
        for _ in range(args.rounds):
            for target in traces:
                others = [t for t in traces if t is not target]
                order = list(SIDES) if turn % 2 == 0 else list(reversed(SIDES))  # alternate who goes first
                turn += 1
                for name in order:
                    await one_side(sides[name], SIDES[name], target, others, env, state_dir, args)
        for stream in background:
            stream.stopping.set()
        results[phase] = sides
    return results


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


def report(results: dict[str, dict[str, Side]]) -> None:
    rows = [
        ("pause-to-suggestion p50 / p95 ms", lambda f: f"{f['pause_ms'].get('p50')} / {f['pause_ms'].get('p95')}"),
        ("a file's first pause (cold prompt) p50 ms", lambda f: f["cold_pause_ms"].get("p50")),
        ("after-accept p50 / p95 ms",
         lambda f: f"{f['after_accept_ms'].get('p50')} / {f['after_accept_ms'].get('p95')}"),
        ("prefetch hit rate", lambda f: _percent(f["prefetch_hit_rate"])),
        ("median suggestion length, chars", lambda f: f["median_chars"]),
        ("tokens generated per shown char", lambda f: f["tokens_per_shown_char"]),
        ("prompt tokens prefilled per job (cached share)",
         lambda f: f"{f['prefilled_per_job']} ({_percent(f['cached_share'])})"),
        ("first-line exact match", lambda f: f"{_percent(f['first_line_exact'])} of {f['judged']}"),
        ("suggested characters kept (common start with the real code)",
         lambda f: _percent(f["accepted_char_share"])),
        ("accepts / keystrokes / cancelled / errors",
         lambda f: f"{f['accepts']} / {f['keystrokes']} / {f['cancelled']} / {f['errors']}"),
    ]
    for phase, sides in results.items():
        figures = {name: side.figures() for name, side in sides.items()}
        print(f"\n{phase}:\n\n| | {' | '.join(figures)} |\n|---|{'---|' * len(figures)}")
        for label, cell in rows:
            print(f"| {label} | {' | '.join(str(cell(f)) for f in figures.values())} |")
    if "idle" in results and "loaded" in results:
        for name in SIDES:
            idle, loaded = results["idle"][name].figures(), results["loaded"][name].figures()
            if idle["pause_ms"].get("p95") and loaded["pause_ms"].get("p95"):
                times = loaded["pause_ms"]["p95"] / idle["pause_ms"]["p95"]
                print(f"{name}: loaded/idle pause-to-suggestion p95 {times:.2f} (target <= 1.5)")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="PATH", help="checkpoint for a scratch daemon (default: embedded)")
    parser.add_argument("--state-dir", metavar="DIR", help="use the daemon running there (default: a scratch one)")
    parser.add_argument("--functions", default=FUNCTIONS, help="module.function to type, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="times every function is typed on each side")
    parser.add_argument("--phases", default="idle", help="idle, loaded or both (comma-separated)")
    parser.add_argument("--streams", type=int, default=8, help="background HTTP streams in the loaded phase")
    parser.add_argument("--key-ms", type=float, default=60.0, help="time between keystrokes")
    parser.add_argument("--pause-ms", type=float, default=1000.0, help="extra pause after Enter")
    parser.add_argument("--read-ms", type=float, default=300.0, help="from a suggestion shown to its accept")
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
        if args.model:  # a path, or a name in the usual models folder (the scratch one has none)
            env["MTPLXD_MODEL"] = str(load_settings({"model": args.model}).model_path)
    try:
        results = asyncio.run(bench(args, env, state_dir))
    finally:
        if scratch is not None:
            daemon_client.stop(state_dir)
            scratch.cleanup()
    if args.json:
        print(json.dumps({phase: {name: {**side.figures(), "counters": side.counters} for name, side in sides.items()}
                          for phase, sides in results.items()}, indent=2))
    else:
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
