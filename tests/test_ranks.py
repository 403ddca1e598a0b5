"""Several ranks (mtplxd/ranks/): one daemon serving a model split over two processes
on loopback (`mtplxd start --ranks 2`), driven through the openai client.

The split model must answer exactly as the whole one: the same greedy and seeded
texts at 1 and 2 ranks, AR and MTP, alone and in a batch; session-bank hits and
cancellations leave the ranks in step; a follower that dies or hangs puts the daemon
out of service within seconds (503 and a reason, never a hung client), and
`mtplxd stop` leaves no process behind.

Families: deepseek_v3 (attention only, MLA + MoE, split by mlx-lm's own `shard`),
qwen3_5_moe (hybrid GatedDeltaNet + attention with MoE, split by mlx-lm, its LM head
split by vocabulary and gathered before sampling), and the embedded MiMo (split by its
backend: MLP only, one KV head), and qwen3_next (hybrid, which mlx-lm cannot split by
weights: its layers are split, a pipeline).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.checkpoints import write
from tests.daemon_fixture import mtplxd_command, running_daemon, stop_process
from tests.engine_helpers import assert_batched_greedy_agree

PROMPTS = ["def add(a, b):", "The capital of", "for i in range(10):"]
MODES = [{"generation_mode": "ar"}] + [{"generation_mode": "mtp", "depth": d} for d in (1, 2, 3)]
SAMPLERS = [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}]


def complete(daemon, prompt: str, max_tokens: int = 24, **extra) -> tuple[str, int]:
    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0)
    extra_body = {k: extra.pop(k) for k in ("generation_mode", "depth", "ignore_eos") if k in extra}
    reply = client.completions.create(model=Path(daemon.model).name, prompt=prompt, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True, **extra_body}, **extra)
    return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens


class Daemon:
    """A running daemon and the model it serves."""

    def __init__(self, info, model: Path):
        self.base_url, self.state_dir, self.process, self.model = info.base_url, info.state_dir, info.process, model


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_5_moe", "qwen3_next"])
def pair(request, tmp_path_factory):
    """The same checkpoint served by one process and by two ranks."""
    family = request.param
    root = tmp_path_factory.mktemp(f"ranks-{family}")
    model = write(family, root / family, **({"mtp_heads": 2} if family == "deepseek_v3" else {}))
    with running_daemon(root / "one", model) as one, running_daemon(root / "two", model, "--ranks", "2") as two:
        yield Daemon(one, model), Daemon(two, model), family


def test_two_ranks_answer_as_one(pair):
    one, two, family = pair
    health = httpx.get(two.base_url + "/health").json()
    assert health["ranks"]["size"] == 2 and [r["state"] for r in health["ranks"]["ranks"]] == ["ok", "ok"]
    assert ("pipeline" if family == "qwen3_next" else "tensor parallel") in health["ranks"]["sharding"]
    assert "ranks" not in httpx.get(one.base_url + "/health").json()
    for mode in MODES:
        for sampler in SAMPLERS:
            alone = complete(one, PROMPTS[0], **mode, **sampler)[0]
            assert complete(two, PROMPTS[0], **mode, **sampler)[0] == alone, (mode, sampler)


def test_a_batch_at_two_ranks_answers_as_one_rank_alone(pair):
    """Eight concurrent streams, two per mode (AR, MTP depths 1-3), one greedy and one
    seeded each: those of a depth decode in one batch (engine/batch.py)."""
    one, two, _ = pair
    rows = [(f"item {i}: {PROMPTS[i % 3]}", MODES[i // 2], SAMPLERS[i % 2]) for i in range(8)]

    def run(daemon, row):
        prompt, mode, sampler = row
        return complete(daemon, prompt, 32, **mode, **sampler)[0]

    with ThreadPoolExecutor(len(rows)) as pool:
        batched = list(pool.map(lambda row: run(two, row), rows))
    for row, text in zip(rows, batched):
        alone = run(one, row)
        if row[2]["temperature"] > 0:
            assert text == alone, row  # seeded rows draw with their own keys in a batch too
        elif text != alone:  # batched matmuls round differently: only a near-tie may part them
            assert_batched_greedy_agree(two.model, row[0], alone, text)
    metrics = httpx.get(two.base_url + "/metrics").text.splitlines()
    steps = sum(float(line.split()[-1]) for line in metrics if line.startswith("mtplxd_batch_rows_count"))
    alone = sum(float(line.split()[-1]) for line in metrics if line.startswith('mtplxd_batch_rows_bucket{le="1.0"}'))
    assert steps - alone > 0, "the streams decoded in batched steps"


def test_cancel_mid_stream_leaves_the_ranks_in_step(pair):
    one, two, _ = pair
    client = openai.OpenAI(base_url=two.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model=two.model.name, prompt=PROMPTS[2], max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    for _ in range(3):
        next(iter(stream))
    stream.close()  # the client goes away mid-stream
    for mode in MODES[::2]:
        assert complete(two, PROMPTS[1], **mode, **SAMPLERS[1])[0] == complete(one, PROMPTS[1], **mode, **SAMPLERS[1])[0]
    assert httpx.get(two.base_url + "/health").json()["status"] == "ok"


SESSION_ENV = {"MTPLXD_SESSION_WRITE_DELAY_MS": "0"}


def test_session_bank_at_two_ranks(tmp_path):
    """A hit at two ranks answers as a cold run; the slices persist per rank across a
    restart; one rank never restores a two-rank snapshot."""
    model = write("deepseek_v3", tmp_path / "model", mtp_heads=2)
    prompt = "def long_function(x):\n" + "    x = x + 1\n" * 12
    greedy = {"temperature": 0.0, "generation_mode": "mtp", "depth": 2}
    with running_daemon(tmp_path / "state", model, "--ranks", "2", env=SESSION_ENV) as info:
        two = Daemon(info, model)
        cold, cached = complete(two, prompt, 40, **greedy)
        assert cached == 0
        warm, cached = complete(two, prompt, 40, **greedy)
        assert cached > 0 and warm == cold
    folders = sorted(p.name for p in (tmp_path / "state" / "sessions").iterdir())
    assert folders == ["rank0-of2", "rank1-of2"]
    with running_daemon(tmp_path / "state", model, "--ranks", "2", env=SESSION_ENV) as info:
        text, cached = complete(Daemon(info, model), prompt, 40, **greedy)
        assert cached > 0 and text == cold, "each rank restores its own slice from disk"
    with running_daemon(tmp_path / "state", model, env=SESSION_ENV) as info:
        text, cached = complete(Daemon(info, model), prompt, 40, **greedy)
        assert cached == 0 and text == cold, "a two-rank snapshot is a miss at one rank"


def test_a_model_that_cannot_split_is_refused(tmp_path):
    model = write("mimo", tmp_path / "model")  # intermediate_size 64: not over 3 ranks
    with running_daemon(tmp_path / "state", model, "--ranks", "3", until="failed") as info:
        reply = httpx.get(info.base_url + "/health")
        assert reply.status_code == 503
        assert "mimo: intermediate_size 64 does not divide over 3 ranks" in reply.json()["error"]


def follower_pids(daemon_pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(daemon_pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def wait_for_status(base_url: str, status: int, within_s: float) -> tuple[dict, float]:
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        try:
            reply = httpx.get(base_url + "/health", timeout=5)
        except httpx.TransportError:  # not listening yet
            reply = None
        if reply is not None and reply.status_code == status:
            return reply.json(), time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"/health did not answer {status} within {within_s} s")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_lost_follower_puts_the_daemon_out_of_service(tmp_path, fault):
    env = {"MTPLXD_RANK_TIMEOUT_S": "3"}
    with running_daemon(tmp_path / "state", None, "--ranks", "2", env=env) as info:
        daemon = Daemon(info, Path("assets"))
        [follower] = follower_pids(info.process.pid)
        assert complete(daemon, PROMPTS[0], 8)[0]
        client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(model="assets", prompt=PROMPTS[0], max_tokens=4000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(follower, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        health, _ = wait_for_status(daemon.base_url, 503, 10)
        assert health["ranks"]["failure"] and health["error"] == health["ranks"]["failure"]
        with pytest.raises(openai.APIError):  # the open stream ends with an error, not a hang
            for _ in stream:
                pass
        with pytest.raises(openai.APIStatusError) as refused:
            complete(daemon, PROMPTS[1], 8)
        assert refused.value.status_code == 503 and "ranks" in str(refused.value)
        assert info.process.poll() is None, "rank 0 stays up"
        stop = subprocess.run([*mtplxd_command(), "stop", "--state-dir", str(info.state_dir)],
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert stop_process(info.process) is not None
    deadline = time.monotonic() + 10
    while alive(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(follower), "no rank outlives `mtplxd stop`"


def _launch_two_ranks(state: Path) -> subprocess.Popen:
    """`mlx.launch -n 2 ... mtplxd start` on loopback, as a user with two machines types it."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    return subprocess.Popen([str(launcher), "-n", "2", "--backend", "ring", "--", *mtplxd_command(), "start",
                             "--port", "0", "--state-dir", str(state)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())


