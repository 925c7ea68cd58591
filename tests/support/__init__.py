"""Helpers shared by the tests, one module per job; the tests import them as ``from support.clock import Clock``.

pytest puts tests/ on sys.path (the rootdir conftest.py, in its default ``prepend`` import mode), so ``support``
is found beside ``conftest`` and ``reference``. A test module imports from here or from those, never from
another test module.

- ``clock``: a clock the test turns by hand, for code that takes a ``clock`` callable.
- ``images``: image-text batches laid out as the tiny Qwen2.5-VL's and Gemma 3's processors lay them out.
- ``messages``: broker messages built and read for ``BrokerState`` on its own (no sockets).
- ``metrics``: a Prometheus text page (``GET /metrics``) read into samples.
- ``nemo``: NeMo AutoModel from .nemo-packages on the path, or the test skipped.
- ``planes``: data planes end to end: a worker's pairs in status, a worker with a forced fault in its sends, batches
  checked against the in-process computation.
"""
