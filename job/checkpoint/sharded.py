"""The sharded part of a checkpoint, under both strategies: model, optimizer and EMA written by every rank as its own
shards with torch.distributed.checkpoint (DCP), and loaded back at any world size and under either strategy (DCP
reshards on load).

Layout inside a step directory (job.checkpoint.store commits it; nothing here renames or prunes):

    step-0000120/
        shards/         DCP: one ``__<rank>_0.distcp`` per rank and ``.metadata`` (written by rank 0 last)
        state.pt        rank 0: layout, progress, schedule, scaler, every rank's RNG, guard counters
        items.json      rank 0: the sha256 of each item of the shards (job.checkpoint.verified.ITEMS)
        manifest.json   written LAST by rank 0: size + sha256 of every file above
    The shards hold the model, the optimizer (unless ``optim.zero``: ZeroRedundancyOptimizer's consolidated state
    stays in state.pt) and the EMA where enabled.

One format for both strategies. Under fsdp the parameters are already DTensors of this rank's dim-0 chunk. Under
ddp every rank holds the whole tensors; each is saved as the same dim-0 chunks (``_chunked``: a view of this rank's
rows, nothing copied), so every rank writes 1/world_size of the state and the checkpoint is laid out as an fsdp
one. A load reads this rank's chunks and all-gathers them (``_merge_gathered``). 0-d tensors (optimizer steps, the
EMA's count) stay whole; DCP writes them once.

Every rank hashes what it writes while writing it, and verifies what it reads while reading it, each stored item
read once over all ranks at any pair of world sizes (job.checkpoint.verified): rank 0 commits with the digests DCP
gathered, reading nothing back. The files every loading rank needs whole and that grow with the saving ranks
(``.metadata``, items.json, state.pt) are read by rank 0 alone and broadcast, so a rank's reads are its own share.

A save goes to the step's ``.tmp-shards`` directory; DCP returns on every rank only after rank 0 gathered every
rank's write results and wrote ``.metadata``, so when rank 0 then writes the manifest and renames the directory,
every rank's shards are on storage (fsynced by DCP's writer). A crash before the rename leaves a ``.tmp-``
directory that is never loaded and is removed at the next start.

A load prepares the state on every rank, then all ranks agree that every rank is ready before the first DCP
collective: a rank that fails alone ends every rank with an error naming the checkpoint and the rank instead of
leaving the others waiting in a collective. A checkpoint without ``shards/`` (written before this format, the whole
state in state.pt) loads from state.pt under either strategy.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from job.checkpoint.layout import SHARDS
from job.checkpoint.snapshot import HostStaging
from job.checkpoint.verified import ITEMS, HashingWriter, VerifyingReader, digests_of
from job.errors import CheckpointLoadError, CorruptCheckpointError, NonFiniteStateError
from job.parallel import fsdp
from job.parallel.distributed import broadcast_buffers

log = logging.getLogger("job")


class ShardedEma(Protocol):
    """What a sharded checkpoint needs of the EMA (job.train.ema.Ema, a layer above this package): its module
    (sharded like the model under fsdp), its update count, and its whole-state load (a checkpoint without shards)."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def averaged(self) -> Any: ...

    updates: int

    def load_state_dict(self, saved: dict[str, Any] | None) -> None: ...


TMP_SUFFIX = ".tmp-shards"
"""The name every rank writes a save's shards under before rank 0 commits it (a ``.tmp-`` name: never loaded)."""
PARTS = ("model", "optimizer", "ema")
"""What the shards may hold, by top-level key."""


