"""The code of cupy_parallel, in layers that import one way (public names are in the shells).

Each layer imports only from the layers below it; ``pyproject.toml``'s import-linter contracts
hold this in the test suite (``tests/test_layers.py``), counting every import, those under
``TYPE_CHECKING`` and inside functions too, and forbid import cycles at any depth. Top to bottom:

- ``ddp`` (``DistributedDataParallel``: the tape's gradient-ready hooks driving the
  collectives).
- ``distributed`` (process groups, collectives, backends, stores, rendezvous, and ``spawn``'s
  thread ranks over ``thread_mpi``, an in-process MPI; its ``env`` module, below
  ``groups``/``mpi``/``rendezvous``, reads the launch environment; its ``comm_hooks``, DDP's
  communication hooks) and ``testing`` (hypothesis strategies).
- parallel: ``parallel`` (``replicate``, ``parallel_apply``, ``data_parallel``) over ``nested``
  (scatter/gather of pytrees) over ``moves`` (the recorded Scatter/Gather/Broadcast/ReduceAdd).
- autodiff: ``functional``/``gradcheck`` over ``tape``, ``ops`` and ``function``; the ops are
  ``reduction_ops`` over ``elementwise`` over ``shape_ops``; under them ``guard`` (the raw-NumPy
  guard: ops register their names with it) and ``fingerprints`` (``check_writes``), then
  ``recording`` (nodes, active tapes, the reverse loop) and ``compute`` (running on a device).
- ``comm`` (torch.cuda.comm) over ``comm_transfer`` (its staged broadcasts and flat reductions).
- ``arrays``: placement (``device_of``, ``empty``, ``to_device``) and the one raw move.
- ``simcuda`` (the simulated CUDA) and ``hostdispatch`` (NumPy's protocols for host arrays);
  then ``cuda`` (streams, pinned staging, copies, the one NCCL runtime), ``hostarray`` and
  ``memory`` (the host pool); then ``hosterrors``.
- ``devices``: the Device type, discovery, the one way to reach CuPy.
- ``arraytypes`` (typing only), ``dtypes``, ``enums``, ``exports``, ``tree`` (the one
  flattener), ``versions``;
- the bottom, importing nothing from the package: ``arguments`` (the one reader per kind of
  argument, and ``ArgumentError``, which ``enums`` raises).

Where a lower layer must call a higher one, the higher one registers itself at import (the
raw-NumPy guard with ``hostarray``; ``arrays`` installs the mover and NumPy dispatch of host
arrays), so that no import runs upward.
"""
