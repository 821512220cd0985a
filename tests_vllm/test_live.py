"""vLLM's weight-transfer API with reshard's backend "reshard", live (``live_run.py``): 2 FSDP2
trainer ranks (gloo, CPU) train the tiny Qwen2 and push into an ``LLM`` at TP 2 after each of 3
optimizer steps.

* After every step the engine generates exactly what a fresh vLLM load of the trainer's weights
  (saved float32, cast to bfloat16 by vLLM) generates: greedy tokens and top-20 logprobs, and
  every tensor it keeps as loaded equal byte for byte (``engine_run.py``, one engine per step).
* Each worker received exactly the bytes of the elements vLLM's loaders place on it (its engine
  tensors less padding, counted by the markers at init), about 1/TP of the common path's
  (every whole tensor to every worker); no trainer rank gathered a tensor (``full_tensor`` raises
  inside ``send_weights``) or sent more than its local shards.
* Over a server's HTTP routes (``vllm serve``, vLLM's ``HTTPVLLMWeightSyncClient``): the same
  greedy tokens as a fresh load after a step.
* Fed by a checkpoint folder's reader instead of a trainer (``reader_run.py``: the Megatron
  fixture's 2 TP ranks, each offering its own files' fragments): one update makes an engine that
  started on random weights generate and keep exactly what vLLM's own load of the checkpoint
  (exported to HF) does.
* Fed by a live Megatron-Core trainer (``megatron_run.py``: a GPTModel at TP 2 on 2 gloo ranks,
  ``ShardSource.megatron``, each rank's views of its own module parameters): after 2 optimizer
  steps and a send after each, the engine generates and keeps exactly what a fresh vLLM load of
  the trainer's weights does.
* A parameter the engine's model lacks: every trainer rank raises ``MapError`` naming it at init.
* The learned maps are cached: a second engine on the same model and TP reads them from disk at
  init and gets the same maps.
* A vLLM worker killed during an update: both trainer ranks raise ``TransferError`` within the
  group's timeout; nothing hangs. A trainer rank killed before it sends: the other raises
  ``TransferError``, and the engine still serves the previous update's weights (the same tokens,
  logprobs and kept tensors as after it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from .conftest import HERE, run

STEPS = 3
BENCH = 2  # updates by each path before training starts (live_run.bench)
RUN_S = 600  # one engine start, 2 trainer ranks, 3 steps (about 1.5 minutes here)
ENGINE_S = 600
TIMEOUT_S = 30  # live_run.TIMEOUT_S: the transfer group's


@pytest.fixture(scope="module")
def live(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("live")
    run([HERE / "live_run.py", qwen2, out, "--steps", STEPS, "--bench", BENCH], RUN_S, out / "live.log",
        env={"RESHARD_CACHE_DIR": str(out / "cache")})  # empty: the backend learns the maps, then keeps them
    return {"out": out, "live": json.loads((out / "live.json").read_text()),
            "trainers": [json.loads((out / f"trainer{r}.json").read_text()) for r in range(2)]}


@pytest.fixture(scope="module")
def fresh(live: dict) -> list:
    """A fresh vLLM load of the trainer's weights after each step (one engine each)."""
    out, result = live["out"], []
    for step in range(1, STEPS + 1):
        run([HERE / "engine_run.py", out / f"step{step}", out / f"fresh{step}.json"], ENGINE_S,
            out / f"fresh{step}.log")
        result.append(json.loads((out / f"fresh{step}.json").read_text()))
    return result


