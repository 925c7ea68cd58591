"""NIXL as both sides of a nixl pair share it: ``transport.py`` the agent, its one-sided writes and notifications;
``memory.py`` the regions it moves bytes between and the page-aligned host memory both sides register; ``layout.py``
where an answer's tensors lie in a slot and the notification that names a grant. The worker's side of the protocol is
dataplane/nixl/worker.py (where an answer is written from: dataplane/nixl/worker_writes.py), the rank's
dataplane/nixl/rank.py (its slots: dataplane/nixl/rank_slots.py). Nothing here is imported until a nixl pair is used.
"""
