"""The one scheduling queue, on the real engine and a tiny MiMo checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import anyio
import pytest

from engine.engine import Engine
from engine.sampling import SamplerSettings
from mtplxd.requests import Done, Failed, Priority, TextDelta, TextRequest
from mtplxd.scheduler import NotReady, QueueFull, Scheduler, SchedulerLimits
from tests.checkpoints import write

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def engine_(tmp_path_factory):
    return Engine.load(write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1))


@pytest.fixture
def anyio_backend():
    return "asyncio"


def request(n: int, priority=Priority.NORMAL, **kw) -> TextRequest:
    return TextRequest(prompt_ids=(10, 11, 12, 13), max_tokens=n, priority=priority,
                       sampler=SamplerSettings(temperature=0.7), seed=1, **kw)


async def collect(ticket, log: list, name: str) -> list:
    events = []
    async for event in ticket:
        events.append(event)
        log.append((name, type(event).__name__))
    return events


async def test_interactive_overtakes_and_classes_round_robin(engine_):
    scheduler = Scheduler(lambda: engine_)
    log: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        long_a = scheduler.submit(request(200))
        long_b = scheduler.submit(request(200))
        tg.start_soon(collect, long_a, log, "a")
        tg.start_soon(collect, long_b, log, "b")
        while len(log) < 6:
            await anyio.sleep(0.01)
        steps_before = scheduler.steps
        events = await collect(scheduler.submit(request(3, Priority.INTERACTIVE, mode="ar")), log, "i")
        assert isinstance(events[-1], Done)
        # interactive prefill + 3 tokens need about 3 steps; normal jobs got at most one in between
        assert scheduler.steps - steps_before <= 6
        scheduler.stop()
    names = [n for n, kind in log if kind == "TextDelta"]
    first_a, first_b = names.index("a"), names.index("b")
    last_a = len(names) - 1 - names[::-1].index("a")
    assert first_b < last_a, "round-robin: b must start before a finishes"
    assert max(first_a, first_b) < 4


async def test_cancel_frees_the_engine_within_one_step(engine_):
    scheduler = Scheduler(lambda: engine_)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        ticket = scheduler.submit(request(500))
        seen = 0
        async for event in ticket:
            seen += isinstance(event, TextDelta)
            if seen == 3:
                break
        ticket.cancel()
        steps = scheduler.steps
        with anyio.fail_after(10):
            while scheduler.stats().active:
                await anyio.sleep(0.005)
        assert scheduler.steps - steps <= 1
        assert scheduler.cancelled == 1
        scheduler.stop()


async def test_admission_control_refuses_beyond_the_bound(engine_):
    scheduler = Scheduler(lambda: engine_, SchedulerLimits(max_active=1, max_queued=2))
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        tickets = [scheduler.submit(request(100))]
        while scheduler.stats().active == 0:
            await anyio.sleep(0.005)
        tickets += [scheduler.submit(request(100)) for _ in range(2)]  # no free slot: they wait
        assert scheduler.stats().queued_by_class["normal"] == 2
        with pytest.raises(QueueFull):
            scheduler.submit(request(100))
        for t in tickets:
            t.cancel()
        scheduler.stop()


async def test_shutdown_ends_streams_with_an_error_event(engine_):
    scheduler = Scheduler(lambda: engine_)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        ticket = scheduler.submit(request(1000))
        first = await ticket.next_event()
        assert isinstance(first, TextDelta)
        scheduler.stop()
        with anyio.fail_after(10):
            rest = [e async for e in ticket]
    assert isinstance(rest[-1], Failed) and rest[-1].kind == "shutdown"
    with pytest.raises(NotReady):
        scheduler.submit(request(1))


async def test_failed_load_is_reported_not_raised(engine_):
    def broken():
        raise FileNotFoundError("no config.json")

    scheduler = Scheduler(broken)
    async with anyio.create_task_group() as tg:
        queued = scheduler.submit(request(5))
        tg.start_soon(scheduler.run)
        with anyio.fail_after(10):
            events = [e async for e in queued]
    assert scheduler.state == "failed" and "no config.json" in scheduler.load_error
    assert isinstance(events[-1], Failed)
    with pytest.raises(NotReady):
        scheduler.submit(request(1))


async def test_bad_request_fails_alone(engine_):
    scheduler = Scheduler(lambda: engine_)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        bad = [e async for e in scheduler.submit(request(5, depth=-1))]
        good = [e async for e in scheduler.submit(request(5))]
        scheduler.stop()
    assert isinstance(bad[-1], Failed) and bad[-1].kind == "invalid"
    assert isinstance(good[-1], Done) and good[-1].usage.completion_tokens == 5


async def test_text_is_the_detokenized_ids_without_control_tokens(engine_):
    from mtplxd.jobs import special_token_ids

    scheduler = Scheduler(lambda: engine_)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        events = [e async for e in scheduler.submit(request(300, stop=()))]
        scheduler.stop()
    deltas = [e for e in events if isinstance(e, TextDelta)]
    ids = [t for d in deltas for t in d.token_ids]
    special = special_token_ids(engine_.tokenizer)
    assert any(t in special for t in ids), "the random model should emit some control tokens"
    text = "".join(d.text for d in deltas)
    assert text == engine_.tokenizer.decode([t for t in ids if t not in special])
    assert "<|" not in text


async def test_ignore_eos_gives_fixed_length_outputs(engine_):
    scheduler = Scheduler(lambda: engine_)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        hot = SamplerSettings(temperature=5.0)  # near-uniform: end-of-text comes early
        normal = [e async for e in scheduler.submit(TextRequest((10, 11), 400, hot, seed=2))]
        fixed = [e async for e in scheduler.submit(TextRequest((10, 11), 400, hot, seed=2, ignore_eos=True))]
        scheduler.stop()
    assert normal[-1].usage.completion_tokens < 400  # the random model does emit end-of-text
    assert fixed[-1].usage.completion_tokens == 400 and fixed[-1].finish_reason == "length"


@pytest.fixture(scope="module")
def embedded():
    """The embedded model: its byte-level BPE is where healing and leading spaces matter."""
    import engine as engine_package

    return Engine.load(Path(engine_package.__file__).parent / "assets")


async def run_alone(engine_: Engine, request: TextRequest) -> tuple[str, list[int]]:
    scheduler = Scheduler(lambda: engine_)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        events = await collect(scheduler.submit(request), [], "alone")
        scheduler.stop()
    deltas = [e for e in events if isinstance(e, TextDelta)]
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize("mode,depth", [("ar", None), ("mtp", 2)])
async def test_a_healed_prompt_completes_the_word_and_leaves_out_its_start(embedded, mode, depth):
    """After "def " the embedded model's byte-level BPE ends the prompt with a lone
    " ", a token it never saw before a name. Healed, the first token must begin with
    " " and the text the client gets leaves that " " out: a name, not noise."""
    from engine.prompts import heal_last_token

    tok = embedded.tokenizer
    prompt = "import os\n\n\nclass Cache:\n    def __init__(self):\n        self.items = {}\n\n    def "
    ids, heal = heal_last_token(tok, list(tok.encode(prompt)))
    assert heal.text == " "
    text, tokens = await run_alone(embedded, TextRequest(
        prompt_ids=tuple(ids), max_tokens=12, heal=heal, mode=mode, depth=depth,
        sampler=SamplerSettings(temperature=0.0), seed=1))
    assert tokens[0] in heal.first_tokens
    assert text == tok.decode(tokens)[len(heal.text):]
    assert text[:1].isidentifier()  # a method name, right after "def "


async def test_a_continuation_keeps_its_leading_space(embedded):
    """"return x +" continues with " 0"-like text: a completion must not lose the
    space a detokenizer drops at the start of a text (a chat reply may)."""
    tok = embedded.tokenizer
    ids = tuple(tok.encode("def f(x):\n    return x +"))
    request = TextRequest(prompt_ids=ids, max_tokens=4, mode="ar", sampler=SamplerSettings(temperature=0.0), seed=1)
    text, tokens = await run_alone(embedded, replace(request, continuation=True))
    assert tok.decode(tokens).startswith(" ") and text == tok.decode(tokens)
    reply, _ = await run_alone(embedded, request)
    assert reply == text[1:]  # a new turn: the detokenizer's trim stays


# -- continuous batching (engine/batch.py) ------------------------------------------------------------


def _mixed_requests() -> list[TextRequest]:
    """Different prompts, lengths, samplers, seeds and modes; sampled rows decode AR so
    their key sequence is the same alone and in the batch."""
    hot, greedy = SamplerSettings(temperature=0.8, top_p=0.9), SamplerSettings(temperature=0.0)
    return [
        TextRequest(prompt_ids=(10, 11, 12, 13), max_tokens=24, sampler=greedy, mode="mtp", depth=1, ignore_eos=True),
        TextRequest(prompt_ids=(5, 6), max_tokens=17, sampler=hot, seed=3, mode="ar", ignore_eos=True),
        TextRequest(prompt_ids=tuple(range(3, 40)), max_tokens=9, sampler=greedy, mode="ar", ignore_eos=True),
        TextRequest(prompt_ids=(20, 21, 22), max_tokens=30, sampler=hot, seed=8, mode="ar", ignore_eos=True,
                    priority=Priority.INTERACTIVE),
        TextRequest(prompt_ids=(7, 7, 8), max_tokens=12, sampler=SamplerSettings(temperature=1.0, top_k=5), seed=1,
                    mode="ar", ignore_eos=True),
    ]


async def _tokens_of(scheduler: Scheduler, requests: list[TextRequest]) -> tuple[list[list[int]], list[int]]:
    """Every request's tokens, run concurrently, and the batch sizes their deltas came from."""
    results: list[list[int]] = [[] for _ in requests]
    sizes: list[int] = []

    async def one(i: int) -> None:
        async for event in scheduler.submit(requests[i]):
            if isinstance(event, TextDelta):
                results[i].extend(event.token_ids)
                sizes.append(event.batch)
            assert not isinstance(event, Failed), event

    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        async with anyio.create_task_group() as clients:
            for i in range(len(requests)):
                clients.start_soon(one, i)
        scheduler.stop()
    return results, sizes


