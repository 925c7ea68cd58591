from sglang._fake import CacheInitParams  # noqa: F401
