"""vLLM's sharded state at a tensor-parallel degree, written from any source (``--format vllm --tp T``):
what ``LLM(model=OUT, load_format="sharded_state", tensor_parallel_size=T)`` loads as it stands.

* **Files**: per TP rank ``r``, ``model-rank-{r}-part-{p}.safetensors`` (parts of at most
  ``max_file_bytes``), holding that rank's share of the engine's own state dict as it is *before*
  vLLM's post-processing: fused ``qkv_proj`` (``[q_r; k_r; v_r]``, a key/value head replicated on
  ``T / num_kv_heads`` ranks past that many heads) and ``gate_up_proj``, row-parallel ``o_proj`` and
  ``down_proj``, the vocabulary padded to a multiple of 64 then split over TP (padding rows zero),
  norms whole on every rank: the maps of :data:`reshard.layouts.arch.LLAMA_VLLM`. vLLM's loader
  copies each tensor into the parameter of that name and refuses a state that lacks one, so each
  attention layer's float32 scalars (``attn._k_scale``, ``_v_scale``, ``_q_scale``, ``_prob_scale``:
  1.0, as vLLM holds them for an unquantized checkpoint) are written too.
* **Tied embeddings**: vLLM's state dict keeps one name for the shared table, ``lm_head.weight``
  (its loader keeps the smaller of two names sharing storage), made from ``model.embed_tokens.weight``.
* ``config.json``, the tokenizer and generation files as the HF export carries them
  (:class:`reshard.formats.hf.writer.HfWriter`); the dtype likewise (``dtype``, else the config's).
* **Architectures**: Llama and Qwen2 (dense); any other is refused by name before any output exists.
* **FP8 kept** (``--quantize fp8``, or ``fp8-ue8m0`` for a source with E8M0 scales; from a source
  that stores its linears as FP8 block scales, ``Reader.stored``): each linear's payload moved byte for byte into the rank's
  ``X.weight`` (E4M3) and its scales, as float32 (E8M0 ones converted exactly), into
  ``X.weight_scale_inv`` ``[⌈rows_r/bm⌉, ⌈cols_r/bn⌉]``, each part's at block row ``⌈offset/bm⌉``
  -- the scale map ``ir.blocks.coarsen`` derives from the payload's (``layouts.inference.scale_placed``),
  never decoded. ``config.json`` keeps the FP8 ``quantization_config``. A TP split that cuts a block
  is refused as vLLM's ``Fp8LinearMethod.create_weights`` refuses it (``validate_fp8_block_shape``),
  naming the tensor, before any output exists. ``--quantize keep``: the source's own encoding.
* **FP8 encoded** (``--quantize fp8`` / ``fp8-ue8m0`` where the source stores a linear otherwise:
  bf16, or FP8 in another block or scale format): each rank's shard of the engine tensor is read in
  the dtype the weights are written in and each part's shard quantized there
  (``ir.codec.fp8_block_encode``): with no block cut by a TP boundary (refused, as above) a shard is
  whole blocks but at the weight's edge, so it equals the TP slice of transformers' ``Fp8Quantize``
  of the full weight -- what ``--format hf --quantize fp8`` and then ``--format vllm --tp T`` gives,
  byte for byte -- with no whole weight gathered.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...errors import QuantizedError, ReshardError, in_context
from ...ir.apply import extract
from ...ir.blocks import cut_blocks
from ...ir.codec import e8m0, fp8_block_encode
from ...ir.piece import prod
from ...layouts.arch import LLAMA_VLLM, inference_targets
from ...layouts.inference import Placed, scale_placed
from ..contract import BEST, Buffer, Held, Reader, Slot, Stored, Writer
from ..hf.writer import TIED, HfWriter
from ..safetensors.io import SafetensorsFile, plan_files

__all__ = ["ARCHITECTURES", "SCALES", "VllmWriter"]

# model classes whose engine state dict the LLAMA_VLLM maps describe (vLLM's Llama and Qwen2 modules)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
# each attention layer's scalars that vLLM's state dict holds beside the weights (unquantized: 1.0)
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
# with an FP8 quantization_config, vLLM's Fp8KVCacheMethod adds these parameters (-1.0, "none in the
# checkpoint", in the model dtype) to each attention layer: its state dict, and so the files, hold them
FP8_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")
PATTERN = "model-rank-{rank}-part-{part}.safetensors"  # vLLM's ShardedStateLoader.DEFAULT_PATTERN
SKIPPED = re.compile(r".*rotary_emb\.inv_freq\Z")  # a buffer older checkpoints keep; vLLM's loaders skip it
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _complete(names: Any, arch: str, config: dict[str, Any], layers: int, where: str) -> None:
    """Refuse a source that lacks a tensor vLLM's state dict holds, or has layers its config does not
    (vLLM's loader would fail on a missing key, after the output was written)."""
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if arch == "Qwen2ForCausalLM" or config.get("attention_bias"):
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    want = {"model.embed_tokens.weight", "model.norm.weight"} | {f"model.layers.{i}.{n}" for i in range(layers)
                                                                  for n in per_layer}
    if not config.get("tie_word_embeddings"):
        want.add(TIED[0])
    missing = sorted(want - set(names))
    if missing:
        raise ReshardError(f"{where}: no {missing[:4]}" + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                           + f" (a {arch} of {layers} layers, as its config says, holds them)")
    extra = sorted(n for n in names if (m := LAYER.match(n)) and int(m.group(1)) >= layers)
    if extra:
        raise ReshardError(f"{where}: {extra[:4]} past the config's {layers} layers (num_hidden_layers)")


class VllmWriter(Writer):
    format = "vllm"
    latest = None
    keeps_replicas = False
    tag = None  # the output folder itself is the model folder vLLM is given

    def __init__(self, reader: Reader, *, tp: int = 1, max_file_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
                 hf_config: Any = None, quantize: str | None = None, block: tuple[int, int] | None = None) -> None:
        if not isinstance(tp, int) or tp < 1:
            raise ReshardError(f"--tp must be a positive number of ranks, got {tp!r}")
        self.reader, self.tp = reader, tp
        if quantize == "keep":  # the source's own encoding (an FP8 source's scale format and block)
            own = next((st for st in map(reader.stored, reader.names) if st is not None and st.kind == "fp8"), None)
            quantize = None if own is None else "fp8-ue8m0" if own.scale_fmt == "ue8m0" else "fp8"
            block = None
        # the HF export's config.json: with the FP8 quantization_config where the weights stay FP8
        self.hf = HfWriter(reader, max_file_bytes=max_file_bytes, dtype=dtype, hf_config=hf_config,
                           quantize=quantize, block=block)
        self.dtype, config = self.hf.dtype, self.hf.config
        where = f"{self.hf.folder / 'config.json'}" if self.hf.folder is not None else f"{reader.sources[-1]}"
        arch = config.get("architectures") or [config.get("model_type")]
        if len(arch) != 1 or arch[0] not in ARCHITECTURES:
            raise ReshardError(f"{where}: architecture {arch} -- --format vllm writes {', '.join(ARCHITECTURES)}")
        heads = config.get("num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        layers = config.get("num_hidden_layers")
        if not all(isinstance(x, int) and x > 0 for x in (heads, kv_heads, layers)):
            raise ReshardError(f"{where}: num_attention_heads, num_key_value_heads and num_hidden_layers must be "
                               f"positive integers, got {heads!r}, {kv_heads!r}, {layers!r}")
        self.tied = bool(config.get("tie_word_embeddings"))
        self.sources = self._names(config, where)
        _complete(self.sources, arch[0], config, layers, f"{reader.sources[-1]}")
        shapes = {n: tuple(reader.shape(src)) for n, src in self.sources.items()}
        try:
            self.placed = inference_targets(LLAMA_VLLM, shapes, tp=tp, num_heads=heads, num_kv_heads=kv_heads)
        except ReshardError as e:
            raise ReshardError(f"{reader.sources[-1]}: --format vllm --tp {tp}: {e}") from None
        if self.tied:  # the table vLLM keeps under its smaller name
            self.placed = {n: (p.named(TIED[0]) if p.into == TIED[1] else p) for n, p in self.placed.items()}
        self.layers = layers
        # engine tensor -> its FP8 parts: (source parameter, payload placement, scale placement, stored;
        # None: encoded from the values)
        self.fp8: dict[str, list[tuple[str, Placed, Placed, Stored | None]]] = self._fp8() if quantize else {}
        self.files = self._files(max_file_bytes)
        self._buffers = self._declare()

    def _fp8(self) -> dict[str, list[tuple[str, Placed, Placed, Stored | None]]]:
        """Every FP8 engine tensor's parts, each moved as stored or encoded (``None``); refuses
        (before any output exists) a fused tensor of FP8 and other parts, and a TP split that cuts a
        block, as vLLM does."""
        block = self.hf.inner.block or (128, 128)
        where = f"{self.reader.sources[-1]}"
        kept = {name: copy for name, (_, _, copy) in self.hf.inner.encoded.items()}
        parts: dict[str, list[str]] = {}
        for n, p in self.placed.items():
            parts.setdefault(p.into, []).append(n)
        out: dict[str, list[tuple[str, Placed, Placed, Stored | None]]] = {}
        for into, names in parts.items():
            fp8 = [n for n in names if n in kept]
            if not fp8:
                continue
            if into in TIED:  # ParallelLMHead / VocabParallelEmbedding: vLLM's Fp8Config leaves them unquantized
                raise QuantizedError(f"{where}: parameter {self.sources[fp8[0]]!r} is stored as FP8, but vLLM holds "
                                     f"{into!r} unquantized (its FP8 layers are the linears); decode it to an hf "
                                     "folder first (--format hf) or leave the output head unquantized")
            if len(fp8) != len(names):
                raise QuantizedError(f"{where}: engine tensor {into!r} fuses FP8 {fp8} with {sorted(set(names) - set(fp8))}, "
                                     "which the source does not store as FP8: vLLM holds one dtype per tensor")
            for n in names:
                self._refuse_cut(n, self.placed[n], block)
            try:
                out[into] = [(self.sources[n], self.placed[n], scale_placed(self.placed[n], block), kept[n])
                             for n in names]
            except ReshardError as e:  # a fused part starting inside a block row (after a partial block)
                raise QuantizedError(f"{where}: --format vllm --tp {self.tp}: {e}") from None
        return out

    def _refuse_cut(self, name: str, p: Placed, block: tuple[int, int]) -> None:
        """Refuse a TP split that cuts a block of ``name`` (``ir.blocks.cut_blocks``: a rank would hold
        a scale for elements another rank holds), in the words of vLLM's ``validate_fp8_block_shape``
        where it names the split; vLLM keeps no shared scale block (its loader narrows the scales by
        ``⌈size/block⌉`` per rank, which reads past them or misplaces them)."""
        rows, cols = p.map.logical_shape
        bm, bn = block
        cut = {r: n for r, n in cut_blocks(p.map, block).items() if n}
        if not cut:
            return
        r = min(cut)
        pr, pc = p.map.shard(r).shape
        why = f"{self.reader.sources[-1]}: parameter {self.sources[name]!r} {[rows, cols]} at --format vllm --tp {self.tp}"
        if pc != cols and pc % bn:
            split = (f"holds {pc} of its columns, which vLLM refuses for FP8 block scales (validate_fp8_block_shape: "
                     f"input_size_per_partition = {pc} is not divisible by block_k = {bn})")
        elif pr != rows and pr % bm:
            split = (f"holds {pr} of its rows, which vLLM refuses for FP8 block scales (validate_fp8_block_shape: "
                     f"output_partition_size = {pr} is not divisible by block_n = {bm})")
        else:
            split = f"holds part of a {bm}x{bn} block ({cut[r]} of the elements its scales cover are another rank's)"
        raise QuantizedError(f"{why}: rank {r} {split}; choose a TP that splits whole blocks")

    def _names(self, config: dict[str, Any], where: str) -> dict[str, str]:
        """The source's parameters by their Hugging Face names (a wrapper's prefix dropped; a tied
        ``lm_head.weight`` left out, its table written once)."""
        out = {}
        for src in self.reader.names:
            name = src[len(self.hf.prefix):]
            if SKIPPED.match(name) or (self.tied and name == TIED[0]):
                continue
            out[name] = src
        if not self.tied and TIED[0] not in out and TIED[1] in out:
            raise ReshardError(f"{self.reader.sources[-1]}: no lm_head.weight, and {where} does not tie the word "
                               "embeddings (tie_word_embeddings)")
        return out

    def _files(self, max_file_bytes: int) -> list[tuple[int, str, list]]:
        """Every output file: (rank, name, [(engine name, shape, dtype), ...])."""
        out = []
        for r in range(self.tp):
            specs: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
            for p in self.placed.values():
                if p.into in self.fp8:  # the payload, its scales right after it (the state dict's order)
                    sp = self.fp8[p.into][0][2]
                    specs.setdefault(p.into, (p.into, tuple(p.shapes[r]), torch.float8_e4m3fn))
                    specs.setdefault(_scales_of(p.into), (_scales_of(p.into), tuple(sp.shapes[r]), torch.float32))
                    continue
                specs.setdefault(p.into, (p.into, tuple(p.shapes[r]), self.dtype))
            specs.update({n: (n, (), torch.float32) for n in self._scales()})
            specs.update({n: (n, (), self.dtype) for n in self._fp8_scales()})
            for part, group in enumerate(plan_files(list(specs.values()), max_file_bytes)):
                out.append((r, PATTERN.format(rank=r, part=part), group))
        return out

    def _scales(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn.{s}" for i in range(self.layers) for s in SCALES]

    def _by_into(self) -> dict[str, list[tuple[str, Placed]]]:
        """Each engine tensor's source parameters (several where vLLM fuses them)."""
        by_into: dict[str, list[tuple[str, Placed]]] = {}
        for n, p in self.placed.items():
            by_into.setdefault(p.into, []).append((self.sources[n], p))
        return by_into

    def _declare(self) -> dict[str, Buffer]:
        """Each rank's file's engine tensors, a slot per source parameter at its place in the fused
        tensor (the attention scales are constants, no buffer). An FP8 tensor's parts moved as stored
        take no slot; those encoded are read in the weights' dtype, then quantized."""
        by_into = self._by_into()
        out = {}
        for r, fname, group in self.files:
            for name, shape, dtype in group:
                if name not in by_into:
                    continue
                parts = by_into[name]
                if name in self.fp8:
                    encoded = {src for src, _, _, stored in self.fp8[name] if stored is None}
                    parts = [(src, p) for src, p in parts if src in encoded]
                    if not parts:
                        continue
                    dtype = self.dtype
                out[f"{fname}:{name}"] = Buffer(f"{fname}:{name}", dtype, prod(shape),
                                                tuple(Slot(p.offsets[r], src, BEST, p.map, r) for src, p in parts))
        return out

    def buffers(self) -> list[Buffer]:
        return list(self._buffers.values())

    def _fp8_scales(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn.{s}" for i in range(self.layers) for s in FP8_SCALES] if self.fp8 else []

    def copied(self) -> list[str]:
        """The FP8 parameters moved as the source stores them (payload and scales), from no buffer."""
        return [src for parts in self.fp8.values() for src, _, _, stored in parts if stored is not None]

    def carries(self, held: Held) -> bool:
        """A tied ``lm_head.weight``: written once, as the table it is tied to (``_names``)."""
        return self.tied and held.key.startswith(self.hf.prefix) and held.key[len(self.hf.prefix):] == TIED[0]

    def meta(self) -> dict[str, Any]:
        return {"target": "vLLM sharded state (load_format='sharded_state')", "target_topology": {"tp": self.tp, "dp": 1}}

    def notes(self) -> list[str]:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.fp8:
            block = self.hf.inner.block or (128, 128)
            parts = [stored for ps in self.fp8.values() for _, _, _, stored in ps]
            moved = sum(1 for s in parts if s is not None)
            how = ", ".join(w for w in ((f"{moved} weights moved as the source stores them (never decoded)" if moved
                                         else ""),
                                        (f"{len(parts) - moved} encoded per rank as transformers' Fp8Quantize "
                                         f"({self.hf.inner.scale_fmt} scales)" if len(parts) > moved else "")) if w)
            dtype += (f"; {len(self.fp8)} engine tensors FP8 E4M3 with float32 weight_scale_inv per "
                      f"{block[0]}x{block[1]} block ({how}), and "
                      f"{len(FP8_SCALES)} unset attention scales per layer (-1.0) as vLLM's FP8 layers hold them")
        return [f"vLLM sharded state at TP={self.tp}: {len(self.files)} file(s) model-rank-R-part-P.safetensors, "
                f"{dtype}, {len({p.into for p in self.placed.values()})} engine tensors per rank and "
                f"{len(SCALES)} float32 attention scales per layer (1.0)"
                + (", tied embeddings as lm_head.weight" if self.tied else "")
                + (f"; config.json from {self.hf.folder}" if self.hf.folder is not None else "")
                + (f"; carried: {', '.join(self.hf.carried)}" if self.hf.carried else "")]

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        by_into = self._by_into()
        jobs: list[tuple[int, Callable[[], None]]] = [
            (sum(prod(s) * d.itemsize for _, s, d in group), partial(self._file, engine, staging, r, f, group, by_into))
            for r, f, group in self.files]
        return jobs + self.hf.metadata_jobs(staging)

    def _file(self, engine: Any, staging: Any, rank: int, fname: str, group: list,
              by_into: dict[str, list[tuple[str, Placed]]]) -> None:
        with staging.open(fname) as out:
            w = SafetensorsFile(out, group)
            scales: dict[str, torch.Tensor] = {}  # an FP8 payload's scales, written right after it (same file)
            for name, shape, dtype in group:
                if name in scales:
                    w.write(name, scales.pop(name))
                    continue
                if name.endswith(".weight_scale_inv") and name[:-len("_scale_inv")] in self.fp8:  # in another part
                    w.write(name, self._fp8_tensors(engine, fname, name[:-len("_scale_inv")], rank)[1])
                    continue
                if name in self.fp8:
                    payload, scales[_scales_of(name)] = self._fp8_tensors(engine, fname, name, rank)
                    w.write(name, payload)
                    continue
                if name not in by_into:  # an attention scale: 1.0, or an FP8 layer's unset one (-1.0)
                    w.write(name, torch.full((), -1.0 if name.rsplit(".", 1)[1] in FP8_SCALES else 1.0, dtype=dtype))
                    continue
                w.write_fill(name, shape, dtype, engine.fill(self._buffers[f"{fname}:{name}"]))
            w.close()

    def _fp8_tensors(self, engine: Any, fname: str, into: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Engine tensor ``into`` on ``rank`` (FP8) and its ``weight_scale_inv``: each part's payload
        and scale shards cut from the source's stored tensors by their maps, bytes as stored (one
        source parameter at a time), or its shard of the values encoded (:meth:`_encode`)."""
        parts = self.fp8[into]
        p0, s0 = parts[0][1], parts[0][2]
        payload = torch.empty(prod(tuple(p0.shapes[rank])), dtype=torch.uint8)
        scales = torch.empty(prod(tuple(s0.shapes[rank])), dtype=torch.float32)
        buffer = self._buffers.get(f"{fname}:{into}")
        values = None
        if buffer is not None:  # the parts to encode, read in the weights' dtype
            values = torch.empty(buffer.numel, dtype=buffer.dtype)
            engine.fill(buffer)(values, 0)
        for src, p, sp, stored in parts:
            if stored is None:
                if values is None:  # every encoded part has a slot in the buffer (_declare)
                    raise ReshardError(f"{into!r} on rank {rank}: no buffer declared for {src!r}")
                q, s = self._encode(src, p, sp, values, rank)
                payload[p.offsets[rank]:p.offsets[rank] + q.numel()] = q
                scales[sp.offsets[rank]:sp.offsets[rank] + s.numel()] = s
                continue
            shard = extract(p.map, stored.payload().view(torch.uint8), rank).reshape(-1)
            payload[p.offsets[rank]:p.offsets[rank] + shard.numel()] = shard
            raw = stored.scales()
            value = e8m0(raw) if raw.dtype in (torch.uint8, torch.float8_e8m0fnu) else raw.to(torch.float32)
            s = extract(sp.map, value, rank).reshape(-1)
            scales[sp.offsets[rank]:sp.offsets[rank] + s.numel()] = s
        return (payload.view(torch.float8_e4m3fn).view(tuple(p0.shapes[rank])),
                scales.view(tuple(s0.shapes[rank])))

    def _encode(self, src: str, p: Placed, sp: Placed, values: torch.Tensor, rank: int) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """Part ``src``'s shard on ``rank`` quantized: its payload bytes and its float32 scales, flat.
        No block is cut by a TP boundary (``_refuse_cut``), so the shard is whole blocks but at the
        weight's edge and its encoding is the slice of the whole weight's."""
        shape = p.map.shard(rank).shape
        part = values[p.offsets[rank]:p.offsets[rank] + prod(shape)].view(shape)
        try:
            q, s = fp8_block_encode(part, self.hf.inner.block or (128, 128), self.hf.inner.scale_fmt or "float32")
        except QuantizedError as e:
            raise in_context(e, f"{self.reader.sources[-1]}: parameter {src!r} (rank {rank}'s shard)") from None
        if tuple(s.shape) != tuple(sp.map.shard(rank).shape):  # no cut block: the shard's own grid is its scales'
            raise QuantizedError(f"{src!r} on rank {rank}: scales {list(s.shape)}, its scale map holds "
                                 f"{list(sp.map.shard(rank).shape)}")
        value = e8m0(s) if s.dtype == torch.float8_e8m0fnu else s
        return q.reshape(-1).view(torch.uint8), value.reshape(-1)


def _scales_of(weight: str) -> str:
    """``X.weight``'s scales in vLLM's state dict (``Fp8LinearMethod``'s name, DeepSeek-V3's)."""
    return weight[:-len(".weight")] + ".weight_scale_inv"
