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
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...errors import ReshardError
from ...ir.piece import prod
from ...layouts.arch import LLAMA_VLLM, inference_targets
from ...layouts.inference import Placed
from ..contract import BEST, Buffer, Held, Reader, Slot, Writer
from ..hf.writer import TIED, HfWriter
from ..safetensors.io import SafetensorsFile, plan_files

__all__ = ["ARCHITECTURES", "SCALES", "VllmWriter"]

# model classes whose engine state dict the LLAMA_VLLM maps describe (vLLM's Llama and Qwen2 modules)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
# each attention layer's scalars that vLLM's state dict holds beside the weights (unquantized: 1.0)
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
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
                 hf_config: Any = None) -> None:
        if not isinstance(tp, int) or tp < 1:
            raise ReshardError(f"--tp must be a positive number of ranks, got {tp!r}")
        self.reader, self.tp = reader, tp
        self.hf = HfWriter(reader, max_file_bytes=max_file_bytes, dtype=dtype, hf_config=hf_config)
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
        self.files = self._files(max_file_bytes)
        self._buffers = self._declare()

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
                specs.setdefault(p.into, (p.into, tuple(p.shapes[r]), self.dtype))
            specs.update({n: (n, (), torch.float32) for n in self._scales()})
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
        tensor (the attention scales are constants, no buffer)."""
        by_into = self._by_into()
        return {f"{fname}:{name}": Buffer(f"{fname}:{name}", dtype, prod(shape),
                                          tuple(Slot(p.offsets[r], src, BEST, p.map, r) for src, p in by_into[name]))
                for r, fname, group in self.files for name, shape, dtype in group if name in by_into}

    def buffers(self) -> list[Buffer]:
        return list(self._buffers.values())

    def carries(self, held: Held) -> bool:
        """A tied ``lm_head.weight``: written once, as the table it is tied to (``_names``)."""
        return self.tied and held.key.startswith(self.hf.prefix) and held.key[len(self.hf.prefix):] == TIED[0]

    def meta(self) -> dict[str, Any]:
        return {"target": "vLLM sharded state (load_format='sharded_state')", "target_topology": {"tp": self.tp, "dp": 1}}

    def notes(self) -> list[str]:
        dtype = str(self.dtype).removeprefix("torch.")
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
            for name, shape, dtype in group:
                if name not in by_into:  # an attention scale
                    w.write(name, torch.ones((), dtype=torch.float32))
                    continue
                w.write_fill(name, shape, dtype, engine.fill(self._buffers[f"{fname}:{name}"]))
            w.close()
