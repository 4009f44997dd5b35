"""The model built on the meta device, and each rank's shards initialised as the unsharded CPU build would be.

Under ``train.strategy: fsdp`` no rank may hold the whole model: a 7B-parameter model in fp32 is 28 GB, times the
ranks of a node. ``build`` runs the task's ``build_model`` under ``torch.device("meta")`` (shapes, no storage)
and records, with a dispatch mode, every operation that creates or writes a tensor: factories, the in-place
initialisers (``normal_``, ``uniform_``, ``fill_``, a view's ``zero_`` for an embedding's padding row), any
operation that computes one tensor from others, and ``torch.tensor(data)`` constants (made on the CPU, then
copied to meta: ``_Constants``). ``Replay`` then recomputes ONE tensor at a time on the CPU from
that record: the random draws replay with the CPU generator state each would have found in a CPU build seeded
with ``run.seed`` (found in a first pass over the draws alone, one tensor's worth of scratch memory at a time).
So FSDP starts from exactly the parameters DDP does, and a rank's peak is its shards plus a few of the largest
tensor (measured in tests/test_parallel.py).

Why not a model's own ``init_weights``/``reset_parameters`` after ``to_empty`` (torchtitan's way): the task
contract promises that the model ``build_model`` returns is the model trained, whatever its initialisation code;
replaying it keeps that promise without asking tasks for a second initialiser.

What cannot be replayed falls back to the CPU build (with a warning naming the reason, ``Replay.unreplayable``):
a build that fails on meta (an op reading values: ``.item()``, data-dependent shapes), a build that draws from
or seeds the CPU generator itself, a draw with its own ``generator=``, a tensor made on another device, a tensor
never written after ``torch.empty`` (an initialiser that skips meta tensors), a module's tensor kept as a plain
attribute (not a parameter or buffer: never materialised). The initialisers of
``torch.nn.init`` that return early on meta tensors (``trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_``)
are recorded as calls and replayed as such.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger("job")

PATCHED_INITS = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")
"""torch.nn.init functions that return early on a meta tensor: recorded as calls, replayed on the CPU."""
FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)
"""Factories from Python data: on meta they keep no value and dispatch no operation (``_Constants``)."""


@dataclass(frozen=True)
class Ref:
    """A meta tensor argument: a view (size, stride, offset, dtype) of a recorded storage."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class Op:
    """One recorded operation; meta tensors in ``args``/``kwargs`` are ``Ref``s, everything else a constant."""

    index: int
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    random: bool
    writes: Ref | None = None
    """The argument it writes in place (an initialiser's tensor), None for an operation that creates."""


@dataclass
class Storage:
    """A meta storage: the operation (and output) that created it, then the operations that wrote into it."""

    created_by: Op | None
    output: int
    writes: list[Op] = field(default_factory=list)


def _ref(t: torch.Tensor) -> Ref:
    return Ref(t.untyped_storage()._cdata, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()), t.dtype)


class _Recorder(TorchDispatchMode):
    """Records every operation touching a meta tensor (runs it too, on meta: shapes only)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.storages: dict[int, Storage] = {}
        self.alive: list[torch.Tensor] = []
        """Every meta tensor seen: a storage's key (its address) must not be reused while recording."""
        self.problems: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        metas = [t for t in flat_in + flat_out if isinstance(t, torch.Tensor) and t.is_meta]
        if not metas:
            return out
        self.alive.extend(metas)
        self.record(func, args, kwargs, flat_out)
        return out

    def record(self, func: Any, args: Any, kwargs: Any, flat_out: list[Any]) -> None:
        schema = func._schema
        random = torch.Tag.nondeterministic_seeded in func.tags
        if random and kwargs.get("generator") is not None:
            self.problems.append(f"{func} draws from its own generator")
        writes = [
            args[i]
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write and i < len(args)
        ]
        op = Op(len(self.ops), func, _refs(args), _refs(kwargs), random)
        if writes:
            op.writes = _ref(writes[0])
            if len(writes) > 1 or op.writes.key not in self.storages:
                self.problems.append(f"{func} writes a tensor the record does not know")
                return
            self.ops.append(op)
            self.storages[op.writes.key].writes.append(op)
            return
        created = False
        for i, t in enumerate(flat_out):
            if isinstance(t, torch.Tensor) and t.is_meta and t.untyped_storage()._cdata not in self.storages:
                self.storages[t.untyped_storage()._cdata] = Storage(op, i)
                created = True
        if created or random:
            self.ops.append(op)

    def record_call(self, fn: Callable[..., Any], tensor: torch.Tensor, args: Any, kwargs: Any) -> None:
        """An nn.init function that skips meta tensors, recorded as a write of ``tensor``."""
        key = tensor.untyped_storage()._cdata
        if key not in self.storages:
            self.problems.append(f"{fn.__name__} on a tensor the record does not know")
            return
        op = Op(len(self.ops), fn, _refs((tensor, *args)), _refs(kwargs), True, _ref(tensor))
        self.ops.append(op)
        self.storages[key].writes.append(op)


