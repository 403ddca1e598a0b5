"""Reasoning models: <think> blocks split from the answer, streamed.

Qwen3, DeepSeek-R1 and their kin write their reasoning between `<think>` and
`</think>`; some chat templates open the block themselves (the prompt ends
in `<think>`), so the output starts inside it. The splitter turns the text
into `Reasoning` and `Text` pieces and never lets a think marker into either.
"""

from __future__ import annotations

from adapters.common.streaming_text import Reasoning, Text, TrimmedText, find_first, partial_marker

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a think block open for the model to continue."""
    return prompt_text.rstrip().endswith(THINK_START)


class ThinkSplitter:
    def __init__(self, inside: bool = False):
        self.inside = inside
        self.pending = ""
        self.reasoning = TrimmedText(strip_lead=True)
        self.content = TrimmedText()

    def feed(self, text: str) -> list[Text | Reasoning]:
        self.pending += text
        out: list[Text | Reasoning] = []
        # Outside a block a stray `</think>` is swallowed too: a template may have
        # opened the block in a way the prompt check did not see.
        while (hit := find_first(self.pending, (THINK_END,) if self.inside else (THINK_START, THINK_END))):
            i, marker = hit
            self._emit(self.pending[:i], out)
            self.pending = self.pending[i + len(marker):]
            self._channel().boundary()
            self.inside = marker == THINK_START
            self._channel().boundary()
        keep = partial_marker(self.pending, (THINK_START, THINK_END))
        cut = len(self.pending) - keep
        self._emit(self.pending[:cut], out)
        self.pending = self.pending[cut:]
        return out

    def finish(self) -> list[Text | Reasoning]:
        out: list[Text | Reasoning] = []
        self._emit(self.pending, out)
        self.pending = ""
        if self.inside:
            self.reasoning.flush()  # whitespace at the end of unfinished reasoning is layout
        else:
            tail = self.content.flush()
            if tail:
                out.append(Text(tail))
        return out

    def _channel(self) -> TrimmedText:
        return self.reasoning if self.inside else self.content

    def _emit(self, piece: str, out: list[Text | Reasoning]) -> None:
        text = self._channel().text(piece)
        if text:
            out.append(Reasoning(text) if self.inside else Text(text))
