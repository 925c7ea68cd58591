"""NeMo AutoModel's own model code over 2 processes, sharded as NeMo's frontier DSpark recipes shard a target (FSDP over the
ranks, experts over them with ``ep``), with NeMo's own target wrappers around it: the reference a worker of
``--engine automodel --tensor-parallel 2`` is compared with (tests/test_automodel_engine.py).

Run as ``python automodel_reference.py RANK PORT OUT EP NAME=TARGET [NAME=TARGET ...]`` in two processes (gloo over a
store rank 0 hosts on 127.0.0.1:PORT; ``EP`` 1 for experts over both ranks, 0 for FSDP alone). Rank 0 writes OUT
(safetensors, keys ``NAME/BATCH/dspark/FIELD``, and ``NAME/one/eagle3/FIELD`` for the first batch). Written from NeMo's and torch's documented APIs:
NeMo's mesh, ``init_empty_weights`` and parallelizer build the model; the checkpoint is mapped whole by the model's
adapter and spread over the shards by torch's ``set_model_state_dict``, not by the worker's loading.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
from reference import make_batch

sys.path.append(str(Path(__file__).resolve().parents[1] / ".nemo-packages"))

DSPARK_IDS, AUX_IDS = [1, 3, 5], [1, 2, 3]
VOCAB = 256


def batches() -> dict[str, dict[str, torch.Tensor]]:
    """The batches, by name: ``one`` for both tasks, the ``run-`` ones for a run through workers (DSpark)."""
    return {"one": make_batch(2, 24, VOCAB, seed=13)} | {f"run-{i}": make_batch(2, 16, VOCAB, seed=40 + i) for i in range(RUN_BATCHES)}


RUN_BATCHES = 6


def sharded_nemo_model(target: str, expert_parallel: bool) -> torch.nn.Module:
    from nemo_automodel.components.checkpoint.checkpointing import to_empty_parameters_only
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from nemo_automodel.components.utils.model_utils import init_empty_weights
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from draftfeed.consumers.engines.automodel import CPU_BACKEND, backend_config, nemo_config, nemo_model_class, read_weights

    setup = create_distributed_setup_from_config(
        strategy="fsdp2",
        world_size=2,
        ep_size=2 if expert_parallel else 1,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
    )
    config = nemo_config(target)
    with init_empty_weights():
        model = nemo_model_class(config)(config, backend=backend_config(CPU_BACKEND))
    model = parallelize_model(model, setup.mesh_context) or model
    to_empty_parameters_only(model, device=torch.device("cpu"))
    whole = model.state_dict_adapter.from_hf(read_weights(target))
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, strict=True))
    return model.eval().requires_grad_(False)


def main(rank: int, port: int, out: str, expert_parallel: bool, served: list[str]) -> None:
    import torch.distributed as dist
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    results: dict[str, torch.Tensor] = {}
    for name, target in (item.split("=", 1) for item in served):
        model = sharded_nemo_model(target, expert_parallel)
        for batch_name, batch in batches().items():
            ids, mask, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
            dspark = HFDSparkTargetModel(model, DSPARK_IDS).generate_batch(ids, mask, loss)
            results[f"{name}/{batch_name}/dspark/target_hidden_states"] = dspark.target_hidden_states.contiguous()
            results[f"{name}/{batch_name}/dspark/target_last_hidden_states"] = dspark.target_last_hidden_states.contiguous()
            if batch_name == "one":
                eagle3 = HFEagle3TargetModel(model, AUX_IDS).generate_batch(ids, mask, loss)
                results[f"{name}/one/eagle3/aux_hidden_states"] = eagle3.aux_hidden_states.contiguous()
    if rank == 0:
        save_file(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[5:])
