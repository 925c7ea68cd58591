"""Adapters that let other training frameworks take their target's supervision from draftfeed.

Each adapter imports its framework only when it is used, so importing draftfeed (or this package) never
brings a framework in. ``draftfeed.integrations.nemo``: NeMo AutoModel's EAGLE-3 recipe (docs/nemo.md).
"""
