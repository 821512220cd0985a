"""A Megatron-Core ``GPTModel`` (local or TE spec, docs/megatron-checkpoints.md §2.3-2.4, §5) as
its checkpoint keys and local parameters, from the run's ``args`` alone.

* A **key** is a ``ShardedTensor`` key: per-layer weights are stacked over layers (one leading
  axis), experts over layers and experts (two). Its F is the stacked global shape.
* A **local parameter** is what one TP rank's module holds of one layer (and expert) of a key: a
  few boxes of F stacked along its dim 0 -- one box for a row, column or replicated split, two for
  SwiGLU's fc1 (``[gate_t; up_t]``). Its label is ``flat index * TP + t``.
* The **stage order** of a pipeline stage is the modules' registration order (embedding, then per
  layer ``input_layernorm, linear_proj, linear_qkv, [q_layernorm, k_layernorm,] pre_mlp_layernorm, [router,] linear_fc1,
  linear_fc2``, then final norm and output layer): the order of the distributed optimizer's
  buckets (reversed) and of a legacy optimizer's state indices.

What the model does not cover is refused here, naming the ``args`` field, so no route can
silently misread a layout it does not know.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointError
from ...ir.piece import prod

__all__ = ["Arch", "KeySpec", "LocalParam", "bucket_layout"]

QKV, PROJ = "decoder.layers.self_attention.linear_qkv", "decoder.layers.self_attention.linear_proj"
FC1, FC2 = "decoder.layers.mlp.linear_fc1", "decoder.layers.mlp.linear_fc2"
EXPERTS = "decoder.layers.mlp.experts.experts"
EMBED, OUTPUT, FINAL = "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"
EXTRA_MODULES = (PROJ, QKV, FC1, FC2)  # local-spec modules with an ``_extra_state`` object per layer


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One checkpoint key: ``shape`` is a layer's (expert's) tensor, F is ``stack + shape``;
    ``split`` how TP cuts it (``rows``, ``cols``, ``halves``: each half by rows, ``rep``);
    ``local`` its module name in a legacy state dict (``{layer}``, ``{expert}`` local numbers)."""

    key: str
    local: str
    shape: tuple[int, ...]
    split: str
    stacked: int  # 0, 1 (layers) or 2 (layers, experts)
    expert: bool = False

    @property
    def decay(self) -> bool:
        """Whether Megatron puts it in the weight-decay group (>= 2-D and not a bias)."""
        return len(self.shape) >= 2 and not self.key.endswith(".bias")


@dataclass(frozen=True, slots=True)
class LocalParam:
    """TP rank ``tp``'s module tensor of ``spec`` at stacked ``index``: ``parts`` are boxes of F
    ``(offsets, sizes)`` stacked along its dim 0; ``label`` names it in its key's local map."""

    spec: KeySpec
    index: tuple[int, ...]
    tp: int
    shape: tuple[int, ...]
    parts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    label: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _refuse_unsupported(args: Any, where: str) -> None:
    checks = [
        ("pipeline_model_parallel_layout", lambda v: v is not None, "a custom pipeline layout"),
        ("account_for_embedding_in_pipeline_split", bool, "pipeline splits counting the embedding"),
        ("account_for_loss_in_pipeline_split", bool, "pipeline splits counting the loss"),
        ("multi_latent_attention", bool, "multi-latent attention"),
        ("moe_shared_expert_intermediate_size", lambda v: v not in (None, 0), "shared experts"),
        ("moe_grouped_gemm", bool, "grouped-GEMM experts (TEGroupedMLP keys)"),
        ("add_bias_linear", bool, "linear-layer biases (add_bias_linear)"),
        ("context_parallel_size", lambda v: v not in (None, 1), "context parallelism"),
        ("mtp_num_layers", lambda v: v not in (None, 0), "multi-token prediction layers"),
    ]
    for field, bad, what in checks:
        if bad(_get(args, field)):
            raise CheckpointError(f"{where}: args.{field} = {_get(args, field)!r}: {what} are not read by reshard")
    freq = _get(args, "moe_layer_freq", 1)
    if _get(args, "num_experts") and freq not in (1, None):
        raise CheckpointError(f"{where}: args.moe_layer_freq = {freq!r}: only every layer MoE is read by reshard")