async def test_concurrent_generations_decode_in_one_batch_as_alone(engine_):
    from tests.engine_helpers import assert_greedy_agree

    requests = _mixed_requests()
    batched, sizes = await _tokens_of(Scheduler(lambda: engine_), requests)
    alone, alone_sizes = await _tokens_of(Scheduler(lambda: engine_, SchedulerLimits(batch_rows=1)), requests)
    assert max(sizes) >= 3 and set(alone_sizes) == {1}  # the batch ran; switched off, it did not
    for request, got, want in zip(requests, batched, alone):
        assert len(got) == len(want) == request.max_tokens
        if request.sampler.greedy:
            assert_greedy_agree(engine_.backend, list(request.prompt_ids), want, got)
        else:
            assert got == want


async def test_a_cancelled_row_leaves_the_batch_and_the_others_finish(engine_):
    scheduler = Scheduler(lambda: engine_)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        tickets = [scheduler.submit(request(40 + i, ignore_eos=True, mode="ar")) for i in range(4)]
        seen = 0
        async for event in tickets[0]:
            seen += isinstance(event, TextDelta) and event.batch > 1
            if seen == 3:
                break
        assert seen == 3  # it was in a batch
        tickets[0].cancel()
        steps = scheduler.steps
        with anyio.fail_after(10):
            while scheduler.stats().active > 3:
                await anyio.sleep(0.001)
        assert scheduler.steps - steps <= 2  # freed within a step (a pass is the batch's and one other)
        for ticket, n in zip(tickets[1:], (41, 42, 43)):
            tokens = [t for e in [e async for e in ticket] if isinstance(e, TextDelta) for t in e.token_ids]
            assert len(tokens) == n
        scheduler.stop()


