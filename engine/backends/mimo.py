"""MiMo (XiaomiMiMo/MiMo-7B): dense Qwen2-like trunk, MTP heads `model.mtp_layers.{i}`.

Head i (drafting depth i+1) on the pair (hidden_t, token_{t+1}):

    x = input_proj(concat[hidden_layernorm(hidden_t), token_layernorm(embed(token))])
    x = decoder block (own attention KV)
    h = final_layernorm(x)        -> LM head -> logits; h feeds head i+1

MiMo puts the hidden state first in the concat (DeepSeek and Qwen put the
embedding first). The trunk's hidden is its final-normed output, the same
vector its LM head reads.

The decode path here (a block split around the KV cache, the rotary from a table,
the native attention and block operations on the CPU) serves any Llama-style trunk:
AR-only Llama, Qwen2 and Qwen3 models run through this backend with no heads, their
trunk mlx-lm's own model (engine/backends/plain.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import mimo
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from engine.backends.base import Backend, Tape, build_trunk, load_head_weights
from engine.backends.descriptors import mlx_model_type
from engine.backends.draft_vocab import DRAFT_VOCAB_KEY, DraftVocabulary
from engine.backends.decode_ops import Causal, NativeBlock, RopeTable, apply_rope, cpu_attention, swiglu
from engine.checkpoint import CheckpointError
from engine.distributed import ShardingError, shard_attention, shard_mlp
from engine.quantized_rows import ROWS_MAX

HEAD_PREFIX = "model.mtp_layers."
# The trunks MiMo's layout expresses: its own, Qwen2's, and Llama-style ones given zero
# q/k/v biases (mimo_config).
CONVERTIBLE = ("mimo", "qwen2", "llama")
# Steps of at most this many tokens (decode steps, verify windows, drafts) run
# through mx.compile'd block functions, traced once per shape; longer prefill
# chunks run the same functions eagerly.
COMPILED_MAX_TOKENS = 8


class MTPLayer(mimo.TransformerBlock):
    """One MiMo MTP layer: the trunk's block plus the fusion in front of it."""

    def __init__(self, args: mimo.ModelArgs):
        super().__init__(args)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(d, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(d, eps=eps)
        self.input_proj = nn.Linear(2 * d, d, bias=False)
        self.final_layernorm = nn.RMSNorm(d, eps=eps)

    def fuse(self, hidden: mx.array, embeds: mx.array) -> mx.array:
        x = mx.concatenate(
            [self.hidden_layernorm(hidden), self.token_layernorm(embeds)], axis=-1
        )
        return self.input_proj(x)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:  # type: ignore[override]
        x = self.fuse(hidden, embeds)
        x = super().__call__(x, create_attention_mask(x, cache), cache)
        return self.final_layernorm(x)


# -- one decoder block, split around the KV cache ----------------------------------
# The same math as mlx-lm's mimo.TransformerBlock, with the rotary embedding read
# from a table (engine/backends/decode_ops.py). Everything but the cache update and the
# attention itself is a pure function of its inputs and the block's weights, so a
# decode step can run it compiled: on the CPU each op costs ~5-40 us of dispatch
# whatever its size, and fusing the norms, biases, rotary and SwiGLU halves a step
# of the embedded model. Activations travel between blocks as rows [B*L, D]:
# a linear layer on rows is one matmul, on [B, L, D] two more reshaping ops.


@dataclass(frozen=True)
class StepInputs:
    """What every block of one step shares: the rotary cos/sin [L, head_dim] of its
    positions, which attention it uses and that attention's mask."""

    cos: mx.array
    sin: mx.array
    on_cpu: bool  # on the CPU: cpu_attention
    mask: Any  # cpu_attention's `Causal` or grouped boolean mask, or what mlx-lm's attention takes


def attention_inputs(block: nn.Module, x: mx.array, cos: mx.array, sin: mx.array):
    """Rows x [B*L, D] -> q (already scaled), k, v [B, heads, L, head_dim]."""
    attn = block.self_attn
    length = cos.shape[-2]  # cos [L, head_dim], or [B, 1, L, head_dim] in a batch of rows
    batch = x.shape[0] // length
    h = block.input_layernorm(x)

    def split(projection: nn.Module, heads: int, norm: nn.Module | None = None) -> mx.array:
        x = projection(h).reshape(batch, length, heads, -1)
        return (x if norm is None else norm(x)).transpose(0, 2, 1, 3)

    # Qwen3's blocks (engine/backends/plain.py) norm each head of q and k before the rotary.
    q = apply_rope(split(attn.q_proj, attn.n_heads, getattr(attn, "q_norm", None)), cos, sin) * attn.scale
    k = apply_rope(split(attn.k_proj, attn.n_kv_heads, getattr(attn, "k_norm", None)), cos, sin)
    return q, k, split(attn.v_proj, attn.n_kv_heads)


def block_output(block: nn.Module, x: mx.array, attended: mx.array) -> mx.array:
    """Rows x [B*L, D] and attended [B, heads, L, head_dim] -> the block's rows."""
    h = x + block.self_attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(x.shape[0], -1))
    mlp, normed = block.mlp, block.post_attention_layernorm(h)
    return h + mlp.down_proj(swiglu(mlp.gate_proj(normed), mlp.up_proj(normed)))


