"""reshard: move distributed-training checkpoints between parallel topologies exactly.

The centre is an affine IR (``reshard.ir``): a parameter's map says, for every rank, which
affine blocks of the full tensor F its shard holds. See docs/spec.md.
"""

from .errors import (
    CheckpointError,
    MapError,
    MapFormatError,
    NotAffineError,
    PlanError,
    ReplicaMismatchError,
    ReshardError,
    ShardError,
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

__all__ = [
    "CheckpointError",
    "MapError",
    "MapFormatError",
    "NotAffineError",
    "ParamMap",
    "PlanError",
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
