"""Data planes: how supervision tensors travel from a worker to a rank besides ZeroMQ frames."""
