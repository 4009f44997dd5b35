"""Durable checkpoints: complete, verifiable, never code.

Format (one for both strategies; job.checkpoint.sharded writes the shards):

    run_dir/step-0000120/
        shards/         model, optimizer and EMA: every rank's own part, written with torch.distributed.checkpoint
        state.pt        trainer state, scheduler, scaler, RNG of every rank (rank 0); under optim.zero the optimizer
        items.json      sha256 of each item of the shards (job.checkpoint.verified.ITEMS): out of the manifest,
                        which every rank reads, so that it stays O(files)
        manifest.json   written LAST: sizes + sha256 of every file, step, world size, resolved config

A checkpoint written before the shards existed holds the model, optimizer and EMA in state.pt; it still resumes.
The manager without ``sharded`` writes whatever state it is handed into state.pt (the benchmarks use that).

A save goes to ``step-0000120.tmp-<pid>-<n>/`` (``.tmp-shards`` with shards); every file is fsynced, then the manifest, then the
directory is renamed and the parent fsynced. Every file is hashed while it is written, by the rank that writes it
(job.checkpoint.digest); rank 0 commits with the digests DCP gathered and reads nothing back. A directory counts as a checkpoint only if its name is final
AND its manifest verifies, so a crash, a full disk or a second signal mid-save leaves at worst a ``.tmp``
directory that is ignored and cleaned up later. "Latest" is found by scanning, never by a pointer file.
Files are read with ``torch.load(weights_only=True)``: a checkpoint can never run code. On resume the shards are
verified item by item as they are read, each item by the one rank that reads it (job.checkpoint.verified); the
ranks hash the other files (state.pt; the shards of a checkpoint written before item digests) each a share
(``share``), and agree on the verdict (job.checkpoint.resume.settle). A load reads state.pt, ``.metadata`` and
items.json on rank 0 alone and broadcasts them (``load_state_shared``, job.checkpoint.verified). Pruning trusts the manifests this process
wrote or verified, and reads nothing but manifests.

Async saving: ``save()`` copies state into reused host buffers on the caller's thread (the only blocking
part; job.checkpoint.snapshot), then a background thread serialises and writes. At most one save is in flight; ``wait()`` joins it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import torch

from job.checkpoint.digest import EMPTY_SHA256, Recorder
from job.checkpoint.layout import ITEMS, SHARDS
from job.checkpoint.snapshot import HostStaging, to_host
from job.errors import CheckpointLoadError, CheckpointWriteError, NonFiniteStateError

if TYPE_CHECKING:
    from job.checkpoint.sharded import Sharded
    from job.checkpoint.verified import HashingWriter

log = logging.getLogger("job")

STEP_DIR = re.compile(r"^step-(\d{7,})$")
OWN_SHARDS = re.compile(r"^shards/__(\d+)_\d+\.distcp$")
"""A DCP file and the rank that wrote it."""
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    manifest: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(path: Path) -> tuple[bool, str, dict[str, Any]]:
    """(ok, reason, manifest). Checks the manifest exists and every listed file has its size and sha256."""
    ok, reason, manifest = inspect(path)
    if not ok:
        return ok, reason, manifest
    reason = check_hashes(path, manifest, list(manifest.get("files", {})))
    return not reason, reason, manifest


def inspect(path: Path) -> tuple[bool, str, dict[str, Any]]:
    """(ok, reason, manifest) from the manifest and the files' sizes alone: what a torn or truncated save leaves
    is found without reading the checkpoint (``check_hashes`` finds flipped bits)."""
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        return False, f"{mpath} is missing (save did not complete)", {}
    except (OSError, ValueError) as e:
        return False, f"{mpath} is unreadable: {e}", {}
    for name, meta in manifest.get("files", {}).items():
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            return False, f"{f} is missing", manifest
        if size != meta["size"]:
            return False, f"{f} has {size} bytes, manifest says {meta['size']} (truncated?)", manifest
    return True, "", manifest


def check_hashes(path: Path, manifest: dict[str, Any], names: list[str]) -> str:
    """Why the files ``names`` of the checkpoint at ``path`` do not match their sha256 in ``manifest`` ("": they do)."""
    for name in names:
        f = path / name
        try:
            if _sha256(f) != manifest["files"][name]["sha256"]:
                return f"{f} does not match its sha256 (corrupted)"
        except OSError as e:
            return f"{f} is unreadable: {e}"
    return ""


def hashed_on_resume(files: dict[str, Any]) -> dict[str, Any]:
    """The manifest's entries that the ranks hash together on resume: all but the shards' files with item digests
    (in ``ITEMS``, or in their entries in a checkpoint without it), which are verified as they are read
    (job.checkpoint.verified), ``.metadata`` and ``ITEMS`` (likewise, by rank 0)."""
    itemised = ITEMS in files
    return {
        name: entry
        for name, entry in files.items()
        if name != ITEMS
        and not (name.startswith(f"{SHARDS}/") and (itemised or "items" in entry or name == f"{SHARDS}/.metadata"))
    }


def share(files: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """The files of a manifest that ``rank`` hashes when the ranks verify a checkpoint together: the shards its rank
    number wrote, then the rest, largest first, each to the rank with the fewest bytes so far. Every rank computes
    the same split, and together they read the checkpoint once."""
    owner: dict[str, int] = {}
    load = [0] * world_size
    for name, meta in files.items():
        m = OWN_SHARDS.match(name)
        if m and int(m.group(1)) < world_size:
            owner[name] = int(m.group(1))
            load[owner[name]] += int(meta["size"])
    for name in sorted((n for n in files if n not in owner), key=lambda n: (-int(files[n]["size"]), n)):
        owner[name] = min(range(world_size), key=lambda r: (load[r], r))
        load[owner[name]] += int(files[name]["size"])
    return sorted(name for name, r in owner.items() if r == rank)


def scan(run_dir: Path) -> list[tuple[int, Path]]:
    """Final-named step directories, newest first (validity not checked)."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def held_bytes(run_dir: Path) -> int:
    """Bytes of the checkpoints ``run_dir`` holds: its step directories and the torn saves the next start
    removes. Pruning reuses this space, so a rerun needs room only for the rest of its checkpoints."""
    if not run_dir.is_dir():
        return 0
    dirs = [p for p in run_dir.glob("step-*") if p.is_dir() and (STEP_DIR.match(p.name) or ".tmp-" in p.name)]
    return sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file())


