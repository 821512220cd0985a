"""Readers and writers of checkpoint formats (DeepSpeed, universal, safetensors)."""
