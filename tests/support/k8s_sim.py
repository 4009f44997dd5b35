"""Run a rendered PyTorchJob pod by pod, as the Kubeflow training operator (v1.9.4) and kubelet would.

Follows the simulation recipe of the operator's behaviour (OPERATOR-BEHAVIOUR.md §8), with one
network namespace per pod on a private bridge:

* pods ``<job>-master-0`` / ``<job>-worker-<i>`` (§2), each with its own IP, hostname, mount and PID
  namespace and a root filesystem of its own (tests/support/k8s_pod.py) that applies the manifest's
  securityContext, its own ``/etc/hosts`` (a file in the simulation's work directory, replaced by rename
  and seen by its containers through a link) that always holds its own name and holds the other pods'
  names only while their container runs: what the headless Services' DNS records do (Ready pods only);
* the operator's environment appended after the container's own ``env`` (§3, ``operator_env``);
* worker pods wait for ``<job>-master-0`` to resolve first (the ``init-pytorch`` init container);
* the container's ``command`` + ``args`` executed as written in the simulated image (no image registry
  here): the host's operating system read-only, docker/Dockerfile's layout, the checkout under test
  read-only at ``/opt/ddp-job`` and the project's venv at ``/opt/venv`` (``image_layers``), with ``PATH``
  and ``PYTHONPATH`` pointing there (``IMAGE_ENV``). Never the host paths: a pod's root holds only the
  image and its volumes, so a checkout under ``/tmp`` would not exist inside the pods. ConfigMaps become
  read-only directories, the PVC one shared directory, ``emptyDir: {medium: Memory}`` a size-limited tmpfs;
* restarts per ``restartPolicy`` (§4) with the kubelet's CrashLoopBackOff, the job's conditions (§5),
  ``backoffLimit`` and ``cleanPodPolicy`` (§6); evicted pods (node drain) are recreated with a new IP.

Addresses come from 10.232.0.0/24 and exist only inside these namespaces; the simulation's own bridge
has no address in the host namespace, so no traffic leaves them. A simulation creates nothing on the
host outside its work directory but its uniquely named network namespaces, veths and bridge
(``Network``), so any number of simulations of either API run at once. Needs root and iproute2.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
POD_SHIM = Path(__file__).resolve().parent / "k8s_pod.py"
OPERATOR_SUBNET = "10.232.0"  # the first three octets of the PyTorchJob pods' addresses
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_SRC, IMAGE_VENV = "/opt/ddp-job", "/opt/venv"  # where docker/Dockerfile puts the project and its venv
# The image's own environment (its ENV lines), before the container's env. PYTHONPATH: the venv's editable
# install points at the checkout's host path, which a pod does not see; the image's copy is imported instead.
IMAGE_ENV = {"PATH": f"{IMAGE_VENV}/bin:{IMAGE_PATH}", "PYTHONPATH": IMAGE_SRC, "PYTHONDONTWRITEBYTECODE": "1"}
# The host's operating system as the image's base layer (read-only); merged-/usr links are made as links.
OS_LAYERS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
NAMESPACE, CLUSTER_DOMAIN = "default", "cluster.local"
RETRYABLE = 128  # ExitCode policy: exit codes >= 128 are retried (§4)
EVICTED = 0xBEEF  # the operator's sentinel when no terminated state is found
# containerd's default capabilities of a container (its CRI's default spec); securityContext.capabilities
# drops from and adds to these
DEFAULT_CAPABILITIES = frozenset(
    [
        "CHOWN",
        "DAC_OVERRIDE",
        "FSETID",
        "FOWNER",
        "MKNOD",
        "NET_RAW",
        "SETGID",
        "SETUID",
        "SETFCAP",
        "SETPCAP",
        "NET_BIND_SERVICE",
        "SYS_CHROOT",
        "KILL",
        "AUDIT_WRITE",
    ]
)
# A container without a securityContext in an image that runs as root (the operator's init container)
ROOT_CONTAINER = {
    "uid": 0,
    "gid": 0,
    "groups": [],
    "capabilities": sorted(DEFAULT_CAPABILITIES),
    "no_new_privs": False,
    "read_only_root": False,
}
IFNAMSIZ = 15  # the longest Linux interface name
NET_FILES_MOUNT = ".pod"  # where a pod's hosts and resolv.conf are mounted, under its /etc (``etc_links``)
_serials = itertools.count()
T = TypeVar("T")


@dataclass(frozen=True)
class Network:
    """One simulation's cluster network: a bridge, one network namespace and veth pair per pod, and a /24.

    Every name carries the owning process's pid and a serial number, so any number of simulations (of
    either API, in any number of test processes) run at once, each removing only its own; what a process
    killed hard left behind is recognised by its dead owner and removed by the next simulation
    (``sweep_orphans``). The /24 may repeat: each bridge is its own link, unreachable from the host."""

    subnet: str  # the first three octets
    owner: int = field(default_factory=os.getpid)
    serial: int = field(default_factory=lambda: next(_serials))

    @property
    def tag(self) -> str:
        return f"{self.owner}x{self.serial}"

    @property
    def bridge(self) -> str:
        return _ifname(f"sb{self.tag}")

    @property
    def ns_prefix(self) -> str:
        return f"sim-{self.tag}-"

    def veth(self, index: int, end: str) -> str:
        """The host (``v``) or pod (``p``) end of pod ``index``'s veth pair."""
        return _ifname(f"s{self.tag}{end}{index}")