class Sharded:
    """Model, optimizer and EMA, saved and loaded as this rank's shards.

    ``optimizer``: None where its state is not sharded (``optim.zero``: state.pt holds it; ``ddp-job evaluate``:
    not needed). ``rank``: for errors; ``group``: a gloo group for the agreement, the default group when None;
    ``fail_load``: a fault injected for tests.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        rank: int,
        group: Any = None,
        fail_load: bool = False,
        ema: ShardedEma | None = None,
    ) -> None:
        self.model, self.optimizer, self.rank, self.group, self.fail_load = model, optimizer, rank, group, fail_load
        self.ema = ema
        fsdp.reshard(model)  # a gathered unit's parameters are whole tensors, not the DTensors of its shards
        self.replicated = not any(isinstance(p, DTensor) for p in model.parameters())
        """ddp: whole tensors on every rank, saved and loaded as dim-0 chunks."""
        self._mesh: DeviceMesh | None = None
        self._cpu_mesh: DeviceMesh | None = None
        self._host = HostStaging()
        self._save_group: Any = None

    def parts(self) -> list[str]:
        """The top-level keys this object writes into the shards (recorded in the manifest)."""
        parts = ["model"]
        if self.optimizer is not None:
            parts.append("optimizer")
        if self.ema is not None:
            parts.append("ema")
        return parts

    def state_dict(self) -> dict[str, Any]:
        """Model (and optimizer, EMA) state dicts as torch.distributed.checkpoint.state_dict writes them: keyed by
        parameter names under either strategy."""
        fsdp.reshard(self.model)  # after an evaluation that left units gathered (fsdp.reshard_after_forward)
        if self.ema is not None:
            fsdp.reshard(self.ema.module)
        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            out["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if self.ema is not None:  # n_averaged is loaded in place into its own tensor
            out["ema"] = {"module": get_model_state_dict(self.ema.module), "n_averaged": self.ema.averaged.n_averaged}
        return out

    def save(
        self, run_dir: Path, step_name: str, is_main: bool, background: bool = False
    ) -> tuple[Path, Any, HashingWriter]:
        """Every rank: write this rank's shards under the step's temporary directory, returned for the commit with
        the write's future (None: written when this returns) and its writer (on rank 0, once written, ``files``: the
        digests of every rank's files). ``background``: copy them to host memory now
        (reused buffers, pinned on CUDA), write them in a thread; the future completes on every rank once every
        rank's shards and ``.metadata`` are on storage.

        Raises:
            NonFiniteStateError: on every rank, when any rank's shards hold NaN or Inf (nothing is written).
        """
        tmp = run_dir / f"{step_name}{TMP_SUFFIX}"
        if is_main:  # a torn earlier attempt at this step
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)  # nobody writes into a directory rank 0 is still replacing
        # Under either strategy each rank's BatchNorm statistics differ after a step: rank 0's are saved (DCP
        # keeps one rank's copy of a replicated tensor, not necessarily rank 0's).
        broadcast_buffers(self.model)
        if self.ema is not None:
            broadcast_buffers(self.ema.module)
        state = self.state_dict()
        if self.replicated:
            state = _map_tensors(state, self._chunk)
        self._refuse_nonfinite(state, run_dir / step_name, tmp, is_main)
        writer = HashingWriter(tmp / SHARDS)
        if not background:
            dcp.save(state, storage_writer=writer)
            return tmp, None, writer
        if self._save_group is None:  # the writer thread's collectives, apart from training's (every rank, once)
            self._save_group = dist.new_group(backend="gloo")
        staged = self._staged(state)
        future = dcp.async_save(
            staged, storage_writer=writer, process_group=self._save_group, async_stager=_AlreadyStaged()
        )
        return tmp, future, writer

    def _staged(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` in host memory: each tensor's local part copied into its reused buffer, the chunks wrapped
        again as DTensors, on a CPU mesh (a DTensor's local part lives on its mesh's device)."""
        host = self._host.snapshot(_map_tensors(state, _local))
        if self._cpu_mesh is None:
            self._cpu_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        staged: dict[str, Any] = _rewrapped(state, host, self._cpu_mesh)
        return staged

    def _refuse_nonfinite(self, state: dict[str, Any], final: Path, tmp: Path, is_main: bool) -> None:
        bad = _nonfinite(state)
        flags = _agree(bool(bad), self.group)
        if not any(flags):
            return
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        ranks = [r for r, f in enumerate(flags) if f]
        raise NonFiniteStateError(
            f"not saving checkpoint {final}: non-finite values in the shards of rank(s) {ranks}"
            + (f" ({', '.join(bad[:5])} here)" if bad else "")
            + ". Earlier checkpoints are intact.",
            "lower optim.lr, set train.grad_clip_norm, or check the data.",
        )

    def load(self, path: Path, saved: dict[str, Any], files: dict[str, Any]) -> None:
        """Every rank: read this rank's part of the checkpoint at ``path`` (any world size, either strategy);
        ``saved``: its state.pt, which holds the whole state of a checkpoint without shards; ``files``: its
        manifest's entries, against which every item is verified as it is read.

        Raises:
            CorruptCheckpointError: on every rank, when any rank read an item that does not match its sha256.
            CheckpointLoadError: on every rank, naming the checkpoint and the rank(s) that failed.
        """
        whole: dict[str, Any] = {}
        state: dict[str, Any] = {}
        error = ""
        reader = VerifyingReader(path / SHARDS, digests_of(files, SHARDS), self.group, items=files.get(ITEMS))
        try:
            if (path / SHARDS).is_dir():  # a collective: before anything that may fail on one rank alone
                reader.share_metadata()
            if self.fail_load:
                raise OSError("debug.fail_load_rank: load failure injected")
            whole, state = self._targets(path, reader)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self._raise_if_corrupt(reader.corrupt, path)
        self._raise_if_any(error, path, "preparing the load")
        try:
            if state:
                dcp.load(state, storage_reader=reader)
            if self.replicated:
                state = _merge_gathered(whole, state)
            self._apply(state, saved)
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
            error = f"{type(e).__name__}: {str(e).strip()[:500]}"
        self._raise_if_corrupt(reader.corrupt, path)
        self._raise_if_any(error, path, "loading the shards")
        self.bytes_read = reader.bytes_read

    def _raise_if_corrupt(self, corrupt: list[str], path: Path) -> None:
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, corrupt, group=self.group)
        found = sorted({c for rank_found in every for c in rank_found})
        if found:
            raise CorruptCheckpointError(path, found)

    def _targets(self, path: Path, reader: VerifyingReader) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this object's state dict, what DCP loads into in place): the state dict less what the shards lack (an
        EMA enabled on resume; an optimizer that state.pt holds), under ddp as fresh chunks to gather. Both empty:
        a checkpoint without shards."""
        if not (path / SHARDS).is_dir():
            return {}, {}
        held = _parts_of(reader.read_metadata())
        state = {k: v for k, v in self.state_dict().items() if k in held}
        if self.replicated:
            return state, _map_tensors(state, self._empty_chunk)
        return state, state

    def _apply(self, state: dict[str, Any], saved: dict[str, Any]) -> None:
        """Put what was loaded into the model, optimizer and EMA; what the shards lack comes from state.pt."""
        whole = StateDictOptions(full_state_dict=True)  # state.pt's tensors are whole, on every rank
        if "model" in state:
            set_model_state_dict(self.model, state["model"])
        else:
            set_model_state_dict(self.model, _required(saved, "model"), options=whole)
        if self.optimizer is not None:
            if "optimizer" in state:
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            else:
                named = _named_optimizer_state(self.model, self.optimizer, _required(saved, "optimizer"))
                set_optimizer_state_dict(self.model, self.optimizer, named, options=whole)
        if self.ema is not None:
            _apply_ema(self.ema, state.get("ema"), saved.get("ema"), whole)

    def _raise_if_any(self, error: str, path: Path, what: str) -> None:
        flags = _agree(bool(error), self.group)
        if not any(flags):
            return
        ranks = [r for r, f in enumerate(flags) if f]
        here = f" Rank {self.rank}: {error}" if error else ""
        raise CheckpointLoadError(
            f"checkpoint {path}: {what} failed on rank(s) {ranks}.{here}",
            f"see rank {ranks[0]}'s log; move {path} out of the run directory to resume from the one before.",
        )

    def _mesh_of(self, t: torch.Tensor) -> DeviceMesh:
        if self._mesh is None:  # all ranks, one dimension: the default group, no new one
            self._mesh = init_device_mesh(t.device.type, (dist.get_world_size(),))
        return self._mesh

    def _chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 chunk of a whole tensor (a view), as the DTensor fsdp would hold; 0-d tensors stay."""
        if t.ndim == 0:
            return t
        return self._as_chunk(t.detach()[_rows(t)].contiguous(), t)

    def _empty_chunk(self, t: torch.Tensor) -> torch.Tensor:
        """An uninitialised chunk of the shape ``_chunk`` gives, for DCP to load into."""
        if t.ndim == 0:
            return t
        rows = _rows(t)
        return self._as_chunk(t.new_empty((rows.stop - rows.start, *t.shape[1:])), t)

    def _as_chunk(self, local: torch.Tensor, whole: torch.Tensor) -> DTensor:
        stride = torch.empty(whole.shape, device="meta").stride()  # whole, contiguous: what fsdp's DTensors report
        return DTensor.from_local(
            local, self._mesh_of(whole), [Shard(0)], run_check=False, shape=whole.shape, stride=stride
        )


