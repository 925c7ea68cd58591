"""speculators (the vLLM project's draft trainer) fed by draftfeed: the ``draftfeed`` hidden-states backend, its
command (``python -m draftfeed.integrations.speculators train ...``) and the conversions both it and
``draftfeed store export --format speculators`` use (docs/speculators.md). Nothing here imports speculators until it
is used."""
