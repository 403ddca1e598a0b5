"""`mtplxd bench --sessions`: what the session bank saves, as a client sees it.

A daemon started as users start it (`mtplxd start --detach`, --model or the
embedded model) on a scratch state directory; every figure is the client's wall
time of a non-streamed completion with max_tokens=1 (request sent -> first token
back: time to first token plus one HTTP round trip), and the daemon's own TTFT
(`timings`, from the job's start: bank lookup and restore included).

  cold        a ~2,000-token prompt, each repetition in a fresh workspace
  warm RAM    the same prompt again in its workspace (the whole prompt restored)
  warm +64    the prompt plus 64 new tokens (prefix restored, 64 prefilled)
  warm disk   after a clean restart on the same state directory, the first
              request of each workspace (read, verified, restored from disk)
  chat        8 turns, each resending the whole history (a ~1,500-token first
              message, 32-token replies, ~60-token follow-ups): per turn the
              daemon's TTFT in one workspace against the same messages in a
              fresh one (the replies make the client's wall time a decode figure)

Prompts are token ids cut from this Python's own `argparse.py` with the
model's tokenizer, so the prompt length is exact for any model.
"""

from __future__ import annotations

import argparse as _argparse_module
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

HEADER = "X-Mtplx-Workspace"


@dataclass
class Timing:
    client_ms: float
    server_ms: float
    cached_tokens: int
    prompt_tokens: int


@dataclass
class SessionsBench:
    model: str
    prompt_tokens: int
    cold: dict
    warm_ram: dict
    warm_prefix: dict
    warm_disk: dict
    chat: list[dict] = field(default_factory=list)
    speedup_ram: float = 0.0
    speedup_disk: float = 0.0


def summary(timings: list[Timing]) -> dict:
    return {
        "client_ms": round(statistics.median(t.client_ms for t in timings), 1),
        "server_ms": round(statistics.median(t.server_ms for t in timings), 1),
        "cached_tokens": min(t.cached_tokens for t in timings),
        "prompt_tokens": timings[0].prompt_tokens,
        "n": len(timings),
    }


def source_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    text = Path(_argparse_module.__file__).read_text()
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    while len(ids) < offset + n:
        ids += ids
    return ids[offset : offset + n]


def source_text(tokenizer, n: int, offset: int) -> str:
    return tokenizer.decode(source_ids(tokenizer, n, offset))


def timed(client: httpx.Client, path: str, body: dict, workspace: str) -> tuple[Timing, dict]:
    body = {"model": "default", "max_tokens": 1, "temperature": 0, "ignore_eos": True, **body}
    start = time.perf_counter()
    r = client.post(path, json=body, headers={HEADER: workspace})
    elapsed = (time.perf_counter() - start) * 1000
    r.raise_for_status()
    data = r.json()
    usage = data["usage"]
    return Timing(elapsed, data["timings"]["time_to_first_token_s"] * 1000,
                  usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]), data


class Daemon:
    """`mtplxd start --detach` on one state directory, restartable."""

    def __init__(self, state: Path, model: str | None):
        self.state, self.model = state, model

    def start(self) -> str:
        from mtplxd.client import read_address

        cmd = [sys.executable, "-m", "mtplxd", "start", "--detach", "--port", "0", "--state-dir", str(self.state)]
        if self.model:
            cmd += ["--model", self.model]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        address = read_address(self.state)
        if address is None:  # `start --detach` returned: the daemon should be listening
            raise RuntimeError(f"the daemon in {self.state} published no address")
        host, port = address
        base_url = f"http://{host}:{port}"
        deadline = time.monotonic() + 600
        while httpx.get(f"{base_url}/health", timeout=30).status_code != 200:  # a real model loads for seconds
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon in {self.state} did not become ready")
            time.sleep(0.2)
        return base_url

    def stop(self) -> None:
        subprocess.run([sys.executable, "-m", "mtplxd", "stop", "--state-dir", str(self.state)], check=False,
                       stdout=subprocess.DEVNULL)