async def test_interactive_request_waits_for_at_most_one_batched_step(engine_):
    """An editor's completion behind a full batch: its prefill goes first (the batch,
    which holds no editor's row, does not step before it), then it rides in the batch."""
    scheduler = Scheduler(lambda: engine_)
    log: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        for i in range(8):
            tg.start_soon(collect, scheduler.submit(request(300, Priority.BACKGROUND, mode="ar")), log, f"bg{i}")
        while not any(n == "bg7" and kind == "TextDelta" for n, kind in log):
            await anyio.sleep(0.01)
        steps_before = scheduler.steps
        events = [e async for e in scheduler.submit(request(3, Priority.INTERACTIVE, mode="ar", ignore_eos=True))]
        assert isinstance(events[-1], Done)
        first, *rest = events[:-1]
        assert first.batch == 1 and rest and all(e.batch == 9 for e in rest)  # then one row of the batch
        # the batched step already running, its prefill, then two batched steps
        assert scheduler.steps - steps_before <= 4
        scheduler.stop()


async def test_a_raised_background_row_stays_in_the_batch_as_interactive(engine_):
    """An editor's prefetch, accepted while it decodes in the batch with normal streams:
    raised to interactive, it keeps its row and its tokens and is served as interactive
    from then on; the negative control (not raised) stays background."""
    for raise_it in (True, False):
        scheduler = Scheduler(lambda: engine_)
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            for i in range(4):
                tg.start_soon(collect, scheduler.submit(request(400, mode="ar", ignore_eos=True)), [], f"n{i}")
            prefetch = scheduler.submit(request(40, Priority.BACKGROUND, mode="ar", ignore_eos=True))
            events, classes = [], set()
            async for event in prefetch:
                if not isinstance(event, TextDelta):
                    break
                events.append(event)
                if len(events) == 5 and raise_it:
                    prefetch.raise_priority(Priority.INTERACTIVE)
                    prefetch.raise_priority(Priority.BACKGROUND)  # lowering is not raising: ignored
                if len(events) > 5:
                    classes |= {c for i, c, *_ in scheduler.entries() if i == prefetch.id}
            assert all(e.batch > 1 for e in events[1:])  # a row of the batch after its prefill, throughout
            assert sum(len(e.token_ids) for e in events) == 40  # nothing lost in the move
            assert classes == ({"interactive"} if raise_it else {"background"})
            scheduler.stop()