def _rows(t: torch.Tensor) -> slice:
    """This rank's rows of ``t`` in DTensor's ``Shard(0)`` (torch.chunk's split: ceil(rows / world_size) each, the
    last ranks fewer or none), the split fsdp's parameters and their checkpoints use."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    per = -(-t.shape[0] // world_size)
    start = min(rank * per, t.shape[0])
    return slice(start, min(start + per, t.shape[0]))


def held_parts(path: Path) -> set[str]:
    """The top-level keys (``model``, ``optimizer``, ``ema``) the shards of the checkpoint at ``path`` hold."""
    return _parts_of(dcp.FileSystemReader(path / SHARDS).read_metadata())


def _parts_of(metadata: Any) -> set[str]:
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def read_whole(path: Path, files: dict[str, Any], parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """``parts`` of the checkpoint at ``path`` as whole tensors, on one process without a process group (a tool,
    ``model.weights``, a test), verified against ``files`` (its manifest's entries) as they are read: the model's
    state dict; the optimizer's, keyed by parameter names; the EMA as AveragedModel's state dict (``module.<name>``
    and ``n_averaged``), as state.pt held them.

    Raises:
        CorruptCheckpointError: an item does not match its sha256."""
    # What torch's dcp_to_torch_save does: a state dict rebuilt from .metadata (dcp.load would fill a copy).
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = VerifyingReader(path / SHARDS, digests_of(files, SHARDS), alone=True, items=files.get(ITEMS))
    try:
        reader.share_metadata()
        wanted = _parts_of(reader.read_metadata()) & set(parts)
        state: dict[str, Any] = {}
        if wanted:
            _load_state_dict(
                state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=wanted), no_dist=True
            )
    except (Exception, CheckpointException):
        if reader.corrupt:
            raise CorruptCheckpointError(path, reader.corrupt) from None
        raise
    if "ema" in state:
        ema = state["ema"]
        state["ema"] = {**{f"module.{k}": v for k, v in ema["module"].items()}, "n_averaged": ema["n_averaged"]}
    return state


def _apply_ema(ema: ShardedEma, sharded: dict[str, Any] | None, whole: dict[str, Any] | None, options: Any) -> None:
    if sharded is not None:
        set_model_state_dict(ema.module, sharded["module"])
    elif whole is not None:  # state.pt: AveragedModel's own state dict
        module = {k.removeprefix("module."): v for k, v in whole.items() if k.startswith("module.")}
        set_model_state_dict(ema.module, module, options=options)
        ema.averaged.n_averaged.copy_(whole["n_averaged"])
    else:  # an EMA enabled on resume (ckpt.allow_config_change)
        ema.load_state_dict(None)
        return
    ema.updates = int(ema.averaged.n_averaged)


def _required(saved: dict[str, Any], key: str) -> Any:
    if key not in saved:
        raise KeyError(f"neither the shards nor state.pt hold the {key} (it holds {', '.join(sorted(saved))})")
    return saved[key]


def _named_optimizer_state(model: nn.Module, optimizer: Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` as state.pt holds it (parameters numbered in the optimizer's order, the same build)
    keyed by parameter names, as torch.distributed.checkpoint.state_dict loads it under either strategy."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[int(i)]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in saved["param_groups"]],
    }


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    return obj


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.to_local()
    return t


def _rewrapped(state: Any, host: Any, mesh: DeviceMesh) -> Any:
    """``host`` (``state``'s tensors as plain host copies of their local parts) with each DTensor of ``state`` wrapped
    again as the same chunk of the same whole tensor on ``mesh``."""
    if isinstance(state, DTensor):
        return DTensor.from_local(
            host, mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
        )
    if isinstance(state, dict):
        return {k: _rewrapped(v, host[k], mesh) for k, v in state.items()}
    if isinstance(state, list):
        return [_rewrapped(v, h, mesh) for v, h in zip(state, host, strict=True)]
    return host


class _AlreadyStaged(AsyncStager):
    """The staging dcp.async_save would do (a second host copy), skipped: ``Sharded._staged`` did it."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


def _merge_gathered(whole: Any, loaded: Any) -> Any:
    """``loaded`` (chunks DCP read, and the values it replaced in place) with each chunked tensor all-gathered into
    its whole tensor in ``whole`` (one tensor at a time: no second copy of the state)."""
    if isinstance(loaded, DTensor):
        whole.copy_(loaded.full_tensor())
        return whole
    if isinstance(loaded, dict):
        return {k: _merge_gathered(whole.get(k) if isinstance(whole, dict) else None, v) for k, v in loaded.items()}
    if isinstance(loaded, list):
        whole = whole if isinstance(whole, list) else []
        return [_merge_gathered(whole[i] if i < len(whole) else None, v) for i, v in enumerate(loaded)]
    return loaded


def _agree(failed: bool, group: Any) -> list[bool]:
    """Every rank's flag, on every rank (one small all-gather)."""
    flags: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, failed, group=group)
    return [bool(f) for f in flags]


def _nonfinite(obj: Any, prefix: str = "") -> list[str]:
    """Dotted keys of this rank's floating-point shards holding NaN or Inf."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        bad = obj.is_floating_point() and obj.numel() > 0 and not bool(torch.isfinite(obj).all())
        return [prefix] if bad else []
    if isinstance(obj, dict):
        return [k for key, v in obj.items() for k in _nonfinite(v, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(obj, (list, tuple)):
        return [k for i, v in enumerate(obj) for k in _nonfinite(v, f"{prefix}[{i}]")]
    return []
