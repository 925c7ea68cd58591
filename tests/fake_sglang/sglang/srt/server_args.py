from sglang._fake import ServerArgs  # noqa: F401
