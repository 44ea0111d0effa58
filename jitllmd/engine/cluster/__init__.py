"""Other hosts: the torch.distributed link, a run of remote layers, the worker."""
