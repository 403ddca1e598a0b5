"""A model split over several ranks (mx.distributed): how it is sharded, and the
decisions every rank must take alike.

Rank 0 runs the daemon; every rank runs the same engine steps in the same order
(mtplxd/ranks/). The trunk is sharded, so its forward holds collectives and every
rank must run it on the same inputs. The inputs are tokens, and tokens are
*decisions*: draws, accepted-draft counts, whether a top-p shortcut held. `Ranks.decide`
makes each of them once, on rank 0, and hands rank 0's values to every rank (a
broadcast written as an all-sum to which the other ranks add zeros). It stays lazy,
inside the step's graph, so a decode step gains no host sync; on one rank it is the
identity and costs nothing.

Sharding (`shard`): tensor parallel through the trunk's own mlx-lm `shard()` where
the family has one, or the backend's own (`Backend.shard`, e.g. MiMo's); the MTP
heads are replicated (small, and drafting then needs no collective of its own). A
vocabulary-sharded LM head is gathered before anything samples from it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, shard_linear
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import ArraysCache


class ShardingError(Exception):
    """This model cannot be split over this many ranks; str(e) says why."""


class Ranks:
    """The ranks a model runs on. The default, one rank, decides nothing.

    Every rank must run its collectives in the same order. A forward's are chained by
    the data; decisions may not be (a token and the top-p verdict of the same draw are
    independent in the graph), so each decision is made to depend on the one before."""

    def __init__(self, group: Any = None):
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1
        self._previous: mx.array | None = None  # the last decision: the next one comes after it

    def decide(self, *arrays: mx.array) -> tuple[mx.array, ...]:
        """Rank 0's values of integer or boolean `arrays`, on every rank (lazily)."""
        if self.size == 1:
            return arrays
        flat = [a.reshape(-1).astype(mx.int32) for a in arrays]
        joined = mx.concatenate(flat) if len(flat) > 1 else flat[0]
        # The other ranks add zeros, but only once they have computed their own values:
        # what led to them holds collectives (a sharded forward) that must meet rank 0's.
        mine = joined if self.rank == 0 else mx.depends(mx.zeros(joined.shape, mx.int32), joined)
        total = self._all_sum(mine)
        out, start = [], 0
        for a, f in zip(arrays, flat):
            out.append(total[start : start + f.size].reshape(a.shape).astype(a.dtype))
            start += f.size
        return tuple(out)

    def held(self, checks: list[mx.array], results: list[mx.array]) -> bool:
        """Evaluate `results` with the top-p shortcut checks (engine/sampling.py);
        whether every check held, as rank 0 found it (a host sync)."""
        if self.size == 1 or not checks:  # no checks (greedy): nothing to decide
            mx.eval(*results, *checks)
            return all(check.item() for check in checks)
        held = mx.all(mx.stack([mx.all(c) for c in checks]))
        (agreed,) = self.decide(held)
        mx.eval(*results, agreed)
        return bool(agreed.item())

    def same(self, value: int) -> bool:
        """Whether every rank holds the same integer (a host sync: for rare decisions)."""
        if self.size == 1:
            return True
        mine = mx.array([value], dtype=mx.int32)
        if self._previous is not None:
            mine = mx.depends(mine, self._previous)
        values = mx.distributed.all_gather(mine, group=self.group)
        self._previous = values
        return bool(mx.all(values == values[0]).item())

    def _all_sum(self, values: mx.array) -> mx.array:
        if self._previous is not None:
            values = mx.depends(values, self._previous)
        self._previous = mx.distributed.all_sum(values, group=self.group)
        return self._previous


# -- sharding ----------------------------------------------------------------------------


def shard(backend: Any, group: Any) -> str:
    """Split `backend`'s trunk over `group`; returns how, in words. Raises ShardingError."""
    n = group.size()
    if n == 1:
        return "not sharded (one rank)"
    how = backend.shard(group)
    backend.ranks = Ranks(group)
    mx.eval(backend.trunk.parameters(), [head.parameters() for head in backend.heads])  # this rank's slice only
    return how


