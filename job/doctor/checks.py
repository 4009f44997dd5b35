"""The doctor's checks that need no process group: each returns a ``Check`` (PASS/WARN/FAIL + a one-line fix).

Kept apart from the orchestration in ``job.doctor.phases`` so each check is a plain function of the config, the
detected environment and a few measured facts (sizes, versions), testable one by one.
"""

from __future__ import annotations

import errno
import importlib.metadata
import os
import platform
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from job.checkpoint import store as ckpt
from job.cluster.env import NOTICE_VAR, DistEnv, stop_notice_s
from job.config import DataConfig, JobConfig
from job.errors import BadInput
from job.parallel import memory

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
ORDER = {PASS: 0, WARN: 1, FAIL: 2}
# A FAIL in these can go away by itself (a pod whose DNS name appears late, a peer that restarts, a disk that
# is freed): exit 1 ("restart may help"). Every other FAIL is the input's fault: exit 2 ("do not retry").
TRANSIENT = ("rendezvous", "communication", "storage.space")


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def installed_version(dist: str) -> str:
    """A distribution's installed version, read from its metadata without importing it ("not installed" if
    absent). Importing torchvision costs a worker about a second (its ops import torch._dynamo), which a task
    that does not use it should not pay for a version string."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Library versions that must agree on every rank (mixed builds hang or corrupt collectives). torch's own
    string carries its build (+cu130, +cpu); torchvision refuses to load beside a torch of another CUDA build."""
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": installed_version("torchvision"),
        "cuda_runtime": str(torch.version.cuda),
        "nccl": "n/a",
        "cudnn": "n/a",
        "cuda_driver": "n/a",
    }
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        out["cudnn"] = str(torch.backends.cudnn.version())
        try:
            v = torch._C._cuda_getDriverVersion()  # type: ignore[attr-defined]  # the CUDA version the driver supports, e.g. 12040
            out["cuda_driver"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
    return out


def check_cuda_driver(v: dict[str, str]) -> Check:
    runtime, driver = v["cuda_runtime"], v["cuda_driver"]
    if driver == "n/a" or runtime in ("None", "n/a"):
        return Check("versions.cuda", PASS, f"CUDA runtime {runtime}, driver {driver} (no GPU in use)")
    rt, dr = (tuple(int(x) for x in s.split(".")[:2]) for s in (runtime, driver))
    if dr[0] < rt[0]:
        return Check(
            "versions.cuda",
            FAIL,
            f"torch's CUDA runtime {runtime} needs a newer driver than the installed one (supports CUDA {driver})",
            f"install a driver for CUDA {rt[0]}.x, or a torch build for CUDA {dr[0]}.x",
        )
    if dr < rt:
        return Check(
            "versions.cuda",
            WARN,
            f"CUDA runtime {runtime} on a driver for CUDA {driver} (minor-version compatibility only)",
            "upgrade the driver if kernels fail to load (PTX JIT needs a matching driver)",
        )
    return Check("versions.cuda", PASS, f"CUDA runtime {runtime}, driver supports {driver}")


def check_gpus(env: DistEnv, backend: str, cuda_count: int) -> Check:
    n = env.local_world_size
    if cuda_count == 0:
        if backend == "nccl":
            return Check(
                "topology.gpus",
                FAIL,
                "dist.backend=nccl but no CUDA device is visible",
                "check CUDA_VISIBLE_DEVICES / the container's GPU runtime, or use --dist.backend gloo",
            )
        return Check(
            "topology.gpus",
            WARN,
            f"no CUDA device visible: {n} process(es) on this node train on CPU (gloo)",
            "expected GPUs? check CUDA_VISIBLE_DEVICES, the device plugin / --gres, the container's GPU runtime",
        )
    if cuda_count == 1 or cuda_count == n:
        return Check("topology.gpus", PASS, f"{cuda_count} visible GPU(s) for LOCAL_WORLD_SIZE={n}")
    if cuda_count > n:
        return Check(
            "topology.gpus",
            WARN,
            f"{cuda_count} GPUs visible but only LOCAL_WORLD_SIZE={n} processes: {cuda_count - n} idle",
            f"start {cuda_count} processes per node (--nproc-per-node {cuda_count})",
        )
    return Check(
        "topology.gpus",
        FAIL,
        f"LOCAL_WORLD_SIZE={n} processes but only {cuda_count} GPUs visible",
        f"start at most {cuda_count} processes per node (--nproc-per-node {cuda_count})",
    )


def check_flight_recorder(backend: str, environ: dict[str, str]) -> Check:
    if backend != "nccl":
        return Check("observe.flight_recorder", PASS, f"backend {backend}: NCCL flight recorder not applicable")
    size = environ.get("TORCH_FR_BUFFER_SIZE") or environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
    if size == "0":
        return Check(
            "observe.flight_recorder",
            WARN,
            "NCCL flight recorder off: a hang leaves no record of the last collectives",
            "export TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=<run_dir>/nccl_trace/rank_ (docs/doctor.md)",
        )
    return Check("observe.flight_recorder", PASS, f"NCCL flight recorder on (buffer {size} entries)")


def _retry(what: Callable[[], Any], deadline: float, pause: float = 0.25) -> tuple[Any, BaseException | None, int]:
    """Call ``what`` until it returns or ``deadline`` (monotonic) passes; back off up to 2 s between tries."""
    tries = 0
    while True:
        tries += 1
        try:
            return what(), None, tries
        except OSError as e:
            if time.monotonic() + pause > deadline:
                return None, e, tries
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def _check_store_host(where: str, port: int, family: socket.AddressFamily, addr: str, addrs: list[str]) -> Check:
    """Rank 0 outside torchrun opens the store itself: the port must be free here, MASTER_ADDR one of ours."""
    try:  # the store listens on all interfaces at MASTER_PORT, as TCPStore does
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
    except OSError as e:
        return Check(
            "rendezvous",
            FAIL,
            f"{where}: rank 0 cannot open the rendezvous store on port {port} ({e.strerror})",
            "pick a free MASTER_PORT (another job or a stale process holds this one)",
        )
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        return Check(
            "rendezvous",
            WARN,
            f"{where} resolves to {addr}, not an address of this host where rank 0 runs",
            "fine if MASTER_ADDR forwards to this host (a Service); otherwise run rank 0 on MASTER_ADDR's host",
        )
    return Check(
        "rendezvous",
        PASS,
        f"{where} resolves to {', '.join(addrs)}; port free for rank 0's store",
        data={"addrs": addrs},
    )


def check_rendezvous(env: DistEnv, timeout_s: float, hosts_store: bool) -> Check:
    """MASTER_ADDR resolves and MASTER_PORT answers, retried for ``timeout_s``. Runs before the process group:
    init_process_group itself would block on a dead endpoint for the whole init timeout.

    ``hosts_store``: this process will open the store itself (rank 0 outside torchrun), so the port must be
    free to bind on this host instead of answering.
    """
    if env.world_size == 1:
        return Check("rendezvous", PASS, "single process: no rendezvous endpoint needed")
    host, port, where = env.master_addr, env.master_port, f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port}"
    deadline = time.monotonic() + timeout_s
    infos, err, tries = _retry(lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), deadline)
    if err is not None:
        return Check(
            "rendezvous",
            FAIL,
            f"{where}: name does not resolve ({err}) after {tries} tries in {timeout_s:g} s",
            "set MASTER_ADDR to rank 0's resolvable host name or IP (Kubernetes: the master pod's service must exist)",
        )
    addrs = sorted({i[4][0] for i in infos})
    if hosts_store:
        return _check_store_host(where, port, infos[0][0], infos[0][4][0], addrs)

    def connect() -> None:
        with socket.create_connection((host, port), timeout=max(0.5, min(5.0, deadline - time.monotonic()))):
            pass

    t0 = time.monotonic()
    _, err, tries = _retry(connect, deadline)
    if err is not None:
        return Check(
            "rendezvous",
            FAIL,
            f"{where} ({', '.join(addrs)}): nothing accepts connections ({err}) after {tries} tries in {timeout_s:g} s",
            "start rank 0 / the rendezvous host first, check MASTER_PORT and firewalls, or raise doctor.rendezvous_timeout_s",
        )
    return Check(
        "rendezvous",
        PASS,
        f"{where} resolves to {', '.join(addrs)}; port reachable in {time.monotonic() - t0:.2f} s ({tries} tries)",
        data={"addrs": addrs, "tries": tries},
    )


