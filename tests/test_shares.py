"""The scheduler's policy between priority classes (mtplxd/shares.py), pass by pass, and
through the real scheduler on a tiny checkpoint: counted in passes and steps, never timed."""

from __future__ import annotations

import random
import threading
import time

import anyio
import httpx
import pytest

from mtplxd.requests import Done, Priority, TextDelta
from mtplxd.scheduler import Scheduler, SchedulerLimits
from mtplxd.shares import Shares
from tests.test_scheduler import engine_, request  # noqa: F401 (engine_ is a fixture)

I, N, B = Priority.INTERACTIVE, Priority.NORMAL, Priority.BACKGROUND
PATIENCE = {I: 1, N: 2, B: 8}


def longest_waits(shares: Shares, readiness: list[set[Priority]]) -> dict[Priority, int]:
    """Play the passes; the most passes each class waited in a row while it had work."""
    waited = {p: 0 for p in Priority}
    longest = {p: 0 for p in Priority}
    for ready in readiness:
        chosen = shares.choose(ready)
        assert chosen in ready
        for p in Priority:
            waited[p] = waited[p] + 1 if p in ready and p != chosen else 0
            longest[p] = max(longest[p], waited[p])
    return longest


def test_with_no_contention_the_highest_class_goes_first():
    shares = Shares(PATIENCE)
    assert [shares.choose({N}) for _ in range(5)] == [N] * 5  # normal alone builds no claim
    assert shares.choose({I, N}) == I  # a keystroke arriving goes first
    assert shares.choose({I, N, B}) == I
    assert shares.choose(set()) is None
    assert shares.due_turns == 0


def test_a_storm_of_interactive_work_cannot_starve_a_normal_job():
    shares = Shares(PATIENCE)
    turns = [shares.choose({I, N}) for _ in range(30)]
    assert turns[:3] == [I, I, N]  # interactive first, then the normal class's share
    assert turns.count(N) == 10 and turns.count(I) == 20  # one pass in patience + 1
    assert max(len(run) for run in "".join(p.name[0] for p in turns).split("N")) == 2


def test_every_class_keeps_its_bound_whatever_arrives():
    """Deterministic random arrivals, the interactive class always busy: no class with
    work ever waits past its bound, and the interactive class waits at most one pass
    unless both lower classes are due together."""
    rng = random.Random(33)
    readiness = [{I} | {p for p in (N, B) if rng.random() < 0.7} for _ in range(5000)]
    shares = Shares(PATIENCE)
    longest = longest_waits(shares, readiness)
    assert longest[N] <= shares.bound(N) == 4
    assert longest[B] <= shares.bound(B) == 10
    assert 1 <= longest[I] <= 2
    assert longest[N] >= PATIENCE[N] and longest[B] >= PATIENCE[B]  # the storm did hold them back


def test_two_due_lower_classes_do_not_shut_the_top_class_out():
    shares = Shares({I: 1, N: 1, B: 1})
    longest = longest_waits(shares, [{I, N, B}] * 300)
    assert all(longest[p] <= shares.bound(p) for p in Priority)
    assert longest[I] <= 2


def test_a_new_job_that_waited_its_patience_claims_the_next_slot():
    shares = Shares(PATIENCE)
    for _ in range(2):
        assert shares.claims({I, N}) is None
        shares.started({I, N}, I)  # the editors started theirs, the chat's waited
    assert shares.claims({I, N}) == N
    shares.started({I, N}, N)
    assert shares.claims({I, N}) is None  # started: no claim left
    for _ in range(5):
        shares.started({I}, None)
    assert shares.claims({I}) is None  # nothing outranks the top class: it never claims


@pytest.mark.parametrize("patience", [{I: 1, N: 0, B: 8}, {I: 1, N: 2}])
def test_a_class_must_have_a_patience_of_one_pass_or_more(patience):
    with pytest.raises(ValueError):
        Shares(patience)


# -- through the scheduler ---------------------------------------------------------------


@pytest.fixture
def anyio_backend():
    return "asyncio"


STORM_TOKENS = 30  # long enough that the storm's jobs come to hold every slot


