"""Fake sglang (see sglang/__init__.py)."""
