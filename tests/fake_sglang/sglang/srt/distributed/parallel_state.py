from sglang._fake import destroy_distributed_environment, destroy_model_parallel  # noqa: F401
