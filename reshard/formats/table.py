"""Every format reshard reads or writes, one row each (:data:`FORMATS`): its name and aliases, the
words messages call it by, how a path is recognised as one, its reader and writer, the options its
writer takes and one example command. Built from it: the command line's flags and help
(``reshard.cli``), :func:`reshard.formats.registry.open_reader`'s detection order and dispatch,
``make_writer`` and the options it admits, and the validation of ``convert(fmt=)`` and
``reshard(to=)``. A new format is one folder and one row.

Plain data, no torch: the command line builds its parser from this before torch loads. Readers,
writers and detectors are named ``"module:attribute"`` and imported on first use (``registry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ReshardError

if TYPE_CHECKING:  # the table loads before torch: the contract only for the type checker
    from .contract import Reader

__all__ = ["DEFAULT_TARGET", "DTYPES", "FORMATS", "OPTIONS", "Format", "Option", "convert_targets", "noun_of",
           "reshard_targets", "row", "sources", "target", "targets"]

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype: torch's names


@dataclass(frozen=True, slots=True)
class Option:
    """A writer option (a keyword of ``make_writer``, ``convert`` or ``reshard``) as the command
    line takes it: ``flag`` (``""``: set by the library only), its help and argparse's settings."""

    flag: str
    help: str
    argparse: dict[str, Any] = field(default_factory=dict)


OPTIONS: dict[str, Option] = {
    "early": Option("", "model-state files already being copied (reshard.jobs.early_copies)"),
    "max_file_bytes": Option("--max-file-gb", "file size limit in GiB (default 5)",
                             {"type": float, "default": 5.0, "metavar": "GB"}),
    "dtype": Option("--dtype", "the weights' dtype (default: hf the config's; safetensors the fp32 masters where "
                    "the source has them, else the stored one; DeepSpeed and Megatron the source's training dtype)",
                    {"choices": sorted(DTYPES)}),
    "with_optimizer": Option("--with-optimizer", "also write the Adam moments beside the weights, in the "
                             "universal layout (zero/<name>/)", {"action": "store_true"}),
    "hf_config": Option("--hf-config", "the folder of the model's config.json (and tokenizer files), where the "
                        "source has none beside it", {"metavar": "DIR"}),
    "megatron_args": Option("--megatron-args", "a Megatron checkpoint of the model (the one a DCP or universal "
                            "checkpoint in Megatron's names was written from): its args, optimizer groups, iteration "
                            "and learning-rate scheduler, for a Megatron target from such a source",
                            {"metavar": "CKPT"}),
    "rename": Option("--rename", "rename parameters by this regex substitution (repeatable, in order)",
                     {"action": "append", "default": [], "metavar": "FROM=TO"}),
    "files": Option("--files", "lay it out for N loading ranks (one file per rank of an N-way FSDP mesh)",
                    {"type": "positive", "metavar": "N"}),
    "tp": Option("--tp", "target TP degree (default: the source's; vllm: 1)", {"type": "positive"}),
    "dp": Option("--dp", "target DP degree (default: the source's)", {"type": "positive"}),
    "pp": Option("--pp", "target pipeline stages (DeepSpeed: the source's count, or 1 to merge them; Megatron: "
                 "default the source's)", {"type": "positive"}),
    "vpp": Option("--vpp", "target virtual pipeline stages (model chunks) per pipeline stage, Megatron's "
                  "--virtual-pipeline-model-parallel-size (Megatron; default: the source's where --pp keeps the "
                  "source's, else 1)", {"type": "positive"}),
    "zero_stage": Option("--zero-stage", "target ZeRO stage (default: the source's)",
                         {"type": int, "choices": (1, 2, 3)}),
    "ep": Option("--ep", "target expert-parallel degree (default: the source's)", {"type": "positive"}),
    "etp": Option("--etp", "target expert tensor-parallel degree (Megatron; default: --tp, or the source's where "
                  "it kept expert TP apart from TP)", {"type": "positive"}),
    "layout": Option("--layout", "target TP layout where TP changes to a degree the source does not record (a "
                     "DeepSpeed checkpoint at that degree, a map document, or 'geometry')",
                     {"metavar": "CKPT|MAPS.json|geometry"}),
    "quantize": Option("--quantize", "keep: every weight a quantized source stores quantized (FP8 of any block, "
                       "MXFP4) moved as stored, payload and scales byte for byte, never decoded (dcp: as entries of "
                       "their own, with the source's quantization_config). fp8, fp8-ue8m0 (not dcp): write 2-D linear "
                       "weights as FP8 E4M3 with a weight_scale_inv per block, as transformers' Fp8Quantize does "
                       "(fp8: float32 scales; fp8-ue8m0: power-of-two E8M0 scales; vllm: each rank's shard); "
                       "embeddings, norms and the output head stay as they are; an FP8 source in that encoding is "
                       "moved as stored", {"choices": ("fp8", "fp8-ue8m0", "keep")}),
    "block": Option("--block", "with --quantize: the scale block, rows x columns (default: an FP8 source's own, "
                    "else 128x128)", {"type": "block", "metavar": "RxC"}),
    "ckpt_format": Option("--ckpt-format", "Megatron's checkpoint format, as Megatron-LM's own flag names it: torch_dist, "
                          "or torch (legacy mp_rank_* files: weights, with plain Adam, the distributed optimizer's "
                          "distrib_optim.pt, or none) (default: a Megatron source's, else torch_dist)",
                          {"choices": ("torch_dist", "torch")}),
    "optimizer": Option("--optimizer", "its optimizer state's layout (default: the source's; from an HF "
                        "folder: none): none, adam (plain Adam), distributed (Megatron's --use-distributed-optimizer "
                        "in the format's own layout: dp_reshardable buckets in torch_dist, distrib_optim.pt in "
                        "torch), dp_reshardable (the same), fully_reshardable (torch_dist only)",
                        {"choices": ("none", "adam", "distributed", "dp_reshardable", "fully_reshardable")}),
}