async def test_the_measured_batch_size_picks_batched_mtp_or_plain_ar(engine_):
    from engine.profiles import Calibration

    greedy = SamplerSettings(temperature=0.0)
    for batched, mtp_in_batch in (({2: {1: 1.5}, 4: {1: 1.5}}, True), ({2: {1: 0.7}, 4: {1: 0.7}}, False)):
        scheduler = Scheduler(lambda: engine_)
        deltas: list[TextDelta] = []
        planned: list[int] = []

        async def one(i: int) -> None:
            request = TextRequest(prompt_ids=(10 + i, 11, 12), max_tokens=24, sampler=greedy, ignore_eos=True)
            events = [e async for e in scheduler.submit(request)]
            deltas.extend(e for e in events if isinstance(e, TextDelta))
            planned.append(events[-1].mtp.depth)

        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            while scheduler.state != "ready":
                await anyio.sleep(0.01)
            scheduler.set_calibration(Calibration({"t0": {1: 1.4}}, batched=batched))  # alone, MTP depth 1 pays
            async with anyio.create_task_group() as clients:
                for i in range(4):
                    clients.start_soon(one, i)
            scheduler.stop()
        in_batch = [d for d in deltas if d.batch > 1]
        assert in_batch and planned == [1] * 4  # batched, each planned MTP at depth 1
        assert all(d.drafted == (1 if mtp_in_batch else 0) for d in in_batch)


async def test_a_long_prefill_runs_in_chunks_between_the_batchs_steps(engine_):
    scheduler = Scheduler(lambda: engine_)
    log: list = []
    long_prompt = tuple(5 + i % 20 for i in range(1500))  # three 512-token prefill chunks
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        for i in range(3):
            tg.start_soon(collect, scheduler.submit(request(400, mode="ar", ignore_eos=True)), log, f"row{i}")
        while sum(kind == "TextDelta" for _, kind in log) < 9:
            await anyio.sleep(0.01)
        start = len(log)
        ticket = scheduler.submit(TextRequest(prompt_ids=long_prompt, max_tokens=2, mode="ar"))
        first = await ticket.next_event()
        assert isinstance(first, TextDelta)
        during = [name for name, kind in log[start:] if kind == "TextDelta"]
        # the rows kept streaming while the prompt went in: a batched step before each chunk
        assert len(during) >= 3 * 3
        scheduler.stop()


async def test_admission_stops_at_the_cache_bytes_bound(engine_):
    """Past `max_cache_bytes` of caches held, new requests wait for a running one to end."""
    longest: dict[int | None, float] = {}
    for budget, overlapping in ((1, False), (None, True)):
        scheduler = Scheduler(lambda: engine_, SchedulerLimits(max_cache_bytes=budget))
        log: list = []
        waits: list[float] = []

        async def one(name: str) -> None:
            events = await collect(scheduler.submit(request(40, mode="ar", ignore_eos=True)), log, name)
            waits.append(events[-1].queue_wait_s)

        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            while scheduler.state != "ready":
                await anyio.sleep(0.01)
            async with anyio.create_task_group() as clients:
                for name in ("a", "b", "c"):
                    clients.start_soon(one, name)
            scheduler.stop()
        kinds = [(name, kind) for name, kind in log if kind in ("TextDelta", "Done")]
        firsts = {name: kinds.index((name, "TextDelta")) for name in "abc"}
        dones = {name: kinds.index((name, "Done")) for name in "abc"}
        # one at a time: each starts after the one before it is done
        one_at_a_time = all(firsts[later] > dones[earlier] for earlier, later in ("ab", "bc"))
        assert one_at_a_time != overlapping
        longest[budget] = max(waits)
    # Done reports the wait: one at a time, the last waited for two whole generations
    assert longest[1] > 3 * longest[None]