@pytest.mark.anyio
@pytest.mark.parametrize("patience_normal", [2, 10**6])
@pytest.mark.parametrize("arrival", [5, 80])
async def test_a_normal_request_finishes_during_an_interactive_storm(engine_, patience_normal, arrival):  # noqa: F811
    """A hundred 30-token interactive completions queued at once (the class never runs out of
    work until they are done). A normal request sent meanwhile finishes before the storm
    ends: sent early (a slot free) it gets its first token within its bound and steps at
    least once in every patience + 1 passes; sent once the interactive jobs hold every
    slot, it claims the first slot that frees. With a patience too large to matter
    (negative control: strict priority) it waits for the whole storm. Order is read on
    the worker thread, as the steps were made, with the engine step each delta came from:
    a pass is at most two steps (the batch's, in which the storm's decoding rows and, once
    it decodes, the normal one ride together, and one job's)."""
    scheduler = Scheduler(lambda: engine_, SchedulerLimits(patience_normal=patience_normal, max_queued=256))
    steps: list[str] = []  # "i" or "n" for each delta, in the worker's order
    at: list[int] = []  # the engine step each came from
    scheduler.on_event = lambda entry, event: (steps.append("i" if entry.priority == I else "n"),
                                               at.append(scheduler.steps)) if isinstance(event, TextDelta) else None
    events: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        # enough that a busy machine's late wake-up of this loop cannot find the storm over
        storm = [scheduler.submit(request(STORM_TOKENS, Priority.INTERACTIVE, mode="ar", ignore_eos=True))
                 for _ in range(100)]
        storm_events: list[list] = [[] for _ in storm]
        for ticket, seen in zip(storm, storm_events):
            tg.start_soon(_collect, ticket, seen)
        while len(steps) < arrival:  # the storm is on
            await anyio.sleep(0.001)
        full = scheduler.stats().active == 10  # every slot held by the storm
        ticket = scheduler.submit(request(4, mode="ar", ignore_eos=True))
        start, submitted_at = len(steps), scheduler.steps
        await _collect(ticket, events)
        storm_done = sum(bool(seen) and isinstance(seen[-1], Done) for seen in storm_events)
        scheduler.stop()
    assert isinstance(events[-1], Done)
    after = "".join(steps[start:])
    assert after.count("n") == 4
    if patience_normal > 100:
        assert after.endswith("nnnn")  # strict priority: it waited for the whole storm
        return
    assert storm_done < len(storm)  # it finished before the storm did
    bound = 2 * scheduler.shares.bound(Priority.NORMAL)  # in steps
    normal_at = [a for a, kind in zip(at[start:], after) if kind == "n"]
    gaps = [b - a for a, b in zip(normal_at, normal_at[1:])]
    assert all(1 <= gap <= bound for gap in gaps)  # a step at least once in patience + 1 passes
    if arrival == 5:
        assert not full and normal_at[0] - submitted_at <= bound + 2  # +2: the pass picked before the submit
    else:  # the slot came with the first interactive job to finish (a batched step a token), then its turn
        assert full and normal_at[0] - submitted_at <= 2 * STORM_TOKENS + bound + 2


async def _collect(ticket, events: list) -> None:
    events.extend([e async for e in ticket])


# -- through the real daemon -----------------------------------------------------------------


def test_a_chat_completes_while_editors_send_completions_back_to_back(tmp_path):
    """The embedded model behind the real daemon, through the `openai` client: four editors
    send interactive completions back to back; a streamed chat sent meanwhile completes while
    they keep going, and /metrics shows the queue wait of both classes."""
    import openai

    from tests.daemon_fixture import running_daemon
    from tests.test_openai import metrics

    with running_daemon(tmp_path / "state", None) as daemon:
        client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        stop, done = threading.Event(), []

        def editor() -> None:
            while not stop.is_set():
                client.completions.create(model="default", prompt="def add(a, b):\n    ", max_tokens=24,
                                          extra_body={"ignore_eos": True},
                                          extra_headers={"X-Mtplx-Priority": "interactive"})
                done.append(time.monotonic())

        editors = [threading.Thread(target=editor) for _ in range(4)]
        for thread in editors:
            thread.start()
        try:
            while len(done) < 8:  # the editors are busy
                time.sleep(0.01)
            sent = time.monotonic()
            stream = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=160, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = list(stream)
            finished = time.monotonic()
        finally:
            stop.set()
            for thread in editors:
                thread.join()
        assert chunks[-1].usage.completion_tokens == 160
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert sum(sent < t < finished for t in done) >= 1  # the editors kept completing meanwhile
        with httpx.Client(base_url=daemon.base_url, timeout=30) as http:
            samples = metrics(http)
        waits = {s.labels["class"]: s.value for s in samples["mtplxd_queue_wait_seconds"]
                 if s.name == "mtplxd_queue_wait_seconds_count"}
        assert waits["interactive"] >= 8 and waits["normal"] == 1
