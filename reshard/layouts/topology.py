"""Global rank numbering of a pipeline x data x tensor parallel job (plus expert parallelism).

Rank order is DeepSpeed's ``PipeModelDataParallelTopology`` (``ProcessTopology`` with axes
``['pipe', 'data', 'model']``, row-major): the tensor-parallel index varies fastest, then the
data-parallel index, then the pipeline stage::

    rank = (stage * dp + dp_rank) * tp + tp_rank

Expert parallelism subdivides each data-parallel group the way DeepSpeed's
``groups._get_expert_parallel_ranks`` does by default (expert before data): the DP group is cut
into consecutive runs of ``ep`` members, each run an EP group; members at the same position of
every run form an expert-data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TopologyError


@dataclass(frozen=True, slots=True)
class Coord:
    pipe: int
    data: int
    model: int


@dataclass(frozen=True, slots=True)
class Topology:
    """``pp`` pipeline stages x ``dp`` data-parallel replicas x ``tp`` tensor-parallel ranks;
    ``ep`` (dividing ``dp``) is the expert-parallel size."""

    pp: int
    dp: int
    tp: int
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TopologyError(f"{name} must be a positive int, got {v!r}")
        if self.dp % self.ep:
            raise TopologyError(f"ep ({self.ep}) must divide dp ({self.dp})")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    # -- coordinates ---------------------------------------------------------------------------
    def rank(self, pipe: int = 0, data: int = 0, model: int = 0) -> int:
        for name, v, n in (("pipe", pipe, self.pp), ("data", data, self.dp), ("model", model, self.tp)):
            if not 0 <= v < n:
                raise TopologyError(f"{name} index {v} outside [0, {n})")
        return (pipe * self.dp + data) * self.tp + model

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside [0, {self.world_size})")
        rest, model = divmod(rank, self.tp)
        pipe, data = divmod(rest, self.dp)
        return Coord(pipe, data, model)

    def stage(self, rank: int) -> int:
        return self.coord(rank).pipe

    def dp_rank(self, rank: int) -> int:
        return self.coord(rank).data

    def tp_rank(self, rank: int) -> int:
        return self.coord(rank).model

    def ep_rank(self, rank: int) -> int:
        return self.coord(rank).data % self.ep

    # -- groups (ranks in increasing order, i.e. by their index within the group) --------------
    def tp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank(c.pipe, c.data, m) for m in range(self.tp))

    def dp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank(c.pipe, d, c.model) for d in range(self.dp))

    def pp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank(p, c.data, c.model) for p in range(self.pp))

    def ep_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        first = c.data - c.data % self.ep
        return tuple(self.rank(c.pipe, d, c.model) for d in range(first, first + self.ep))

    def expert_dp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank(c.pipe, d, c.model) for d in range(c.data % self.ep, self.dp, self.ep))

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        if not 0 <= stage < self.pp:
            raise TopologyError(f"stage {stage} outside [0, {self.pp})")
        n = self.dp * self.tp
        return tuple(range(stage * n, (stage + 1) * n))

    def _groups(self, of) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for r in range(self.world_size):
            g = of(r)
            if g[0] == r:
                out.append(g)
        return out

    def tp_groups(self) -> list[tuple[int, ...]]:
        return self._groups(self.tp_group)

    def dp_groups(self) -> list[tuple[int, ...]]:
        return self._groups(self.dp_group)

    def pp_groups(self) -> list[tuple[int, ...]]:
        return self._groups(self.pp_group)

    def ep_groups(self) -> list[tuple[int, ...]]:
        return self._groups(self.ep_group)

    def expert_dp_groups(self) -> list[tuple[int, ...]]:
        return self._groups(self.expert_dp_group)


__all__ = ["Coord", "Topology"]