def shard_trunk(trunk: nn.Module, family: str, group: Any) -> str:
    """mlx-lm's own tensor-parallel split of the trunk, where the family has one."""
    if not hasattr(trunk, "shard"):
        raise ShardingError(f"{family}: mlx-lm has no tensor-parallel split for this family, "
                            f"and mtplxd has no pipeline split for it yet; run it on one rank")
    try:
        trunk.shard(group)
    except (AssertionError, ValueError) as e:  # mlx-lm asserts divisibility
        raise ShardingError(f"{family}: cannot split over {group.size()} ranks: {e}") from None
    gather_lm_heads(trunk, group)
    return f"tensor parallel over {group.size()} ranks (mlx-lm's split); MTP heads replicated"


def pipeline_trunk(model: nn.Module, family: str, group: Any) -> str:
    """mlx-lm's pipeline split of the trunk's layers (`PipelineMixin`): each rank runs a
    run of layers and hands the hidden state on (`receive_stage`, `pass_stage`)."""
    if not hasattr(model, "pipeline"):
        raise ShardingError(f"{family}: mlx-lm can neither split this family's layers nor its weights")
    try:
        model.pipeline(group)
    except ValueError as e:
        raise ShardingError(f"{family}: cannot split over {group.size()} ranks: {e}") from None
    n = len(model.pipeline_layers)
    return (f"pipeline over {group.size()} ranks ({n} layers on rank {group.rank()}); "
            "MTP heads, embedding and LM head replicated")


def receive_stage(model: nn.Module, h: mx.array) -> mx.array:
    """A pipeline stage's input: the hidden state from the rank holding the layers before
    (the last rank holds the first layers, rank 0 the last, as in mlx-lm)."""
    rank, size = getattr(model, "pipeline_rank", 0), getattr(model, "pipeline_size", 1)
    if rank == size - 1:
        return h
    # A receive takes only the shape of its input, so the graph would let it run before
    # the decisions this input was made of (drafted tokens): collectives out of order,
    # every rank waiting on another. Settle them first.
    mx.eval(h)
    return mx.distributed.recv_like(h, rank + 1)


def pass_stage(model: nn.Module, h: mx.array, cache: list[Any]) -> mx.array:
    """Hand this stage's output on, and give every rank the last stage's (rank 0's).
    The send is tied to this rank's last cache, so evaluating the caches (as a prefill
    chunk does) sends it too."""
    rank, size = getattr(model, "pipeline_rank", 0), getattr(model, "pipeline_size", 1)
    if size == 1:
        return h
    if rank != 0:
        h = mx.distributed.send(h, rank - 1)
        last = cache[-1]
        if isinstance(last, ArraysCache):
            last[0] = mx.depends(last[0], h)
        else:
            last.keys = mx.depends(last.keys, h)
    return mx.distributed.all_gather(h)[: h.shape[0]]


class GatheredLinear(nn.Module):
    """A vocabulary-sharded LM head whose logits are gathered: sampling must see all of them."""

    def __init__(self, sharded: nn.Module, group: Any):
        super().__init__()
        self.sharded = sharded
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return gather_last_axis(self.sharded(x), self.group)


def gather_lm_heads(trunk: nn.Module, group: Any) -> None:
    for _, module in trunk.named_modules():
        head = getattr(module, "lm_head", None)
        if isinstance(head, AllToShardedLinear):
            module.lm_head = GatheredLinear(head, group)
            if getattr(module, "sharding_group", None) is not None:
                module.sharding_group = None  # mlx-lm's own call would gather a second time


def shard_attention(attn: nn.Module, group: Any) -> bool:
    """Split an attention's heads over the ranks (q/k/v by heads, o back to all);
    False, untouched, when its head counts do not divide (e.g. one KV head)."""
    n = group.size()
    if attn.n_heads % n or attn.n_kv_heads % n:
        return False
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= n
    attn.n_kv_heads //= n
    return True


def shard_mlp(mlp: nn.Module, group: Any) -> bool:
    """Split a gated MLP's hidden units over the ranks; False when they do not divide."""
    if mlp.gate_proj.weight.shape[0] % group.size():
        return False
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    return True
