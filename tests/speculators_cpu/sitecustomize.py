"""For the speculators tests only (tests/test_speculators.py puts this folder on PYTHONPATH): speculators' trainer on
a CPU-only machine, and its per-step metrics written where the test reads them. Nothing here is about draftfeed.

With DRAFTFEED_TEST_SPECULATORS_CPU=1, the trainer process (not its DataLoader workers: the variables are taken out
of the environment they inherit) gets speculators 0.9.0's two CPU patches: ``trainer.get_local_rank`` returns "cpu"
(it would put the model on cuda:0) and ``torch.accelerator.synchronize`` does nothing (its step timer calls it). With
DRAFTFEED_TEST_SPECULATORS_METRICS=PATH, each metrics record (the dicts speculators logs to "speculators.metrics") is
appended to PATH as one JSON line, floats written exactly (repr)."""

import json
import logging
import os

if os.environ.pop("DRAFTFEED_TEST_SPECULATORS_CPU", None) == "1":
    import speculators.train.trainer as _trainer
    import torch

    _trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None

_metrics = os.environ.pop("DRAFTFEED_TEST_SPECULATORS_METRICS", None)
if _metrics:

    class _Metrics(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "speculators.metrics" and isinstance(record.msg, dict):
                with open(_metrics, "a") as out:
                    out.write(json.dumps(record.msg, default=repr) + "\n")

    logging.getLogger().addHandler(_Metrics(level=logging.INFO))
