"""A Hugging Face model folder that ``from_pretrained`` and ``AutoTokenizer.from_pretrained`` load as
they stand, written from any source (``--format hf``): the weights directly in ``OUT``
(``model.safetensors``, or shards with ``model.safetensors.index.json`` past ``max_file_bytes``, as
``save_pretrained`` names them), ``config.json`` and the tokenizer and generation files beside them.

* **Where the config comes from**: ``hf_config`` (a folder holding ``config.json``), else the
  folder the source sits in or beside (a Trainer ``checkpoint-N`` keeps them next to ``latest``),
  else the source's own metadata where it records the architecture (``reader.hf_config()``:
  Megatron's ``args``). Without one the export is refused: ``from_pretrained`` could not load it.
* **Dtype**: ``dtype``, else the config's (``dtype`` / ``torch_dtype``), cast from the most precise
  weights the source holds (fp32 masters where there are some); ``config.json`` then says the
  dtype the weights have. What the architecture computes in float32 whatever it loads in
  (transformers' ``_keep_in_fp32_modules_strict``: DeepseekV3's ``e_score_correction_bias``, as the
  release stores it) is not narrowed: float32 source values stay float32 (:func:`kept_fp32`).
* **Quantized sources** are written decoded (``formats/safetensors/quantized.py``): the config's
  ``quantization_config`` is dropped, so ``from_pretrained`` loads an ordinary model.
* **Tied embeddings** (``tie_word_embeddings``): written once, as ``save_pretrained`` does -- the
  input embedding kept, ``lm_head.weight`` left out -- on every route (a DCP source holds both).
* **Names** are HF's: a prefix every name shares (``module.`` of a DDP/DeepSpeed wrapper) is dropped.
  Where transformers can build the config's architecture (on the meta device), the names are
  checked against the model's keys before any output exists: a source lacking a weight the model
  has is refused (``from_pretrained`` would leave it at its initial value, silently), and a source
  tensor that is no key of the model is not written -- refused by the engine's accounting unless
  ``--drop`` names it (``from_pretrained`` would ignore it). Not checked for ``--quantize keep``,
  whose payload names are the quantized model's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ..contract import Buffer, Held, Reader, Writer
from ..hf_order import hf_model_keys
from ..safetensors.writer import KEEP, SafetensorsWriter

__all__ = ["HfWriter", "fp8_config", "kept_fp32", "metadata_folder"]

# what a model folder holds beside its weights, carried as they are (the config may be rewritten)
CARRIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
           "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}
TIED = ("lm_head.weight", "model.embed_tokens.weight")  # (alias save_pretrained drops, the weight kept)


def kept_fp32(config: dict[str, Any], dtype: torch.dtype | None) -> Callable[[str], bool]:
    """Whether the config's architecture keeps a tensor name in float32 when loaded in ``dtype``
    (transformers' ``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules`` for float16, matched
    as transformers does, by substring); never where transformers does not know the architecture.
    Asked only of float32 values a cast would narrow: the model class is imported then (~100 MiB of
    modules), not on every export."""
    mods: list[str] | None = None

    def kept(name: str) -> bool:
        nonlocal mods
        if mods is None:
            mods = _fp32_modules(config, dtype)
        return any(m in name for m in mods)
    return kept


def _fp32_modules(config: dict[str, Any], dtype: torch.dtype | None) -> list[str]:
    arch = (config.get("architectures") or [None])[0]
    try:
        import transformers

        cls = getattr(transformers, arch) if isinstance(arch, str) else None
    except (ImportError, AttributeError):
        return []
    mods = list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        mods += list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    return mods


def metadata_folder(reader: Reader, hf_config: str | Path | None) -> Path | None:
    """The folder holding the model's ``config.json``: the one given, else the first of the
    source's folders (or their parents) that has one."""
    if hf_config is not None:
        p = Path(hf_config)
        p = p.parent if p.is_file() else p
        if not (p / "config.json").is_file():
            raise ReshardError(f"{hf_config}: no config.json there (--hf-config takes the folder of a model's "
                               "config.json)")
        return p
    for src in reader.sources:
        for folder in (Path(src), Path(src).parent):
            if (folder / "config.json").is_file():
                return folder
    return None


