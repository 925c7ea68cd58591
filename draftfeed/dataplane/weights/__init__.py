"""Weights streamed from a trainer's memory to the workers of a service (``publish_weights``; docs/versions.md): the
publisher's half (publisher.py), the worker's (worker.py) and the plan of pieces both compute (plan.py)."""