def shm_need_bytes(cfg: JobConfig, micro_batch_size: int, local_world_size: int) -> int:
    """Shared memory the DataLoader workers of all ranks on this node hold at once: each worker keeps
    prefetch_factor uint8 batches in /dev/shm, for the train and the val loader."""
    if cfg.data.num_workers == 0 or cfg.data.source == "synthetic":
        return 0
    batch = micro_batch_size * (3 * cfg.data.image_size**2 + 8)
    return 2 * cfg.data.num_workers * cfg.data.prefetch_factor * batch * local_world_size


def check_shm(need: int, path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check(
            "shm",
            FAIL if need else WARN,
            f"{path}: {e.strerror}",
            "mount a tmpfs at /dev/shm or set data.num_workers 0",
        )
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    data = {"size_bytes": size, "free_bytes": free, "need_bytes": need}
    mb = 2**20
    if need == 0:
        return Check("shm", PASS, f"{path}: {free / mb:.0f} MiB free; no DataLoader workers use it", data=data)
    text = f"{path}: {free / mb:.1f} MiB free of {size / mb:.1f} MiB; DataLoader workers need about {need / mb:.1f} MiB"
    fix = (
        f"give the container more shared memory (docker/podman --shm-size={max(1, 2 * need // mb)}m, Kubernetes emptyDir "
        "medium: Memory on /dev/shm) or lower data.num_workers / data.prefetch_factor"
    )
    if free < need:
        return Check("shm", FAIL, text, fix, data)
    if free < 2 * need:
        return Check("shm", WARN, text + " (less than 2x headroom)", fix, data)
    return Check("shm", PASS, text, data=data)


def checkpoint_bytes(cfg: JobConfig, model: Any) -> int:
    """Estimated size of one checkpoint of ``model`` (its shapes; a meta model will do): fp32 weights + buffers +
    optimizer state (SGD momentum 1x, AdamW 2x)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    states = 2 if cfg.optim.name == "adamw" else (1 if cfg.optim.momentum > 0 else 0)
    return int(params * (1 + states) + buffers + 2**20)  # + trainer state, RNGs, manifest


def check_run_dir(run_dir: Path, ckpt_bytes: int, keep_last: int, create: bool) -> list[Check]:
    """Writable (by writing, not os.access: root passes os.access on read-only mounts) and big enough for
    keep_last checkpoints plus the one being written."""
    existing = next((p for p in [run_dir, *run_dir.parents] if p.exists()), Path("/"))
    fix_dir = (
        "set run.output_dir (--run.output-dir / JOB_RUN__OUTPUT_DIR) to a writable directory on a shared file system"
    )
    try:
        if create:
            run_dir.mkdir(parents=True, exist_ok=True)
            existing = run_dir
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".ddp-job-probe-") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return [
            Check(
                "storage.writable", FAIL, f"run directory {run_dir}: cannot write in {existing} ({e.strerror})", fix_dir
            )
        ]
    checks = [Check("storage.writable", PASS, f"run directory {run_dir} writable (probe in {existing})")]
    checks.append(check_space(run_dir, existing, ckpt_bytes, keep_last))
    return checks


def check_space(run_dir: Path, existing: Path, ckpt_bytes: int, keep_last: int) -> Check:
    """Free space for keep_last checkpoints plus the one being written, less what the run's own checkpoints
    already hold (pruning deletes them as new ones are written), but always room for one more. A FAIL is
    transient (exit 1): freeing space heals it."""
    free = shutil.disk_usage(existing).free
    total = ckpt_bytes * (keep_last + 1)
    held = ckpt.held_bytes(run_dir)
    need = max(total - held, ckpt_bytes)
    mb = 2**20
    text = (
        f"{free / mb:.0f} MiB free at {existing}; checkpoints need about {total / mb:.0f} MiB "
        f"({ckpt_bytes / mb:.1f} MiB x (ckpt.keep_last={keep_last} + 1 being written))"
    )
    if held:
        text += f", {need / mb:.0f} MiB more than the {held / mb:.0f} MiB of checkpoints the run holds"
    data = {"free_bytes": free, "need_bytes": need, "held_bytes": held, "checkpoint_bytes": ckpt_bytes}
    fix = "free space, point run.output_dir elsewhere, or lower ckpt.keep_last"
    status = FAIL if free < need else (WARN if free < 2 * need else PASS)
    return Check("storage.space", status, text, fix if status != PASS else "", data)


SAVE_PROBE_BYTES = 64 * 2**20
"""The most ``ddp-job doctor`` writes to time the run directory's storage; a bigger checkpoint's write time is
extrapolated from it."""
NOTICE_FIX = (
    "give the stop a longer notice (Slurm: the --signal lead time of slurm/train.sbatch; Kubernetes: "
    "terminationGracePeriodSeconds and the DDP_JOB_NOTICE_S beside it, TORCH_ELASTIC_SHUTDOWN_TIMEOUT below it), "
    "put run.output_dir on faster storage, or stop before a time limit with train.max_time"
)


def time_write(directory: Path, nbytes: int) -> float:
    """Seconds to write and fsync ``nbytes`` of random bytes (incompressible, as weights are) into a new file in
    ``directory``; the file is removed afterwards."""
    chunk = os.urandom(min(nbytes, 2**20))
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".ddp-job-save-probe-") as f:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:left])
        f.flush()
        os.fsync(f.fileno())
        return time.perf_counter() - t0


def measured_save_s(directory: Path, ckpt_bytes: int, probe_bytes: int = SAVE_PROBE_BYTES) -> tuple[float, str]:
    """(seconds, how it was measured): the time one process takes to write a checkpoint of ``ckpt_bytes`` into
    ``directory``, timed on at most ``probe_bytes`` and scaled linearly (a lower bound of a real save, which also
    gathers and serialises the state)."""
    probe = max(1, min(ckpt_bytes, probe_bytes))
    seconds = time_write(directory, probe) * ckpt_bytes / probe
    mib = 2**20
    how = f"writing its {ckpt_bytes / mib:.1f} MiB from one process, timed now on {probe / mib:.1f} MiB"
    return seconds, how


def check_stop_notice(save_s: float, how: str, notice_s: float, source: str) -> Check:
    """Whether a stop save fits in the launcher's notice (the seconds from its stop signal to its hard kill): a
    WARN naming both numbers and the fix when it does not, since a preemption then loses the work since the newest
    periodic save. ``how``: where ``save_s`` comes from; ``source``: where ``notice_s`` does (0: none stated)."""
    data = {"save_s": save_s, "notice_s": notice_s, "source": source}
    if not notice_s:
        return Check(
            "stop.notice",
            PASS,
            f"no stop notice stated ({NOTICE_VAR} unset, ckpt.grace_s 0): nothing to compare",
            data=data,
        )
    text = f"a checkpoint save takes about {save_s:.2f} s ({how}); the stop notice is {notice_s:g} s ({source})"
    if save_s >= notice_s:
        text += ": a stop save does not fit, so a preemption loses the work since the newest periodic save"
        return Check("stop.notice", WARN, text, NOTICE_FIX, data)
    return Check("stop.notice", PASS, text, data=data)


def check_notice(cfg: JobConfig, environ: Mapping[str, str], directory: Path, ckpt_bytes: int) -> Check:
    """``check_stop_notice`` for this job: its notice (``ckpt.grace_s``, else the launcher's ``DDP_JOB_NOTICE_S``)
    and a save timed now in ``directory`` (only when a notice is stated)."""
    try:
        notice_s, source = stop_notice_s(cfg.ckpt.grace_s, environ)
    except BadInput as e:
        return Check("stop.notice", FAIL, e.what, e.fix)
    if not notice_s:
        return check_stop_notice(0.0, "", 0.0, source)
    try:
        save_s, how = measured_save_s(directory, ckpt_bytes)
    except OSError as e:
        return Check("stop.notice", WARN, f"could not time a write in {directory} ({e.strerror})", NOTICE_FIX)
    return check_stop_notice(save_s, how, notice_s, source)


def check_data(cfg: JobConfig, describe_data: Callable[[DataConfig], str]) -> Check:
    """The data as ``describe_data`` reads it (the data package's own validation, one file actually read)."""
    try:
        text = describe_data(cfg.data)
    except BadInput as e:
        return Check("storage.data", FAIL, e.what, e.fix or "fix data.path / data.num_classes")
    return Check("storage.data", PASS, text)


def check_memory(strategy: str, ddp: memory.MemoryEstimate, fsdp: memory.MemoryEstimate, capacity: int) -> Check:
    """The estimated bytes per device (job.parallel.memory) of the chosen strategy against ``capacity``, the other
    strategy beside it. A ddp run that cannot fit where fsdp would is a FAIL naming ``--train.strategy fsdp``."""
    mib = 2**20
    chosen = fsdp if strategy == "fsdp" else ddp
    text = (
        f"train.strategy={strategy}: about {chosen.total / mib:.0f} MiB per device of {capacity / mib:.0f} MiB "
        f"(ddp {ddp.total / mib:.0f} MiB, {fsdp.label} {fsdp.total / mib:.0f} MiB; activations "
        f"{chosen.activations / mib:.0f} MiB from the preflight batch)"
    )
    data = {"ddp": asdict(ddp), "fsdp": asdict(fsdp), "capacity_bytes": capacity, "table": ddp.table(fsdp)}
    found = memory.verdict(strategy, ddp, fsdp, capacity)
    if found == memory.USE_FSDP:
        return Check("memory", FAIL, text + ": ddp does not fit", "--train.strategy fsdp (docs/sharding.md)", data)
    if found == memory.NONE_FITS:
        fix = (
            "more processes under --train.strategy fsdp, a smaller train.micro_batch_size (gradient accumulation), "
            "or train.precision bf16"
        )
        return Check("memory", WARN, text + ": may run out of memory", fix, data)
    return Check("memory", PASS, text, data=data)