@dataclass(frozen=True, slots=True)
class Format:
    """One format. ``convert`` / ``reshard``: the options it takes as a target of that command
    (``None``: not one; a ``reshard`` target is written at a topology, and ``needs`` names the
    option it cannot be written without). ``writes_from``: the source formats it can be written
    from (``None``: every one). ``names``: the parameter names a source that has a choice (a
    Megatron one) is read under for this target (``names_with``: under the second where the option
    the first names is given). ``probe``: detection order (lower first)."""

    name: str
    noun: str  # with its article, for messages: "a DeepSpeed checkpoint"
    reads: str = ""  # as a source, in words (help)
    writes: str = ""  # as a target, in words (help)
    aliases: tuple[str, ...] = ()
    probe: int = 0
    detect: str | None = None  # "module:function(path) -> bool"
    hint: str = ""  # the files detection looks for, for "not a checkpoint" messages
    reader: str | None = None  # "module:callable(path[, names=]) -> Reader"
    reader_names: bool = False  # its reader takes names= ("megatron" or "hf")
    writer: str | None = None  # "module:callable(reader, **options) -> Writer"
    convert: tuple[str, ...] | None = None
    reshard: tuple[str, ...] | None = None
    needs: str | None = None
    writes_from: tuple[str, ...] | None = None
    names: str | None = None
    names_with: tuple[str, str] | None = None  # (option, names): given that option, ``names`` is this
    source_example: str = ""
    target_example: str = ""

    @property
    def options(self) -> tuple[str, ...]:
        """Every option its writer takes."""
        return tuple(dict.fromkeys((*(self.convert or ()), *(self.reshard or ()))))

    @property
    def spelled(self) -> str:
        """Its name with its aliases: ``universal (or ucp)``."""
        return self.name + (f" (or {', '.join(self.aliases)})" if self.aliases else "")


