"""Every DeepSpeed job the end-to-end tests launch, and what each one loads.

A launch is what costs: ~10-20 s on 2 CPU cores (process start, importing torch / DeepSpeed /
transformers on every rank, the process group) before the first load, where a further load and its
two steps in the same job take ~2-6 s at 2 ranks. So the checkpoints that
``tests/jobs/test_e2e_resume.py`` and the e2e tests of ``tests/formats/deepspeed/test_zero12_reshard.py`` resume are loaded one
after another in as few jobs as possible -- one per world size (``launch.resume_many``,
``launch.resume_pipe_many``) -- and every input (reshard's conversion and reshardings, DeepSpeed's
``ds_to_universal`` outputs, the perturbed copy of the negative control) is made once per test
session. :class:`E2E` (the session fixture ``e2e`` of ``tests/conftest.py``)
runs a job the first time one of its reports is asked for::

    e2e.report("reshard", LLAMA, tp=2, dp=1)          # reshard.convert of LLAMA, load_universal
    e2e.report("ds_to_universal", LLAMA, tp=2, dp=1)  # DeepSpeed's ds_to_universal, load_universal
    e2e.report("resharded", "llama_zero1_dp2", tp=1, dp=4)  # reshard.jobs.convert.reshard there, native load
    e2e.report("resaved", ZERO3, tp=1, dp=3)  # DeepSpeed's own native save there, native load
    e2e.pipe_report("resharded", pp=2, dp=1)["losses"]

The same load serves both test files where they ask for the same thing (``ds_to_universal`` of
``llama_tp2_dp2`` at TP=2 x DP=1 and TP=1 x DP=2).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.e2e.launch import (
    LaunchError,
    model_spec_from_fixture,
    resume_load,
    resume_many,
    resume_pipe_many,
)
from tests.support.dsconv import FIXTURES, ds_to_universal

STEPS = 2
LLAMA = "llama_tp2_dp2"  # TP=2 x DP=2, ZeRO-1
PIPE = "pipe_pp2_dp2"  # PP=2 x DP=2, ZeRO-1

# tests/test_e2e_resume.py: reshard's and ds_to_universal's conversions of LLAMA, resumed with
# load_universal at each (tp, dp); the negative control at NEGATIVE_TOPOLOGY; DeepSpeed's native
# load of the source itself at its own topology.
UCP_TOPOLOGIES = [(2, 1), (1, 2)]
NEGATIVE_TOPOLOGY = (2, 1)
SOURCE_TOPOLOGY = (2, 2)
# Negative control: (param, state file, logical index, how to change it). Both elements sit in the
# second TP half of their parameter, so at TP=2 they live on TP rank 1.
EXP_AVG_PERTURB = ("model.layers.1.mlp.down_proj.weight", "exp_avg", (5, 60), "one float32 ulp up")
FP32_PERTURB = ("lm_head.weight", "fp32", (70, 3), "+1e-3")

# tests/formats/deepspeed/test_zero12_reshard.py: (source, tp, dp) resharded by reshard.jobs.convert.reshard and loaded natively, next to
# ds_to_universal of the source loaded with load_universal at the same topology; and the pipeline
# fixture resharded to (pp, dp), the same two ways.
RESHARD_TARGETS = [(LLAMA, 1, 2), (LLAMA, 2, 1), ("llama_zero1_dp2", 1, 4)]
# make test loads this one natively; the others are in the slow tier (make test-all): the 4-rank job, and
# TP2xDP2 -> TP1xDP2, whose file-for-file check against DeepSpeed's own files stays in make test
RESHARD_QUICK = RESHARD_TARGETS[1:2]
# tests/formats/deepspeed/test_zero3_reshard.py: the ZeRO-3 fixture resharded to DP=3 (padded partitions) and loaded
# natively, next to DeepSpeed's own native checkpoint at DP=3: the job loads ds_to_universal of the
# source with load_universal and saves it natively right away (:meth:`E2E.resaved`), then loads
# reshard's files and that save natively, in this order (one extra job, of 3 ranks).
ZERO3 = "llama_zero3_dp2"
ZERO3_TARGETS = [(ZERO3, 1, 3)]
# tests/formats/deepspeed/test_zero3_reshard.py, bf16 and across ZeRO stages: (source, tp, dp, target ZeRO stage), each resharded
# and loaded natively next to DeepSpeed's own native save there, made as for ZERO3_TARGETS; across stages
# ds_to_universal's output is first laid out for the target stage's loader (tests/e2e/restage.py), since
# DeepSpeed's universal route does not cross between ZeRO-3 and ZeRO-1/2 by itself.
ZERO3_BF16 = "llama_zero3_dp2_bf16"
ZERO3_STAGE_TARGETS = [(ZERO3_BF16, 1, 1, 3), (ZERO3_BF16, 1, 1, 2), ("llama_zero1_dp2_bf16", 1, 1, 3),
                       (ZERO3_BF16, 1, 3, 3), (ZERO3, 1, 3, 1), ("llama_zero2_dp2", 1, 3, 3)]
# make test runs the first of them (bf16, one rank); the others are in the slow tier (make test-all)
ZERO3_STAGE_QUICK = ZERO3_STAGE_TARGETS[:1]
PIPE_TARGETS = [(1, 2), (2, 1)]


class Load(NamedTuple):
    """One checkpoint resumed at one topology. ``kind``: ``reshard`` (reshard.convert of
    ``source``), ``ds_to_universal``, ``perturbed`` (the negative control's copy of ``reshard``),
    ``resharded`` (reshard.jobs.convert.reshard of ``source`` to this topology, DeepSpeed's native loader),
    ``resaved`` (DeepSpeed's native save of ``ds_to_universal`` loaded at this topology, native
    loader; made by that load earlier in the same job) or ``source`` (the fixture itself, native
    loader)."""

    kind: str
    source: str
    tp: int
    dp: int
    zero: int = 0  # the target ZeRO stage; 0: the source's

    def stage(self) -> int:
        """The ZeRO stage this load runs at."""
        if self.zero:
            return self.zero
        return int(json.loads((FIXTURES / self.source / "fixture.json").read_text())["topology"]["zero_stage"])

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.source}:tp{self.tp}dp{self.dp}" + (f":zero{self.zero}" if self.zero else "")

    @property
    def universal(self) -> bool:
        return self.kind in ("reshard", "ds_to_universal", "perturbed")


def llama_loads(slow: bool = True) -> list[Load]:
    """Every ``resume_train.py`` load the e2e tests check, each once; without ``slow``, not those
    of the tests marked slow (all but :data:`RESHARD_QUICK` and :data:`ZERO3_STAGE_QUICK`)."""
    loads = [Load(route, LLAMA, tp, dp) for tp, dp in UCP_TOPOLOGIES
             for route in ("reshard", "ds_to_universal")]
    loads += [Load("perturbed", LLAMA, *NEGATIVE_TOPOLOGY)] + [Load("source", LLAMA, *SOURCE_TOPOLOGY)] * slow
    for source, tp, dp in (RESHARD_TARGETS if slow else RESHARD_QUICK):
        loads += [Load("resharded", source, tp, dp), Load("ds_to_universal", source, tp, dp)]
    for source, tp, dp in ZERO3_TARGETS * slow:  # the save precedes the load of it
        loads += [Load(kind, source, tp, dp) for kind in ("ds_to_universal", "resharded", "resaved")]
    for source, tp, dp, zero in (ZERO3_STAGE_TARGETS if slow else ZERO3_STAGE_QUICK):
        loads += [Load(kind, source, tp, dp, zero_target(source, zero)) for kind in ("ds_to_universal", "resharded",
                                                                                    "resaved")]
    return list(dict.fromkeys(loads))


def zero_target(source: str, zero: int) -> int:
    """``Load.zero`` of a load at ZeRO stage ``zero``: 0 when that is ``source``'s own stage."""
    return 0 if Load("source", source, 1, 1).stage() == zero else zero


def group_into_jobs(loads: list[Load]) -> list[list[Load]]:
    """As few jobs as the loads allow: one per world size, TP=1 loads first (see
    ``launch.check_tp_order``); a second TP size above 1 at the same world size gets a job of its
    own. Within a job, loads keep their order."""
    jobs: list[list[Load]] = []
    for world in dict.fromkeys(ld.tp * ld.dp for ld in loads):
        same = [ld for ld in loads if ld.tp * ld.dp == world]
        above = list(dict.fromkeys(ld.tp for ld in same if ld.tp > 1))
        first = [ld for ld in same if ld.tp == 1] + [ld for ld in same if above and ld.tp == above[0]]
        jobs.append(first)
        jobs += [[ld for ld in same if ld.tp == t] for t in above[1:]]
    return jobs


def perturb(tag_dir: Path, spec: tuple) -> None:
    """Apply one negative-control change (:data:`EXP_AVG_PERTURB`, :data:`FP32_PERTURB`) to a
    universal checkpoint's ``zero/<param>/<state>.pt`` in place."""
    name, state, index, _how = spec
    path = tag_dir / "zero" / name / f"{state}.pt"
    obj = load(path, mmap=False)
    t = obj["param"].clone()
    old = t[index].clone()
    if state == "fp32":
        t[index] = old + 1e-3
    else:
        t[index] = torch.nextafter(old, torch.tensor(math.inf, dtype=t.dtype))
    assert t[index] != old
    obj["param"] = t
    save(obj, path)


class E2E:
    """The e2e inputs and job reports of one test session, under ``root``; everything is made or
    run on first use and kept. A job that failed raises its error again for every report of it."""

    def __init__(self, root: Path, slow: bool = True) -> None:
        self.root = Path(root)
        self._dirs: dict[tuple, Path] = {}
        self._reports: dict[str, dict] = {}
        self._failed: dict[str, LaunchError] = {}
        self._jobs = group_into_jobs(llama_loads(slow))

    def _once(self, key: tuple, make) -> Path:
        if key not in self._dirs:
            self._dirs[key] = make()
        return self._dirs[key]

    # -- inputs (each the folder holding latest / latest_universal, unless said otherwise) --------

    def reshard_ucp(self) -> Path:
        """``reshard.convert`` of :data:`LLAMA`."""
        return self._once(("reshard",),
                          lambda: convert(FIXTURES / LLAMA, self.root / "reshard").out_dir.parent)

    def ds_ucp(self, source: str) -> Path:
        """DeepSpeed's own ``ds_to_universal`` of fixture ``source``."""
        return self._once(("ds_to_universal", source),
                          lambda: ds_to_universal(source, self.root / f"ds_{source}").parent)

    def perturbed_ucp(self) -> Path:
        """A copy of :meth:`reshard_ucp` with :data:`EXP_AVG_PERTURB` and :data:`FP32_PERTURB` applied."""

        def make() -> Path:
            out = self.root / "perturbed"
            shutil.copytree(self.reshard_ucp(), out)
            tag_dir = out / (out / "latest_universal").read_text().strip()
            perturb(tag_dir, EXP_AVG_PERTURB)
            perturb(tag_dir, FP32_PERTURB)
            return out

        return self._once(("perturbed",), make)

    def resharded(self, source: str, tp: int, dp: int, zero: int = 0) -> Path:
        """``reshard.jobs.convert.reshard`` of fixture ``source`` to TP=``tp`` x DP=``dp`` (at ZeRO stage
        ``zero``, when not 0)."""
        sfx = f"_zero{zero}" if zero else ""
        return self._once(("resharded", source, tp, dp, zero), lambda: reshard(
            FIXTURES / source, self.root / f"resharded_{source}_tp{tp}dp{dp}{sfx}", tp=tp, dp=dp,
            zero_stage=zero or None).out_dir.parent)

    def resaved(self, source: str, tp: int, dp: int, zero: int = 0) -> Path:
        """Where the job saves what it loaded from ``ds_to_universal`` of ``source`` at TP=``tp``
        x DP=``dp`` (the folder holding ``latest``; written by the job, not here)."""
        return self.root / (f"resaved_{source}_tp{tp}dp{dp}" + (f"_zero{zero}" if zero else ""))

    def restaged_ucp(self, source: str, zero: int) -> Path:
        """:meth:`ds_ucp` of ``source`` laid out for a ZeRO-``zero`` engine's universal loader."""
        from tests.e2e.restage import restage

        return self._once(("restaged", source, zero),
                          lambda: restage(self.ds_ucp(source), self.root / f"ds_{source}_as_zero{zero}", zero))

    def pipe_resharded(self, pp: int, dp: int) -> Path:
        """``reshard.jobs.convert.reshard`` of :data:`PIPE` to PP=``pp`` x DP=``dp``: the *tag* folder."""
        return self._once(("pipe_resharded", pp, dp), lambda: reshard(
            FIXTURES / PIPE, self.root / f"resharded_{PIPE}_pp{pp}dp{dp}", tp=1, pp=pp, dp=dp).out_dir)

    def pipe_resaved(self, pp: int, dp: int) -> Path:
        """Where the PP=``pp`` x DP=``dp`` job saved what it loaded from :meth:`pipe_resharded`."""
        return self.root / f"resaved_{PIPE}_pp{pp}dp{dp}"

    def load_dir(self, ld: Load) -> Path:
        """The folder ``ld`` loads from (made now if need be)."""
        if ld.kind == "reshard":
            return self.reshard_ucp()
        if ld.kind == "ds_to_universal" and ld.zero:
            return self.restaged_ucp(ld.source, ld.zero)
        if ld.kind == "ds_to_universal":
            return self.ds_ucp(ld.source)
        if ld.kind == "perturbed":
            return self.perturbed_ucp()
        if ld.kind == "resharded":
            return self.resharded(ld.source, ld.tp, ld.dp, ld.zero)
        if ld.kind == "source":
            return FIXTURES / ld.source
        if ld.kind == "resaved":
            return self.resaved(ld.source, ld.tp, ld.dp, ld.zero)
        raise ValueError(ld.kind)

    # -- reports ---------------------------------------------------------------------------------

    def report(self, kind: str, source: str, tp: int, dp: int, zero: int = 0) -> dict:
        """``resume_train.py``'s report of :class:`Load` ``(kind, source, tp, dp)``: its job is
        run the first time."""
        want = Load(kind, source, tp, dp, zero)
        found = [i for i, job in enumerate(self._jobs) if want in job]
        if not found:
            raise KeyError(f"{want.name} is not among the loads of tests/e2e/plan.py (llama_loads)")
        (i,) = found
        return self._run(f"train{i}_world{tp * dp}", lambda job: self._resume(self._jobs[i], job))[want.name]

    def pipe_report(self, kind: str, pp: int, dp: int) -> dict:
        """``resume_pipe.py``'s report (``losses``, ``stages``, ``dp``) of :data:`PIPE` resharded
        to PP=``pp`` x DP=``dp`` and loaded natively (``kind="resharded"``, saved again right after
        the load into :meth:`pipe_resaved`) or its ``ds_to_universal`` loaded with
        ``load_universal`` at that topology."""
        if (pp, dp) not in PIPE_TARGETS or kind not in ("resharded", "ds_to_universal"):
            raise KeyError(f"{kind} at PP={pp} x DP={dp} is not a pipeline load of tests/e2e/plan.py")
        reports = self._run(f"pipe_world{pp * dp}", lambda job: self._resume_pipe(pp * dp, job))
        return reports[f"{kind}:pp{pp}dp{dp}"]

    def _run(self, job: str, run: Callable[[str], dict[str, dict]]) -> dict[str, dict]:
        """``run(job)``'s reports, run once; ``job`` names the job's work folder."""
        if job in self._failed:
            raise LaunchError(f"job {job} failed earlier in this session: {self._failed[job]}")
        if job not in self._reports:
            try:
                self._reports[job] = run(job)
            except LaunchError as e:
                self._failed[job] = e
                raise
        return self._reports[job]

    def _resume(self, job: list[Load], name: str) -> dict[str, dict]:
        """Make the inputs of ``job`` and run it (``resume_train.py``)."""
        specs = {src: model_spec_from_fixture(FIXTURES / src) for src in {ld.source for ld in job}}

        def save_dir(ld: Load) -> Path | None:  # the load that makes a later "resaved" load's input
            wanted = ld.kind == "ds_to_universal" and Load("resaved", ld.source, ld.tp, ld.dp, ld.zero) in job
            return self.resaved(ld.source, ld.tp, ld.dp, ld.zero) if wanted else None

        loads = [resume_load(ld.name, self.load_dir(ld), model_spec=specs[ld.source], tp=ld.tp, dp=ld.dp,
                             universal=ld.universal, steps=STEPS, save_dir=save_dir(ld),
                             zero_stage=ld.zero or int(specs[ld.source]["ds_config"]["zero_optimization"]["stage"]))
                 for ld in job]
        world = job[0].tp * job[0].dp
        return resume_many(loads, world_size=world, workdir=self.root / "jobs" / name)

    def _resume_pipe(self, world: int, name: str) -> dict[str, dict]:
        """Make the inputs of the pipeline loads of ``world`` ranks and run them (``resume_pipe.py``)."""
        fx = json.loads((FIXTURES / PIPE / "fixture.json").read_text())
        loads = []
        for pp, dp in PIPE_TARGETS:
            if pp * dp != world:
                continue
            base = {"model_config": dict(fx["model_config"], stages=pp), "seed": fx["seed"],
                    "seq_len": fx["data"]["seq_len"], "micro_batch": fx["data"]["micro_batch"],
                    "ds_config": fx["ds_config"], "steps": STEPS}
            loads += [dict(base, name=f"resharded:pp{pp}dp{dp}", universal=False,
                           load_dir=str(self.pipe_resharded(pp, dp).parent),
                           save_dir=str(self.pipe_resaved(pp, dp))),
                      dict(base, name=f"ds_to_universal:pp{pp}dp{dp}", load_dir=str(self.ds_ucp(PIPE)),
                           universal=True, save_dir=None)]
        return resume_pipe_many(loads, world_size=world, workdir=self.root / "jobs" / name)
