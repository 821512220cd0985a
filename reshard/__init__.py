"""reshard: move distributed-training checkpoints between parallel topologies exactly.

The centre is an affine IR (``reshard.ir``): a parameter's map says, for every rank, which
affine blocks of the full tensor F its shard holds. See docs/spec.md.
"""

from .errors import (
    CheckpointError,
    MapError,
    MapFormatError,
    NotAffineError,
    OutputError,
    PlanError,
    PlotUnavailable,
    ReplicaMismatchError,
    ReshardError,
    ShardError,
    TopologyError,
)
from .ir import (
    ParamMap,
    Piece,
    Shard,
    View,
    canonicalize,
    check,
    maps_from_document,
    maps_to_document,
    piece,
    uncovered,
)

__version__ = "0.1.0"

from . import layouts  # noqa: E402
from .convert import convert  # noqa: E402
from .derive import derive  # noqa: E402
from .execute import apply_model_plan, apply_plan  # noqa: E402
from .formats.output import verify  # noqa: E402
from .offline import reshard as reshard_checkpoint  # noqa: E402
from .plan import ModelPlan, PlanStats, Segment, TransferPlan, Unfilled  # noqa: E402
from .plan_format import model_plan_from_dict, model_plan_to_dict, plan_from_dict, plan_to_dict  # noqa: E402
from .planner import CostModel, DefaultCost, plan, plan_for_rank, plan_model  # noqa: E402
from .reports import ConvertReport, ReshardReport  # noqa: E402
from .reshard_dcp import reshard_dcp_files  # noqa: E402
from .retarget import TopologyPlan, plan_topology  # noqa: E402
from .topology import Topology  # noqa: E402

__all__ = [
    "CheckpointError",
    "ConvertReport",
    "CostModel",
    "DefaultCost",
    "ModelPlan",
    "PlanStats",
    "ReshardReport",
    "Segment",
    "Topology",
    "TopologyPlan",
    "TransferPlan",
    "Unfilled",
    "apply_model_plan",
    "apply_plan",
    "model_plan_from_dict",
    "model_plan_to_dict",
    "plan_from_dict",
    "plan_to_dict",
    "convert",
    "derive",
    "layouts",
    "plan",
    "plan_for_rank",
    "plan_model",
    "reshard_dcp_files",
    "plan_topology",
    "reshard_checkpoint",
    "verify",
    "MapError",
    "MapFormatError",
    "NotAffineError",
    "OutputError",
    "ParamMap",
    "PlanError",
    "PlotUnavailable",
    "TopologyError",
    "Piece",
    "ReplicaMismatchError",
    "ReshardError",
    "Shard",
    "ShardError",
    "View",
    "canonicalize",
    "check",
    "maps_from_document",
    "maps_to_document",
    "piece",
    "uncovered",
]