# In the order help lists them. ``probe``: which detector runs first where two could match.
FORMATS: tuple[Format, ...] = (
    Format("deepspeed", "a DeepSpeed checkpoint", probe=5,
           reads="DeepSpeed 0.19.8 (ZeRO-1/2/3, AutoTP, pipe stages, AutoEP and classic MoE), or a Trainer "
           "checkpoint-N of one",
           writes="DeepSpeed at TP x DP x PP x EP x ZeRO stage, loadable by engine.load_checkpoint (a Trainer "
           "checkpoint-N stays one Trainer resumes)",
           detect="reshard.formats.registry:is_deepspeed", hint="'latest', *model_states.pt",  # before safetensors:
           reader="reshard.formats.deepspeed.reader:DeepSpeedReader.open",  # a Trainer ZeRO-2 folder holds both
           writer="reshard.formats.registry:deepspeed_writer",
           reshard=("tp", "dp", "pp", "zero_stage", "ep", "layout", "dtype"),
           names_with=("ep", "hf"),  # AutoEP wraps a transformers model: its experts in HF names
           source_example="reshard reshard CKPT OUT --tp 1 --dp 4",
           target_example="reshard reshard HF_FOLDER OUT --to deepspeed --dp 2 --zero-stage 3"),
    Format("universal", "a universal checkpoint", aliases=("ucp",), probe=4,
           reads="a universal checkpoint (ds_to_universal's or reshard's)",
           writes="DeepSpeed's universal checkpoint (from DeepSpeed: ds_to_universal's files, byte for byte)",
           detect="reshard.formats.registry:is_universal", hint="zero/, latest_universal",
           reader="reshard.formats.universal.reader:UniversalReader",
           writer="reshard.formats.universal.writer:UniversalWriter", convert=("early",),
           source_example="reshard reshard UCP OUT --tp 1 --dp 2",
           target_example="reshard convert CKPT OUT --format universal"),
    Format("dcp", "a PyTorch DCP checkpoint", probe=3,
           reads="PyTorch DCP (FSDP2, torchtitan, FSDP x TP)",
           writes="PyTorch DCP that dcp.load reads at any world size, or laid out for N loading ranks (--files N)",
           detect="reshard.formats.registry:is_dcp", hint=".metadata",
           reader="reshard.formats.dcp.reader:DcpReader.open",
           writer="reshard.formats.dcp.writer:DcpWriter", convert=("max_file_bytes", "rename", "quantize"),
           reshard=("files", "quantize"),
           needs="files", source_example="reshard reshard DCP OUT --files 8",
           target_example="reshard convert CKPT OUT --format dcp"),
    Format("accelerate", "an Accelerate FSDP checkpoint", probe=2,  # before dcp: its folders are DCP ones
           reads="a Trainer + Accelerate FSDP checkpoint-N (pytorch_model_fsdp_0/, optimizer_0/)",
           detect="reshard.formats.registry:is_accelerate", hint="pytorch_model_fsdp_0/",
           reader="reshard.formats.hf.accelerate:open_accelerate",
           source_example="reshard convert checkpoint-N OUT --format hf"),
    Format("safetensors", "a Hugging Face safetensors folder", probe=6,
           reads="a Hugging Face save_pretrained folder (model.safetensors, or shards with its index)",
           writes="HF-style safetensors weights (--with-optimizer: the Adam moments beside them)",
           detect="reshard.formats.safetensors.reader:is_safetensors",
           hint="model.safetensors, model.safetensors.index.json",
           reader="reshard.formats.safetensors.reader:SafetensorsReader",
           writer="reshard.formats.safetensors.writer:SafetensorsWriter",
           convert=("max_file_bytes", "dtype", "with_optimizer", "quantize", "block"), names="hf",
           source_example="reshard convert HF_FOLDER OUT --format dcp",
           target_example="reshard convert CKPT OUT --format safetensors"),
    Format("hf", "a Hugging Face model folder",
           writes="a folder from_pretrained loads as it stands (config.json and tokenizer carried)",
           writer="reshard.formats.hf.writer:HfWriter", convert=("max_file_bytes", "dtype", "hf_config", "quantize", "block"),
           names="hf",
           target_example="reshard convert CKPT OUT --format hf --dtype bf16"),
    Format("megatron", "a Megatron-Core checkpoint", probe=1,  # before dcp: a torch_dist iteration folder is one
           reads="Megatron-LM's save folder (torch_dist or legacy torch, TP x PP x DP x EP)",
           writes="Megatron-Core torch_dist at TP x PP x DP (x EP), from a Megatron source, an HF folder, or a DCP / "
           "universal / DeepSpeed checkpoint in HF names (DeepSpeed AutoEP's read back in them; with --hf-config) or in "
           "Megatron's names (with --megatron-args); or legacy torch files, plain Adam, the distributed "
           "optimizer (distrib_optim.pt) or weights only (--ckpt-format torch)",
           detect="reshard.formats.megatron.files:is_megatron", hint="latest_checkpointed_iteration.txt, iter_*",
           reader="reshard.formats.megatron.reader:MegatronReader.open", reader_names=True,
           writer="reshard.formats.megatron.legacy_writer:megatron_writer",
           reshard=("tp", "pp", "vpp", "dp", "ep", "etp", "optimizer", "dtype", "hf_config", "megatron_args",
                    "ckpt_format"),
           writes_from=("megatron", "safetensors", "dcp", "universal", "deepspeed"),
           source_example="reshard reshard MEGATRON OUT --tp 1 --pp 2",
           target_example="reshard reshard HF_FOLDER OUT --to megatron --tp 2 --pp 2"),
    Format("vllm", "a vLLM sharded state",
           writes="vLLM's load_format='sharded_state' files at TP T (Llama, Qwen2), with config.json and the "
           "tokenizer carried",
           writer="reshard.formats.vllm.writer:VllmWriter",
           convert=("tp", "max_file_bytes", "dtype", "hf_config", "quantize", "block"),
           reshard=("tp", "dtype"), names="hf",
           target_example="reshard convert CKPT OUT --format vllm --tp 2 --dtype bf16"),
)
DEFAULT_TARGET = "deepspeed"  # of `reshard`, for a source whose own format holds no topology

