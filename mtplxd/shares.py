"""Which priority class the scheduler's next pass serves: priority with patience.

Interactive work (editor completions) keeps first place for latency, but no class
waits for ever: a class that has work and has been passed over `patience` passes in
a row is due, and a due class goes before any other (of two due classes, the one that
waited longer). So under a storm of higher-class work a class still gets at least one
pass in every `patience + 1`: its share of the engine's passes, and a bound on its
wait (`Shares.bound`). With no contention, or once the due class had its pass, the
highest class with work goes first, as strict priority would. The interactive class
has a patience too (the scheduler gives it 1), so two lower classes that are due in
turn never shut it out.

Why patience and not weights: a class that arrives after an idle spell (a keystroke)
goes first at once, since nobody has waited; a weighted round robin would make it wait
for credit the others built up. Why passes and not time: a pass is the scheduler's
unit of work (the batch's step, where every class's decoding rows ride, and one step
of a job outside it), which it can count deterministically and tests can check without
timing anything.

Pure bookkeeping, no threads, no engine: the scheduler calls `choose` under its lock
once a pass (mtplxd/scheduler.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from mtplxd.requests import Priority


class Shares:
    def __init__(self, patience: Mapping[Priority, int]):
        """`patience[c]`: passes class c may be passed over in a row while it has work
        (at least 1: a class due at every pass would shut the others out)."""
        for priority in Priority:
            n = patience.get(priority)
            if n is None or n < 1:
                raise ValueError(f"patience of {priority.name.lower()}: must be at least 1, got {n}")
        self.patience = {p: patience[p] for p in Priority}
        self.waited: dict[Priority, int] = {p: 0 for p in Priority}  # passes passed over in a row
        self.unstarted: dict[Priority, int] = {p: 0 for p in Priority}  # passes a new job waited to start
        self.due_turns = 0  # passes given out of priority order (tests)

    def choose(self, ready: Collection[Priority]) -> Priority | None:
        """The class the next pass serves, among `ready` (those with work that can step
        now); None when there is none. Records the pass."""
        due = self._due(ready, self.waited)
        chosen = due if due is not None else (min(ready) if ready else None)
        self.due_turns += due is not None and due != min(ready)
        _count(self.waited, {p for p in ready if p != chosen})
        return chosen

    def claims(self, new: Collection[Priority]) -> Priority | None:
        """Of the classes with a new job waiting to start (for a slot, or for a pass), the
        one that has waited its patience: no higher class starts a new job until it has
        started one. Else new editor completions could take every slot that frees, and a
        chat would never start without ever being passed over as a class."""
        return self._due([p for p in new if p != min(Priority)], self.unstarted)  # the top class outranks all

    def started(self, new: Collection[Priority], started: Priority | None) -> None:
        """Record a pass's starts: `new` the classes that had a new job waiting, `started`
        the class whose new job this pass starts (None: none)."""
        _count(self.unstarted, {p for p in new if p != started})

    def _due(self, classes: Collection[Priority], waited: dict[Priority, int]) -> Priority | None:
        """Of the classes that ran out of patience, the one that waited longest (then the
        higher): two due classes take turns rather than one waiting again."""
        due = [p for p in classes if waited[p] >= self.patience[p]]
        return max(due, key=lambda p: (waited[p], -p)) if due else None

    def bound(self, priority: Priority) -> int:
        """Most passes a class with work waits in a row: its patience, plus one for each
        other class that may be due at the same time."""
        return self.patience[priority] + len(Priority) - 1


def _count(waited: dict[Priority, int], passed_over: Collection[Priority]) -> None:
    """One more pass for the classes passed over; the others start again from 0."""
    for priority in waited:
        waited[priority] = waited[priority] + 1 if priority in passed_over else 0