def _ifname(name: str) -> str:
    if len(name) > IFNAMSIZ:
        raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ} characters")
    return name


# ----------------------------------------------------------------------------- pure operator logic
def replica_types(job: dict) -> dict[str, dict]:
    """pytorchReplicaSpecs after the controller's defaulting (§1c): Master/Worker keys, replicas 1,
    restartPolicy OnFailure."""
    out = {}
    for key, rs in job["spec"]["pytorchReplicaSpecs"].items():
        rs = dict(rs)
        rs.setdefault("replicas", 1)
        rs.setdefault("restartPolicy", "OnFailure")
        out[key.capitalize()] = rs
    return out


def pod_names(job: dict) -> list[tuple[str, int, str]]:
    """(replica type, index, pod name) of every pod the operator creates (§2), Master first."""
    name = job["metadata"]["name"]
    types = replica_types(job)
    return [
        (t, i, f"{name}-{t.lower()}-{i}".replace("/", "-"))
        for t in ("Master", "Worker")
        if t in types
        for i in range(types[t]["replicas"])
    ]


def _port(rs: dict) -> int:
    c = next(c for c in rs["template"]["spec"]["containers"] if c["name"] == "pytorch")
    return next((p["containerPort"] for p in c.get("ports") or [] if p.get("name") == "pytorchjob-port"), 23456)


def operator_env(job: dict, rtype: str, index: int) -> list[tuple[str, str]]:
    """The variables the operator appends to every container of pod (rtype, index), in its order (§3)."""
    spec, name = job["spec"], job["metadata"]["name"]
    types = replica_types(job)
    elastic = spec.get("elasticPolicy")
    nproc = spec.get("nprocPerNode")
    if nproc is None and not (elastic and elastic.get("nProcPerNode") is not None):
        nproc = "auto"
    nproc_int = int(nproc) if isinstance(nproc, str) and nproc.isdigit() else 1
    total = sum(rs["replicas"] for rs in types.values())
    rank = 0 if rtype == "Master" else index + ("Master" in types)
    env = [("PYTHONUNBUFFERED", "1")]
    if "Master" in types:
        port = str(_port(types["Master"]))
        env += [
            ("MASTER_PORT", port),
            ("PET_MASTER_PORT", port),
            ("MASTER_ADDR", f"{name}-master-0"),
            ("PET_MASTER_ADDR", f"{name}-master-0"),
            ("WORLD_SIZE", str(total * nproc_int)),
            ("RANK", str(rank)),
            ("PET_NODE_RANK", str(rank)),
        ]
    if nproc is not None:
        env.append(("PET_NPROC_PER_NODE", str(nproc)))
    if elastic is not None:
        workers = types["Worker"]["replicas"]
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        lo, hi = (lo or hi or workers), (hi or lo or workers)
        host = elastic.get("rdzvHost") or f"{name}-worker-0"
        env += [
            ("PET_RDZV_ENDPOINT", f"{host}:{elastic.get('rdzvPort') or _port(types['Worker'])}"),
            ("PET_RDZV_BACKEND", elastic.get("rdzvBackend") or "c10d"),
            ("PET_NNODES", f"{lo}:{hi}"),
        ]
        if elastic.get("maxRestarts") is not None:
            env.append(("PET_MAX_RESTARTS", str(elastic["maxRestarts"])))
        if elastic.get("nProcPerNode") is not None:
            env.append(("PET_NPROC_PER_NODE", str(elastic["nProcPerNode"])))
        if elastic.get("rdzvId") is not None:
            env.append(("PET_RDZV_ID", str(elastic["rdzvId"])))
        if elastic.get("rdzvConf"):
            env.append(("PET_RDZV_CONF", ",".join(f"{kv['key']}={kv['value']}" for kv in elastic["rdzvConf"])))
        if elastic.get("standalone"):
            env.append(("PET_STANDALONE", ""))
    else:
        env.append(("PET_NNODES", str(total)))
    return env


def backoff_s(restarts: int, base: float) -> float:
    """kubelet's CrashLoopBackOff before restart number ``restarts`` (1-based): 10 s doubling to 5 min."""
    return min(base * 2 ** (restarts - 1), 30 * base)


