"""The public surface against the contract (../shared/API.md): names, signatures, examples."""

from __future__ import annotations

import ast
import importlib
import inspect
from datetime import timedelta
from typing import Any

import pytest

from cupy_parallel.distributed import ReduceOp

PUBLIC_MODULES = [
    "cupy_parallel",
    "cupy_parallel.comm",
    "cupy_parallel.functions",
    "cupy_parallel.ops",
    "cupy_parallel.testing",
    "cupy_parallel.distributed",
    "cupy_parallel.distributed.nn.functional",
    "cupy_parallel.distributed.algorithms.ddp_comm_hooks",
    "cupy_parallel.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "cupy_parallel.optim",
    "cupy_parallel.optim.lr_scheduler",
]

_ = inspect.Parameter.empty

# name -> [(parameter, default)], transcribed from API.md (``_`` marks "no default").
CONTRACT: dict[str, list[tuple[str, Any]]] = {
    "cupy_parallel.comm.broadcast": [("array", _), ("devices", None), ("out", None)],
    "cupy_parallel.comm.broadcast_coalesced": [
        ("arrays", _),
        ("devices", _),
        ("buffer_size", 10485760),
    ],
    "cupy_parallel.comm.reduce_add": [("inputs", _), ("destination", None)],
    "cupy_parallel.comm.reduce_add_coalesced": [
        ("inputs", _),
        ("destination", None),
        ("buffer_size", 10485760),
    ],
    "cupy_parallel.comm.scatter": [
        ("array", _),
        ("devices", None),
        ("chunk_sizes", None),
        ("dim", 0),
        ("streams", None),
        ("out", None),
    ],
    "cupy_parallel.comm.gather": [("arrays", _), ("dim", 0), ("destination", None), ("out", None)],
    "cupy_parallel.scatter": [("inputs", _), ("target_devices", _), ("dim", 0)],
    "cupy_parallel.scatter_kwargs": [
        ("inputs", _),
        ("kwargs", _),
        ("target_devices", _),
        ("dim", 0),
    ],
    "cupy_parallel.gather": [("outputs", _), ("target_device", _), ("dim", 0)],
    "cupy_parallel.Tape": [("persistent", False), ("check_writes", False)],
    "cupy_parallel.Tape.gradient": [
        ("self", _),
        ("target", _),
        ("sources", _),
        ("output_gradients", None),
        ("unconnected_gradients", "zero"),
    ],
    "cupy_parallel.grad": [("fn", _), ("argnums", 0), ("has_aux", False)],
    "cupy_parallel.value_and_grad": [("fn", _), ("argnums", 0), ("has_aux", False)],
    "cupy_parallel.stop_gradient": [("x", _)],
    "cupy_parallel.replicate": [("params", _), ("devices", _), ("detach", False)],
    "cupy_parallel.parallel_apply": [
        ("fns", _),
        ("inputs", _),
        ("kwargs_tup", None),
        ("devices", None),
    ],
    "cupy_parallel.data_parallel": [
        ("fn", _),
        ("params", _),
        ("inputs", _),
        ("device_ids", None),
        ("output_device", None),
        ("dim", 0),
        ("module_kwargs", None),
    ],
    "cupy_parallel.DataParallel": [
        ("fn", _),
        ("params", _),
        ("device_ids", None),
        ("output_device", None),
        ("dim", 0),
    ],
    "cupy_parallel.DistributedDataParallel": [
        ("fn", _),
        ("params", _),
        ("process_group", None),
        ("bucket_cap_mb", 25.0),
        ("broadcast_params", True),
    ],
    "cupy_parallel.DistributedDataParallel.no_sync": [("self", _)],
    "cupy_parallel.DistributedDataParallel.reduce_gradients": [("self", _), ("grads", _)],
    "cupy_parallel.DistributedDataParallel.register_comm_hook": [
        ("self", _),
        ("state", _),
        ("hook", _),
    ],
    # torch's hook signature: (process_group, bucket)
    "cupy_parallel.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook": [
        ("process_group", _),
        ("bucket", _),
    ],
    "cupy_parallel.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook": [
        ("process_group", _),
        ("bucket", _),
    ],
    "cupy_parallel.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook": [
        ("process_group", _),
        ("bucket", _),
    ],
    "cupy_parallel.to_device": [("array", _), ("device", _), ("stream", None)],
    "cupy_parallel.distributed.shard_indices": [
        ("n", _),
        ("rank", None),
        ("world_size", None),
        ("shuffle", True),
        ("seed", 0),
        ("epoch", 0),
        ("drop_last", False),
    ],
    # The differentiable collectives (section 5b): the data argument positional-only.
    "cupy_parallel.distributed.nn.functional.all_reduce": [
        ("x", _),
        ("op", ReduceOp.SUM),
        ("group", None),
    ],
    "cupy_parallel.distributed.nn.functional.broadcast": [("x", _), ("src", _), ("group", None)],
    "cupy_parallel.distributed.nn.functional.reduce": [
        ("x", _),
        ("dst", _),
        ("op", ReduceOp.SUM),
        ("group", None),
    ],
    "cupy_parallel.distributed.nn.functional.all_gather": [("x", _), ("group", None)],
    "cupy_parallel.distributed.nn.functional.reduce_scatter": [
        ("inputs", _),
        ("op", ReduceOp.SUM),
        ("group", None),
    ],
    "cupy_parallel.distributed.nn.functional.all_to_all": [("inputs", _), ("group", None)],
    "cupy_parallel.distributed.nn.functional.all_to_all_single": [
        ("x", _),
        ("output_split_sizes", None),
        ("input_split_sizes", None),
        ("group", None),
    ],
    "cupy_parallel.distributed.nn.functional.gather": [("x", _), ("dst", _), ("group", None)],
    "cupy_parallel.distributed.nn.functional.scatter": [("inputs", _), ("src", _), ("group", None)],
    # The contract's three, then torch's keyword-only use_local_synchronization (issue 23).
    "cupy_parallel.distributed.new_group": [
        ("ranks", None),
        ("timeout", None),
        ("backend", None),
        ("use_local_synchronization", False),
    ],
    # Issue 22: torch.multiprocessing.spawn's (fn, nprocs, args) with our keyword-only
    # backend and timeout (60 s: a stuck notebook cell should end).
    "cupy_parallel.distributed.spawn": [
        ("fn", _),
        ("nprocs", _),
        ("args", ()),
        ("backend", "threads"),
        ("timeout", timedelta(seconds=60)),
    ],
    # Issue 32 (API.md 5c): torch.optim's signatures; lr defaults to 1e-3 as in torch 2.x
    # (API.md writes SGD's lr without a default), Adam also takes torch's
    # decoupled_weight_decay.
    "cupy_parallel.optim.SGD": [
        ("params", _),
        ("lr", 1e-3),
        ("momentum", 0.0),
        ("dampening", 0.0),
        ("weight_decay", 0.0),
        ("nesterov", False),
        ("maximize", False),
    ],
    "cupy_parallel.optim.Adam": [
        ("params", _),
        ("lr", 1e-3),
        ("betas", (0.9, 0.999)),
        ("eps", 1e-8),
        ("weight_decay", 0.0),
        ("amsgrad", False),
        ("maximize", False),
        ("decoupled_weight_decay", False),
    ],
    "cupy_parallel.optim.AdamW": [
        ("params", _),
        ("lr", 1e-3),
        ("betas", (0.9, 0.999)),
        ("eps", 1e-8),
        ("weight_decay", 1e-2),
        ("amsgrad", False),
        ("maximize", False),
    ],
    "cupy_parallel.clip_grad_norm": [
        ("grads", _),
        ("max_norm", _),
        ("norm_type", 2.0),
        ("error_if_nonfinite", False),
        ("process_group", None),
    ],
}


