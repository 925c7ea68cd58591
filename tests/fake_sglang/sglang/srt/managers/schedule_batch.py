from sglang._fake import Req, ScheduleBatch  # noqa: F401
