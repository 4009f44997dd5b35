"""DataLoader worker processes: tracked so they can be killed at exit, and started so they cannot hang the job.

Workers ignore the stop signals (job.train.preempt) and are SIGKILLed when the trainer leaves (`kill_workers`):
a worker blocked in I/O would otherwise outlive the job. Each worker also keeps its Unix socket paths short
enough to bind (`use_short_socket_tempdir`).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import shutil
import signal
import tempfile
import weakref
from typing import Any

from torch.utils.data import DataLoader

from job.cluster.stop import block_stop_signals, ignore_stop_signals, unblock_stop_signals
from job.errors import BadInput, JobError, TransientIOError, is_transient_io

_WORKERS: weakref.WeakSet[multiprocessing.process.BaseProcess] = weakref.WeakSet()
_INIT_ERROR: list[JobError] = []  # in a worker: why init_worker failed (sent with its first batch)


class WorkerTrackingLoader(DataLoader):
    """A DataLoader that records its worker processes, so that `kill_workers` finds them."""

    def _get_iterator(self):  # type: ignore[no-untyped-def]
        # Workers start with the stop signals blocked (a group signal now must not reach torch's handler in a
        # worker, job.cluster.stop.ignore_stop_signals); the trainer's own pending signal arrives after.
        before = block_stop_signals()
        try:
            it = super()._get_iterator()
        finally:
            unblock_stop_signals(before)
        if not _WORKERS:
            atexit.unregister(kill_workers)
            atexit.register(kill_workers)  # after multiprocessing's hook, so it runs before it
        _WORKERS.update(getattr(it, "_workers", []))
        return it


def kill_workers() -> None:
    """SIGKILL the DataLoader workers still alive: at interpreter exit (atexit) and before job.cli's ``os._exit``.

    The workers ignore SIGTERM (job.cluster.stop.ignore_stop_signals). multiprocessing's own exit hook
    terminates daemonic children with SIGTERM and then joins them, so a loader or iterator still
    referenced at exit (a traceback after a worker error, pytest's excinfo, a global) would hang the
    process forever: the workers outlive SIGTERM and their parent is alive (observed). Workers only
    read files: nothing is lost by SIGKILL.
    """
    workers = [w for w in list(_WORKERS) if w.is_alive()]
    if not workers:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's SIGCHLD check would raise "worker killed"
    for w in workers:
        w.kill()
    for w in workers:
        w.join(5)


# Linux's sun_path holds 108 bytes with the NUL: bind() refuses a 108-character path (measured here).
_SUN_PATH_MAX = 107
_SOCKET_NAME = len("/listener-12345678")  # multiprocessing.connection.arbitrary_address, Python 3.11
_TEMPDIR_NAME = len("/pymp-12345678")  # multiprocessing.util.get_temp_dir


def _process_config() -> dict[str, Any]:
    """multiprocessing's private per-process settings, where util.get_temp_dir keeps its directory."""
    config: dict[str, Any] = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    return config


def socket_tempdir_too_long() -> bool:
    tempdir = _process_config().get("tempdir")  # multiprocessing.util.get_temp_dir's
    length = len(tempdir) if tempdir else len(tempfile.gettempdir()) + _TEMPDIR_NAME
    return length + _SOCKET_NAME > _SUN_PATH_MAX


def use_short_socket_tempdir() -> str | None:
    """Move this process's multiprocessing temp dir under /tmp when TMPDIR is too long for Unix sockets.

    A DataLoader worker hands each batch's shared memory to the trainer as file descriptors, through a
    multiprocessing resource_sharer socket at ``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``. When that path
    exceeds 107 characters, bind() fails inside the worker's queue feeder thread, which only prints the
    traceback and drops the batch: the trainer waits for it forever (or data.loader_timeout_s) while the
    workers sit idle on their index queues. Observed with the 76-character TMPDIR of a pytest-xdist test.
    Newer Pythons fall back to /tmp themselves; 3.11 does not. Returns the directory now used, or None.
    """
    if not socket_tempdir_too_long():
        return None
    for base in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            short = tempfile.mkdtemp(prefix="pymp-", dir=base)
        except OSError:
            continue
        # Removed when this process exits through multiprocessing (a worker's normal end, also after its
        # trainer died: the workers' parent watchdog), like multiprocessing's own directory.
        multiprocessing.util.Finalize(
            None, shutil.rmtree, args=(short,), kwargs={"ignore_errors": True}, exitpriority=-100
        )
        _process_config()["tempdir"] = short
        return short
    limit = _SUN_PATH_MAX - _SOCKET_NAME - _TEMPDIR_NAME
    raise BadInput(
        f"TMPDIR={tempfile.gettempdir()} is too long ({len(tempfile.gettempdir())} characters) for the "
        "DataLoader workers' Unix sockets, and /tmp, /var/tmp and /dev/shm are not writable.",
        f"set TMPDIR to a writable directory of at most {limit} characters, or --data.num-workers 0.",
        setting="TMPDIR",
        value=tempfile.gettempdir(),
    )


def unreadable_image(path: str, err: Exception) -> JobError:
    """The error for an image file that cannot be read or decoded, whichever path decodes it: bad input, unless the
    storage failed (a transient errno: a failure, retried)."""
    if is_transient_io(err):
        return TransientIOError(
            f"data: cannot read image file {path}: the storage failed ({type(err).__name__}: {err}).",
            "retry: a transient error of the storage, not of the file (the launcher's restart resumes the run).",
            setting="data.path",
            value=path,
        )
    return BadInput(
        f"data: cannot read image file {path} ({type(err).__name__}: {str(err).strip()[:200]}).",
        "delete or replace this file (it is truncated, corrupt or unreadable).",
        setting="data.path",
        value=path,
    )


def init_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: ignore the stop signals (job.train.preempt), sockets that fit (above).

    In the worker rather than the trainer: the directory is then removed when the worker ends, which
    the trainer's exit (``os._exit``, job.cli.entrypoint) would skip.
    """
    ignore_stop_signals(worker_id)
    try:
        use_short_socket_tempdir()
    except JobError as err:
        # Raised here, torch would rebuild it in the trainer from its traceback text; job.data.images.collate
        # sends it, whole, in place of this worker's first batch instead.
        _INIT_ERROR.append(err)


def init_error() -> JobError | None:
    """In a DataLoader worker: the error that made ``init_worker`` fail, if any."""
    if _INIT_ERROR:
        return _INIT_ERROR[0]
    return None


class WorkerFailure:
    """A batch that could not be made: carries our error from a DataLoader worker to the trainer whole.

    Raised in a worker, the error would reach the trainer rebuilt by torch as ``type(err)(traceback text)``
    (torch/utils/_utils.py ``ExceptionWrapper.reraise``): its fix, setting and value lost in text. Returned
    as this batch instead (pickled with its attributes), ``CleanErrors`` raises it in the trainer as it was.
    """

    def __init__(self, error: JobError) -> None:
        self.error = error
