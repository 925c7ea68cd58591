"""Supervision as ZeroMQ frames: the codec both sides use, the worker's links to ranks (worker.py), the rank's receive tuning (rank.py)."""