class MiMoBackend(Backend):
    family = "mimo"
    packable_heads = True

    def __init__(self, trunk: nn.Module, heads: list[MTPLayer], draft_ids: mx.array | None = None):
        """`trunk`: mlx-lm's MiMo model, or a Llama, Qwen2 or Qwen3 one without heads (plain.py)."""
        super().__init__(trunk, cast("list[nn.Module]", heads))
        # Heads trained against a draft vocabulary score only its rows (draft_vocab.py).
        self.draft_vocab = DraftVocabulary(draft_ids, trunk.args.vocab_size) if draft_ids is not None else None
        args = trunk.args
        rope = trunk.model.layers[0].self_attn.rope
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        self.rope = RopeTable(rope, head_dim) if RopeTable.supports(rope) else None
        self.group = args.num_attention_heads // args.num_key_value_heads
        self._compiled: dict[tuple[str, int], Callable] = {}
        self._native: dict[int, NativeBlock | None] = {}

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.model
        h = self._run(model.layers, model.embed_tokens(tokens), cache)
        return self._output(model.norm, h, last)

    def shard(self, group) -> str:
        """mlx-lm has no split for MiMo: each block's MLP is split over the ranks, and
        its attention too when the head counts divide (one KV head does not: then every
        rank holds the whole attention). The LM head is tied to the embedding: whole."""
        blocks = self.trunk.model.layers
        attention = all([shard_attention(block.self_attn, group) for block in blocks])
        if not all([shard_mlp(block.mlp, group) for block in blocks]):
            raise ShardingError(f"mimo: intermediate_size {self.trunk.args.intermediate_size} "
                                f"does not divide over {group.size()} ranks")
        self._compiled.clear()
        self._native.clear()
        split = "attention heads and MLP" if attention else "MLP (attention replicated: its head counts do not divide)"
        return f"tensor parallel over {group.size()} ranks: {split}; MTP heads replicated"

    def head(self, k, hidden, tokens, cache, last=False):
        head = self.heads[k]
        embeds = self.trunk.model.embed_tokens(tokens)
        x = self._step("fuse", head, head.fuse, hidden.shape[1])(hidden, embeds)
        return self._output(head.final_layernorm, self._run([head], x, [cache]), last, self.draft_vocab)

    def _run(self, blocks: list[nn.Module], x: mx.array, caches: list) -> mx.array:
        """x [B, L, D] through the blocks, each with its own cache."""
        x = self._blocks(blocks, x, caches)
        if isinstance(caches[0].offset, mx.array):
            # A batch's rows are at the same positions in every block: one array of offsets
            # for all. Else each block whose offsets nothing reads grows a chain of additions
            # by one a step, evaluated only when a row leaves (25 ms after 100 SmolLM2 steps).
            for cache in caches[1:]:
                cache.offset = caches[0].offset
        return x

    def _blocks(self, blocks: list[nn.Module], x: mx.array, caches: list) -> mx.array:
        if self.rope is None:  # interleaved rotary: mlx-lm's own blocks
            mask = create_attention_mask(x, caches[0])
            for block, cache in zip(blocks, caches):
                x = block(x, mask, cache)
            return x
        B, L, D = x.shape
        step = self._step_inputs(x, caches[0])
        rows = x.reshape(B * L, D)
        for block, cache in zip(blocks, caches):
            rows = self._block(block, rows, step, cache)
            # Start computing this block while the next one's graph is built: building
            # a step's graph takes ~1 ms of Python, which would otherwise come first.
            mx.async_eval(rows)
        return rows.reshape(B, L, D)

    def _step_inputs(self, x: mx.array, cache) -> StepInputs:
        """Rotary slices and mask, built once for all the blocks of a step."""
        rope = cast(RopeTable, self.rope)  # forward takes this path only with a table
        length = x.shape[1]
        on_cpu = mx.default_device() == mx.cpu  # a prompt's chunk too: the library's attention spends it in `exp`
        if isinstance(cache.offset, mx.array):  # a batch of rows, each at its own position (engine/batch.py)
            cos, sin = rope.rows(cache.offset, length, cache.size())
            mask = create_attention_mask(x, cache, return_array=True)  # [B, 1, L, T]: padding and causality
            # Grouped once a step, and laid out in memory here: every block reads it (a broadcast
            # view would be copied in each block's operation).
            grouped = mx.contiguous(mx.tile(mask, (1, 1, self.group, 1))) if on_cpu else mask
            return StepInputs(cos, sin, on_cpu, grouped)
        cos, sin = rope.slices(cache.offset, length)
        if not on_cpu:
            return StepInputs(cos, sin, False, create_attention_mask(x, cache))
        return StepInputs(cos, sin, True, Causal(cache.offset, length) if length > 1 else None)

    def _block(self, block: nn.Module, rows: mx.array, step: StepInputs, cache) -> mx.array:
        n = rows.shape[0]
        native = self._native_block(block) if step.on_cpu and n <= ROWS_MAX and rows.dtype == mx.float32 else None
        if native is not None:  # a batch's rows carry their mask; rows at one position are causal
            mask = step.mask if isinstance(step.mask, mx.array) else None
            stepped = native.step(rows, step.cos, step.sin, cache, mask)
            if stepped is not None:
                return stepped
        if native is not None:
            q, k, v = native.inputs(rows, step.cos, step.sin, step.cos.shape[-2])
        else:
            q, k, v = self._step("attention_inputs", block, partial(attention_inputs, block), n)(rows, step.cos, step.sin)
        k, v = cache.update_and_fetch(k, v)
        if step.on_cpu:
            attended = cpu_attention(q, k, v, step.mask)  # eager: the cache length changes every step
        else:
            attended = scaled_dot_product_attention(q, k, v, cache=cache, scale=1.0, mask=step.mask)
        if native is not None:
            return native.output(rows, attended)
        return self._step("block_output", block, partial(block_output, block), n)(rows, attended)

    def _native_block(self, block: nn.Module) -> NativeBlock | None:
        """The block as the native module's two operations where it is one (decode_ops.py)."""
        key = id(block)
        if key not in self._native:
            self._native[key] = NativeBlock.of(block)
        return self._native[key]

    def _output(self, norm: nn.Module, x: mx.array, last: bool = False,
                draft: DraftVocabulary | None = None) -> tuple[mx.array, mx.array]:
        """(logits, normed hidden): the final norm, then the LM head (on the last
        position only when `last`); with `draft`, only its rows, -inf elsewhere."""
        layer = self.trunk.model.embed_tokens if self.trunk.args.tie_word_embeddings else self.trunk.lm_head
        if draft is not None:
            draft.follow(layer)
            project, state, name = draft.logits, draft.rows, "draft"
        else:
            project, state, name = self._lm_head, layer.state, "output"

        def output(x: mx.array) -> tuple[mx.array, mx.array]:
            h = norm(x)
            return project(h[:, -1:] if last else h), h

        return self._step(f"{name}_last" if last else name, norm, output, x.shape[1], [norm.state, state])(x)

    def _lm_head(self, h: mx.array) -> mx.array:
        if self.trunk.args.tie_word_embeddings:
            return self.trunk.model.embed_tokens.as_linear(h)
        return self.trunk.lm_head(h)

    def _step(self, name: str, module: nn.Module, fn: Callable, length: int, state=None) -> Callable:
        """`fn`, a pure function of its inputs and `module`'s weights (or `state`),
        compiled for steps of up to COMPILED_MAX_TOKENS tokens; eager for longer ones.
        Declaring the weights as inputs makes the compiled function read their
        current values rather than freezing the ones it was traced with."""
        if length > COMPILED_MAX_TOKENS:
            return fn
        key = (name, id(module))
        if key not in self._compiled:
            self._compiled[key] = mx.compile(fn, inputs=module.state if state is None else state)
        return self._compiled[key]