def wait_written(client: httpx.Client, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        disk = client.get("/v1/sessions").json().get("disk", {})
        if disk and disk.get("pending_writes") == 0:
            return
        time.sleep(0.2)


def run_bench(model: str | None, prompt_tokens: int = 2000, repeats: int = 5, turns: int = 8) -> SessionsBench:
    import engine  # noqa: F401  (BLAS before mlx)
    from engine.engine import load_tokenizer
    from mtplxd.config import Settings

    folder = Path(model) if model else Settings().model_path
    tokenizer = load_tokenizer(folder)
    prompt = source_ids(tokenizer, prompt_tokens)
    tail = source_ids(tokenizer, 64, offset=prompt_tokens + 500)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        daemon = Daemon(root / "state", model)
        workspaces = [str(root / f"ws{i}") for i in range(repeats)]
        with httpx.Client(base_url=daemon.start(), timeout=600) as client:
            try:
                timed(client, "/v1/completions", {"prompt": prompt[:64]}, str(root / "warmup"))  # first-call costs
                cold, warm, prefix = [], [], []
                for ws in workspaces:  # interleaved, so a shared machine's load hits all three alike
                    cold.append(timed(client, "/v1/completions", {"prompt": prompt}, ws)[0])
                    warm.append(timed(client, "/v1/completions", {"prompt": prompt}, ws)[0])
                    prefix.append(timed(client, "/v1/completions", {"prompt": prompt + tail}, ws)[0])
                chat = chat_turns(client, tokenizer, root, turns)
                wait_written(client)
            finally:
                daemon.stop()
        with httpx.Client(base_url=daemon.start(), timeout=600) as client:
            try:
                disk = [timed(client, "/v1/completions", {"prompt": prompt}, ws)[0] for ws in workspaces]
            finally:
                daemon.stop()
    result = SessionsBench(
        model=str(folder), prompt_tokens=len(prompt), cold=summary(cold), warm_ram=summary(warm),
        warm_prefix=summary(prefix), warm_disk=summary(disk), chat=chat,
    )
    result.speedup_ram = round(result.cold["client_ms"] / result.warm_ram["client_ms"], 1)
    result.speedup_disk = round(result.cold["client_ms"] / result.warm_disk["client_ms"], 1)
    return result


def chat_turns(client: httpx.Client, tokenizer, root: Path, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a careful Python reviewer."},
                {"role": "user", "content": "Review this code:\n" + source_text(tokenizer, 1500, 3000)}]
    rows = []
    for turn in range(turns):
        body = {"messages": messages, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        warm, data = timed(client, "/v1/chat/completions", body, str(root / "chat"))
        cold, _ = timed(client, "/v1/chat/completions", body, str(root / f"chat-cold{turn}"))
        rows.append({"turn": turn + 1, "prompt_tokens": warm.prompt_tokens, "cached_tokens": warm.cached_tokens,
                     "cold_ms": round(cold.server_ms, 1), "warm_ms": round(warm.server_ms, 1),
                     "speedup": round(cold.server_ms / warm.server_ms, 1)})
        reply = data["choices"][0]["message"]["content"]
        messages = messages + [{"role": "assistant", "content": reply},
                               {"role": "user", "content": "And this part?\n" + source_text(tokenizer, 60, 6000 + 97 * turn)}]
    return rows


def render(r: SessionsBench) -> str:
    lines = [f"session bank, {r.prompt_tokens}-token prompt, model {r.model}",
             "(client wall time of a max_tokens=1 completion, median; daemon TTFT in brackets)", ""]
    cold = r.cold["client_ms"]
    for name, s in (("cold", r.cold), ("warm from RAM (same prompt)", r.warm_ram),
                    ("warm from RAM (+64 new tokens)", r.warm_prefix), ("warm from disk after restart", r.warm_disk)):
        lines.append(f"  {name:<32} {s['client_ms']:>9.1f} ms  [{s['server_ms']:>8.1f} ms]  "
                     f"cached {s['cached_tokens']:>5}/{s['prompt_tokens']}  x{cold / s['client_ms']:.1f}")
    lines += ["", f"  targets: RAM >= 10x cold (x{r.speedup_ram}), disk >= 5x cold (x{r.speedup_disk})", "",
              "  chat (daemon TTFT; each turn resends the whole history)",
              "  turn  prompt  cached    cold ms    warm ms  speedup"]
    for row in r.chat:
        lines.append(f"  {row['turn']:>4}  {row['prompt_tokens']:>6}  {row['cached_tokens']:>6}  "
                     f"{row['cold_ms']:>9.1f}  {row['warm_ms']:>9.1f}  x{row['speedup']}")
    return "\n".join(lines)


def run(model: str | None, as_json: bool, prompt_tokens: int = 2000, repeats: int = 5) -> int:
    result = run_bench(model, prompt_tokens, repeats)
    print(json.dumps(asdict(result), indent=2) if as_json else render(result))
    return 0
