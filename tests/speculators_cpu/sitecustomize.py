"""For the speculators tests only (tests/test_speculators.py puts this folder on PYTHONPATH): speculators' trainer on
a CPU-only machine, with its metrics kept, while its command line stays the user's. Nothing here is about draftfeed.

In a process started with DRAFTFEED_TEST_SPECULATORS_CPU=1 (the trainer; its DataLoader workers inherit the
environment without the variables, which are taken out here), speculators 0.9.0's two CPU patches are applied
(draftfeed/bench/speculators_run.py says which), and with DRAFTFEED_TEST_SPECULATORS_METRICS=PATH each metrics record
is appended to PATH as one JSON line."""

import os

if os.environ.pop("DRAFTFEED_TEST_SPECULATORS_CPU", None) == "1":
    from draftfeed.bench.speculators_run import cpu_patches, record_metrics

    cpu_patches()
    metrics = os.environ.pop("DRAFTFEED_TEST_SPECULATORS_METRICS", None)
    if metrics:
        record_metrics(metrics)