@dataclass(frozen=True)
class Arch:
    """The model shape and the parallel sizes a checkpoint's ``args`` record."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    padded_vocab: int
    vocab: int
    swiglu: bool
    qkv_bias: bool
    tied: bool
    experts: int
    moe_ffn: int
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline stage
    first: int | None = None  # layers of the first / last pipeline stage when uneven
    last: int | None = None
    qk_norm: bool = False  # q_layernorm / k_layernorm over the head dim (--qk-layernorm)

    @classmethod
    def from_args(cls, args: Any, where: str) -> Arch:
        _refuse_unsupported(args, where)
        try:
            heads = int(args.num_attention_heads)
            groups = int(args.num_query_groups) if _get(args, "group_query_attention") else heads
            hidden = int(args.hidden_size)
            tp = int(_get(args, "tensor_model_parallel_size", 1) or 1)
            experts = int(_get(args, "num_experts") or 0)
            arch = cls(
                layers=int(args.num_layers), hidden=hidden, heads=heads, groups=groups,
                head_dim=int(_get(args, "kv_channels") or hidden // heads), ffn=int(args.ffn_hidden_size),
                padded_vocab=int(args.padded_vocab_size), vocab=int(args.vocab_size), swiglu=bool(_get(args, "swiglu")),
                qkv_bias=bool(_get(args, "add_qkv_bias")),
                tied=not bool(_get(args, "untie_embeddings_and_output_weights")), experts=experts,
                moe_ffn=int(_get(args, "moe_ffn_hidden_size") or 0) if experts else 0, tp=tp,
                pp=int(_get(args, "pipeline_model_parallel_size", 1) or 1),
                dp=int(_get(args, "data_parallel_size", 1) or 1),
                ep=int(_get(args, "expert_model_parallel_size", 1) or 1),
                etp=int(_get(args, "expert_tensor_parallel_size") or tp),
                vpp=int(_get(args, "virtual_pipeline_model_parallel_size") or 1),
                first=_opt_int(_get(args, "decoder_first_pipeline_num_layers")),
                last=_opt_int(_get(args, "decoder_last_pipeline_num_layers")),
                qk_norm=bool(_get(args, "qk_layernorm")))
        except (AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: args lack what the model shape needs ({type(e).__name__}: {e})") from None
        arch.check(where)
        return arch

    def check(self, where: str) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise CheckpointError(f"{where}: args: {what}")

        need(self.heads % self.groups == 0, f"{self.heads} heads are not a multiple of {self.groups} query groups")
        self._check_stages(need)
        need(self.groups % self.tp == 0, f"{self.groups} query groups do not divide over TP={self.tp}")
        need(self.ffn % self.tp == 0 and self.heads % self.tp == 0, f"ffn/heads do not divide over TP={self.tp}")
        need(self.padded_vocab % self.tp == 0 and self.padded_vocab >= self.vocab,
             f"padded vocabulary {self.padded_vocab} (vocab {self.vocab}) does not divide over TP={self.tp}")
        if self.experts:
            need(self.experts % self.ep == 0, f"{self.experts} experts do not divide over EP={self.ep}")
            need(self.moe_ffn % self.etp == 0, f"moe_ffn_hidden_size does not divide over expert TP={self.etp}")
            need((self.tp * self.dp) % (self.etp * self.ep) == 0, "expert TP x EP does not divide TP x DP")

    # -- pipeline stages -------------------------------------------------------------------------
    @property
    def even(self) -> bool:
        return self.vpp == 1 and self.first is None and self.last is None

    def evened(self) -> Arch:
        """The same model and sizes over even, non-virtual pipeline stages."""
        return dataclasses.replace(self, vpp=1, first=None, last=None)

    def _stage_counts(self) -> list[int]:
        """Layers of each pipeline stage's model chunk (every chunk of a stage holds as many):
        ``get_transformer_layer_offset`` -- the first / last stage's count (when set) split over
        the virtual stages, the other stages sharing the rest evenly."""
        if self.pp == 1:
            return [self.layers // self.vpp]
        ends = [x for x in (self.first, self.last) if x is not None]
        middle = self.pp - len(ends)
        mid = (self.layers - sum(ends)) // self.vpp // middle if middle else 0
        counts = [mid] * self.pp
        if self.first is not None:
            counts[0] = self.first // self.vpp
        if self.last is not None:
            counts[-1] = self.last // self.vpp
        return counts

    def _check_stages(self, need: Any) -> None:
        need(self.vpp >= 1 and (self.vpp == 1 or self.pp > 1), f"{self.vpp} virtual stages over PP={self.pp}")
        counts = self._stage_counts()
        sizes = [c * self.vpp for c in counts]
        for what, n, i in (("first", self.first, 0), ("last", self.last, self.pp - 1)):
            need(n is None or (self.pp > 1 and n == sizes[i]),
                 f"decoder_{what}_pipeline_num_layers = {n} does not divide over {self.vpp} virtual stages of PP={self.pp}")
        need(min(sizes) >= 0 and sum(sizes) == self.layers, f"{self.layers} layers do not divide over {self.pp} pipeline stages"
             + (f" x {self.vpp} virtual stages" if self.vpp > 1 else "")
             + (f" (first {self.first}, last {self.last})" if not self.even else ""))

    def chunk_layers(self, pp: int, vp: int = 0) -> range:
        """The global layers of pipeline stage ``pp``'s model chunk ``vp`` (virtual stage)."""
        counts = self._stage_counts()
        start = vp * sum(counts) + sum(counts[:pp])
        return range(start, start + counts[pp])

    def stage_layers(self, pp: int) -> list[int]:
        """The global layers stage ``pp`` holds, in its model chunks' order."""
        return [i for vp in range(self.vpp) for i in self.chunk_layers(pp, vp)]

    def place(self, layer: int) -> tuple[int, int, int]:
        """``(pp, vp, local)``: the stage, model chunk and the chunk's own number of a global layer."""
        for pp in range(self.pp):
            for vp in range(self.vpp):
                r = self.chunk_layers(pp, vp)
                if layer in r:
                    return pp, vp, layer - r.start
        raise CheckpointError(f"layer {layer} lies outside the {self.layers} layers")

    # -- keys ----------------------------------------------------------------------------------
    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    @property
    def qkv_rows(self) -> int:
        return self.groups * (self.per_group + 2) * self.head_dim

    def keys(self) -> list[KeySpec]:
        """Every key, in registration order (embedding, one layer's, final norm, output)."""
        h, fc1 = self.hidden, (2 * self.ffn if self.swiglu else self.ffn)
        fc1_split = "halves" if self.swiglu else "rows"
        out = [KeySpec(EMBED, EMBED, (self.padded_vocab, h), "rows", 0)]
        layer = [KeySpec(f"{QKV}.layer_norm_weight", "input_layernorm.weight", (h,), "rep", 1),
                 KeySpec(f"{PROJ}.weight", "self_attention.linear_proj.weight", (h, self.heads * self.head_dim),
                         "cols", 1),
                 KeySpec(f"{QKV}.weight", "self_attention.linear_qkv.weight", (self.qkv_rows, h), "rows", 1)]
        if self.qkv_bias:
            layer.append(KeySpec(f"{QKV}.bias", "self_attention.linear_qkv.bias", (self.qkv_rows,), "rows", 1))
        if self.qk_norm:  # registered after linear_qkv; replicated over TP (per head, every head alike)
            layer += [KeySpec(f"decoder.layers.self_attention.{n}.weight", f"self_attention.{n}.weight",
                              (self.head_dim,), "rep", 1) for n in ("q_layernorm", "k_layernorm")]
        layer.append(KeySpec(f"{FC1}.layer_norm_weight", "pre_mlp_layernorm.weight", (h,), "rep", 1))
        if self.experts:
            efc1 = (2 * self.moe_ffn if self.swiglu else self.moe_ffn, h)
            layer += [KeySpec("decoder.layers.mlp.router.weight", "mlp.router.weight", (self.experts, h), "rep", 1),
                      KeySpec(f"{EXPERTS}.linear_fc1.weight", "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                              efc1, fc1_split, 2, True),
                      KeySpec(f"{EXPERTS}.linear_fc2.weight", "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                              (h, self.moe_ffn), "cols", 2, True)]
        else:
            layer += [KeySpec(f"{FC1}.weight", "mlp.linear_fc1.weight", (fc1, h), fc1_split, 1),
                      KeySpec(f"{FC2}.weight", "mlp.linear_fc2.weight", (h, self.ffn), "cols", 1)]
        out += [KeySpec(s.key, "decoder.layers.{layer}." + s.local, s.shape, s.split, s.stacked, s.expert) for s in layer]
        out.append(KeySpec(FINAL, FINAL, (h,), "rep", 0))
        if not self.tied:
            out.append(KeySpec(OUTPUT, OUTPUT, (self.padded_vocab, h), "rows", 0))
        return out

    def spec(self, key: str) -> KeySpec:
        for s in self.keys():
            if s.key == key:
                return s
        raise CheckpointError(f"no key {key!r} in this model")

    def stack(self, s: KeySpec) -> tuple[int, ...]:
        return ((self.layers,) if s.stacked >= 1 else ()) + ((self.experts,) if s.stacked == 2 else ())

    def full_shape(self, s: KeySpec) -> tuple[int, ...]:
        return self.stack(s) + s.shape

    def tp_of(self, s: KeySpec) -> int:
        return self.etp if s.expert else self.tp

    def stage_of(self, s: KeySpec, index: tuple[int, ...]) -> int:
        if s.stacked:
            return self.place(index[0])[0]
        return 0 if s.key == EMBED else self.pp - 1

    # -- local parameters ------------------------------------------------------------------------
    def local(self, s: KeySpec, index: tuple[int, ...], t: int) -> LocalParam:
        """TP rank ``t``'s tensor of ``s`` at stacked ``index``."""
        n = self.tp_of(s)
        shape = s.shape
        if s.split == "rep":
            parts = (((0,) * len(shape), shape),)
            local = shape
        elif s.split == "rows":
            r = shape[0] // n
            parts = (((t * r,) + (0,) * (len(shape) - 1), (r, *shape[1:])),)
            local = (r, *shape[1:])
        elif s.split == "cols":
            c = shape[1] // n
            parts = (((0, t * c), (shape[0], c)),)
            local = (shape[0], c)
        else:  # halves: [gate_t; up_t]
            half = shape[0] // 2
            f = half // n
            parts = (((t * f, 0), (f, shape[1])), ((half + t * f, 0), (f, shape[1])))
            local = (2 * f, shape[1])
        flat = 0
        for i, m in zip(index, self.stack(s)):
            flat = flat * m + i
        stacked = tuple((tuple(index) + o, (1,) * len(index) + z) for o, z in parts)
        return LocalParam(s, tuple(index), t, local, stacked, flat * n + t)

    def indices(self, s: KeySpec) -> Iterator[tuple[int, ...]]:
        if s.stacked == 0:
            yield ()
        elif s.stacked == 1:
            yield from ((i,) for i in range(self.layers))
        else:
            yield from ((i, e) for i in range(self.layers) for e in range(self.experts))

    def locals_of(self, s: KeySpec) -> list[LocalParam]:
        return [self.local(s, ix, t) for ix in self.indices(s) for t in range(self.tp_of(s))]

    def stage_params(self, pp: int, t: int, *, expert_rank: int | None = None, vp: int | None = None
                     ) -> list[LocalParam]:
        """The local parameters of stage ``pp``, TP rank ``t``, in registration order: the dense
        ones, or (``expert_rank`` = EP rank) that EP rank's experts; of model chunk ``vp`` only
        (each has a DDP buffer of its own), or of the stage's chunks one after the other."""
        out: list[LocalParam] = []
        keys = self.keys()
        first = vp in (None, 0)
        last = vp in (None, self.vpp - 1)
        if expert_rank is None and pp == 0 and first:
            out.append(self.local(keys[0], (), t))
        layer_keys = [s for s in keys if s.stacked]
        local_experts = self.experts // self.ep if self.experts else 0
        for i in (self.stage_layers(pp) if vp is None else self.chunk_layers(pp, vp)):
            for s in layer_keys:
                if expert_rank is None and not s.expert:
                    out.append(self.local(s, (i,), t))
                elif expert_rank is not None and s.expert:
                    continue
            if expert_rank is not None:
                for x in range(expert_rank * local_experts, (expert_rank + 1) * local_experts):
                    out += [self.local(s, (i, x), t) for s in layer_keys if s.expert]
        if expert_rank is None and pp == self.pp - 1 and last:
            out += [self.local(s, (), t) for s in keys if not s.stacked and s.key != EMBED]
        return out

    # -- ranks -----------------------------------------------------------------------------------
    def rank(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """Global rank, Megatron's default order ``tp-cp-ep-dp-pp`` (EP carved out of DP)."""
        return tp + self.tp * (dp + self.dp * pp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.etp * self.ep)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def pad(x: int, m: int) -> int:
    return -(-x // m) * m


def bucket_layout(params: list[LocalParam], dp: int) -> tuple[list[tuple[LocalParam, int, int]], int, int]:
    """One DDP buffer's single bucket (``DistributedOptimizer._compute_per_buffer_param_layout``):
    parameters in reverse registration order, each start rounded up to 64 elements; the end padded
    to a multiple of ``lcm(dp, 128)``. Returns ``([(param, start, end)], numel_unpadded, numel)``."""
    out, pos = [], 0
    for p in reversed(params):
        pos = pad(pos, 64)
        out.append((p, pos, pos + p.numel))
        pos += p.numel
    return out, pos, pad(pos, math.lcm(dp, 128))
