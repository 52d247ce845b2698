"""Process groups, stores, rendezvous and the launcher behind :mod:`cupy_parallel.distributed`."""