def _daemon_url(state: Path, timeout: float = 60) -> str:
    """Rank 0's address, once it has written daemon.json."""
    deadline = time.monotonic() + timeout
    while not (state / "daemon.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return "http://127.0.0.1:{port}".format(**json.loads((state / "daemon.json").read_text()))


def test_start_under_mlx_launch(tmp_path):
    """What a user with two machines types, on loopback: mlx.launch starts `mtplxd start`
    on every rank; rank 0 serves, rank 1 follows, `mtplxd stop` ends both."""
    state = tmp_path / "state"
    launch = _launch_two_ranks(state)
    try:
        url = _daemon_url(state)
        health, _ = wait_for_status(url, 200, 60)
        assert [r["role"] for r in health["ranks"]["ranks"]] == ["daemon", "follower"]
        reply = httpx.post(url + "/v1/completions", json={"model": "assets", "prompt": PROMPTS[0], "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] == 8
        subprocess.run([*mtplxd_command(), "stop", "--state-dir", str(state)], check=True, timeout=60,
                       capture_output=True)
        assert launch.wait(30) == 0, "every rank ended"
    finally:
        if launch.poll() is None:
            launch.kill()


def _env() -> dict[str, str]:
    from tests.daemon_fixture import daemon_env

    return daemon_env()


def test_commands_carry_only_our_own_classes():
    from mtplxd.ranks.channel import Close, _load

    assert _load(pickle.dumps(Close(3))) == Close(3)
    with pytest.raises(pickle.UnpicklingError):
        _load(pickle.dumps(os.system))  # negative control: any other callable is refused


def test_a_follower_that_diverged_says_so(tmp_path):
    """A follower checks each step's rows against rank 0's before running it."""
    from engine.engine import Engine
    from mtplxd.ranks.channel import DIVERGED, OK, Close, RowCheck, Start, Step
    from mtplxd.ranks.follower import Mirror
    from mtplxd.requests import TextRequest

    engine = Engine.load(Path(__file__).parents[1] / "engine" / "assets")
    mirror = Mirror(engine, None)
    prompt = tuple(engine.tokenizer.encode("def add(a, b):"))
    plan = _plan(engine)
    assert mirror.run(Start(1, TextRequest(prompt, 8), 5, plan)) == OK
    assert mirror.run(Step(1, RowCheck(len(prompt), 0, prompt[-1]))) == OK  # the prefill
    job = mirror.jobs[1]
    held = RowCheck(len(job.generation.tokens), job.generation.fed_count, job.generation.tokens[-1])
    assert mirror.run(Step(1, RowCheck(held.committed, held.fed, held.last + 1))) == DIVERGED
    assert mirror.run(Step(1, held)) == OK
    assert mirror.run(Close(1)) == OK and not mirror.jobs


def _plan(engine):
    from engine.profiles import DecodePlanner, auto_profile

    return DecodePlanner(auto_profile({}), engine.backend.n_heads).plan(0.0)


def _rank_pid(rank: int, state: Path) -> int | None:
    """The pid of the `mtplxd start` that mlx.launch started as `rank` for this state dir."""
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"MLX_RANK={rank}".encode() in environ and str(state).encode() in cmdline and proc.name.isdigit():
            return int(proc.name)
    return None


def test_rank_0_says_why_when_mlx_launch_stops_it_for_a_follower(tmp_path):
    """mlx.launch stops every rank when one exits with an error: rank 0, terminated for a
    follower's death, leaves a line in its log saying so (before: only `received SIGTERM`)."""
    from mtplxd import client as daemon_client

    state = tmp_path / "state"
    launch = _launch_two_ranks(state)
    try:
        url = _daemon_url(state)
        wait_for_status(url, 200, 60)
        follower = _rank_pid(1, state)
        assert follower is not None
        os.kill(follower, signal.SIGKILL)
        launch.wait(60)
        log = daemon_client.log_tail(state, 10)
        assert "rank 0 of 2" in log and "mlx.launch" in log, log
    finally:
        if launch.poll() is None:
            launch.kill()
