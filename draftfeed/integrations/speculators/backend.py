"""The ``draftfeed`` hidden-states backend of speculators' trainer (``--hidden-states-backend draftfeed
--draftfeed-url draftfeed://BROKER:PORT/SERVICE[?options]``), registered with hs_connectors' registry."""

from __future__ import annotations

import argparse
from typing import Any

from hs_connectors import HiddenStatesBackend

from draftfeed.integrations.speculators.samples import check_service
from draftfeed.integrations.speculators.schedule import Plan
from draftfeed.integrations.speculators.transfer import DraftfeedTransfer, Wanted

NAME = "draftfeed"
DEFAULT_REQUEST_TIMEOUT = 600.0  # a row of a large target on a busy service; speculators' own --request-timeout is for vLLM


class Refused(Exception):
    """What the backend cannot serve, said in one line (the command prints it without a traceback)."""


def verifier_config(args: argparse.Namespace) -> dict[str, int]:
    from speculators.models.utils import get_verifier_config

    config = get_verifier_config(args.verifier_name_or_path, trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    return {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}


def speculators_layer_ids(args: argparse.Namespace) -> list[int]:
    """speculators' ``--target-layer-ids`` as it resolves them (its default when unset); none for MTP, which reads
    L alone. L, a sample's last layer, is added by ``samples.service_layer_ids``."""
    if args.speculator_type == "mtp":
        return []
    from speculators.models.utils import resolve_target_layer_ids

    return list(resolve_target_layer_ids(args.target_layer_ids, args.verifier_name_or_path, bool(getattr(args, "trust_remote_code", False))))


def data_parallel() -> tuple[int, int]:
    from speculators.train.distributed import get_dp_rank, get_dp_size

    return get_dp_size(), get_dp_rank()


def register() -> None:
    """Register the backend (before speculators resolves its config: its flags are read then); twice is harmless."""
    if NAME in HiddenStatesBackend.registry:
        return
    HiddenStatesBackend.register(NAME)(DraftfeedBackend)


class DraftfeedBackend(HiddenStatesBackend):
    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--draftfeed-url",
            type=str,
            default=None,
            help="draftfeed://BROKER[:PORT]/SERVICE[?OPTION=VALUE&...]: the broker and the --task dflash service to take "
            "hidden states from, and the rank's settings (prefetch_depth, data_plane, keys, store, ...; docs/speculators.md)",
        )
        parser.add_argument(
            "--draftfeed-request-timeout",
            type=float,
            default=DEFAULT_REQUEST_TIMEOUT,
            help="the longest wait, in seconds, for one sample's hidden states from draftfeed",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing to launch: draftfeed's workers are started with `draftfeed launch worker --task dflash`."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> DraftfeedTransfer:
        from draftfeed import RemoteTargetError
        from draftfeed.integrations.url import DraftfeedUrl
        from draftfeed.producers.tasks.dflash import RemoteDFlashTarget

        if not args.draftfeed_url:
            raise Refused("--hidden-states-backend draftfeed needs --draftfeed-url draftfeed://BROKER:PORT/SERVICE")
        try:
            url = DraftfeedUrl.parse(args.draftfeed_url, timeout=args.draftfeed_request_timeout)
            verifier = verifier_config(args)
            ids = speculators_layer_ids(args)
            with RemoteDFlashTarget(url.broker, url.service, **url.target_arguments()) as target:
                layer_ids = check_service(ids, url.service, target.model_info(), verifier)
        except (ValueError, RemoteTargetError) as error:  # a bad URL or setting, no broker, other layers: said in one line
            raise Refused(str(error)) from None
        dp_size, dp_rank = data_parallel()
        plan = Plan(
            data_path=data_path,
            total_seq_len=args.total_seq_len,
            train_data_ratio=args.train_data_ratio,
            seed=args.seed,
            epochs=args.epochs,
            dp_size=dp_size,
            dp_rank=dp_rank,
        )
        wanted = Wanted(
            url=args.draftfeed_url, request_timeout=args.draftfeed_request_timeout, layer_ids=layer_ids, hidden_size=verifier["hidden_size"]
        )
        return DraftfeedTransfer(wanted, plan)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise ValueError("the draftfeed backend takes no vLLM producer: start draftfeed workers with `draftfeed launch worker --task dflash`")
