"""The old name of dataplane/nixl/transport.py, kept for launch/cli.py's ``unavailable`` until it imports the new one."""

from draftfeed.dataplane.nixl.transport import unavailable

__all__ = ["unavailable"]