def _refs(tree: Any) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:
            return _ref(x)
        if isinstance(x, torch.Tensor):
            return x.detach().clone()  # a CPU constant (torch.tensor(...) data): kept as it was then
        return x

    return tree_map(one, tree)


class _Constants(TorchFunctionMode):
    """``torch.tensor(data)`` (BatchNorm's ``num_batches_tracked``) made on the CPU, then copied to meta: the
    copy is an operation the record keeps, with the CPU value as its constant argument."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in FROM_DATA and kwargs.get("device") is None:
            return func(*args, **{**kwargs, "device": "cpu"}).to("meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _recording_calls(
    record: Callable[[Callable[..., Any], torch.Tensor, Any, Any], None],
    applies: Callable[[torch.Tensor], bool] = lambda t: t.is_meta,
) -> Iterator[None]:
    """Patch the nn.init functions that return early on meta so that a call on a tensor it ``applies`` to is
    ``record``ed (a meta tensor: ``_Recorder.record_call``) instead of run."""
    originals = {name: getattr(nn.init, name) for name in PATCHED_INITS}

    def patched(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and applies(tensor):
                record(fn, tensor, args, kwargs)
                return tensor
            return fn(tensor, *args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(nn.init, name, patched(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


class Replay:
    """The values a CPU build seeded with ``seed`` gives each tensor of the meta model, one tensor at a time."""

    def __init__(self, model: nn.Module, recorder: _Recorder, seed: int) -> None:
        self.ops, self.storages, self.seed = recorder.ops, recorder.storages, seed
        self.tensors = {name: _ref(t) for name, t in _named_tensors(model)}
        self.problems = list(recorder.problems) + self._check(model)
        self.rng: dict[int, torch.Tensor] = {}
        """The CPU generator's state before each random op (``draws``)."""
        self.rng_after = torch.random.get_rng_state()
        """The CPU generator's state after the CPU build (``draws``): where ``build`` leaves it."""

    def unreplayable(self) -> list[str]:
        """Why the record cannot reproduce the CPU build (empty: it can)."""
        return self.problems

    def _check(self, model: nn.Module) -> list[str]:
        problems = _plain_tensors(model)
        for name, t in _named_tensors(model):
            if not t.is_meta:
                problems.append(f"{name} is made on {t.device}, not on the meta device")
                continue
            node = self.storages.get(t.untyped_storage()._cdata)
            if node is None or node.created_by is None:
                problems.append(f"{name} was made outside the record")
            elif node.created_by.func is torch.ops.aten.empty.memory_format and not node.writes:
                problems.append(f"{name} is never written after torch.empty (an initialiser that skips meta?)")
        return problems

    def draws(self) -> None:
        """Pass one: every random op in order from ``manual_seed(seed)``, on scratch tensors of its shape (the
        number of draws depends on the shape, not the values), keeping the generator state before each."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            for op in self.ops:
                if op.random:
                    self.rng[op.index] = torch.random.get_rng_state()
                    self._run(op, None, scratch=True)
            self.rng_after = torch.random.get_rng_state()

    def value(self, name: str) -> torch.Tensor:
        """The tensor ``name`` of the model as the CPU build makes it (a new CPU tensor)."""
        ref = self.tensors[name]
        return _view(self._storage(ref.key, len(self.ops)), ref).clone()

    def _storage(self, key: int, upto: int) -> torch.Tensor:
        """The storage ``key`` (as its creating op's output) after every write recorded before op ``upto``."""
        node = self.storages[key]
        assert node.created_by is not None
        created = self._run(node.created_by, None)
        base: torch.Tensor = tree_flatten(created)[0][node.output]
        for op in node.writes:
            if op.index >= upto:
                break
            self._run(op, (key, base))
        return base

    def _run(self, op: Op, current: tuple[int, torch.Tensor] | None, scratch: bool = False) -> Any:
        """Run ``op`` on the CPU; ``current``: the storage being computed (its writes see its state so far)."""

        def resolve(x: Any) -> Any:
            if not isinstance(x, Ref):
                return x
            if scratch and op.writes is not None and x == op.writes:  # strided as the view written (a slice's
                return torch.empty_strided(x.size, x.stride, dtype=x.dtype)  # rows are far apart): the same draws
            if current is not None and x.key == current[0]:
                return _view(current[1], x)
            return _view(self._storage(x.key, op.index), x)

        args, kwargs = tree_map(resolve, op.args), tree_map(resolve, op.kwargs)
        kwargs = _on_cpu(kwargs)
        with contextlib.ExitStack() as stack:
            if op.random and not scratch:
                stack.enter_context(torch.random.fork_rng(devices=[]))
                torch.random.set_rng_state(self.rng[op.index])
            with torch.no_grad():
                return op.func(*args, **kwargs)

    def materialise(self, model: nn.Module, device: torch.device) -> None:
        """Allocate the (sharded) meta ``model`` on ``device`` and fill each tensor, or this rank's chunk of it,
        with the CPU build's values. A rank holds one whole tensor at a time, never the model."""
        allocate(model, device)
        with torch.no_grad():
            for name, t in _named_tensors(model):
                full = self.value(name).to(device)
                if isinstance(t, DTensor):
                    mine = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
                    t.to_local().copy_(mine.to_local())
                else:
                    t.copy_(full)
                del full


def allocate(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` with its tied parameters tied again: ``to_empty`` gives each module a new
    parameter where the meta one cannot take the new storage in place (a plain tensor; an FSDP DTensor can), and
    a tie broken there would train two copies of a weight meant to be one."""
    first: dict[int, str] = {}
    ties = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    model.to_empty(device=device)
    for name, owner in ties:
        prefix, _, attr = name.rpartition(".")
        setattr(model.get_submodule(prefix), attr, model.get_parameter(owner))


def _view(base: torch.Tensor, ref: Ref) -> torch.Tensor:
    return base.as_strided(ref.size, ref.stride, ref.offset)


def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "device" in kwargs:
        return {**kwargs, "device": torch.device("cpu")}
    return kwargs


def _plain_tensors(model: nn.Module) -> list[str]:
    """Tensors a module keeps as plain attributes: neither moved nor materialised with the module (they would
    stay on meta)."""
    return [
        f"{prefix or 'the model'}.{attr} is a tensor attribute, neither a parameter nor a buffer"
        for prefix, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    ]


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


Step = tuple[str, Any, Any]
"""One initialising operation of a build: its name, its arguments (each tensor as size, stride, offset and dtype;
devices left out) and its keyword arguments."""


def _step(func: Any, args: Any, kwargs: dict[str, Any]) -> Step:
    def one(x: Any) -> Any:
        if isinstance(x, Ref):
            return ("tensor", x.size, x.stride, x.offset, x.dtype)
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.size()), tuple(x.stride()), int(x.storage_offset()), x.dtype)
        if isinstance(x, torch.device):
            return "device"
        return x

    kept = sorted((k, v) for k, v in kwargs.items() if k not in ("device", "pin_memory"))
    name = func.__name__ if callable(func) and not isinstance(func, torch._ops.OpOverload) else str(func)
    return name, tree_map(one, args), tree_map(one, kept)


def _initialising(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A random draw, an in-place write or a factory (no tensor argument): the operations that decide values."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return True
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return True
    return not any(isinstance(x, (torch.Tensor, Ref)) for x in tree_flatten((args, kwargs))[0])


class _OnTheCPU(TorchFunctionMode):
    """What the meta build computes on real CPU tensors stays real in the fake build: a tensor made with an explicit
    ``device="cpu"``, and what is computed from real tensors alone (a drop-path schedule read with ``.item()``)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        device = kwargs.get("device")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        explicit_cpu = device is not None and torch.device(device).type == "cpu"
        if explicit_cpu or (tensors and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors)):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _Path(TorchDispatchMode):
    """The initialising operations of a build with fake tensors: ``Step``s, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Step] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fake = any(isinstance(t, FakeTensor) for t in tree_flatten((args, kwargs, out))[0])
        if fake and _initialising(func, args, kwargs):  # as the record keeps only what touches a meta tensor
            self.steps.append(_step(func, args, kwargs))
        return out

    def record_call(self, fn: Callable[..., Any], tensor: torch.Tensor, args: Any, kwargs: Any) -> None:
        self.steps.append(_step(fn, (tensor, *args), kwargs))


def _recorded_path(recorder: _Recorder) -> list[Step]:
    """The initialising operations of the meta build, as ``_Path`` writes them."""
    steps = []
    for op in recorder.ops:
        if op.random or op.writes is not None or _initialising(op.func, op.args, op.kwargs):
            steps.append(_step(op.func, op.args, op.kwargs))
    return steps


def _path_differs(build_model: Callable[[], nn.Module], recorder: _Recorder) -> list[str]:
    """Why the meta build may not give what the CPU build gives (empty: it takes the same path).

    The replay recomputes exactly what the meta build did; the question is whether the CPU build does the same. A
    model may skip or change its initialisation on meta (transformers skips its own when the default device is
    meta, leaving torch's defaults). A third build, with fake tensors (no storage, but they report the CPU as
    their device), performs every operation the CPU build performs: where its random draws, in-place writes and
    factories, with their shapes and constants, are the meta build's in order, the replay is the CPU build.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    path = _Path()
    with torch.random.fork_rng(devices=[]):
        try:
            with (
                FakeTensorMode(allow_non_fake_inputs=True),
                _OnTheCPU(),
                _recording_calls(path.record_call, lambda t: isinstance(t, FakeTensor)),
                path,
            ):
                build_model()
        except Exception as e:
            return [f"the build fails with fake tensors, which check the meta build ({type(e).__name__}: {e!s:.200})"]
    meta = _recorded_path(recorder)
    if meta == path.steps:
        return []
    i = next((i for i, (a, b) in enumerate(zip(meta, path.steps)) if a != b), min(len(meta), len(path.steps)))
    on_meta = meta[i][0] if i < len(meta) else "nothing"
    on_cpu = path.steps[i][0] if i < len(path.steps) else "nothing"
    return [
        f"the build initialises differently on the meta device: its initialising operation {i + 1} is {on_meta} "
        f"on meta, {on_cpu} on the CPU (a model that skips or changes its initialisation on meta)"
    ]


def build(build_model: Callable[[], nn.Module], seed: int, warn: bool = True) -> tuple[nn.Module, Replay | None]:
    """The model on meta with its ``Replay``, or, where the record cannot reproduce the CPU build, the model
    built on the CPU (seeded with ``seed``) and None, with a warning naming why (``warn``: this rank logs it).
    Either way the CPU generator is left as the CPU build seeded with ``seed`` leaves it."""
    recorder = _Recorder()
    before = torch.random.get_rng_state()
    reasons: list[str] = []
    model: nn.Module | None = None
    try:
        with torch.device("meta"), _Constants(), _recording_calls(recorder.record_call), recorder:
            model = build_model()
    except Exception as e:
        reasons.append(f"the build fails on the meta device ({type(e).__name__}: {str(e).strip()[:200]})")
    if not torch.equal(before, torch.random.get_rng_state()):
        reasons.append("the build draws from or seeds the CPU generator itself")
    replay = None
    if model is not None:
        replay = Replay(model, recorder, seed)
        reasons += replay.unreplayable()
        if not reasons:
            reasons += _path_differs(build_model, recorder)
    if not reasons and replay is not None:
        reasons += _first_pass(replay)
    if reasons or model is None or replay is None:
        if warn:
            log.warning(
                "fsdp: building the whole model on the CPU on every rank, then sharding it (%s)",
                "; ".join(reasons[:3]),
            )
        torch.random.set_rng_state(before)
        torch.manual_seed(seed)
        return build_model(), None
    torch.random.set_rng_state(replay.rng_after)
    return model, replay


def _first_pass(replay: Replay) -> list[str]:
    """Run the replay's pass over the draws (``Replay.draws``); why it failed, as a reason to build on the CPU
    (empty: it ran). It runs each recorded operation on the CPU for the first time: one the record cannot
    reproduce fails here, before any process group or shard."""
    try:
        replay.draws()
    except Exception as e:
        return [f"the replay fails on the CPU ({type(e).__name__}: {str(e).strip()[:200]})"]
    return []
