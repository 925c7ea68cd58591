from sglang._fake import CaptureHiddenMode, ForwardBatch  # noqa: F401
