"""Where the repository and its committed fixtures are, for every test module wherever it sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
DEEPSPEED = FIXTURES / "deepspeed"
DCP = FIXTURES / "dcp"
HF = FIXTURES / "hf"
MEGATRON = FIXTURES / "megatron"
