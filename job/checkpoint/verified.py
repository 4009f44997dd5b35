"""torch.distributed.checkpoint (DCP) storage that hashes what each rank writes while it writes it, and verifies what
each rank reads while it reads it, reading every stored item once whatever the two world sizes.

Save (``HashingWriter``): DCP's FileSystemWriter, its files written through job.checkpoint.digest's hashing stream.
Each item's write result carries the item's sha256 and its file's size and sha256; DCP gathers every rank's results
onto rank 0 for ``.metadata`` anyway, so rank 0 learns every file's digest without reading a byte
(``HashingWriter.files``: the manifest's entries for the DCP folder).

Load (``VerifyingReader``): DCP's plan says which stored items (a tensor's chunk as one rank saved it) each rank
needs, and which part of each. DCP's own reader reads every needed item whole on every rank that needs part of it:
a checkpoint saved at 1 process and loaded at 8 is read 8 times. Here the ranks share their plans (one small
all-gather), each needed item is read once, whole, by one of the ranks that need it (``owners``), and checked
against its sha256; the ranks agree on every verdict before anything is loaded, then the readers send each rank
the parts it needs (point-to-point, on the gloo group the reader is given). A corrupt item is refused by every
rank with the same error (``CorruptShards``), and nothing of it reaches the state.
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from job.checkpoint.digest import FileDigest, Recorder, sha256_of
from job.checkpoint.layout import ITEMS
from job.errors import CorruptShards

METADATA = ".metadata"


class _HashingFileSystem(FileSystem):
    """DCP's local file system, every file it writes hashed on its way (``recorder``)."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = Recorder()

    def create_stream(self, path: str | Any, mode: str) -> Any:
        if "w" in mode:
            return self.recorder.create(Path(path))
        return super().create_stream(path, mode)


@dataclass
class _Hashed(_StorageInfo):
    """An item's storage info as it travels to rank 0: with its sha256 and its file's (dropped before .metadata)."""

    sha256: str = ""
    file_size: int = 0
    file_sha256: str = ""