def test_engine_generates_what_a_fresh_load_generates(live, fresh):
    steps = live["live"]["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    before = live["live"]["before"]
    for s, load in zip(steps, fresh):
        assert [o["tokens"] for o in s["outputs"]] == [o["tokens"] for o in load["outputs"]], s["step"]
        assert all(len(t) >= 20 for o in load["outputs"] for t in o["logprobs"])
        assert [o["logprobs"] for o in s["outputs"]] == [o["logprobs"] for o in load["outputs"]], s["step"]
        assert s["kept"] == load["kept"], s["step"]
        assert len(s["kept"]) == 2 and "model.layers.1.self_attn.qkv_proj.bias" in s["kept"][1]
        assert s["outputs"] != before  # the update changed what the engine computes
        before = s["outputs"]


def test_learned_targets_of_the_running_engine(live):
    """``learned_targets(llm, shapes)`` (for WeightSync) equals the backend's own targets and
    reshard's vLLM layouts for this model."""
    learned = live["live"]["learned"]
    assert learned == {"params": 27, "differ_from_backend": [], "differ_from_cached": [], "differ_from_arch": []}


def test_each_worker_received_exactly_its_bytes(live):
    trainers = live["trainers"]
    common = trainers[0]["common_bytes_per_worker"]
    for s in live["live"]["steps"]:
        workers = s["workers"]
        assert [w["rank"] for w in workers] == [2, 3]
        for w in workers:
            assert w["updates"] == s["step"] + 2 * BENCH
            assert w["received_bytes"] == 2 * w["marked_elements"]  # bf16: each placed element once
            sent = sum(t["steps"][s["step"] - 1]["sent_bytes"].get(str(w["rank"]), 0) for t in trainers)
            assert sent == w["received_bytes"]
            assert w["received_bytes"] < 0.55 * common  # ~1/TP of whole tensors to every worker
        assert sum(w["received_bytes"] for w in workers) < 1.05 * common


def test_no_trainer_rank_gathers(live):
    for t in live["trainers"]:
        for s in t["steps"]:
            assert s["raised"] is None, s["raised"]  # full_tensor() raises inside send_weights
            # to each worker at most its local shards, as bf16 (replicated engine tensors, the norms, go to both)
            assert all(b <= t["local_numel"] * 2 for b in s["sent_bytes"].values())


def test_killed_worker_makes_trainers_raise(qwen2: Path, tmp_path: Path):
    out = tmp_path / "kill"
    run([HERE / "live_run.py", qwen2, out, "--steps", 2, "--kill-worker-at", 2], RUN_S, tmp_path / "kill.log")
    for r in range(2):
        steps = json.loads((out / f"trainer{r}.json").read_text())["steps"]
        assert steps[0]["raised"] is None
        assert steps[1]["raised"].startswith("TransferError: ") and "update 2 failed" in steps[1]["raised"], steps[1]
        assert steps[1]["send_s"] < TIMEOUT_S + 30, steps[1]


@pytest.fixture(scope="module")
def killed_trainer(qwen2: Path, live: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second engine, on the cache folder ``live`` left (its maps on disk), whose trainer rank 1
    dies before update 2."""
    out = tmp_path_factory.mktemp("killed-trainer") / "kill"
    run([HERE / "live_run.py", qwen2, out, "--steps", 2, "--kill-trainer-at", 2], RUN_S, out.parent / "kill.log",
        env={"RESHARD_CACHE_DIR": str(live["out"] / "cache")})
    return out


def test_a_second_engine_reads_the_cached_maps(live, killed_trainer: Path):
    """The learned maps are cached per (model class, config, TP, ...): the first engine's workers
    learned them and wrote one entry each; a second engine (new processes, the same model and TP)
    read them from disk at init, built no marker model, and got the same maps (with which its
    update 1 changed what the engine generates: ``test_killed_trainer_leaves_the_last_good_weights``)."""
    first = live["live"]["init_workers"]
    second = json.loads((killed_trainer / "live.json").read_text())["init_workers"]
    assert [w["maps_from"] for w in first] == ["learned", "learned"]
    assert [w["maps_from"] for w in second] == ["disk", "disk"]
    assert [w["maps_key"] for w in second] == [w["maps_key"] for w in first]
    assert [w["maps_digest"] for w in second] == [w["maps_digest"] for w in first]
    assert [w["marked_elements"] for w in second] == [w["marked_elements"] for w in first]
    files = sorted(p.name for p in (live["out"] / "cache" / "vllm-maps").iterdir())
    assert files == [f"{first[0]['maps_key']}.w0.json", f"{first[0]['maps_key']}.w1.json"]


def test_killed_trainer_leaves_the_last_good_weights(killed_trainer: Path):
    out = killed_trainer
    steps = json.loads((out / "trainer0.json").read_text())["steps"]
    assert steps[0]["raised"] is None
    assert steps[1]["raised"].startswith("TransferError: ") and "update 2 failed" in steps[1]["raised"], steps[1]
    assert steps[1]["send_s"] < TIMEOUT_S + 30, steps[1]
    live = json.loads((out / "live.json").read_text())
    assert live["after_failure"] == live["steps"][0]["outputs"] != live["before"]
    assert live["kept_after_failure"] == live["steps"][0]["kept"]


def test_common_path_sends_whole_tensors_and_loads_the_same(live):
    """The common path (whole tensors to every worker, vLLM's ``load_weights``) on the same weights:
    the engine generates the same as after the backend's update; each worker received every
    parameter's bytes, which is what the backend's byte counts are compared with above."""
    bench = live["trainers"][0]["bench"]
    assert bench["outputs"]["common"] == bench["outputs"]["reshard"]
    common = live["trainers"][0]["common_bytes_per_worker"]
    assert [w["received_bytes"] for w in bench["common_workers"]] == [common, common]
    assert bench["common_sent_bytes"] == 2 * common
    assert len(bench["reshard_ms"]) == len(bench["common_ms"]) == BENCH


def test_over_a_servers_http_routes(qwen2: Path, tmp_path: Path):
    """The same backend behind ``vllm serve`` (its RL routes), driven by vLLM's own
    ``HTTPVLLMWeightSyncClient``: after one step the server generates the greedy tokens a fresh
    load of the trainer's weights generates."""
    out = tmp_path / "http"
    run([HERE / "live_run.py", qwen2, out, "--steps", 1, "--http"], RUN_S, tmp_path / "http.log")
    live = json.loads((out / "live.json").read_text())
    run([HERE / "engine_run.py", out / "step1", tmp_path / "fresh.json"], ENGINE_S, tmp_path / "fresh.log")
    fresh = json.loads((tmp_path / "fresh.json").read_text())
    tokens = [o["tokens"] for o in live["steps"][0]["outputs"]]
    assert tokens == [o["tokens"] for o in fresh["outputs"]]
    assert tokens != [o["tokens"] for o in live["before"]]


def test_a_parameter_the_engine_lacks_is_refused_at_init(qwen2: Path, tmp_path: Path):
    """Bad input: the trainers offer a parameter vLLM's model class does not have. vLLM's loader
    refuses it on the workers, and every trainer rank raises ``MapError`` naming it at
    ``trainer_init``, at once (no wait for the group's timeout)."""
    out = tmp_path / "extra"
    run([HERE / "live_run.py", qwen2, out, "--extra-param"], RUN_S, tmp_path / "extra.log")
    for r in range(2):
        rec = json.loads((out / f"trainer{r}.json").read_text())
        assert rec["raised"].startswith("MapError: ") and "layers.0.mlp.extra_proj" in rec["raised"], rec
        assert rec["init_s"] < TIMEOUT_S, rec


def test_a_checkpoint_folders_reader_feeds_the_backend(megatron_hf: dict, tmp_path: Path):
    """``ShardSource.checkpoint(reshard.open(MEGATRON, names="hf"), rank)`` on 2 trainer ranks (each
    the fragments of its own TP rank's files, memory-mapped: Megatron's fused and interleaved q/k/v
    and gate/up cut into HF tensors, then into vLLM's fused per-rank tensors) into an engine started
    with random weights (``load_format="dummy"``): after one ``send_weights`` it generates (greedy
    tokens, top-20 logprobs) and keeps (byte for byte) exactly what vLLM's load of the checkpoint
    exported to HF does; each worker received each of its elements once, and each trainer rank sent
    only what its own files hold."""
    from .conftest import MEGATRON

    out = tmp_path / "reader"
    run([HERE / "reader_run.py", MEGATRON, megatron_hf["work"] / "hf-bf16", out], RUN_S, tmp_path / "reader.log")
    got = json.loads((out / "reader.json").read_text())
    hf = megatron_hf["hf"]
    assert [o["tokens"] for o in got["before"]] != [o["tokens"] for o in hf["outputs"]]  # random weights first
    assert [o["tokens"] for o in got["after"]] == [o["tokens"] for o in hf["outputs"]]
    assert all(len(t) >= 20 for o in hf["outputs"] for t in o["logprobs"])
    assert [o["logprobs"] for o in got["after"]] == [o["logprobs"] for o in hf["outputs"]]
    assert got["kept"] == hf["kept"]
    trainers = [json.loads((out / f"trainer{r}.json").read_text()) for r in range(2)]
    for w in got["workers"]:
        assert w["updates"] == 1 and w["received_bytes"] == 2 * w["marked_elements"]
        assert sum(t["sent_bytes"].get(str(w["rank"]), 0) for t in trainers) == w["received_bytes"]
    # 15 HF tensors; TP rank 1's files hold a part of each but the norms (Megatron keeps replicated
    # tensors' replica 0): no rank holds or sends a whole tensor but those three norms, on rank 0
    assert [(t["params"], t["held"]) for t in trainers] == [(15, 15), (15, 12)]
    assert trainers[0]["whole"] == ["model.layers.0.input_layernorm.weight",
                                    "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
    assert trainers[1]["whole"] == []
    for t in trainers:
        assert all(b <= 2 * t["local_numel"] for b in t["sent_bytes"].values())  # bf16: its own elements at most


MEGATRON_STEPS = 2


@pytest.fixture(scope="module")
def megatron_live(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``megatron_run.py``: a live Megatron-Core GPTModel at TP 2 (2 gloo trainer ranks) pushing into
    an engine started on random weights after each of 2 optimizer steps; then a fresh vLLM load of
    the trainer's weights after the last step (one engine)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed in this venv (make test-vllm installs it)")
    out = tmp_path_factory.mktemp("megatron-live") / "run"
    run([HERE / "megatron_run.py", out, "--steps", MEGATRON_STEPS], RUN_S, out.parent / "megatron.log")
    last = out / f"step{MEGATRON_STEPS}"
    run([HERE / "engine_run.py", last, out / "fresh.json"], ENGINE_S, out.parent / "fresh.log")
    return {"run": json.loads((out / "megatron.json").read_text()), "fresh": json.loads((out / "fresh.json").read_text()),
            "trainers": [json.loads((out / f"trainer{r}.json").read_text()) for r in range(2)]}


def test_a_live_megatron_trainer_feeds_the_backend(megatron_live: dict):
    """``ShardSource.megatron(model)``: after 2 optimizer steps of a Megatron-Core GPTModel (TP 2:
    q/k/v interleaved per query group, fc1 ``[gate_t; up_t]``, a padded vocabulary) and a
    ``send_weights()`` after each, the engine (started on random weights) generates -- greedy tokens,
    top-20 logprobs -- and keeps, byte for byte, exactly what a fresh vLLM load of the trainer's
    weights (gathered and converted to HF by hand, after the sends) does. That conversion is
    Megatron's own model: transformers' Qwen2 on it gives Megatron's forward (float32 logits)."""
    got, fresh = megatron_live["run"], megatron_live["fresh"]
    forward = got["forward"]
    assert forward["argmax_equal"] and forward["max_abs_diff"] < 1e-4 * max(1.0, forward["scale"]), forward
    steps = got["steps"]
    assert [s["step"] for s in steps] == list(range(1, MEGATRON_STEPS + 1))
    last = steps[-1]
    assert [o["tokens"] for o in last["outputs"]] == [o["tokens"] for o in fresh["outputs"]]
    assert all(len(t) >= 20 for o in fresh["outputs"] for t in o["logprobs"])
    assert [o["logprobs"] for o in last["outputs"]] == [o["logprobs"] for o in fresh["outputs"]]
    assert last["kept"] == fresh["kept"]
    assert "model.layers.1.self_attn.qkv_proj.bias" in last["kept"][1]
    before = got["before"]
    for s in steps:  # each update changed what the engine computes
        assert s["outputs"] != before, s["step"]
        before = s["outputs"]
    for t in megatron_live["trainers"]:
        assert all(s["replicas_differ"] == [] for s in t["steps"])  # the norms' TP copies stayed equal


def test_a_live_megatron_trainer_sends_its_own_parameters_once(megatron_live: dict):
    """Each worker received each element it holds once (bf16), all of it from the trainer ranks'
    views of their own module parameters: no rank holds a whole tensor but the replicated norms,
    or sends more than its parameters (and every gather of ``torch.distributed`` raises during
    ``send_weights``: ``megatron_run.no_gathers``)."""
    trainers = megatron_live["trainers"]
    for t in trainers:
        assert t["hf_params"] == 27 and t["held"] == 27 and t["views"]
        assert t["local_numel"] == sum(math.prod(s) for s in t["params"].values())
        assert all(n.endswith("norm.weight") for n in t["whole"]) and len(t["whole"]) == 5
        for s in t["steps"]:
            assert all(b <= 2 * t["local_numel"] for b in s["sent_bytes"].values())
    for k, s in enumerate(megatron_live["run"]["steps"]):
        for w in s["workers"]:
            assert w["updates"] == k + 1 and w["received_bytes"] == 2 * w["marked_elements"]
            sent = sum(t["steps"][k]["sent_bytes"].get(str(w["rank"]), 0) for t in trainers)
            assert sent == w["received_bytes"]
