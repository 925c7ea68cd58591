"""Adapters that let other training frameworks take their target's supervision from draftfeed.

Each adapter imports its framework only when it is used, so importing draftfeed (or this package) never
brings a framework in. ``draftfeed.integrations.nemo``: NeMo AutoModel's draft recipes (EAGLE-3, DFlash and its
variants, EAGLE-1/2, ViSpec, DSpark) with their code unchanged (docs/nemo.md).
"""