def head_count(weights: dict) -> int:
    indices = {int(k[len(HEAD_PREFIX):].split(".")[0]) for k in weights if k.startswith(HEAD_PREFIX)}
    return len(indices)


def load(folder: Path, config: dict, weights: dict) -> MiMoBackend:
    draft_ids = weights.pop(DRAFT_VOCAB_KEY, None)
    n_heads = head_count(weights)
    trunk_weights = {k: v for k, v in weights.items() if not k.startswith(HEAD_PREFIX)}
    trunk = build_trunk(mimo.Model, mimo.ModelArgs, config, trunk_weights)
    heads = []
    for i in range(n_heads):
        head = MTPLayer(trunk.args)
        load_head_weights(head, weights, f"{HEAD_PREFIX}{i}.")
        heads.append(head)
    return MiMoBackend(cast(mimo.Model, trunk), heads, draft_ids if heads else None)


# -- other trunks in MiMo's layout --------------------------------------------------


def mimo_config(config: dict, keys: set[str], heads: int) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """The MiMo config for a MiMo / Qwen2 / Llama-style trunk, and the zero
    biases (name -> shape) a Llama-style trunk needs. Raises CheckpointError
    for trunks MiMo's layout cannot express."""
    kind = mlx_model_type(config)
    if kind not in CONVERTIBLE:
        raise CheckpointError(f"model_type {config.get('model_type')!r}: new heads are MiMo-style, for MiMo, "
                              f"Qwen2 and Llama-style dense trunks (a checkpoint of an MTP family that has "
                              f"its own heads can distil them further with --replace-heads)")
    if isinstance(config.get("text_config"), dict):
        raise CheckpointError("nested text_config (a multimodal checkpoint) is not supported")
    d, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = d // n_heads
    if config.get("head_dim") not in (None, head_dim):
        raise CheckpointError(f"head_dim {config['head_dim']} != hidden_size / num_attention_heads: "
                              "not expressible in MiMo's layout")
    for flag in ("mlp_bias", "attention_bias"):
        if kind == "llama" and config.get(flag):
            raise CheckpointError(f"{flag}=true: not expressible in MiMo's layout")
    if any(t != "full_attention" for t in config.get("layer_types") or ()) or (
        kind == "llama" and config.get("sliding_window")
    ):
        raise CheckpointError("sliding-window attention layers are not supported")
    new = dict(config)
    new.update(_as_loaded(config, kind))
    new.update({"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": heads})
    new.pop("auto_map", None)
    if kind != "mimo":
        new["mtplxd_converted_from"] = config.get("model_type")
    biases: dict[str, tuple[int, ...]] = {}
    for i in range(config["num_hidden_layers"]):
        for proj, rows in (("q_proj", n_heads * head_dim), ("k_proj", n_kv * head_dim), ("v_proj", n_kv * head_dim)):
            name = f"model.layers.{i}.self_attn.{proj}.bias"
            if name not in keys:
                biases[name] = (rows,)
    if biases:
        new.pop("attention_bias", None)  # the converted trunk has (zero) q/k/v biases
    return new, biases


# Fields of mlx-lm's MiMo ModelArgs that shape the trunk's computation.
_TRUNK_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                 "rope_theta", "rope_traditional", "rope_scaling", "tie_word_embeddings")


def _as_loaded(config: dict, kind: str) -> dict:
    """The trunk fields as mlx-lm resolves them for the source's own model
    class (its defaults differ between families: rope_theta, tied
    embeddings), written out so the MiMo class computes the same trunk the
    heads were trained against."""
    import importlib

    args = importlib.import_module(f"mlx_lm.models.{kind}").ModelArgs.from_dict(config)
    values = {f: getattr(args, f, None) for f in _TRUNK_FIELDS}
    values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
    return {k: v for k, v in values.items() if v is not None}
