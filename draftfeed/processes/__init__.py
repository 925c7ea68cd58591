"""Processes draftfeed starts of itself, for the launch commands, the demo and the bench alike: each dies with the
process that started it (children.py), says when it is ready in one line (ready.py), and is started and watched
through a handle (commands.py)."""
