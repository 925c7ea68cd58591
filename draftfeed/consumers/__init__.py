"""The worker side (workers consume the batches, hence the design card's name): the compute loop, its links to the
broker and the ranks, the engines that run the frozen target and the tasks that build supervision
(docs/architecture.md)."""
