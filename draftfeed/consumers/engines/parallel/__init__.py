"""One target over several devices: the worker's process (the leader, rank 0) and the processes it starts and owns
(followers, one per further device), all running the same engine over one process group.

The broker, the ranks and the data planes see one worker: only the leader talks to them. The leader sends each
engine call (prepare, forward, a weight) to the followers first, then makes it itself; every process runs it, so
the engine's collectives line up, and the leader keeps the result (docs/engines.md, "Tensor parallel").
"""
