"""Running one method: the training process on every rank, its command line and network, injected faults."""