def find_latest(run_dir: Path, hashes: bool = True, below: int | None = None) -> Found | None:
    """The newest checkpoint (older than step ``below`` where given) that verifies; newer broken ones are skipped
    with a warning naming the file. ``hashes=False``: sizes only (``inspect``); the ranks of a resume then hash
    their shares (job.checkpoint.resume.settle)."""
    for step, path in scan(run_dir):
        if below is not None and step >= below:
            continue
        ok, reason, manifest = verify(path) if hashes else inspect(path)
        if ok:
            return Found(step, path, manifest)
        log.warning("skipping checkpoint %s: %s", path, reason)
    return None


def load_state(found: Found) -> dict[str, Any]:
    """state.pt of ``found``, read by this process.

    Raises:
        CheckpointLoadError: torch.load(weights_only=True) refused it."""
    return _unpickled_state(found, found.path / STATE_FILE)


def load_state_shared(found: Found, group: Any = None) -> dict[str, Any]:
    """Every rank: state.pt of ``found``, read from storage by rank 0 alone and sent to the others (one broadcast on
    ``group``, gloo): it holds every rank's RNG states, so reading it on each of W ranks would read O(W^2).

    Raises:
        CheckpointLoadError: on every rank, where rank 0 could not read it or torch.load(weights_only=True) refused
            it (every rank unpickles the same bytes)."""
    import torch.distributed as dist

    path = found.path / STATE_FILE
    payload: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            payload = [(path.read_bytes(), "")]
        except OSError as e:
            payload = [(b"", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(payload, group=group, group_src=0)
    data, error = payload[0]
    if error:
        raise CheckpointLoadError(
            f"{path}: rank 0 could not read it ({error}).", f"check {found.path}, or move it out of the run directory."
        )
    return _unpickled_state(found, io.BytesIO(data))


def _unpickled_state(found: Found, source: Path | IO[bytes]) -> dict[str, Any]:
    path = found.path / STATE_FILE
    try:
        state: dict[str, Any] = torch.load(source, map_location="cpu", weights_only=True)
        return state
    except Exception as e:
        raise CheckpointLoadError(
            f"{path} verifies against its manifest but torch.load(weights_only=True) refused it "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}). A checkpoint may hold only tensors and "
            f"plain containers; this one was not written by ddp-job or was tampered with. It is never loaded "
            f"with weights_only=False.",
            f"move {found.path} out of the run directory to resume from the one before.",
        ) from None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The whole state of the checkpoint at ``path`` on one process (a tool, a test): its state.pt, with the model,
    optimizer and EMA that its shards hold as whole tensors, verified as they are read against its manifest where it
    has one (job.checkpoint.sharded.read_whole)."""
    state = load_state(Found(0, path, {}))
    if (path / SHARDS).is_dir():
        files: dict[str, Any] = {}
        if (path / MANIFEST).is_file():
            files = json.loads((path / MANIFEST).read_text()).get("files", {})
        from job.checkpoint.sharded import read_whole  # DCP: not imported where no shards are read (the launcher)

        state.update(read_whole(path, files))
    return state


def nonfinite_entries(obj: Any, prefix: str = "") -> list[str]:
    """Keys (dotted paths) of floating-point tensors in ``obj`` that hold NaN or Inf."""
    if isinstance(obj, torch.Tensor):
        bad = obj.is_floating_point() and obj.numel() > 0 and not bool(torch.isfinite(obj).all())
        return [prefix or "<tensor>"] if bad else []
    if isinstance(obj, dict):
        return [k for key, v in obj.items() for k in nonfinite_entries(v, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(obj, (list, tuple)):
        return [k for i, v in enumerate(obj) for k in nonfinite_entries(v, f"{prefix}[{i}]")]
    return []


def _write_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    tmp: Path | None = None,
    shard_files: dict[str, Any] | None = None,
    trusted: frozenset[Path] = frozenset(),
) -> Path:
    """``tmp``: the directory the ranks' shards were written to (job.checkpoint.sharded), committed with the rest;
    ``shard_files``: their digests, taken by the ranks that wrote them (job.checkpoint.verified.HashingWriter.files).
    A checkpoint of the same step already in ``run_dir`` is kept if it is ``trusted`` (this process wrote or
    verified it), else replaced (resume fell back past it)."""
    final = run_dir / step_dir_name(step)
    if tmp is None:
        tmp = run_dir / f"{final.name}.tmp-{os.getpid()}-{threading.get_ident() % 10000}"
        tmp.mkdir(parents=True)
    bad = nonfinite_entries(state)
    if bad:
        shutil.rmtree(tmp, ignore_errors=True)
        raise NonFiniteStateError(
            f"not saving checkpoint {final}: non-finite values in {', '.join(bad[:5])}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            + ". Earlier checkpoints are intact.",
            "lower optim.lr, set train.grad_clip_norm, or check the data.",
        )
    try:
        recorder = Recorder()
        with recorder.create(tmp / STATE_FILE) as f:
            torch.save(state, cast(IO[bytes], f))
            f.flush()
            os.fsync(f.fileno())
        shard_entries = _without_items(shard_files or {})
        if shard_entries != (shard_files or {}):
            with recorder.create(tmp / ITEMS) as f:
                f.write(json.dumps(_items(shard_files or {}), sort_keys=True).encode())
                f.flush()
                os.fsync(f.fileno())
        listed = _listed(tmp, recorder.digests[STATE_FILE].entry(items=False), shard_entries, recorder)
        manifest = dict(meta, step=step, files=listed)
        mpath = tmp / MANIFEST
        with mpath.open("w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            if final in trusted:
                # Same step saved before (e.g. preempted right after a periodic save): keep the one on disk.
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            # A corrupted checkpoint of this step (resume fell back past it): move it to a name that is
            # ignored and cleaned, then put the new one in place. Never a moment without a valid newest one.
            broken = run_dir / f"{final.name}.tmp-broken-{os.getpid()}"
            os.rename(final, broken)
            log.warning("replacing corrupted checkpoint %s", final)
            os.rename(tmp, final)
            _fsync_dir(run_dir)
            shutil.rmtree(broken, ignore_errors=True)
            return final
        os.rename(tmp, final)
        _fsync_dir(run_dir)
        return final
    except (OSError, RuntimeError) as e:  # torch.save's zip writer turns ENOSPC into a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(run_dir).free if run_dir.exists() else 0
        need = sum(t.numel() * t.element_size() for t in _tensors(state))
        cause = _os_error(e)
        raise CheckpointWriteError(
            f"writing checkpoint {final} failed: {cause.strerror if cause else e}. It needs about {need / 2**20:.1f} MiB; "
            f"{free / 2**20:.1f} MiB are free on that filesystem. Earlier checkpoints are intact.",
            "free space, lower ckpt.keep_last, or point run.output_dir elsewhere.",
        ) from e


def _items(shard_files: dict[str, Any]) -> dict[str, Any]:
    """``ITEMS``' content: each shard file's item digests (job.checkpoint.verified.ITEMS)."""
    return {name: entry["items"] for name, entry in shard_files.items() if "items" in entry}


def _without_items(shard_files: dict[str, Any]) -> dict[str, Any]:
    return {name: {k: v for k, v in entry.items() if k != "items"} for name, entry in shard_files.items()}


def _listed(tmp: Path, state_entry: dict[str, Any], shard_files: dict[str, Any], recorder: Recorder) -> dict[str, Any]:
    """The manifest's files: state.pt, ``ITEMS`` where written, and every rank's shards, from the digests taken while
    they were written. The directory is listed (no file is read) so that nothing in it goes unlisted: a rank with
    nothing to write left an empty file that no digest names.

    Raises:
        OSError: a file that no digest covers."""
    listed = {STATE_FILE: state_entry, **{f"{SHARDS}/{name}": entry for name, entry in shard_files.items()}}
    if ITEMS in recorder.digests:
        listed[ITEMS] = recorder.digests[ITEMS].entry(items=False)
    for p in sorted(tmp.rglob("*")):
        name = p.relative_to(tmp).as_posix()
        if name in listed or not p.is_file():
            continue
        if p.stat().st_size:
            raise OSError(0, f"{p} was written but no rank reported its digest")
        listed[name] = {"size": 0, "sha256": EMPTY_SHA256}
    return dict(sorted(listed.items()))


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind ``e`` (itself, or its cause/context chain), if any."""
    while e is not None:
        if isinstance(e, OSError) and e.strerror:
            return e
        e = e.__cause__ or e.__context__
    return None


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _delete(path: Path) -> None:
    """Rename out of the checkpoint namespace first (atomic), then delete: a kill mid-delete leaves a
    ``.tmp-`` directory that the next start removes, never a torn ``step-*`` directory beside the good ones."""
    doomed = path.with_name(f"{path.name}.tmp-pruned-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


class CheckpointManager:
    """Saves (rank 0 only), prunes to the newest ``keep_last`` valid checkpoints, finds the latest."""

    def __init__(
        self,
        run_dir: Path,
        keep_last: int,
        async_save: bool,
        is_main: bool,
        write_delay_s: float = 0.0,
        sharded: Sharded | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.sharded = sharded
        """Every rank writes its shards (job.checkpoint.sharded), then rank 0 commits them with the rest."""
        self._shards_written: Future[Any] | None = None
        """A rank other than 0: its background shard write, waited for before the next save and at the end."""
        self.write_delay_s = write_delay_s
        self.keep_last = keep_last
        self.async_save = async_save
        self.is_main = is_main
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging = HostStaging() if async_save and is_main else None
        self.last_write_s = 0.0
        """How long the newest finished write took (serialise, fsync, rename; rank 0)."""
        self.trusted: set[Path] = set()
        """Checkpoints this process wrote (hashed while written) or verified as it loaded them: pruning counts them
        without reading them."""
        self.broken: set[Path] = set()
        """Checkpoints a resume found corrupt: pruning never counts them."""
        self.committed: tuple[int, float] | None = None
        """(step, ``time.monotonic()`` when its state was taken) of the newest checkpoint this process has on
        storage (rank 0; None: none yet): an async save counts once its write is complete, not while in flight."""

    def resumed_from(self, found: Found) -> None:
        """The run resumed from ``found``, verified as it was loaded; every newer checkpoint here was refused by the
        resume (it picks the newest that verifies)."""
        self.trusted.add(found.path)
        self.broken = {path for step, path in scan(self.run_dir) if step > found.step}

    def clean_stale_tmp(self) -> None:  # also pruned checkpoints whose deletion was interrupted (_delete)
        """Remove torn saves left by a crash (never valid, never loaded)."""
        if self.is_main and self.run_dir.is_dir():
            for p in self.run_dir.glob("step-*.tmp-*"):
                shutil.rmtree(p, ignore_errors=True)

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]], meta: dict[str, Any]) -> None:
        """Snapshot ``state_fn()`` to host memory now; write now (sync) or in the background (async).

        ``state_fn`` must be called on every rank by the caller beforehand if it involves collectives;
        here it is only evaluated on rank 0.
        """
        self.wait()  # at most one save in flight; also surfaces a background failure
        shards, written, writer = None, None, None
        if self.sharded is not None:  # async: staged in host memory here, written by DCP's thread
            shards, written, writer = self.sharded.save(
                self.run_dir, step_dir_name(step), self.is_main, self.async_save
            )
        if not self.is_main:
            self._shards_written = written
            return
        taken = time.monotonic()
        # Async: into buffers kept between saves (safe: the previous write was waited for above).
        state = self._staging.snapshot(state_fn()) if self._staging is not None else to_host(state_fn())
        if self.async_save:
            self._thread = threading.Thread(
                target=self._write_and_prune,
                args=(step, state, meta, taken, shards, written, writer),
                name="ckpt-writer",
                daemon=False,
            )
            self._thread.start()
            # Logged once the writer runs, so "in flight" is true for anyone who reacts to this line.
            log.info("writing checkpoint %s in the background", self.run_dir / step_dir_name(step))
        else:
            self._write_and_prune(step, state, meta, taken, shards, None, writer)
            self._raise_pending()

    def _write_and_prune(
        self,
        step: int,
        state: dict[str, Any],
        meta: dict[str, Any],
        taken: float,
        shards: Path | None = None,
        written: Future[Any] | None = None,
        writer: HashingWriter | None = None,
    ) -> None:
        """``shards``: the directory every rank's shards went to; ``written``: their background write, complete on
        every rank when it completes here (DCP's rank 0 gathers every rank's results, then writes .metadata);
        ``writer``: its digests of every rank's files, complete then too."""
        try:
            t0 = time.perf_counter()
            if self.write_delay_s:
                time.sleep(self.write_delay_s)
            if written is not None:
                written.result()
            shard_files = writer.files if writer is not None else None
            path = _write_checkpoint(self.run_dir, step, state, meta, shards, shard_files, frozenset(self.trusted))
            self.trusted.add(path)
            self.last_write_s = time.perf_counter() - t0
            self.committed = (step, taken)  # one assignment: a reader on another thread sees old or new
            log.info("saved checkpoint %s", path)
            self.prune(just_written=path)
        except BaseException as e:
            self._error = e

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def in_flight(self) -> bool:
        """True while a background write runs (safe to call from a signal handler: no locks)."""
        t, written = self._thread, self._shards_written
        return (t is not None and t.is_alive()) or (written is not None and not written.done())

    def wait(self) -> None:
        """Block until the in-flight save (if any) is on disk; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._shards_written is not None:
            written, self._shards_written = self._shards_written, None
            written.result()
        self._raise_pending()

    def close(self) -> None:
        """On every exit path: let an in-flight write finish (a crash leaves at worst a ``.tmp`` directory that the
        next start removes, never a checkpoint that verifies half-written); its error is logged, not raised,
        so it does not hide the error that ended the run."""
        try:
            self.wait()
        except Exception as e:
            log.error("the last checkpoint write failed: %s", e)

    def prune(self, just_written: Path | None = None) -> None:
        """Keep the newest ``keep_last`` valid checkpoints; delete older ones. Valid: ``trusted`` (this process
        wrote or verified it), else not ``broken`` and complete by its manifest and sizes (``inspect``: no file
        but the manifest is read). Broken newer ones do not count towards K, so the only valid checkpoint is never
        deleted."""
        valid = 0
        for _step, path in scan(self.run_dir):
            if valid >= self.keep_last:
                _delete(path)
                continue
            ok = path == just_written or path in self.trusted or (path not in self.broken and inspect(path)[0])
            valid += ok
