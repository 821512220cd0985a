"""End-to-end helpers: resume checkpoints in real DeepSpeed jobs (see launch.py)."""
