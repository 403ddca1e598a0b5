"""Does the model complete held-out Python plausibly?

For `def`/`for`/`if` lines of the held-out standard-library modules, the
model sees the file up to and including the keyword (not the space after it)
and completes the line greedily; the line counts as plausible when it parses
as Python with a `pass` body. `--after-space` cuts after the space instead, as
an editor's cursor after "def " does, and heals the prompt's last token as the
LSP adapter does (engine/prompts.py). `--fim` asks as an editor does: a
fill-in-the-middle prompt whose suffix is the text after the line (healed too).
Also measures per-depth acceptance at temperature 0.

    python -m engine.training.quality [CHECKPOINT] [--lines N] [--after-space] [--fim]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from dataclasses import dataclass

import engine  # BLAS before mlx
from engine.engine import Engine
from engine.generation import GenerationRequest
from engine.prompts import heal_last_token, healed_fim_prompt_ids
from engine.sampler_settings import SamplerSettings
from engine.training.corpus import held_out_files
from engine.training.measure import measure_acceptance

KEYWORD_LINE = re.compile(r"^(?P<indent>[ \t]*)(?P<kw>def|for|if) ", re.MULTILINE)
CONTEXT_CHARS = 1500
SUFFIX_CHARS = 600  # --fim: text after the completed line


@dataclass(frozen=True)
class Sample:
    path: str
    keyword: str
    completion: str
    parses: bool


def cut_points(limit: int, after_space: bool = False) -> list[tuple[str, str, str]]:
    """(path, text before the cursor, keyword) for keyword lines spread over the held-out modules."""
    docs = held_out_files()
    per_doc = max(1, limit // max(1, len(docs)) + 1)
    points = []
    for doc in docs:
        matches = list(KEYWORD_LINE.finditer(doc.text))
        step = max(1, len(matches) // per_doc)
        for m in matches[::step][:per_doc]:
            # Right after the keyword, before its space: byte-level BPE spells " name" as one
            # token, so a prompt ending in a lone space is one the model never saw in training.
            cursor = m.end() if after_space else m.end() - 1
            points.append((doc.path, doc.text[max(0, cursor - CONTEXT_CHARS) : cursor], m.group("kw")))
    return points[:limit]


def complete_line(engine_: Engine, before: str, max_tokens: int = 48, heal: bool = False,
                  suffix: str | None = None) -> str:
    """The rest of the line after `before`: a plain prompt, or with `suffix` a FIM one."""
    if suffix is not None:
        ids, healed = healed_fim_prompt_ids(engine_.tokenizer, before, suffix, heal=heal)
    else:
        ids, healed = list(engine_.tokenizer.encode(before)), None
        if heal:
            ids, healed = heal_last_token(engine_.tokenizer, ids)
    gen = engine_.open(GenerationRequest(prompt=tuple(ids), sampler=SamplerSettings(temperature=0.0), mode="ar",
                                         max_tokens=max_tokens, stop_token_ids=frozenset(engine_.tokenizer.eos_token_ids),
                                         first_tokens=healed.first_tokens if healed else None))
    out = []
    while not gen.finished:
        out += gen.step().tokens
        if "\n" in engine_.tokenizer.decode(out):
            break
    gen.close()
    return engine_.tokenizer.decode(out)[len(healed.text) if healed else 0:].split("\n")[0]


def parses(keyword: str, rest: str) -> bool:
    try:
        ast.parse(f"{keyword} {rest.strip()}\n    pass\n")
        return True
    except SyntaxError:
        return False


def parse_rate(engine_: Engine, lines: int, after_space: bool = False,
               fim: bool = False) -> tuple[float, list[Sample]]:
    texts = {doc.path: doc.text for doc in held_out_files()} if fim else {}
    samples = []
    for path, before, keyword in cut_points(lines, after_space):
        suffix = text_after_line(texts[path], before) if fim else None
        rest = complete_line(engine_, before, heal=after_space or fim, suffix=suffix)
        samples.append(Sample(path, keyword, rest, parses(keyword, rest)))
    return sum(s.parses for s in samples) / max(1, len(samples)), samples


def text_after_line(text: str, before: str) -> str:
    """What follows the line `before` ends in: an editor's suffix for the cursor."""
    end = text.find("\n", text.find(before) + len(before))
    return text[end : end + SUFFIX_CHARS] if end >= 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default=str(engine.EMBEDDED_MODEL))
    parser.add_argument("--lines", type=int, default=60)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--after-space", action="store_true",
                        help="cut after the keyword's space and heal the prompt (as the LSP adapter does)")
    parser.add_argument("--fim", action="store_true",
                        help="fill-in-the-middle prompts with the text after the line as suffix (healed)")
    args = parser.parse_args(argv)
    engine_ = Engine.load(args.checkpoint)
    rate, samples = parse_rate(engine_, args.lines, args.after_space, args.fim)
    prompts = [before for _, before, _ in cut_points(8)]
    acceptance = measure_acceptance(engine_, prompts, depth=args.depth, n_tokens=64)
    for s in samples[:10]:
        print(f"{'ok ' if s.parses else 'bad'} {s.path}: {s.keyword} {s.completion.strip()}")
    print(json.dumps({"parse_rate": round(rate, 3), "lines": len(samples),
                      "acceptance_by_depth_t0": [round(a, 3) for a in acceptance]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