def _tmpfs_size(quantity: str | None) -> str:
    m = re.fullmatch(r"(\d+)([KMGT]i)?", quantity or "64Mi")  # runtime default /dev/shm: 64 MiB
    if not m:
        raise ValueError(f"emptyDir sizeLimit={quantity!r}: the simulation supports <n>Ki/Mi/Gi/Ti")
    return m.group(1) + (m.group(2) or "")[:1].lower()


# ----------------------------------------------------------------------------- security
def image_user(dockerfile: Path = REPO / "docker" / "Dockerfile") -> tuple[int, int]:
    """The image's user and group (its last numeric ``USER uid[:gid]``): a container's when the manifest names none."""
    users = re.findall(r"^USER\s+(\d+)(?::(\d+))?\s*$", dockerfile.read_text(), re.M)
    if not users:
        raise ValueError(f"{dockerfile} has no numeric USER line")
    uid, gid = users[-1]
    return int(uid), int(gid or 0)


def security_context(pod_spec: dict, container: dict) -> dict:
    """The user, groups, capabilities and restrictions that the kubelet and runc give ``container``
    (tests/support/k8s_pod.py's ``security``): the container's securityContext over the pod's, the image's user
    when neither names one, ``fsGroup`` and ``supplementalGroups`` as supplementary groups, containerd's default
    capabilities less ``drop`` plus ``add``, ``no_new_privs`` only for ``allowPrivilegeEscalation: false``."""
    pod_sc, sc = pod_spec.get("securityContext") or {}, container.get("securityContext") or {}
    if sc.get("privileged"):
        raise ValueError(f"container {container.get('name')}: privileged containers are not simulated")
    uid, gid = sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if uid is None:
        uid, image_gid = image_user()
        if gid is None:
            gid = image_gid
    groups = [g for g in (pod_sc.get("fsGroup"), *(pod_sc.get("supplementalGroups") or [])) if g is not None]
    caps = sc.get("capabilities") or {}
    drop = {c.removeprefix("CAP_") for c in caps.get("drop") or []}
    add = {c.removeprefix("CAP_") for c in caps.get("add") or []}
    if "ALL" in add:
        raise ValueError(f"container {container.get('name')}: capabilities.add ALL is not simulated")
    kept = set() if "ALL" in drop else set(DEFAULT_CAPABILITIES - drop)
    return {
        "uid": uid,
        "gid": gid or 0,  # a runAsUser without runAsGroup: the runtime's group 0 (no passwd entry in the image)
        "groups": groups,
        "capabilities": sorted(kept | add),
        "no_new_privs": sc.get("allowPrivilegeEscalation") is False,
        "read_only_root": bool(sc.get("readOnlyRootFilesystem")),
    }


def set_volume_ownership(path: Path, fs_group: int | None, read_only: bool = False) -> None:
    """The kubelet's ``SetVolumeOwnership`` for a pod's ``fsGroup``: every file and directory of the volume
    gets that group, read and write for it (read-only volumes: read), directories also search and setgid, so
    that what the pod's user creates there stays the group's. Without an fsGroup a volume keeps its owner
    (root here): a non-root container cannot write it, as on a cluster."""
    if fs_group is None:
        return
    mask = 0o440 if read_only else 0o660
    for top, _dirs, files in os.walk(path):
        for name in (top, *(os.path.join(top, f) for f in files)):
            _own(name, fs_group, mask)


def _own(path: str, gid: int, mask: int) -> None:
    try:
        st = os.lstat(path)
        os.lchown(path, -1, gid)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode) | mask | 0o110 | stat.S_ISGID)
        elif not stat.S_ISLNK(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode) | mask)
    except FileNotFoundError:  # a running pod renamed or removed it meanwhile
        pass


# ----------------------------------------------------------------------------- the image
def _console_script(path: Path) -> bool:
    """A script that names its interpreter by absolute path (``#!/.../bin/python``), as pip writes them."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        first = f.read(256).split(b"\n", 1)[0]
    return re.fullmatch(rb"#!\s*/\S*/python[\d.]*\s*", first) is not None


def image_bin(venv: Path, out: Path) -> Path:
    """The venv's ``bin/`` as it would be had the venv been made at IMAGE_VENV. A venv found at another path
    still works (python finds ``pyvenv.cfg`` next to ``bin/`` and its site-packages from there), but each
    console script's shebang names the old interpreter path. So the console scripts are written again with
    the image's interpreter; the interpreter (symlinks, or copies in a ``--copies`` venv) is kept as it is;
    the rest (activate scripts, native dev tools) is not part of a runtime image."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for entry in sorted((venv / "bin").iterdir()):
        dest = out / entry.name
        if entry.is_symlink():
            dest.symlink_to(os.readlink(entry))
        elif entry.name.startswith("python"):
            shutil.copy2(entry, dest)
        elif _console_script(entry):
            dest.write_bytes(f"#!{IMAGE_VENV}/bin/python\n".encode() + entry.read_bytes().split(b"\n", 1)[1])
            dest.chmod(0o755)
    return out


