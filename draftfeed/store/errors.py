"""The store's errors; each message names the store's path and what to change."""

from draftfeed.schemas.errors import DraftfeedError


class StoreError(DraftfeedError, RuntimeError):
    """The store cannot be used as asked: another target's store, a corrupt shard, a mode that needs what is absent."""


class StoreWriteError(StoreError):
    """Writing into the store failed (a full disk, a read-only folder, a disk that does not keep up)."""


class BatchNotInStore(StoreError, LookupError):
    """A replayed batch the store does not hold."""
