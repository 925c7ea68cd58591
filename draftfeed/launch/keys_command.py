"""``draftfeed keys generate``: CURVE key pairs for a secure deployment (docs/security.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftfeed.schemas.errors import UsageError


def run_keys(args: argparse.Namespace) -> int:
    from draftfeed.security.keys import generate, generate_pair

    out = Path(args.out)
    if args.name is None:
        if args.role is not None:
            raise UsageError("--role goes with --name")
        pairs = generate(out)
        print(f"wrote the broker, rank and worker key pairs to {out}:")
        print(f"  broker:   draftfeed launch broker --secure --keys {out}   ({out}/broker.key_secret stays on the broker host)")
        print(f"  workers:  draftfeed launch worker --secure --keys {out} ...   (needs worker.key_secret and broker.key)")
        print(f"  ranks:    RemoteEagle3Target(..., keys='{out}') or DRAFTFEED_KEYS={out}   (needs rank.key_secret and broker.key)")
        for name, pair in pairs.items():
            print(f"  {name} public key {pair.public.decode()}")
    else:
        allow_list = out / f"{args.role}s" if args.role else None
        pair = generate_pair(out, args.name, allow_list)
        where = f", and added its public key to {allow_list}" if allow_list else ""
        print(f"wrote {out}/{args.name}.key and {out}/{args.name}.key_secret{where}; public key {pair.public.decode()}")
    return 0