def interpreter_prefix(venv: Path) -> Path:
    """Where the venv's base interpreter is installed (``home`` in pyvenv.cfg is its ``bin/``)."""
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return Path(value.strip()).resolve().parent
    raise ValueError(f"{venv / 'pyvenv.cfg'} has no 'home' line: not a venv")


def image_layers(venv: Path, bin_dir: Path) -> list[dict]:
    """The image's read-only layers, in mount order (tests/support/k8s_pod.py mounts them into each container's own
    root): the host's operating system, a container's /dev, the base interpreter that the venv links to (at its
    own path), the checkout at IMAGE_SRC and the venv at IMAGE_VENV with its rewritten ``bin/``."""
    layers: list[dict] = []
    for name in OS_LAYERS:
        path = Path("/") / name
        if path.is_symlink():
            layers.append({"kind": "symlink", "source": os.readlink(path), "target": str(path)})
        elif name == "etc":  # under each pod's links to its hosts and resolv.conf (tests/support/k8s_pod.py)
            layers.append({"kind": "etc", "source": str(path), "target": str(path)})
        elif path.is_dir():
            layers.append({"kind": "bind", "source": str(path), "target": str(path), "read_only": True})
    layers.append({"kind": "dev", "target": "/dev"})  # runc's /dev, not the host's
    prefix = interpreter_prefix(venv)
    if not prefix.is_relative_to("/usr"):
        layers.append({"kind": "bind", "source": str(prefix), "target": str(prefix), "read_only": True})
    return [
        *layers,
        {"kind": "bind", "source": str(REPO), "target": IMAGE_SRC, "read_only": True},
        {"kind": "bind", "source": str(venv.resolve()), "target": IMAGE_VENV, "read_only": True},
        {"kind": "bind", "source": str(bin_dir), "target": f"{IMAGE_VENV}/bin", "read_only": True},
    ]


# ----------------------------------------------------------------------------- pods
@dataclass
class Pod:
    name: str
    rtype: str
    index: int
    netns: str
    veth: int
    ip: str = ""
    phase: str = "Pending"  # Pending, Running, Succeeded, Failed
    reason: str = ""
    restarts: int = 0
    generation: int = 0  # +1 per (re)creation by the operator
    exit_codes: list[int] = field(default_factory=list)
    ready: bool = False
    deleting: bool = False
    pid1: int | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    hosts: Path | None = None  # its /etc/hosts on the host, made with its network (make_pod_network)


def container_spec(pod: Pod, label: str, workdir: Path, layers: list[dict], mounts: list[dict], **run: Any) -> dict:
    """tests/support/k8s_pod.py's SPEC for one container run of ``pod`` (``label``: the run's number, or ``init``):
    its own root under ``workdir``, the pod's network namespace, hosts file and hostname; ``run`` holds the
    container's ``command``, ``env``, ``cwd`` and ``security`` (``security_context``)."""
    if pod.hosts is None:
        raise RuntimeError(f"pod {pod.name} has no network yet")
    stem = f"{pod.name}.{pod.generation}.{label}"
    root = workdir / "pods" / f"{stem}.root"
    root.mkdir(parents=True, exist_ok=True)  # an empty mount point: the shim mounts the container's root on it
    return {
        "hostname": pod.name,
        "netns": f"/run/netns/{pod.netns}",
        "root": str(root),
        "net_files": str(pod.hosts.parent),
        "net_files_target": f"/etc/{NET_FILES_MOUNT}",
        "etc_links": str(etc_links(pod.hosts.parent)),
        "layers": layers,
        "mounts": mounts,
        "pid_file": str(workdir / "pods" / f"{stem}.pid"),
        **run,
    }


def run_container_once(sim: Any, pod: Pod, run: int, started: str) -> int:
    """One run of ``pod``'s container for a simulation of either API (its ``_spec``, ``_publish`` and
    ``_event``): Ready (in every hosts file) while it runs; returns its exit code."""
    spec = sim._spec(pod, run)
    spec_path = Path(spec["pid_file"]).with_suffix(".json")
    spec_path.write_text(json.dumps(spec))
    proc, log, pod.pid1 = start_container(spec_path, sim.workdir / "logs" / f"{pod.name}.{pod.generation}.{run}.log")
    pod.phase, pod.ready = "Running", True  # no readiness probe: Ready once started
    sim._publish()
    sim._event(pod.name, started)
    rc = proc.wait()
    log.close()
    pod.ready, pod.pid1 = False, None
    sim._publish()
    pod.exit_codes.append(rc)
    sim._event(pod.name, f"exited {rc}")
    return rc


