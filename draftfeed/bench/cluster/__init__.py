"""Simulated ranks and workers speaking the real protocol to a real broker, for ``draftfeed bench --scenario cluster``
and the cluster tests: raw pyzmq, each message built and parsed with ``draftfeed.schemas``, one DEALER per peer.

A simulated worker registers, takes dispatches, "computes" each for ``compute_ms`` (one at a time, its queue FIFO,
as a worker does), answers ``done`` (naming the ticket it computes next) and heartbeats once per interval as
draftfeed's worker does (its pairs as changes: each rank's pair once, then a few in turn). A simulated rank says
hello, keeps ``prefetch`` requests in flight, and heartbeats once per interval; the answer to its request is
in-process (the worker marks it done), so only the broker's work is measured. No torch: the request's tensors are
three small int64 frames, as a batch's token tensors are.

The simulator is one thread that must outrun the broker: it waits on its sockets' file descriptors with epoll
(O(sockets ready), where a zmq poll over a thousand sockets is O(all of them) each turn), and on the hot path it
writes ``submit`` and ``done`` headers from templates the schemas made and reads a dispatch's rank, ticket and
request id with ``json.loads``; everything else is built and parsed with ``draftfeed.schemas``.

What is measured (``ClusterRun``): requests completed per second against the ideal (workers / compute time),
how long a request waits at the broker before a credit frees (queueing, which Little's law fixes) and how long the
broker takes to hand it out once it can (from the later of its submit and the ``done`` that freed the credit, to the
dispatch at the worker: the broker's own latency), every request dispatched once and each rank's in order, and
every error or ``forgotten`` a peer heard.
"""

from __future__ import annotations

from draftfeed.bench.cluster.load import ClusterRun, Load, merge
from draftfeed.bench.cluster.simulator import SimulatedCluster

__all__ = ["ClusterRun", "Load", "SimulatedCluster", "merge"]
