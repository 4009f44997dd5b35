"""``train.strategy: fsdp``: parameters, gradients and optimizer state sharded with FSDP2
(``torch.distributed.fsdp.fully_shard``) on a ``replicate x shard`` device mesh (``mesh_shape``): sharded over
``fsdp.shard_degree`` ranks, each shard group replicated ``fsdp.replicate_degree`` times (HSDP: a reduce-scatter
within the shard group, then an all-reduce of the shards across groups). One group (replicate 1) is plain fsdp.

The units (modules whose parameters are gathered together, one all-gather each) are the modules whose class
names ``fsdp.units`` lists, else those the task's optional ``shard_units(model)`` returns, else the blocks a
Hugging Face model names in its ``_no_split_modules``; the root is always one more unit, holding every parameter
no unit owns. Preflight checks the units on the model it built (``check_units``: exit 2 before any process
group); ``shard`` then shards that same model in place. Preflight
built it on the meta device (job.parallel.meta_init: each rank then materialises its shards as the seeded CPU
build would make them), or whole on the CPU where that is refused, so FSDP starts from exactly the parameters DDP
would. See docs/sharding.md for when to choose it and what it costs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from job.config import JobConfig
from job.config.schema import FsdpConfig
from job.errors import BadInput

MESH_DIMS = ("replicate", "shard")
"""The device mesh's dimensions, outer first: ranks ``r * shard_degree .. (r + 1) * shard_degree - 1`` form shard
group ``r``, consecutive ranks as every launcher numbers one node's processes."""


def default_shape(world_size: int, local_world_size: int) -> tuple[int, int]:
    """Shard within a node, replicate across nodes; one node, one process per node (a shard group of one would
    shard nothing) or nodes of unequal size: shard over all ranks."""
    if 1 < local_world_size < world_size and world_size % local_world_size == 0:
        return world_size // local_world_size, local_world_size
    return 1, world_size


def mesh_label(shape: tuple[int, int]) -> str:
    """``hsdp 2x2`` (replicate x shard), or ``fsdp 1x4`` for one shard group."""
    kind = "fsdp"
    if shape[0] > 1:
        kind = "hsdp"
    return f"{kind} {shape[0]}x{shape[1]}"


def mesh_shape(cfg: FsdpConfig, world_size: int, local_world_size: int) -> tuple[int, int]:
    """``(replicate_degree, shard_degree)`` of the run: the settings, a 0 among them filled in from the other, and
    with both 0 ``default_shape``.

    Raises:
        BadInput: a shape whose product is not ``world_size``, naming both settings and a shape that fits.
    """
    replicate, shard = cfg.replicate_degree, cfg.shard_degree
    if replicate == 0 and shard == 0:
        return default_shape(world_size, local_world_size)
    if replicate == 0 and world_size % shard == 0:
        replicate = world_size // shard
    if shard == 0 and world_size % replicate == 0:
        shard = world_size // replicate
    if replicate * shard != world_size:
        fit_replicate, fit_shard = default_shape(world_size, local_world_size)
        raise BadInput(
            f"fsdp.replicate_degree={cfg.replicate_degree} x fsdp.shard_degree={cfg.shard_degree} does not divide "
            f"the {world_size} processes of this job ({local_world_size} per node) into a mesh: "
            "replicate_degree x shard_degree must be the world size.",
            f"--fsdp.replicate-degree {fit_replicate} --fsdp.shard-degree {fit_shard} (shard within a node, "
            "replicate across nodes), or leave both 0 to get that shape.",
            setting="fsdp.replicate_degree",
            value=[cfg.replicate_degree, cfg.shard_degree],
        )
    return replicate, shard


def validate(cfg: JobConfig, world_size: int, local_world_size: int) -> None:
    """Refuse settings that make no sense under fsdp, before any process group.

    Raises:
        BadInput: naming both settings and the fix.
    """
    mesh_shape(cfg.fsdp, world_size, local_world_size)
    if cfg.optim.zero:
        raise BadInput(
            "optim.zero=true with train.strategy='fsdp': FSDP already shards the optimizer state (and the "
            "parameters and gradients); ZeRO on top of it is redundant.",
            "--optim.zero false (keep --train.strategy fsdp), or --train.strategy ddp to keep optim.zero.",
            setting="optim.zero",
            value=True,
        )


