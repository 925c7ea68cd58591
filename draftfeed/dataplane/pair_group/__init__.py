"""A torch.distributed group of one worker and one rank (gloo, NCCL): the transport both sides share, the worker's half (worker.py), the rank's (rank.py)."""