def signal_pod(sim: Any, name: str, sig: int) -> None:
    """Signal pod ``name``'s container PID 1 (either API's simulation); SIGKILL takes the whole pod with it."""
    pid = sim.pods[name].pid1
    if pid is None:
        raise RuntimeError(f"pod {name} has no running container to signal")
    os.kill(pid, sig)
    sim._event(name, f"signal {signal.Signals(sig).name}")


def wait_for_condition(sim: Any, final: tuple[str, ...], timeout: float) -> str:
    """Poll ``sim.condition`` (a simulated job of either API) until it is one of ``final``; returns it."""
    deadline = time.monotonic() + timeout
    while sim.condition not in final:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"job still {sim.condition} after {timeout} s; pods: "
                f"{[(p.name, p.phase, p.exit_codes) for p in sim.pods.values()]}"
            )
        time.sleep(0.2)
    return sim.condition


class Simulation:
    """The operator + kubelets for one rendered manifest set. Use as a context manager: the
    namespaces, bridge, hosts files and processes are removed on exit, also after a failure."""

    def __init__(
        self, docs: list[dict], workdir: Path, *, backoff_base_s: float = 10.0, venv: Path = REPO / ".venv"
    ) -> None:
        self.job = next(d for d in docs if d["kind"] == "PyTorchJob")
        self.config_maps = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d["kind"] == "ConfigMap"}
        self.workdir, self.venv, self.backoff_base_s = workdir, venv, backoff_base_s
        self.types = replica_types(self.job)
        self.net = Network(OPERATOR_SUBNET)
        self.pods = {n: Pod(n, t, i, self.net.ns_prefix + n, k) for k, (t, i, n) in enumerate(pod_names(self.job))}
        self.events: list[tuple[float, str, str]] = []
        self._lock = threading.RLock()
        self._next_ip = 10
        self.image: list[dict] = []  # the image's layers, made on __enter__
        self.condition = "Created"
        self._stopped = threading.Event()

    # --------------------------------------------------------------------- network
    def __enter__(self) -> Simulation:
        sweep_orphans()  # what a simulation killed hard left behind
        (self.workdir / "logs" / "init").mkdir(parents=True, exist_ok=True)
        make_bridge(self.net)
        for pod in self.pods.values():
            make_pod_network(pod, self.net, self.workdir / "net")
        for pod in self.pods.values():
            self._assign_ip(pod)
        self.image = image_layers(self.venv, image_bin(self.venv, self.workdir / "image" / "bin"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        for pod in self.pods.values():
            pod.stop.set()
        teardown(self.net)
        for pod in self.pods.values():
            if pod.thread:
                pod.thread.join(timeout=10)

    def _assign_ip(self, pod: Pod) -> None:
        """A new pod gets a new IP (a restarted container keeps its pod's)."""
        set_pod_ip(pod, f"{self.net.subnet}.{self._next_ip}")
        self._next_ip += 1
        self._publish()

    def _publish(self) -> None:
        """Replace every pod's /etc/hosts (running pods see the new file at once, ``write_hosts``): its
        own name (kubelet) plus the Services of Ready pods (cluster DNS)."""
        with self._lock:
            ready = [p for p in self.pods.values() if p.ready]
            for pod in self.pods.values():
                lines = ["127.0.0.1 localhost", f"{pod.ip} {pod.name}"]
                lines += [f"{p.ip} {p.name} {p.name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}" for p in ready if p is not pod]
                write_hosts(pod, lines)

    def _event(self, pod: str, what: str) -> None:
        with self._lock:
            self.events.append((time.monotonic(), pod, what))

    # --------------------------------------------------------------------- kubelet
    def _container(self, pod: Pod) -> tuple[dict, dict]:
        tmpl = self.types[pod.rtype]["template"]["spec"]
        return tmpl, next(c for c in tmpl["containers"] if c["name"] == "pytorch")

    def _spec(self, pod: Pod, run: int) -> dict:
        tmpl, c = self._container(pod)
        pod_dir = self.workdir / "pods" / f"{pod.name}.{pod.generation}"
        mounts = volume_mounts(pod.name, c, tmpl, self.config_maps, self.workdir, pod_dir)
        env = {**IMAGE_ENV, "HOSTNAME": pod.name}
        for e in c.get("env") or []:  # the user's env first ...
            if "value" not in e and "valueFrom" in e:
                raise ValueError(f"{pod.name}: env {e['name']} uses valueFrom, not simulated")
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e.get("value", ""))
        env.update(operator_env(self.job, pod.rtype, pod.index))  # ... then the operator's, which win
        command = [*(c.get("command") or []), *(c.get("args") or [])]
        return container_spec(
            pod,
            str(run),
            self.workdir,
            self.image,
            mounts,
            command=command,
            env=env,
            cwd=c.get("workingDir", "/"),
            security=security_context(tmpl, c),
        )

    def _wait_for_master(self, pod: Pod) -> bool:
        """The init-pytorch init container: nslookup <job>-master-0 up to 100 times, 2 s apart (here
        ``getent hosts``, in a container of the pod: its network, its hosts file)."""
        master = f"{self.job['metadata']['name']}-master-0"
        spec = container_spec(
            pod,
            "init",
            self.workdir,
            self.image,
            [],
            command=["getent", "hosts", master],
            env={"PATH": IMAGE_PATH},
            security=ROOT_CONTAINER,  # the operator's init container: its own image, no securityContext
        )
        spec_path = Path(spec["pid_file"]).with_suffix(".json")
        spec_path.write_text(json.dumps(spec))
        for attempt in range(100):
            proc, log, _ = start_container(spec_path, self.workdir / "logs" / "init" / f"{pod.name}.{attempt}.log")
            rc = proc.wait()
            log.close()
            if rc == 0:
                return True
            if pod.stop.wait(2):
                return False
        return False

    def _kubelet(self, pod: Pod) -> None:
        policy = self.types[pod.rtype]["restartPolicy"]
        pod_policy = "Never" if policy == "ExitCode" else policy
        if pod.rtype == "Worker" and "Master" in self.types and not self._wait_for_master(pod):
            pod.phase, pod.reason = "Failed", "Init:Error"
            pod.exit_codes.append(EVICTED)
            return
        run = 0
        while not pod.stop.is_set():
            rc = run_container_once(self, pod, run, f"started ip={pod.ip} run={run}")
            if pod.deleting or pod.stop.is_set():
                pod.phase, pod.reason = "Failed", "Deleted"
                return
            if pod_policy == "Always" or (pod_policy == "OnFailure" and rc != 0):
                pod.restarts += 1
                run += 1
                if pod.stop.wait(backoff_s(pod.restarts, self.backoff_base_s)):
                    return
                continue
            pod.phase = "Succeeded" if rc == 0 else "Failed"
            return

    def _create(self, pod: Pod) -> None:
        pod.phase, pod.reason, pod.restarts, pod.deleting = "Pending", "", 0, False
        pod.stop = threading.Event()
        pod.thread = threading.Thread(target=self._kubelet, args=(pod,), name=pod.name, daemon=True)
        self._event(pod.name, f"created generation={pod.generation}")
        pod.thread.start()

    # --------------------------------------------------------------------- the test's controls
    def start(self, only: list[str] | None = None) -> None:
        """Create the pods (all, or ``only`` these: the others stay unscheduled until ``add``)."""
        self.condition = "Running"
        for name in only or list(self.pods):
            self._create(self.pods[name])
        threading.Thread(target=self._operator, name="operator", daemon=True).start()

    def add(self, name: str) -> None:
        """A pod that the scheduler places late (e.g. a node that came up later)."""
        self._create(self.pods[name])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the container's PID 1; SIGKILL takes every process of the pod with it."""
        signal_pod(self, name, sig)

    def evict(self, names: list[str]) -> None:
        """Node drain: each pod is deleted (SIGTERM, SIGKILL after terminationGracePeriodSeconds),
        reaches phase Failed, and the operator recreates it under the same name with a new IP."""
        for name in names:
            pod = self.pods[name]
            pod.deleting = True
            grace = self._container(pod)[0].get("terminationGracePeriodSeconds", 30)
            self.kill(name, signal.SIGTERM)
            timer = threading.Timer(
                grace,
                lambda p=pod, gen=pod.generation: p.generation == gen and p.pid1 and os.kill(p.pid1, signal.SIGKILL),
            )
            timer.daemon = True
            timer.start()

    def restarts_of_running_pods(self) -> int:
        return sum(p.restarts for p in self.pods.values() if p.phase == "Running")

    def wait(self, timeout: float) -> str:
        """Wait until the job is Succeeded or Failed; returns the condition."""
        return wait_for_condition(self, ("Succeeded", "Failed"), timeout)

    def _operator(self) -> None:
        while self.condition not in ("Succeeded", "Failed") and not self._stopped.is_set():
            self._reconcile()
            self._stopped.wait(0.2)

    def _reconcile(self) -> None:
        """One pass of the controller: recreate failed pods, backoffLimit, job conditions (§4-§6)."""
        limit = (self.job["spec"].get("runPolicy") or {}).get("backoffLimit")
        for pod in self.pods.values():
            policy = self.types[pod.rtype]["restartPolicy"]
            if pod.phase != "Failed" or pod.thread is None or pod.thread.is_alive():
                continue
            code = pod.exit_codes[-1] if pod.exit_codes else EVICTED
            if policy == "Never" or (policy == "ExitCode" and code < RETRYABLE and not pod.deleting):
                self._finish("Failed")
                return
            pod.generation += 1  # OnFailure/Always after eviction, ExitCode >= 128: a new pod
            self._event(pod.name, f"recreate after {pod.reason or code}")
            self._assign_ip(pod)
            self._create(pod)
        if limit is not None and self.restarts_of_running_pods() >= max(limit, 1):
            self._finish("Failed")
            return
        phases = {p.name: p.phase for p in self.pods.values() if p.rtype == "Worker"}
        if "Master" in self.types:
            if next(p for p in self.pods.values() if p.rtype == "Master").phase == "Succeeded":
                self._finish("Succeeded")
        elif phases and (
            all(v == "Succeeded" for v in phases.values())
            or ("elasticPolicy" in self.job["spec"] and "Succeeded" in phases.values())
        ):
            self._finish("Succeeded")

    def _finish(self, condition: str) -> str:
        self.condition = condition
        clean = (self.job["spec"].get("runPolicy") or {}).get("cleanPodPolicy", "None")
        for pod in self.pods.values():
            if clean != "None" and pod.phase in ("Running", "Pending"):
                pod.stop.set()
                if pod.pid1:
                    try:
                        os.kill(pod.pid1, signal.SIGKILL)
                    except ProcessLookupError:  # it exited between the phase check and the kill
                        pass
        self._event("job", condition)
        return condition

    def log(self, name: str) -> str:
        """Every container run of this pod, in order."""
        files = sorted(
            (self.workdir / "logs").glob(f"{name}.*.log"), key=lambda p: tuple(int(x) for x in p.name.split(".")[-3:-1])
        )
        return "".join(f.read_text(errors="replace") for f in files)


# ----------------------------------------------------------------------------- kubelet and CNI parts
def make_bridge(net: Network) -> None:
    _ip("link", "add", net.bridge, "type", "bridge")
    _ip("link", "set", net.bridge, "up")  # no address: the host cannot reach the pods' /24


def make_pod_network(pod: Pod, net: Network, files: Path) -> None:
    """The pod's network namespace on the bridge, and its (empty) hosts and resolv.conf files in a
    directory of its own under ``files``: bind-mounted into each of its containers by tests/support/k8s_pod.py,
    where the image's /etc links to them (``etc_links``)."""
    ns, host_end, pod_end = pod.netns, net.veth(pod.veth, "v"), net.veth(pod.veth, "p")
    _ip("netns", "add", ns)
    _ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end)
    _ip("link", "set", host_end, "master", net.bridge, "up")
    _ip("link", "set", pod_end, "netns", ns)
    _ip("-n", ns, "link", "set", pod_end, "name", "eth0")
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    pod_files = files / pod.name
    pod_files.mkdir(parents=True, exist_ok=True)
    replace_file(pod_files / "resolv.conf", "")  # no DNS server: lookups stay local
    pod.hosts = pod_files / "hosts"
    replace_file(pod.hosts, "")
    links = etc_links(pod_files)
    (links / NET_FILES_MOUNT).mkdir(parents=True, exist_ok=True)  # where the pod's files are mounted
    for name in ("hosts", "resolv.conf"):
        if not (links / name).is_symlink():
            (links / name).symlink_to(f"{NET_FILES_MOUNT}/{name}")