_BY_NAME = {n: f for f in FORMATS for n in (f.name, *f.aliases)}


def row(name: str) -> Format:
    """The row of format ``name`` or one of its aliases."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ReshardError(f"unknown format {name!r}; reshard knows {', '.join(f.spelled for f in FORMATS)}") from None


def sources() -> list[Format]:
    return [f for f in FORMATS if f.reader is not None]


def targets() -> list[Format]:
    return [f for f in FORMATS if f.writer is not None]


def convert_targets() -> list[Format]:
    return [f for f in FORMATS if f.convert is not None]


def reshard_targets() -> list[Format]:
    return [f for f in FORMATS if f.reshard is not None]


def _choices(rows: list[Format]) -> str:
    return ", ".join(f.spelled for f in rows)


def target(name: str, command: str) -> Format:
    """The target format ``name`` of ``command`` (``"convert"``: ``--format``; ``"reshard"``:
    ``--to``), refused naming that command's choices."""
    flag, rows = ("format (--format)", convert_targets()) if command == "convert" else ("--to", reshard_targets())
    f = _BY_NAME.get(name) if isinstance(name, str) else None
    if f is None or f not in rows:
        hint = ""
        if f is not None and command == "reshard" and f.convert is not None:
            hint = f"; {f.name} has no topology: reshard convert --format {f.name}"
        elif f is not None and command == "convert" and f.reshard is not None:
            hint = f"; {f.name} is written at a topology: reshard reshard --to {f.name}"
        raise ReshardError(f"{flag} must be one of {_choices(rows)}, got {name!r}{hint}")
    return f


def noun_of(reader: Reader) -> str:
    """A source in words, with its article, for messages: ``a Hugging Face safetensors folder``."""
    f = _BY_NAME.get(reader.format)
    return f.noun if f is not None else f"a {reader.format} source"
