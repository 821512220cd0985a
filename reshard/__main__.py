"""``python -m reshard ...`` (and ``torchrun ... -m reshard ...``): the ``reshard`` command."""

from .cli import run

run()
