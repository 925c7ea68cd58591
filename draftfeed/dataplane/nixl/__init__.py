"""NIXL as both sides of a nixl pair share it: ``transport.py`` the agent, its one-sided writes and notifications;
``memory.py`` the regions it moves bytes between and the page-aligned host memory both sides register; ``layout.py``
where an answer's tensors lie in a slot and the notification that names a grant. The worker's side of the protocol is
consumers/nixl_plane.py (where an answer is written from: consumers/nixl_senders.py), the rank's
producers/nixl_receivers.py (its slots: producers/nixl_pool.py). Nothing here is imported until a nixl pair is used.
"""
