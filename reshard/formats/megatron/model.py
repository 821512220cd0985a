"""A Megatron-Core ``GPTModel`` (local or TE spec, docs/megatron-checkpoints.md §2.3-2.4, §5) as
its checkpoint keys and local parameters, from the run's ``args`` alone.

* A **key** is a ``ShardedTensor`` key: per-layer weights are stacked over layers (one leading
  axis), experts over layers and experts (two). Its F is the stacked global shape.
* A **local parameter** is what one TP rank's module holds of one layer (and expert) of a key: a
  few boxes of F stacked along its dim 0 -- one box for a row, column or replicated split, two for
  SwiGLU's fc1 (``[gate_t; up_t]``). Its label is ``flat index * TP + t``.
* The **stage order** of a pipeline stage is the modules' registration order (embedding, then per
  layer ``input_layernorm, linear_proj, linear_qkv, [q_layernorm, k_layernorm,] pre_mlp_layernorm, [router,] linear_fc1,
  linear_fc2``; with MLA ``input_layernorm, linear_proj, linear_q_down_proj, linear_q_up_proj,
  linear_kv_down_proj, linear_kv_up_proj, q_layernorm, kv_layernorm, pre_mlp_layernorm, …``),
  then final norm and output layer): the order of the distributed optimizer's buckets (reversed)
  and of a legacy optimizer's state indices.

What the model does not cover is refused here, naming the ``args`` field, so no route can
silently misread a layout it does not know.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ...errors import CheckpointError
from ...ir.piece import prod

__all__ = ["MLA", "Arch", "KeySpec", "LocalParam", "bucket_layout"]

QKV, PROJ = "decoder.layers.self_attention.linear_qkv", "decoder.layers.self_attention.linear_proj"
FC1, FC2 = "decoder.layers.mlp.linear_fc1", "decoder.layers.mlp.linear_fc2"
EXPERTS = "decoder.layers.mlp.experts.experts"
ROUTER, SHARED = "decoder.layers.mlp.router", "decoder.layers.mlp.shared_experts"
EMBED, OUTPUT, FINAL = "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One checkpoint key: ``shape`` is a layer's (expert's) tensor, F is ``stack + shape``;
    ``split`` how TP cuts it (``rows``, ``cols``, ``halves``: each half by rows, ``rep``);
    ``local`` its module name in a legacy state dict (``{layer}``, ``{expert}`` local numbers).
    Stacked axes are (layers[, experts]); a **per-layer** key (mixed dense and MoE layers:
    ``decoder.layers.<i>.…``) names its global layer ``layer`` and stacks experts only. A
    ``buffer`` (the router's ``expert_bias``) is model state without optimizer state or group. An
    MTP layer's key (``mtp``) is one key per MTP layer, stacked over experts only, like a per-layer one."""

    key: str
    local: str
    shape: tuple[int, ...]
    split: str
    stacked: int  # 0, 1 (layers; a per-layer key's experts) or 2 (layers, experts)
    expert: bool = False
    layer: int | None = None  # a per-layer key's global layer
    buffer: bool = False
    mtp: int | None = None  # an MTP layer's key (``mtp.layers.<mtp>.…``): stacked over experts only, last stage

    @property
    def decay(self) -> bool:
        """Whether Megatron puts it in the weight-decay group (>= 2-D and not a bias)."""
        return len(self.shape) >= 2 and not self.key.endswith(".bias")

    @property
    def layered(self) -> bool:
        """Whether it belongs to a decoder layer (an MTP layer's keys do not: they sit after the decoder)."""
        return self.mtp is None and (self.layer is not None or self.stacked >= 1)

    def layer_at(self, index: tuple[int, ...]) -> int:
        """The global layer of stacked ``index``."""
        return self.layer if self.layer is not None else index[0]

    def at(self, layer: int, expert: int | None = None) -> tuple[int, ...]:
        """The stacked index of ``layer`` (and ``expert``)."""
        return ((layer,) if self.layered and self.layer is None else ()) + ((expert,) if self.expert else ())


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
        ("mla_down_proj_fusion", bool, "fused MLA q/kv down projections (linear_qkv_down_proj)"),
        ("moe_single_grouped_weight", bool, "grouped-GEMM experts held as one grouped parameter"),
        ("moe_single_grouped_bias", bool, "grouped-GEMM expert biases held as one grouped parameter"),
        ("add_bias_linear", bool, "linear-layer biases (add_bias_linear)"),
        ("context_parallel_size", lambda v: v not in (None, 1), "context parallelism"),
        # GTP shards each weight over TP x gtp_remat ranks (--tensor-parallel-num-weight-shards): padded TE shards
        ("gtp_weight_remat_size", lambda v: v not in (None, 1), "weights sharded beyond TP (generalized tensor "
         "parallelism)"),
        ("expert_gtp_weight_remat_size", lambda v: v not in (None, 1), "expert weights sharded beyond expert TP "
         "(generalized tensor parallelism)"),
    ]
    for field, bad, what in checks:
        if bad(_get(args, field)):
            raise CheckpointError(f"{where}: args.{field} = {_get(args, field)!r}: {what} are not read by reshard")
    if _get(args, "multi_latent_attention") and _get(args, "transformer_impl", "local") != "local":
        raise CheckpointError(f"{where}: args.transformer_impl = {_get(args, 'transformer_impl')!r} with "
                              "multi_latent_attention: only the local spec's MLA keys are read by reshard (Transformer "
                              "Engine's fold the latent norms into the up projections)")
    for field in ("heterogeneous_block_specs", "hetereogenous_dist_checkpoint"):
        if _get(args, field):
            raise CheckpointError(f"{where}: args.{field} = {_get(args, field)!r}: heterogeneous layers are not read "
                                  "by reshard")