def unit_modules(model: nn.Module, cfg: JobConfig, task: Any) -> list[nn.Module]:
    """The modules sharded as units, in ``model.modules()`` order, the root excluded.

    Raises:
        BadInput: a name in ``fsdp.units`` that is the class of no module of the model.
    """
    names = cfg.fsdp.units
    if not names:
        if task is not None and task.has("shard_units"):
            return [m for m in task.task.shard_units(model) if m is not model]
        return _no_split_units(model)
    present = {type(m).__name__ for m in model.modules()}
    for name in names:
        if name not in present:
            raise BadInput(
                f"fsdp.units lists {name!r}, but no module of the model has that class. Its classes: "
                f"{', '.join(sorted(present))}.",
                "list class names of the model's repeated blocks, e.g. --fsdp.units '[Block]'.",
                setting="fsdp.units",
                value=list(names),
            )
    wanted = set(names)
    return [m for m in model.modules() if m is not model and type(m).__name__ in wanted]


def _no_split_units(model: nn.Module) -> list[nn.Module]:
    """The blocks a Hugging Face model names as its own in ``_no_split_modules`` (class names Accelerate's FSDP
    auto-wrap reads), the root excluded; none for a model without them. A block holding a parameter tied to one
    outside it (BERT's embeddings, tied to its output layer) is left to the root: FSDP shards a parameter once."""
    wanted = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()}
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    units = []
    for m in model.modules():
        if m is model or type(m).__name__ not in wanted:
            continue
        inside = Counter(id(p) for _, p in m.named_parameters(remove_duplicate=False))
        if all(uses[key] == count for key, count in inside.items()):
            units.append(m)
    return units


def check_units(model: nn.Module, cfg: JobConfig, task: Any) -> None:
    """Preflight, on the model it built: the configured units exist, and activation checkpointing has units to
    checkpoint (exit 2 otherwise)."""
    if cfg.train.strategy == "fsdp":
        unit_modules(model, cfg, task)
    if cfg.train.activation_checkpointing:
        checkpointed_units(model, cfg, task)


def checkpointed_units(model: nn.Module, cfg: JobConfig, task: Any) -> list[nn.Module]:
    """The units whose activations ``train.activation_checkpointing`` recomputes: the same modules fsdp shards.

    Raises:
        BadInput: under ``train.strategy: dp`` (a baseline only), or when there are no units: checkpointing the
            whole model would recompute everything and save nothing.
    """
    if cfg.train.strategy == "dp":
        raise BadInput(
            "train.activation_checkpointing=true with train.strategy='dp': it applies under ddp and fsdp only "
            "(dp is a baseline for comparison).",
            "--train.strategy ddp, or --train.activation-checkpointing false.",
            setting="train.activation_checkpointing",
            value=True,
        )
    units = unit_modules(model, cfg, task)
    if not units:
        raise BadInput(
            "train.activation_checkpointing=true, but the model has no units to checkpoint: fsdp.units is empty "
            "and the task has no shard_units(model).",
            "name the model's repeated blocks, e.g. --fsdp.units '[Block]' (they are checkpointed under ddp too), "
            "or --train.activation-checkpointing false.",
            setting="train.activation_checkpointing",
            value=True,
        )
    return units