def _resolve(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError:
        owner = _resolve(module_name)
        return getattr(owner, attr)


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_signature_matches_the_contract(name: str) -> None:
    signature = inspect.signature(_resolve(name))
    actual = [(p.name, p.default) for p in signature.parameters.values()]
    assert actual == CONTRACT[name]


def test_init_process_group_matches_torch() -> None:
    from datetime import timedelta

    from cupy_parallel import distributed

    parameters = inspect.signature(distributed.init_process_group).parameters
    assert [(p.name, p.default) for p in parameters.values()] == [
        ("backend", None),  # PyTorch 2: None picks the backend from environment and platform
        ("init_method", None),
        ("timeout", timedelta(minutes=30)),
        ("world_size", -1),
        ("rank", -1),
        ("store", None),
        ("group_name", ""),
    ]


def _public_objects() -> list[tuple[str, Any]]:
    found = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.ismodule(obj) and not name.startswith("__"):
                found.append((f"{module_name}.{name}", obj))
    return found


@pytest.mark.parametrize(
    ("name", "obj"), _public_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_public_name_has_a_runnable_example(name: str, obj: Any) -> None:
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"{name} has no >>> example in its docstring"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_modules_only_re_export(module_name: str) -> None:
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    defined = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.name != "__getattr__"  # lazy loading of optional parts
    ]
    assert defined == [], f"{module_name} defines {defined} instead of re-exporting them"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names_report_their_public_module(module_name: str) -> None:
    # repr(cupy_parallel.Tape) reads cupy_parallel.Tape, not the _src module (JAX's set_module)
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == module_name, f"{module_name}.{name}: {obj.__module__}"
    if module_name == "cupy_parallel":
        assert repr(module.Tape) == "<class 'cupy_parallel.Tape'>"


def test_api_md_names_exist() -> None:
    import cupy_parallel as cp
    from cupy_parallel import comm, distributed, functions, ops, testing
    from cupy_parallel.distributed.nn import functional

    for module, names in [
        (
            cp,
            (
                "Device HostArray as_device device_of to_device devices set_host_device_count "
                "scatter scatter_kwargs gather Tape Function gradcheck replicate parallel_apply "
                "data_parallel DataParallel DistributedDataParallel"
            ),
        ),
        (comm, "broadcast broadcast_coalesced reduce_add reduce_add_coalesced scatter gather"),
        (functions, "Scatter Gather Broadcast ReduceAddCoalesced"),
        (
            ops,
            (
                "add subtract multiply divide negative matmul sum mean square exp log tanh relu "
                "reshape transpose"
            ),
        ),
        (testing, "nested_structures arrays devices assert_tree_equal"),
        (
            distributed,
            (
                "Backend ReduceOp group GroupMember init_process_group new_group "
                "destroy_process_group is_initialized is_nccl_available is_mpi_available "
                "get_backend get_rank get_world_size broadcast all_reduce reduce all_gather "
                "gather scatter reduce_scatter all_to_all barrier send recv isend irecv "
                "all_reduce_coalesced all_gather_coalesced broadcast_multigpu "
                "all_reduce_multigpu reduce_multigpu all_gather_multigpu "
                "reduce_scatter_multigpu Work TCPStore FileStore PrefixStore spawn"
            ),
        ),
        (
            functional,
            (
                "all_reduce broadcast reduce all_gather reduce_scatter all_to_all "
                "all_to_all_single gather scatter"
            ),
        ),
    ]:
        missing = [n for n in names.split() if not hasattr(module, n)]
        assert missing == [], f"{module.__name__} lacks {missing}"