def _moe_pattern(args: Any, layers: int, where: str) -> tuple[tuple[bool, ...] | None, bool]:
    """Which layers are MoE (``get_gpt_decoder_layer_specs``: ``moe_layer_freq`` N puts one every N
    layers from layer 0, a list says it per layer) and whether the keys are per layer (Megatron's
    ``non_homogeneous_layers``: a list, or N > 1)."""
    freq = _get(args, "moe_layer_freq", 1)
    if freq is None:
        freq = 1
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise CheckpointError(f"{where}: args.moe_layer_freq = {freq!r}: neither an integer nor a list")
    if isinstance(freq, int):
        if freq < 1:
            raise CheckpointError(f"{where}: args.moe_layer_freq = {freq!r}: not a positive integer")
        return tuple(i % freq == 0 for i in range(layers)), freq > 1
    if len(freq) != layers or any(x not in (0, 1) or isinstance(x, bool) for x in freq):
        raise CheckpointError(f"{where}: args.moe_layer_freq = {list(freq)!r}: not one 0 / 1 per layer of {layers}")
    return tuple(bool(x) for x in freq), True


@dataclass(frozen=True, slots=True)
class MLA:
    """Multi-latent attention's widths (``MLATransformerConfig``): ``q_lora`` 0 means no q
    down projection (one ``linear_q_proj``); the key's rope part (``rope``) is the tail of the kv
    down projection's rows, shared by every head."""

    q_lora: int
    kv_lora: int
    qk_head: int
    rope: int
    v_head: int

    @classmethod
    def from_args(cls, args: Any) -> MLA | None:
        if not _get(args, "multi_latent_attention"):
            return None
        return cls(int(_get(args, "q_lora_rank") or 0), int(args.kv_lora_rank), int(args.qk_head_dim),
                   int(args.qk_pos_emb_head_dim), int(args.v_head_dim))


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
    shared_ffn: int = 0  # a shared expert's ffn (moe_shared_expert_intermediate_size); 0: none
    shared_gate: bool = False  # its sigmoid gate (moe_shared_expert_gate)
    expert_bias: bool = False  # the router's expert_bias buffer (moe_router_enable_expert_bias)
    moe_layers: tuple[bool, ...] | None = None  # which layers are MoE (None: every one, with experts)
    per_layer: bool = False  # keys per layer (mixed layers), not stacked over layers
    mla: MLA | None = None  # multi-latent attention's widths (--multi-latent-attention)
    mtp: int = 0  # MTP layers built (mtp_num_layers; 1 when repeated): ``mtp.layers.<k>.…`` on the last stage

    @classmethod
    def from_args(cls, args: Any, where: str) -> Arch:
        _refuse_unsupported(args, where)
        try:
            heads = int(args.num_attention_heads)
            mla = MLA.from_args(args)
            groups = int(args.num_query_groups) if _get(args, "group_query_attention") and not mla else heads
            hidden = int(args.hidden_size)
            tp = int(_get(args, "tensor_model_parallel_size", 1) or 1)
            experts = int(_get(args, "num_experts") or 0)
            layers = int(args.num_layers)
            pattern, per_layer = _moe_pattern(args, layers, where) if experts else (None, False)
            arch = cls(
                layers=layers, hidden=hidden, heads=heads, groups=groups,
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
                qk_norm=bool(_get(args, "qk_layernorm")),
                shared_ffn=int(_get(args, "moe_shared_expert_intermediate_size") or 0) if experts else 0,
                shared_gate=bool(experts and _get(args, "moe_shared_expert_intermediate_size")
                                 and _get(args, "moe_shared_expert_gate")),
                expert_bias=bool(experts and _get(args, "moe_router_enable_expert_bias")),
                moe_layers=pattern, per_layer=per_layer, mla=mla, mtp=_mtp_modules(args))
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
        if self.mtp:
            need(self.hidden % self.tp == 0, f"hidden size (the MTP eh_proj's rows) does not divide over TP={self.tp}")
        if self.experts:
            need(self.experts % self.ep == 0, f"{self.experts} experts do not divide over EP={self.ep}")
            need(self.moe_ffn % self.etp == 0, f"moe_ffn_hidden_size does not divide over expert TP={self.etp}")
            need((self.tp * self.dp) % (self.etp * self.ep) == 0, "expert TP x EP does not divide TP x DP")
            need(self.shared_ffn % self.tp == 0, f"the shared expert's ffn does not divide over TP={self.tp}")
        if self.mla:
            m = self.mla
            need(m.q_lora % self.tp == 0 and (m.kv_lora + m.rope) % self.tp == 0,
                 f"the q / kv down projections ({m.q_lora}, {m.kv_lora} + {m.rope} rows) do not divide over "
                 f"TP={self.tp}")

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

    def is_moe(self, layer: int) -> bool:
        return bool(self.experts) and (self.moe_layers is None or self.moe_layers[layer])

    def attention_linears(self) -> list[str]:
        """The attention's linear modules in registration order (``decoder.layers.self_attention.…``)."""
        if not self.mla:
            return ["linear_proj", "linear_qkv"]
        q = ["linear_q_down_proj", "linear_q_up_proj"] if self.mla.q_lora else ["linear_q_proj"]
        return ["linear_proj", *q, "linear_kv_down_proj", "linear_kv_up_proj"]

    def _mla_keys(self) -> list[KeySpec]:
        """MLA's attention keys (``MLASelfAttention``, local spec) in registration order: every
        projection column-parallel (rows split over TP, the down projections' too: their output is
        gathered), ``linear_proj`` row-parallel, the latent norms replicated."""
        m, h, heads = self.mla, self.hidden, self.heads
        if m is None:
            return []
        rows = {"linear_q_down_proj": (m.q_lora, h), "linear_q_up_proj": (heads * (m.qk_head + m.rope), m.q_lora),
                "linear_q_proj": (heads * (m.qk_head + m.rope), h), "linear_kv_down_proj": (m.kv_lora + m.rope, h),
                "linear_kv_up_proj": (heads * (m.qk_head + m.v_head), m.kv_lora),
                "linear_proj": (h, heads * m.v_head)}
        out = [KeySpec(f"decoder.layers.self_attention.{n}.weight", f"self_attention.{n}.weight", rows[n],
                       "cols" if n == "linear_proj" else "rows", 1) for n in self.attention_linears()]
        if self.qk_norm:  # q_layernorm over q_lora (when q is projected down), kv_layernorm over kv_lora
            norms = ([("q_layernorm", m.q_lora)] if m.q_lora else []) + [("kv_layernorm", m.kv_lora)]
            out += [KeySpec(f"decoder.layers.self_attention.{n}.weight", f"self_attention.{n}.weight", (w,), "rep", 1)
                    for n, w in norms]
        return out

    def _layer_keys(self, moe: bool) -> list[KeySpec]:
        """One layer's keys in registration order, stacked over layers (and experts)."""
        h, fc1 = self.hidden, (2 * self.ffn if self.swiglu else self.ffn)
        fc1_split = "halves" if self.swiglu else "rows"
        # MLA's local spec keeps the layer norms under their module names (no sharded-state-dict key map)
        norm_keys = (("decoder.layers.input_layernorm.weight", "decoder.layers.pre_mlp_layernorm.weight") if self.mla
                     else (f"{QKV}.layer_norm_weight", f"{FC1}.layer_norm_weight"))
        layer = [KeySpec(norm_keys[0], "input_layernorm.weight", (h,), "rep", 1)]
        if self.mla:
            layer += self._mla_keys()
        else:
            layer += [KeySpec(f"{PROJ}.weight", "self_attention.linear_proj.weight", (h, self.heads * self.head_dim),
                              "cols", 1),
                      KeySpec(f"{QKV}.weight", "self_attention.linear_qkv.weight", (self.qkv_rows, h), "rows", 1)]
        if self.qkv_bias and not self.mla:
            layer.append(KeySpec(f"{QKV}.bias", "self_attention.linear_qkv.bias", (self.qkv_rows,), "rows", 1))
        if self.qk_norm and not self.mla:  # registered after linear_qkv; replicated over TP (per head, every head alike)
            layer += [KeySpec(f"decoder.layers.self_attention.{n}.weight", f"self_attention.{n}.weight",
                              (self.head_dim,), "rep", 1) for n in ("q_layernorm", "k_layernorm")]
        layer.append(KeySpec(norm_keys[1], "pre_mlp_layernorm.weight", (h,), "rep", 1))
        if moe:  # MoELayer: router, experts, shared experts (gate_weight, its own, before its linears)
            efc1 = (2 * self.moe_ffn if self.swiglu else self.moe_ffn, h)
            layer.append(KeySpec(f"{ROUTER}.weight", "mlp.router.weight", (self.experts, h), "rep", 1))
            if self.expert_bias:
                layer.append(KeySpec(f"{ROUTER}.expert_bias", "mlp.router.expert_bias", (self.experts,), "rep", 1,
                                     buffer=True))
            layer += [KeySpec(f"{EXPERTS}.linear_fc1.weight", "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                              efc1, fc1_split, 2, True),
                      KeySpec(f"{EXPERTS}.linear_fc2.weight", "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                              (h, self.moe_ffn), "cols", 2, True)]
            if self.shared_ffn:
                sfc1 = 2 * self.shared_ffn if self.swiglu else self.shared_ffn
                if self.shared_gate:
                    layer.append(KeySpec(f"{SHARED}.gate_weight", "mlp.shared_experts.gate_weight", (1, h), "rep", 1))
                layer += [KeySpec(f"{SHARED}.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight", (sfc1, h),
                                  fc1_split, 1),
                          KeySpec(f"{SHARED}.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight",
                                  (h, self.shared_ffn), "cols", 1)]
        else:
            layer += [KeySpec(f"{FC1}.weight", "mlp.linear_fc1.weight", (fc1, h), fc1_split, 1),
                      KeySpec(f"{FC2}.weight", "mlp.linear_fc2.weight", (h, self.ffn), "cols", 1)]
        return [dataclasses.replace(s, local="decoder.layers.{layer}." + s.local) for s in layer]

    @cached_property
    def _keys(self) -> tuple[KeySpec, ...]:
        h = self.hidden
        out = [KeySpec(EMBED, EMBED, (self.padded_vocab, h), "rows", 0)]
        if not self.per_layer:
            out += self._layer_keys(bool(self.experts))
        else:  # ``decoder.layers.<i>.…``: one key per layer, stacked over experts only
            for i in range(self.layers):
                out += [dataclasses.replace(s, key=s.key.replace("decoder.layers.", f"decoder.layers.{i}.", 1),
                                            stacked=s.stacked - 1, layer=i) for s in self._layer_keys(self.is_moe(i))]
        out.append(KeySpec(FINAL, FINAL, (h,), "rep", 0))
        out += self._mtp_keys()
        if not self.tied:
            out.append(KeySpec(OUTPUT, OUTPUT, (self.padded_vocab, h), "rows", 0))
        return tuple(out)

    def keys(self) -> list[KeySpec]:
        """Every key, in registration order (embedding, the layers' -- one layer's when stacked --,
        final norm, output)."""
        return list(self._keys)

    @property
    def mtp_moe(self) -> bool:
        """Whether the MTP layers are MoE: ``get_gpt_mtp_block_spec`` gives them the decoder
        block's last layer spec (DeepSeek-V3: MLA + MoE, the dense first layers aside)."""
        return self.is_moe(self.layers - 1)

    def _mtp_keys(self) -> list[KeySpec]:
        """The MTP block's keys (GPTModel registers it after the decoder, before the output layer):
        per MTP layer ``enorm``, ``hnorm``, ``eh_proj`` (2h -> h, column parallel), the transformer
        layer (the decoder's last layer spec -- MLA, MoE with its router, expert bias, experts and
        shared expert as that layer has them; module ``mtp_model_layer``, key
        ``transformer_layer``) and its ``final_layernorm``; one key per MTP layer, stacked over
        experts only (``MultiTokenPredictionBlock.sharded_state_dict`` gives no layer offsets)."""
        h, out = self.hidden, []
        for k in range(self.mtp):
            at = f"mtp.layers.{k}."
            out += [KeySpec(f"{at}{n}.weight", f"{at}{n}.weight", (h,), "rep", 0, mtp=k) for n in ("enorm", "hnorm")]
            out.append(KeySpec(f"{at}eh_proj.weight", f"{at}eh_proj.weight", (h, 2 * h), "rows", 0, mtp=k))
            for s in self._layer_keys(self.mtp_moe):
                local = s.local.replace("decoder.layers.{layer}.", f"{at}mtp_model_layer.", 1)
                out.append(dataclasses.replace(s, key=s.key.replace("decoder.layers.", f"{at}transformer_layer.", 1),
                                               local=local, stacked=s.stacked - 1, mtp=k))
            out.append(KeySpec(f"{at}final_layernorm.weight", f"{at}final_layernorm.weight", (h,), "rep", 0, mtp=k))
        return out

    def layer_keys(self, layer: int) -> list[KeySpec]:
        """The keys of global layer ``layer``, in registration order."""
        return [s for s in self._keys if s.layered and (s.layer is None or s.layer == layer)]

    @cached_property
    def _by_key(self) -> dict[str, KeySpec]:
        return {s.key: s for s in self._keys}

    def spec(self, key: str) -> KeySpec:
        s = self._by_key.get(key)
        if s is None:
            raise CheckpointError(f"no key {key!r} in this model")
        return s

    def stack(self, s: KeySpec) -> tuple[int, ...]:
        if s.layer is not None or s.mtp is not None:
            return (self.experts,) if s.stacked else ()
        return ((self.layers,) if s.stacked >= 1 else ()) + ((self.experts,) if s.stacked == 2 else ())

    def full_shape(self, s: KeySpec) -> tuple[int, ...]:
        return self.stack(s) + s.shape

    def tp_of(self, s: KeySpec) -> int:
        return self.etp if s.expert else self.tp

    def stage_of(self, s: KeySpec, index: tuple[int, ...]) -> int:
        if s.layered:
            return self.place(s.layer_at(index))[0]
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
        if s.layer is not None or s.mtp is not None:
            yield from (((e,) for e in range(self.experts)) if s.stacked else [()])
        elif s.stacked == 0:
            yield ()
        elif s.stacked == 1:
            yield from ((i,) for i in range(self.layers))
        else:
            yield from ((i, e) for i in range(self.layers) for e in range(self.experts))

    def locals_of(self, s: KeySpec) -> list[LocalParam]:
        return [self.local(s, ix, t) for ix in self.indices(s) for t in range(self.tp_of(s))]

    @property
    def expert_apart(self) -> bool:
        """Whether the experts have optimizer and DDP buffers of their own (``chained_1.``): with
        EP > 1 or expert TP apart from TP; else they join the dense ones (Megatron marks them
        ``allreduce`` then)."""
        return bool(self.experts) and (self.ep > 1 or self.etp != self.tp)

    def stage_params(self, pp: int, t: int, *, expert_rank: int | None = None, vp: int | None = None
                     ) -> list[LocalParam]:
        """The local parameters of stage ``pp``, TP rank ``t``, in registration order: the dense
        optimizer's (with every expert unless :attr:`expert_apart`), or (``expert_rank`` = EP rank)
        that EP rank's experts; of model chunk ``vp`` only (each has a DDP buffer of its own), or
        of the stage's chunks one after the other."""
        out: list[LocalParam] = []
        keys = self.keys()
        first = vp in (None, 0)
        last = vp in (None, self.vpp - 1)
        if expert_rank is None and pp == 0 and first:
            out.append(self.local(keys[0], (), t))
        local_experts = self.experts // self.ep if self.experts else 0
        mine = range(self.experts) if expert_rank is None else range(expert_rank * local_experts,
                                                                      (expert_rank + 1) * local_experts)
        with_experts = expert_rank is not None or not self.expert_apart

        def block(params: list[KeySpec], i: int) -> None:
            experts = [s for s in params if s.expert]
            for s in params:
                if not s.expert and expert_rank is None:
                    out.append(self.local(s, s.at(i), t))
                elif experts and s is experts[0] and with_experts:  # SequentialMLP: expert by expert
                    out.extend(self.local(e, e.at(i, x), t) for x in mine for e in experts)

        for i in (self.stage_layers(pp) if vp is None else self.chunk_layers(pp, vp)):
            block([s for s in self.layer_keys(i) if not s.buffer], i)
        if pp == self.pp - 1 and last:  # final norm, the MTP layers (their experts too), output layer
            block([s for s in keys if not s.layered and s.key != EMBED and not s.buffer], 0)
        return out

    # -- ranks -----------------------------------------------------------------------------------
    def rank(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """Global rank, Megatron's default order ``tp-cp-ep-dp-pp`` (EP carved out of DP)."""
        return tp + self.tp * (dp + self.dp * pp)

    def expert_rank(self, t: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
        """Global rank of expert TP rank ``t``, EP rank ``ep``, expert-DP rank ``edp``: Megatron's
        expert order ``tp-ep-dp-pp`` over expert TP x EP x expert DP (MoE parallel folding: expert
        TP apart from TP; with expert TP = TP, EP carved out of DP as :meth:`rank` says)."""
        return t + self.etp * (ep + self.ep * (edp + self.edp * pp))

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.etp * self.ep)


def _mtp_modules(args: Any) -> int:
    """The MTP layers Megatron builds: ``mtp_num_layers``, or one with ``mtp_use_repeated_layer``
    (``get_gpt_mtp_block_spec``: one layer spec, the layer run at every depth; ``mtp.layers.0`` only)."""
    n = int(_get(args, "mtp_num_layers") or 0)
    return min(n, 1) if _get(args, "mtp_use_repeated_layer") else n


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
