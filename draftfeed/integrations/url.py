"""draftfeed:// URLs: the broker, the service and the rank's settings a trainer names its draftfeed target by (NeMo's recipes, speculators' --draftfeed-url)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import parse_qsl, unquote, urlsplit

import torch
from pydantic import BaseModel, ConfigDict

from draftfeed.producers.settings import RankSettings
from draftfeed.producers.tasks.eagle3 import RemoteEagle3Target
from draftfeed.schemas.messages import Name
from draftfeed.schemas.protocol import DEFAULT_FRONTEND

SCHEME = "draftfeed"
DEFAULT_PORT = int(DEFAULT_FRONTEND.rsplit(":", 1)[1])  # the broker's default frontend port
# Not options of the URL: the trainer gives them (a NeMo recipe to from_urls; speculators through its own flags).
FROM_THE_RECIPE = {
    "request_timeout": "it is the recipe's recipe_args.remote_timeout (from_urls' timeout=), or speculators' --draftfeed-request-timeout",
    "device": "it is the trainer's device (a recipe's training device, from_urls' device=)",
}
# The options a URL may give: RemoteEagle3Target's settings that the recipe does not pass, and its own two below.
PATH_OPTIONS = ("keys", "data_endpoint")  # taken as written, never read as numbers
_ACCEPTED = inspect.signature(RemoteEagle3Target.__init__).parameters
SETTING_OPTIONS = tuple(name for name in RankSettings.model_fields if name in _ACCEPTED and name not in FROM_THE_RECIPE)
OPTIONS = (*SETTING_OPTIONS, *(name for name in PATH_OPTIONS if name in _ACCEPTED))


class DraftfeedUrl(BaseModel):
    """One ``draftfeed://HOST[:PORT]/SERVICE[?OPTION=VALUE&...]`` URL, checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str  # as given
    host: Name
    port: int
    service: Name
    settings: RankSettings  # the URL's options, RankSettings' defaults for the rest (request_timeout and device: the recipe's)
    given: tuple[str, ...]  # the settings the URL (or the recipe) gives; RemoteEagle3Target's defaults stand for the others
    keys: str | None = None
    data_endpoint: str | None = None

    @property
    def broker(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str, *, timeout: float | None = None, device: torch.device | str | None = None) -> DraftfeedUrl:
        """The URL's parts, or one ValueError saying what is wrong with it and what to write instead."""
        if not isinstance(url, str):
            raise ValueError(f"a draftfeed URL must be a string, got {type(url).__name__}: {url!r}")
        form = f"{SCHEME}://HOST:PORT/SERVICE?OPTION=VALUE&..."

        def wrong(what: str) -> ValueError:
            return ValueError(f"draftfeed URL {url!r}: {what}")

        parts = urlsplit(url)
        if parts.scheme != SCHEME:
            raise wrong(f"the scheme must be {SCHEME}://, as in {form}")
        try:
            port = parts.port if parts.port is not None else DEFAULT_PORT
        except ValueError:
            raise wrong(f"the port must be a number in 1..65535, as in {form}") from None
        if not parts.hostname:
            raise wrong(f"no broker host: write {form}")
        if parts.username is not None or parts.password is not None or parts.fragment:
            raise wrong(f"a draftfeed URL takes no user, password or #fragment: write {form} (keys= for a --secure broker)")
        service = unquote(parts.path[1:]) if parts.path.startswith("/") else ""
        if not service or "/" in service:
            raise wrong(f"the path must be the service name, one segment (the workers' --service), as in {form}")
        try:
            pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        except ValueError:
            raise wrong(f"the options must be OPTION=VALUE pairs joined by &, as in {form}") from None
        options: dict[str, str] = {}
        for name, value in pairs:
            if name in FROM_THE_RECIPE:
                raise wrong(f"{name!r} is not an option of the URL: {FROM_THE_RECIPE[name]}")
            if name not in OPTIONS:
                raise wrong(f"unknown option {name!r}; the options are {', '.join(OPTIONS)}")
            if name in options:
                raise wrong(f"option {name!r} is given twice")
            if value == "":
                raise wrong(f"option {name!r} has no value: write {name}=VALUE")
            options[name] = value
        given: dict[str, Any] = {name: _read(name, value) for name, value in options.items() if name in SETTING_OPTIONS}
        if timeout is not None:
            given["request_timeout"] = timeout
        if device is not None:
            given["device"] = device
        settings = RankSettings.checked(f"draftfeed URL {url!r}", **given)
        paths = {name: options.get(name) for name in PATH_OPTIONS}
        return cls(text=url, host=parts.hostname, port=port, service=service, settings=settings, given=tuple(given), **paths)

    def target_arguments(self) -> dict[str, Any]:
        """RemoteEagle3Target's keyword arguments for this URL (the broker and service besides)."""
        arguments: dict[str, Any] = {name: getattr(self.settings, name) for name in self.given}
        if self.keys is not None:
            arguments["keys"] = Path(self.keys)
        if self.data_endpoint is not None:
            arguments["data_endpoint"] = self.data_endpoint
        return arguments


def _read(name: str, value: str) -> int | float | str:
    """A query value as its setting takes it: text where the setting takes text, else the number it spells (or the
    text, which RankSettings then refuses naming the setting and what it takes)."""
    if _takes_text(RankSettings.model_fields[name].annotation):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _takes_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(choice, str) for choice in get_args(annotation))
    return any(_takes_text(arg) for arg in get_args(annotation))


def is_draftfeed_url(url: object) -> bool:
    return isinstance(url, str) and url.startswith(f"{SCHEME}://")


def listed_urls(urls: Sequence[Any] | str | None) -> list[Any]:
    """A trainer's URLs as a list: one URL given alone, a list of them, or none."""
    return [urls] if isinstance(urls, str) else list(urls or [])


def one_url(urls: Sequence[str] | str, **checks: Any) -> DraftfeedUrl:
    """The one draftfeed URL ``urls`` names (the same URL listed more than once counts once)."""
    listed = listed_urls(urls)
    if not listed:
        raise ValueError(f"no URL given: pass one {SCHEME}://HOST:PORT/SERVICE URL")
    parsed = [DraftfeedUrl.parse(url, **checks) for url in listed]
    if any(other != parsed[0] for other in parsed[1:]):
        raise ValueError(
            f"{len(set(listed))} different draftfeed URLs given ({', '.join(dict.fromkeys(listed))}): give one. A broker queues a "
            "service's batches for all its workers, so more workers add capacity behind the same URL"
        )
    return parsed[0]