class HashingWriter(FileSystemWriter):
    """FileSystemWriter hashing every byte it writes (see the module's docstring). ``files``: on rank 0 once the save
    completed, the manifest's entries of every file of the DCP folder, by name inside it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs: _HashingFileSystem = _HashingFileSystem()
        self.files: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()  # FileSystemWriter writes before it returns
        hashed: Future[list[WriteResult]] = Future()
        hashed.set_result([_with_digest(r, self.fs.recorder.digests) for r in results])
        return hashed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, FileDigest] = {}
        plain = [[_without_digest(r, files) for r in rank_results] for rank_results in results]
        super().finish(metadata, plain)  # .metadata, through the hashing file system too
        written = self.fs.recorder.digests
        files[METADATA] = written[f"{METADATA}.tmp"]
        self.files = {name: d.entry() for name, d in sorted(files.items())}


def _with_digest(result: WriteResult, digests: dict[str, FileDigest]) -> WriteResult:
    info = cast(_StorageInfo, result.storage_data)
    whole = digests[info.relative_path]
    length, sha = whole.items.get(info.offset, (-1, ""))
    if length != info.length:  # the segments did not line up with DCP's items: never guess
        raise RuntimeError(
            f"hashing {info.relative_path}: no segment of {info.length} bytes at offset {info.offset} "
            f"(DCP's writer no longer asks for the position around each item)"
        )
    storage = _Hashed(
        info.relative_path, info.offset, info.length, info.transform_descriptors, sha, whole.size, whole.sha256
    )
    return WriteResult(index=result.index, size_in_bytes=result.size_in_bytes, storage_data=storage)


def _without_digest(result: WriteResult, files: dict[str, FileDigest]) -> WriteResult:
    info = cast(_Hashed, result.storage_data)
    entry = files.setdefault(info.relative_path, FileDigest(info.file_size, info.file_sha256))
    entry.items[info.offset] = (info.length, info.sha256)
    plain = _StorageInfo(info.relative_path, info.offset, info.length, info.transform_descriptors)
    return WriteResult(index=result.index, size_in_bytes=result.size_in_bytes, storage_data=plain)


_Key = tuple[str, tuple[int, ...], int]
"""A stored item, as every rank names it: (fqn, its chunk's offsets, index)."""


def _key(index: MetadataIndex) -> _Key:
    return (index.fqn, tuple(index.offset or ()), int(index.index or 0))


@dataclass(frozen=True)
class _Want:
    """A part of a stored item that a rank needs: the item, and the hypercube of it (DCP's ReadItem)."""

    key: _Key
    byte_io: bool
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


class VerifyingReader(FileSystemReader):
    """FileSystemReader reading every stored item once across the ranks and verifying it (module docstring).

    ``files``: the manifest's entries of the DCP folder (``HashingWriter.files``); ``group``: a gloo group of every
    rank, for the exchange (None: the default group); ``alone``: this process reads everything it needs itself (a
    tool, without a process group). ``bytes_read``: what this rank read from storage for the load."""

    def __init__(
        self,
        path: Path,
        files: dict[str, dict[str, Any]],
        group: Any = None,
        alone: bool = False,
        items: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(path)
        self.files, self.group, self.alone = {k: dict(v) for k, v in files.items()}, group, alone
        self.items = items
        """The manifest's entry of ``ITEMS`` (None: the items are in ``files``), read by ``share_metadata``."""
        self.bytes_read = 0
        self.corrupt: list[str] = []
        self._metadata: Metadata | None = None
        self._indices: dict[_Key, MetadataIndex] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata: never written here
            raise FileNotFoundError(f"{self.path}: no per-rank metadata")
        if self._metadata is not None:  # read once: the load's preparation read (or received) it already
            return self._metadata
        return self._parsed(self._checked(self._read_metadata_file()))

    def share_metadata(self) -> None:
        """Every rank, before anything that may fail on one rank alone: ``.metadata`` and ``ITEMS``, read and checked
        by rank 0 alone and sent to the others (one broadcast): both grow with every saving rank's items, and every
        loading rank needs them, so W ranks reading them would read O(W^2). A corrupt or unreadable one raises on
        every rank alike (CorruptShards, OSError)."""
        if self.alone:
            self._take_items(self._read_items_file())
            self.read_metadata()
            return
        payload: list[Any] = [None]
        if dist.get_rank(self.group) == 0:
            try:
                payload = [(self._read_metadata_file(), self._read_items_file(), "")]
            except OSError as e:
                payload = [(b"", b"", f"{e}")]
        dist.broadcast_object_list(payload, group=self.group, group_src=0)
        data, items, error = payload[0]
        if error:
            raise OSError(error)
        self._take_items(items)
        self._parsed(self._checked(data))

    def _read_items_file(self) -> bytes:
        if self.items is None:
            return b""
        data = (Path(self.path).parent / ITEMS).read_bytes()
        self.bytes_read += len(data)
        return data

    def _take_items(self, data: bytes) -> None:
        """``ITEMS`` (checked against its sha256) into ``files``' entries, where the verification looks for them."""
        if self.items is None:
            return
        if sha256_of(data) != self.items.get("sha256"):
            self.corrupt = [f"{ITEMS} does not match its sha256 (corrupted)"]
            raise CorruptShards(self.corrupt)
        for name, items in json.loads(data).items():
            self.files.setdefault(name, {})["items"] = items

    def _read_metadata_file(self) -> bytes:
        data = (Path(self.path) / METADATA).read_bytes()
        self.bytes_read += len(data)
        return data

    def _checked(self, data: bytes) -> bytes:
        want = self.files.get(METADATA, {}).get("sha256")
        if want is not None and sha256_of(data) != want:
            self.corrupt = [f"{METADATA} does not match its sha256 (corrupted)"]
            raise CorruptShards(self.corrupt)
        return data

    def _parsed(self, data: bytes) -> Metadata:
        metadata: Metadata = pickle.loads(data)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        self._metadata = metadata
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rank, world_size, every = self._share_plans(plan.items)
        owner = owners(every, self._length, world_size)
        mine = sorted({w.key for w in every[rank] if owner[w.key] == rank})
        read, why = self._read_own(mine)
        self._agree(why)
        received = self._exchange(every, owner, read, rank)
        for item in plan.items:
            want = _want(item)
            if owner[want.key] == rank:
                value = _part(read[want.key], want)
            else:
                value = received[(want.key, want.offsets, want.lengths)]
            _load(planner, item, value)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _share_plans(self, items: list[ReadItem]) -> tuple[int, int, list[list[_Want]]]:
        wants = [_want(i) for i in items]
        if self.alone:
            return 0, 1, [wants]
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, wants, group=self.group)
        return dist.get_rank(self.group), len(every), every

    def _length(self, key: _Key) -> int:
        return int(self._info(key).length)

    def _info(self, key: _Key) -> _StorageInfo:
        return cast(_StorageInfo, self.storage_data[self._index(key)])

    def _index(self, key: _Key) -> MetadataIndex:
        if len(self._indices) != len(self.storage_data):
            self._indices = {_key(index): index for index in self.storage_data}
        return self._indices[key]

    def _read_own(self, keys: list[_Key]) -> tuple[dict[_Key, Any], list[str]]:
        """This rank's items, each read whole once and checked: (values, what failed)."""
        read: dict[_Key, Any] = {}
        why: list[str] = []
        by_file: dict[str, list[_Key]] = {}
        for key in keys:
            by_file.setdefault(self._info(key).relative_path, []).append(key)
        for name, file_keys in sorted(by_file.items()):
            try:
                with open(Path(self.path) / name, "rb") as f:
                    for key in sorted(file_keys, key=lambda k: self._info(k).offset):
                        value, bad = self._read_item(f, name, key)
                        read[key] = value
                        if bad:
                            why.append(bad)
            except OSError as e:
                why.append(f"{name} is unreadable: {e}")
        return read, why

    def _read_item(self, f: Any, name: str, key: _Key) -> tuple[Any, str]:
        info = self._info(key)
        f.seek(info.offset)
        data = f.read(info.length)
        self.bytes_read += len(data)
        items = self.files.get(name, {}).get("items")
        if items is not None:
            length, sha = items.get(str(info.offset), (-1, ""))
            if length != len(data) or sha256_of(data) != sha:
                return None, f"{name} (item {key[0]} at byte {info.offset}) does not match its sha256 (corrupted)"
        if self._is_bytes(key):
            return data, ""
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), ""
        except Exception as e:  # a checkpoint of the earlier manifest, without item digests
            return None, f"{name} (item {key[0]} at byte {info.offset}) is unreadable: {type(e).__name__}: {e}"

    def _is_bytes(self, key: _Key) -> bool:
        assert self._metadata is not None
        return not isinstance(self._metadata.state_dict_metadata[key[0]], TensorStorageMetadata)

    def _agree(self, why: list[str]) -> None:
        """Every rank's failures, on every rank; any raises CorruptShards everywhere with the same list."""
        every: list[Any] = [why]
        if not self.alone:
            every = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, why, group=self.group)
        found = [f"rank {r}: {w}" for r, ws in enumerate(every) for w in ws]
        if found:
            self.corrupt = found
            raise CorruptShards(found)

    def _exchange(
        self, every: list[list[_Want]], owner: dict[_Key, int], read: dict[_Key, Any], rank: int
    ) -> dict[tuple[_Key, tuple[int, ...], tuple[int, ...]], Any]:
        """The parts this rank needs of items other ranks read, sent by their readers (one message each)."""
        ops: list[dist.P2POp] = []
        received: dict[tuple[_Key, tuple[int, ...], tuple[int, ...]], Any] = {}
        raw: dict[tuple[_Key, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        for r, wants in enumerate(every):
            for want in wants:
                src = owner[want.key]
                if src == r or rank not in (src, r):
                    continue
                if src == rank:
                    payload = _payload(_part(read[want.key], want))
                    ops.append(dist.P2POp(dist.isend, payload, group=self.group, group_peer=r))
                else:
                    buf = self._buffer(want)
                    raw[(want.key, want.offsets, want.lengths)] = buf
                    ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=src))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for k, buf in raw.items():
            received[k] = buf.numpy().tobytes() if self._is_bytes(k[0]) else buf
        return received

    def _buffer(self, want: _Want) -> torch.Tensor:
        if want.byte_io:
            return torch.empty(self._length(want.key), dtype=torch.uint8)
        assert self._metadata is not None
        dtype = cast(TensorStorageMetadata, self._metadata.state_dict_metadata[want.key[0]]).properties.dtype
        return torch.empty(want.lengths, dtype=dtype)