def checkpoint_activations(model: nn.Module, cfg: JobConfig, task: Any) -> int:
    """Checkpoint each unit's activations, in place, before sharding or wrapping (torchtitan's order); how many
    units.

    torch's composable, non-reentrant checkpoint works through forward hooks: module names and state-dict keys
    stay as they are, so a checkpoint saved with it resumes without it and back, and export needs nothing.
    Under fsdp the recomputation needs no gather of its own: FSDP's pre-backward hook has gathered the unit
    before it runs (FSDP2 skips its pre-forward gather in that state).
    """
    from torch.distributed._composable import checkpoint

    units = checkpointed_units(model, cfg, task)
    for unit in units:
        checkpoint(unit)
    return len(units)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """Compute in the autocast dtype (bf16/fp16) with gathered parameters in that dtype; gradients are reduced
    and the sharded parameters kept in fp32, so the optimizer's update is fp32 as under DDP."""
    param_dtype = None
    if precision == "bf16":
        param_dtype = torch.bfloat16
    elif precision == "fp16":
        param_dtype = torch.float16
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard(model: nn.Module, cfg: JobConfig, task: Any, device: torch.device, shape: tuple[int, int]) -> nn.Module:
    """Shard ``model`` (on ``device``, identical on every rank, or on the meta device) in place on the
    ``(replicate, shard)`` mesh (``mesh_shape``): each unit, then the root. Its parameters become DTensors holding
    this rank's dim-0 chunk of its shard group; the rest is freed."""
    if shape[0] > 1:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    else:  # one shard group is plain fsdp on a 1-D mesh: its checkpoints and steps stay what they were
        mesh = init_device_mesh(device.type, (shape[1],))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": cfg.fsdp.reshard_after_forward,
        "mp_policy": mixed_precision(cfg.train.precision),
    }
    for unit in unit_modules(model, cfg, task):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def compile_units(model: nn.Module, cfg: JobConfig, task: Any) -> int:
    """Compile each unit's ``forward`` in place (torchtitan's per-block compile); how many (0: no units).

    Why per unit: a compiled whole step traces into the units' hooks. FSDP's hooks break the graph around every
    gather, and activation checkpointing's recomputation would run eagerly what was compiled, so its saved
    tensors would not match (torch refuses). Compiling ``forward`` alone leaves every hook eager around it: FSDP
    gathers, the checkpoint recomputes the same compiled graph, and names and state-dict keys stay unchanged.
    """
    units = unit_modules(model, cfg, task)
    for unit in units:
        unit.forward = torch.compile(unit.forward, backend=cfg.model.compile_backend, mode=cfg.model.compile_mode)
    return len(units)


def remap_groups(groups: list[dict[str, Any]] | None, names: dict[int, str], model: nn.Module) -> Any:
    """A task's parameter groups (of the model before sharding, ``names``: id -> name) over the sharded
    parameters that replaced them."""
    if groups is None:
        return None
    now = dict(model.named_parameters())
    return [{**g, "params": [now[names[id(p)]] for p in g["params"]]} for g in groups]


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Every FSDP unit of ``model`` back to its shards (none: nothing to do).

    Why: with ``fsdp.reshard_after_forward: false`` a forward without backward (preflight's loss check, an
    evaluation) leaves each unit gathered, its parameters replaced by whole tensors until the unit's backward. An
    optimizer built then would hold those instead of the sharded DTensors, and an optimizer state dict taken then
    cannot map them to names (``KeyError``)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally: the micro-batches inside reduce-scatter nothing; the next one
    outside reduce-scatters the sum once."""
    fsdp_model: Any = model
    fsdp_model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        fsdp_model.set_requires_gradient_sync(True)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor reduction (a gradient norm over shards) as the plain tensor every rank agrees on."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of ``t`` (a view: in-place changes reach the DTensor); ``t`` itself when plain."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


def init_optimizer_state(optimizer: Optimizer) -> None:
    """Create the optimizer's state for every parameter now, equal to a fresh state (zeros, step 0).

    Why: a sharded checkpoint load needs the state's shape in advance (DCP loads in place), and torch's helper
    creates it only when the optimizer has none. Created here, before the first step, the state holds every
    parameter at save time and at load time alike (a parameter that never gets a gradient would otherwise have
    no state when saved, and the load fails on its missing keys). The creating step runs at lr 0 on zero
    gradients, then every state tensor is zeroed: for SGD (dampening 0), AdamW, LARS and LAMB the first real step
    then computes exactly what it computes on a fresh state. Used under both strategies (not under ZeRO, whose
    state a checkpoint holds whole).
    """
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    had = [set(group) for group in optimizer.param_groups]
    _init_optim_state(optimizer)
    # Counts the step added to the groups (timm's LAMB keeps its step there) are zeroed too, and kept: a load
    # fills only what exists.
    added = [group[k] for group, keys in zip(optimizer.param_groups, had, strict=True) for k in set(group) - keys]
    with torch.no_grad():
        for value in [v for state in optimizer.state.values() for v in state.values()] + added:
            if torch.is_tensor(value):
                value.zero_()