class HfWriter(Writer):
    format = "hf"
    latest = None
    keeps_replicas = False
    tag = None  # the output folder itself is the model folder

    def __init__(self, reader: Reader, *, max_file_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
                 hf_config: str | Path | None = None, quantize: str | None = None,
                 block: tuple[int, int] | None = None) -> None:
        self.reader = reader
        self.folder = metadata_folder(reader, hf_config)
        self.config = self._config()
        # a source in DeepSpeed AutoEP's names is written in the config's model's (autoep.json)
        from ..deepspeed.autoep_hf import AutoEPHfView, autoep_hf_view

        view = autoep_hf_view(reader, self.config)
        self._view = view if isinstance(view, AutoEPHfView) else None
        self._aliases = view.aliases() if isinstance(view, AutoEPHfView) else {}
        self.reader = reader = view
        dtype = dtype or DTYPES.get(str(self.config.get("dtype") or self.config.get("torch_dtype")))
        names = list(reader.names)
        prefix = _shared_prefix(names)
        out = {n: n[len(prefix):] for n in names}
        self.tied = bool(self.config.get("tie_word_embeddings")) and TIED[0] in out.values() and \
            TIED[1] in out.values()
        # a tied lm_head.weight is written once, as the table it is tied to (from_pretrained ties them)
        self.alias = next((n for n, o in out.items() if o == TIED[0]), None) if self.tied else None
        if self.tied:
            out = {n: o for n, o in out.items() if o != TIED[0]}
        self.unkeyed: dict[str, str] = {}  # source name -> why the model has no place for it
        if quantize != KEEP:
            out = self._keyed(reader, out)
        self.inner = SafetensorsWriter(reader, max_file_bytes=max_file_bytes, dtype=dtype, names=out, index=False,
                                       quantize=quantize, block=block, config=self.config,
                                       fp32=kept_fp32(self.config, dtype) if dtype is not None else None)
        self.dtype = dtype or (self.inner.params[0][2] if self.inner.params else torch.float32)
        self.carried = [f for f in CARRIED if self.folder is not None and (self.folder / f).is_file() and
                        f != "config.json"]
        self.prefix = prefix

    def _keyed(self, reader: Reader, out: dict[str, str]) -> dict[str, str]:
        """``out`` without the names the config's model has no key for (recorded in
        ``unkeyed``); refused where the source lacks one of the model's weights (module doc)."""
        keys = hf_model_keys(self.config)
        if keys is None:  # an architecture transformers cannot build here: nothing to check against
            return out
        arch = (self.config.get("architectures") or [self.config.get("model_type")])[0]
        where = f"{self.folder / 'config.json'}" if self.folder is not None else "the source's recorded config"
        held = list(out.values()) + ([TIED[0]] if self.tied else [])
        missing = keys.missing(held)
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise CheckpointError(
                f"{reader.sources[-1]}: holds no {shown}: {len(missing)} of the {len(keys.keys)} weights of the "
                f"{arch} model {where} describes are not in the source (its names begin {list(out.values())[:2]}), "
                "and from_pretrained would leave them at their initial values. Export a source in that model's "
                "names, or pass --hf-config with the config of the model the source holds")
        for n, o in list(out.items()):
            if o in keys.unexpected([o]):
                self.unkeyed[n] = f"no key of the {arch} model {where} describes: from_pretrained would ignore it"
                del out[n]
        return out

    def unplaced(self, name: str) -> str | None:
        return self.unkeyed.get(name)

    def _config(self) -> dict[str, Any]:
        if self.folder is not None:
            try:
                return json.loads((self.folder / "config.json").read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ReshardError(f"{self.folder / 'config.json'}: unreadable ({e})") from None
        config = self.reader.hf_config()
        if not config:
            raise ReshardError(f"{self.reader.sources[-1]}: no config.json beside the checkpoint and the source "
                               "does not record its architecture; pass --hf-config DIR (a folder with the model's "
                               "config.json)")
        return config

    def buffers(self) -> list[Buffer]:
        return self.inner.buffers()

    def copied(self) -> list[str]:
        return self.inner.copied()

    def carries(self, held: Held) -> bool:
        """The tied ``lm_head.weight``, written as the table it is tied to; AutoEP's router alias,
        written as its router."""
        return (self.alias is not None and held.key == self.alias) or held.key in self._aliases

    def view(self, reader: Reader) -> Reader:
        """The source in the model's HF names where it is in DeepSpeed AutoEP's (``autoep_hf_view``),
        else itself."""
        return self._view if self._view is not None else reader

    def meta(self) -> dict[str, Any]:
        return {"target": "Hugging Face model folder"}

    def notes(self) -> list[str]:
        files = len(self.inner.fnames)
        where = f"from {self.folder}" if self.folder is not None else "built from the source's metadata"
        return ([self._view.how] if self._view is not None else []) + [f"HF export: {len(self.inner.specs)} tensors in {files} safetensors file(s), {NAMES.get(self.dtype, self.dtype)}"
                + (", tied lm_head.weight written once (as model.embed_tokens.weight)" if self.tied else "")
                + (f", names without the prefix {self.prefix!r}" if self.prefix else "")
                + f"; config.json {where}"
                + (f"; carried: {', '.join(self.carried)}" if self.carried else "")
                + ("; its quantization_config dropped (the weights are written unquantized)"
                   if "quantization_config" in self.config and not self.inner.encoded else "")
                + (f"; {self.inner.quantized_note()}" if self.inner.encoded else "")]

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        return self.inner.jobs(engine, staging) + self.metadata_jobs(staging)

    def metadata_jobs(self, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        """``config.json`` and the carried files (also beside the vLLM writer's weights)."""
        return [(1, partial(self._write_config, staging))] + [
            (1, partial(staging.copy, self.folder / f, f)) for f in self.carried]

    def _write_config(self, staging: Any) -> None:
        """``config.json``: as it is where it says the weights' dtype, else with that dtype."""
        config = dict(self.config)
        name = NAMES.get(self.dtype)
        # reshard writes weights, never a quantized payload: a quantization_config would make
        # from_pretrained read them as one
        quantized = config.pop("quantization_config", None) is not None
        if self.inner.encoded and self.inner.keep:  # the source's own, which its kept tensors are read back by
            config["quantization_config"] = self.inner.kept_config()
        elif self.inner.encoded:  # what transformers' quantized save_pretrained writes (FineGrainedFP8Config.to_dict())
            config["quantization_config"] = fp8_config(self.inner.block, self.inner.scale_fmt)
        if self.folder is not None and not quantized and not self.inner.encoded and \
                config.get("dtype", config.get("torch_dtype")) == name:
            staging.copy(self.folder / "config.json", "config.json")
            return
        for key in ("dtype", "torch_dtype"):
            if key in config or key == "dtype":
                config[key] = name
        with staging.open("config.json") as out:  # save_pretrained's layout of the file
            out.write((json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def fp8_config(block: tuple[int, int] | None, scale_fmt: str | None) -> dict[str, Any]:
    """``FineGrainedFP8Config(weight_block_size=block, scale_fmt=...).to_dict()``, without importing
    transformers: the config a quantized ``save_pretrained`` writes."""
    return {"activation_scheme": "dynamic", "dequantize": False, "expert_dtype": "fp8", "modules_to_convert": None,
            "modules_to_not_convert": None, "quant_method": "fp8",
            "scale_fmt": "ue8m0" if scale_fmt == "ue8m0" else "float", "weight_block_size": list(block or (128, 128))}


def _shared_prefix(names: list[str]) -> str:
    """``module.`` when every name starts with it (a wrapper's prefix), else nothing."""
    for prefix in ("module.",):
        if names and all(n.startswith(prefix) for n in names):
            return prefix
    return ""