def owners(every: list[list[_Want]], length: Any, world_size: int) -> dict[_Key, int]:
    """Which rank reads each needed item: among the ranks that need part of it, the one with the fewest bytes to
    read so far, largest items first (the same on every rank: it sees the same plans)."""
    needing: dict[_Key, list[int]] = {}
    for r, wants in enumerate(every):
        for want in wants:
            ranks = needing.setdefault(want.key, [])
            if r not in ranks:
                ranks.append(r)
    load = [0] * world_size
    owner: dict[_Key, int] = {}
    for key in sorted(needing, key=lambda k: (-length(k), k)):
        owner[key] = min(needing[key], key=lambda r: (load[r], r))
        load[owner[key]] += length(key)
    return owner


def _want(item: ReadItem) -> _Want:
    return _Want(
        _key(item.storage_index),
        item.type == LoadItemType.BYTE_IO,
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


def _part(value: Any, want: _Want) -> Any:
    """The hypercube ``want`` asks for of a whole stored tensor (bytes stay whole)."""
    if want.byte_io:
        return value
    out = value
    for dim, (start, n) in enumerate(zip(want.offsets, want.lengths, strict=True)):
        out = out.narrow(dim, start, n)
    return out


def _payload(value: Any) -> torch.Tensor:
    if isinstance(value, bytes):
        return torch.frombuffer(bytearray(value), dtype=torch.uint8)
    return cast(torch.Tensor, value).contiguous()


def _load(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(value))
        return
    target = planner.resolve_tensor(item).detach()
    if target.size() != value.size():
        raise RuntimeError(f"{item.storage_index}: read {tuple(value.size())}, the state needs {tuple(target.size())}")
    target.copy_(value)
    planner.commit_tensor(item, target)


def digests_of(files: dict[str, dict[str, Any]], folder: str) -> dict[str, dict[str, Any]]:
    """The manifest's entries of the files under ``folder``, by name inside it."""
    prefix = f"{folder}/"
    return {name.removeprefix(prefix): entry for name, entry in files.items() if name.startswith(prefix)}
