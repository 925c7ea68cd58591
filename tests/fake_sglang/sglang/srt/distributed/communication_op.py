from sglang._fake import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce  # noqa: F401
