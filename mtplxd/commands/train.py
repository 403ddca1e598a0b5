"""`mtplxd train`: arguments and the run (see engine/train.py for the training itself)."""

from __future__ import annotations

import argparse
import sys

_TRAIN_HELP = """\
Train a small MiMo-layout code model (trunk + MTP heads) from scratch, or, with
--heads-only, new MTP heads for an existing MiMo / Qwen2 / Llama-style
checkpoint that has none (its trunk frozen, heads distilled from its own
next-token distribution; the output folder is the original files plus
mtp.safetensors and an updated config.json). With --heads-only
--replace-heads, a checkpoint of any MTP family mtplxd runs (MiMo, DeepSeek-V3,
GLM-4.5, GLM-5, Step-3.5, MiMo-V2-Flash, Hunyuan-V3, Nemotron-H, Qwen3-Next,
Qwen3.5) gets its own heads distilled further the same way, starting from
their weights: the output folder is the trunk files without the old heads,
the trained heads in mtp.safetensors under the family's own names, and
config.json unchanged.

Defaults (the shipped model's first stage): byte-level BPE vocab 4096, hidden
192, 8 layers (FFN 480, 3 attention / 1 KV heads, tied embeddings), 2 MTP
heads: 4.7M parameters, 9.7 MB in bfloat16; seq-len 256, batch 8, 1500 steps
(3.1M tokens), lr 3e-3 (warmup, cosine decay to 10% by the step count or
--max-minutes, whichever ends first), 1 BLAS thread; corpus: this Python's
standard library minus tests and a fixed held-out list. Heads-only defaults:
2 heads (--replace-heads: the checkpoint's own count), 600 steps, lr 1e-3,
seq-len 256, batch 8. The shipped model's two
commands are in engine/assets/README.md.

Checkpoints every --save-every steps and on Ctrl-C; --resume continues from
the last one (data order, optimizer state and schedule included). Progress,
losses and held-out metrics: <out>/train_state/log.jsonl.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = _TRAIN_HELP
    p.add_argument("--out", metavar="DIR", required=True, help="output checkpoint folder")
    p.add_argument("--corpus", metavar="DIR", help="folder of *.py files (default: the standard library)")
    p.add_argument("--max-corpus-mb", metavar="MB", type=float, help="cap the corpus size (default: all)")
    p.add_argument("--heads-only", action="store_true", help="train MTP heads for --model, trunk frozen")
    p.add_argument("--model", metavar="PATH", help="checkpoint to add heads to (with --heads-only)")
    p.add_argument("--replace-heads", action="store_true",
                   help="with --heads-only on a checkpoint that has MTP heads (any supported family): "
                        "distil them further, starting from their weights")
    p.add_argument("--vocab", metavar="N", type=int, help="tokenizer vocabulary (default 4096)")
    p.add_argument("--layers", metavar="N", type=int, help="trunk layers (default 8)")
    p.add_argument("--hidden", metavar="N", type=int, help="hidden size (default 192)")
    p.add_argument("--heads", metavar="N", type=int,
                   help="MTP heads (default 2; --replace-heads on a family's own heads: their count)")
    p.add_argument("--steps", metavar="N", type=int, help="optimizer steps (default 1500; heads-only 600)")
    p.add_argument("--seq-len", metavar="N", type=int, help="tokens per sequence (default 256)")
    p.add_argument("--batch", metavar="N", type=int, help="sequences per step (default 8)")
    p.add_argument("--lr", metavar="X", type=float, help="peak learning rate (default 3e-3; heads-only 1e-3)")
    p.add_argument("--fim-order", choices=["psm", "spm"],
                   help="fill-in-the-middle sample order (default spm: the prefix right before the middle)")
    p.add_argument("--seed", metavar="S", type=int, help="seed for init, FIM and data order (default 0)")
    p.add_argument("--save-every", metavar="N", type=int, help="checkpoint interval in steps (default 100)")
    p.add_argument("--max-minutes", metavar="M", type=float,
                   help="time budget: save and stop once M minutes of training have passed (heads-only: "
                        "counted from the command's start, the trunk's pass over the corpus included)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--threads", metavar="N", type=int,
                   help="OpenBLAS threads while training (default: full training 1, it is bound by "
                        "single-threaded element-wise work and one thread does not stall on a shared machine; "
                        "heads-only every core, its steps are large products)")
    p.add_argument("--no-compile", action="store_true", help="do not mx.compile the training step")
    p.add_argument("--windows", metavar="N", type=int,
                   help="heads-only: corpus windows the frozen trunk runs over once (default: all of them)")
    p.add_argument("--continued", metavar="N", type=int,
                   help="heads-only: and N windows whose second half the trunk writes itself, greedily continuing "
                        "corpus text: the heads learn the text they will draft (default 0)")
    p.add_argument("--draft-vocab", metavar="N", type=int,
                   help="heads-only: the head's training softmax covers the corpus's N most frequent tokens "
                        "(default 8192)")


def run(args: argparse.Namespace) -> int:
    import engine  # noqa: F401  (the fast BLAS before MLX)
    from engine import train
    from engine.checkpoint import CheckpointError
    from engine.training.freed_memory import keep_freed_memory

    keep_freed_memory()  # this process only trains: the same large arrays every step

    given = {
        "corpus": args.corpus, "vocab": args.vocab, "layers": args.layers, "hidden": args.hidden,
        "heads": args.heads, "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
        "lr": args.lr, "seed": args.seed, "save_every": args.save_every, "threads": args.threads,
        "max_minutes": args.max_minutes, "fim_order": args.fim_order,
        "windows": args.windows, "draft_vocab": args.draft_vocab, "continued": args.continued,
        "max_corpus_bytes": int(args.max_corpus_mb * 1e6) if args.max_corpus_mb else None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.no_compile:
        given["compile"] = False
    try:
        if args.resume:
            ignored = sorted(set(given) - set(train.RESUMABLE))
            if ignored or args.model:
                print(f"mtplxd: --resume continues the saved run; ignoring "
                      f"{', '.join('--' + k.replace('_', '-') for k in ignored + (['model'] if args.model else []))}",
                      file=sys.stderr)
            result = train.resume_training(args.out, **{k: v for k, v in given.items() if k in train.RESUMABLE})
        elif args.heads_only:
            if not args.model:
                print("mtplxd: --heads-only needs --model PATH", file=sys.stderr)
                return 2
            wrong = sorted({"vocab", "layers", "hidden"} & set(given))
            if wrong:
                print(f"mtplxd: --heads-only keeps the model's trunk; drop --{', --'.join(wrong)}", file=sys.stderr)
                return 2
            result = train.train_heads(train.HeadsSettings(model=args.model, out=args.out,
                                                           replace_heads=args.replace_heads, **given))
        else:
            heads_only = sorted({"windows", "draft_vocab", "continued"} & set(given)) + (["model"] if args.model else [])
            if heads_only:
                print(f"mtplxd: --{', --'.join(k.replace('_', '-') for k in heads_only)} is for --heads-only",
                      file=sys.stderr)
                return 2
            result = train.train_model(train.ModelSettings(out=args.out, **given))
    except KeyboardInterrupt:
        print(f"mtplxd: interrupted; the last checkpoint is in {args.out} "
              f"(continue with: mtplxd train --out {args.out} --resume)", file=sys.stderr)
        return 130
    except (OSError, ValueError, CheckpointError) as e:
        print(f"mtplxd: {e}", file=sys.stderr)
        return 1
    last = result.evals[-1] if result.evals else {}
    extra = "".join(f", {k} {v:.3f}" for k, v in last.items() if k != "step")
    print(f"trained {result.step}/{result.steps} steps at {result.tokens_per_s:,.0f} tokens/s{extra}; "
          f"checkpoint: {result.out}")
    return 0