def etc_links(pod_files: Path) -> Path:
    """The top layer of a pod's /etc (an overlay on the image's): ``hosts`` and ``resolv.conf`` link into the
    pod's own directory of network files, mounted at ``/etc/.pod``. Nothing in it ever changes: the files it
    links to are replaced by rename (``replace_file``), which a bind mount of the file itself would not see."""
    return pod_files.with_name(f"{pod_files.name}.etc")


def set_pod_ip(pod: Pod, ip: str) -> None:
    pod.ip = ip
    _ip("-n", pod.netns, "addr", "flush", "dev", "eth0")
    _ip("-n", pod.netns, "addr", "add", f"{ip}/24", "dev", "eth0")


def write_hosts(pod: Pod, lines: list[str]) -> None:
    """Replace the pod's hosts file: a lookup in its containers reads the old file or the new one, whole."""
    if pod.hosts is None:
        raise RuntimeError(f"pod {pod.name} has no network yet")
    replace_file(pod.hosts, "\n".join(lines) + "\n")


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to a new file beside ``path`` and rename it over ``path``: a reader that opens ``path``
    gets either file complete, never an empty or a half-written one (truncating and writing in place would)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), 0o644)  # any container user reads it (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def volume_mounts(
    pod_name: str, c: dict, pod_spec: dict, config_maps: dict[str, dict], workdir: Path, pod_dir: Path
) -> list[dict]:
    """The container's volumeMounts as tests/support/k8s_pod.py mounts: ConfigMaps read-only directories, PVCs one
    shared directory each, ``emptyDir: {medium: Memory}`` a size-limited tmpfs, other emptyDirs a
    directory of this pod (``pod_dir``: it survives container restarts, not a new pod); emptyDirs writable by
    every user as the kubelet makes them, and every volume owned by the pod's ``fsGroup`` if it has one."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    fs_group = (pod_spec.get("securityContext") or {}).get("fsGroup")
    mounts: list[dict] = []
    for m in c.get("volumeMounts") or []:
        vol = volumes[m["name"]]
        if "configMap" in vol:
            src = workdir / "configmaps" / vol["configMap"]["name"]
            src.mkdir(parents=True, exist_ok=True)
            for key, text in config_maps[vol["configMap"]["name"]].items():
                (src / key).write_text(text)
            set_volume_ownership(src, fs_group, read_only=True)
            mounts.append({"kind": "bind", "source": str(src), "target": m["mountPath"], "read_only": True})
        elif "persistentVolumeClaim" in vol:
            src = workdir / "pvc" / vol["persistentVolumeClaim"]["claimName"]
            src.mkdir(parents=True, exist_ok=True)  # a fresh volume's root: root's, 0755
            set_volume_ownership(src, fs_group)
            mounts.append(
                {"kind": "bind", "source": str(src), "target": m["mountPath"], "read_only": bool(m.get("readOnly"))}
            )
        elif vol.get("emptyDir", {}).get("medium") == "Memory":
            size = _tmpfs_size(vol["emptyDir"].get("sizeLimit"))
            mounts.append({"kind": "tmpfs", "target": m["mountPath"], "size": size, "gid": fs_group})
        elif "emptyDir" in vol:
            src = pod_dir / m["name"]
            src.mkdir(parents=True, exist_ok=True)
            src.chmod(0o777)  # the kubelet's emptyDir mode, whatever the umask
            set_volume_ownership(src, fs_group)
            mounts.append({"kind": "bind", "source": str(src), "target": m["mountPath"]})
        else:
            raise ValueError(
                f"{pod_name}: volume {m['name']!r} {vol}: the simulation supports configMap, persistentVolumeClaim and emptyDir"
            )
    return mounts


def start_container(spec_path: Path, log_path: Path) -> tuple[subprocess.Popen, IO[str], int | None]:
    """Start one container run (tests/support/k8s_pod.py); returns once its PID 1 is known (the third value; None
    when it has already exited). The caller closes the log after the process exits."""
    log = open(log_path, "w")  # noqa: SIM115 (closed when the pod's process exits)
    proc = subprocess.Popen(
        [sys.executable, str(POD_SHIM), str(spec_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={"PATH": IMAGE_PATH},
        start_new_session=True,
    )
    pid_file = spec_path.with_suffix(".pid")  # the shim creates it first and writes the PID after the fork
    while proc.poll() is None and not (pid_file.exists() and pid_file.read_text()):
        time.sleep(0.01)
    if pid_file.exists() and pid_file.read_text():
        return proc, log, int(pid_file.read_text())
    return proc, log, None


_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


def call_in_netns(netns: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that has joined network namespace ``netns`` (``ip netns`` name): the sockets it
    creates live there, and stay there when used from any other thread (a listening socket's connections too).
    The calling thread's own namespace is never changed."""
    out: dict[str, Any] = {}

    def run() -> None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                out["error"] = OSError(err, f"setns {netns}: {os.strerror(err)}")
                return
        finally:
            os.close(fd)
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name=f"in-{netns}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def teardown(net: Network) -> None:
    """Remove ``net``'s namespaces (killing what runs there), veths and bridge; nothing of another network."""
    for ns in _netns_names():
        if not ns.startswith(net.ns_prefix):
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:  # only processes a simulation started live in its namespaces
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    host_end = re.compile(rf"s{net.tag}v\d+")  # a pair whose namespace is gone goes with it; this is a stray end
    for name in [*_link_names(), net.bridge]:
        if name == net.bridge or host_end.fullmatch(name):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


ORPHAN_NS, ORPHAN_BRIDGE = re.compile(r"sim-(\d+)x(\d+)-"), re.compile(r"sb(\d+)x(\d+)")


def sweep_orphans() -> None:
    """Tear down the networks whose owning process is gone: a simulation killed before its clean-up. A
    network of a live process is never touched, whichever simulation or test file it belongs to."""
    owners = {(int(m[1]), int(m[2])) for ns in _netns_names() if (m := ORPHAN_NS.match(ns))}
    owners |= {(int(m[1]), int(m[2])) for name in _link_names() if (m := ORPHAN_BRIDGE.fullmatch(name))}
    for owner, serial in sorted(owners):
        if not _alive(owner):
            teardown(Network("", owner, serial))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split(" ")[0] for line in out.splitlines() if line]


def _link_names() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]
