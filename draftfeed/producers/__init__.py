"""The rank side (training ranks produce the batches, hence the design card's name): the remote targets a training
script uses, the connection to the broker and the receivers of supervision (docs/architecture.md)."""
