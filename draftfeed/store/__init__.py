"""The supervision store: batches of supervision on disk, recorded by a rank and replayed by any rank later.

``identity`` says what a store holds (the target, the vocab mapping, the forms) and names each batch by a key;
``index`` is the append-only list of finished shards that several ranks share; ``shards`` writes and reads the
safetensors files; ``writer`` is the background thread that records; ``store`` puts them together for a rank;
``inspect`` answers ``draftfeed store info`` and ``draftfeed store verify``. docs/store.md describes the layout.
"""
