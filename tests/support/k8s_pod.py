"""A minimal container runtime for the pod simulations (tests/support/k8s_sim.py): one container of a pod.

Run as ``python k8s_pod.py SPEC.json``. It does what containerd's shim and runc do for a container, as far
as the simulations need:

* joins the pod's network namespace (``/run/netns/NAME``, made by ``ip netns add``);
* new UTS namespace with the pod name as hostname (the kubelet sets the pod's hostname to its name);
* new mount namespace (private propagation) with a root of its own, as runc gives a container: a fresh
  tmpfs (the container's writable layer) with the image's read-only layers bind-mounted into it; the
  image's ``/etc`` as a read-only overlay whose ``hosts`` and ``resolv.conf`` are links into the pod's
  own directory of network files (mounted under ``/etc``), so that the simulation replaces those files
  by rename and a lookup never reads a half-written one; a ``/dev`` as runc makes it (``null``, ``zero``,
  ``full``, ``random``, ``urandom``, ``tty``, a ``devpts`` of its own, a 64 MiB ``/dev/shm``), read-only
  apart from those; a sysfs of the pod's network namespace, then the pod's volume mounts: bind mounts for
  the ConfigMap and PVC directories, a size-limited tmpfs for ``emptyDir: {medium: Memory}``, a directory
  for a plain emptyDir; the writable layer remounted read-only for ``readOnlyRootFilesystem``; then
  ``pivot_root`` into it and ``/proc`` for the new PID namespace. Every mount target is made inside that
  root, never on the host: a directory the host creates or removes at the same path cannot touch a
  running container (removing a directory on the host lazily detaches every mount on it in every mount
  namespace, which is why targets on the host would not do);
* new PID namespace: the container's command is PID 1 there, so it only gets the signals it handles,
  and when it dies every process of the container dies with it (the kernel kills the namespace);
* the container's user as the kubelet resolves it (``runAsUser``, ``runAsGroup``, ``fsGroup`` and
  ``supplementalGroups`` as supplementary groups), its capabilities (the runtime's default set, less
  ``capabilities.drop``, plus ``capabilities.add``: the bounding set, and the effective set of a root
  user; a non-root user has none, as the kernel clears them on the change of user) and ``no_new_privs``
  for ``allowPrivilegeEscalation: false``, all by the kernel's own calls (``prctl``, ``capset``,
  ``setresuid``), so that what the manifest forbids fails as it would in a cluster;
* the container's exact environment (nothing of the caller's leaks in) and its command + args;
* the exit status as Kubernetes reports it: the code, or 128 + N for a process killed by signal N.

SPEC: {"hostname", "netns", "root", "net_files", "net_files_target", "etc_links", "command": [...], "env": {...}, "cwd", "pid_file",
       "layers": [{"kind": "bind"|"symlink"|"etc"|"dev", "source", "target"}],
       "mounts": [{"kind": "bind"|"tmpfs"|"dir", "source", "target", "size", "gid", "read_only"}],
       "security": {"uid", "gid", "groups": [...], "capabilities": [NAME, ...], "no_new_privs", "read_only_root"}}
``net_files``: the pod's directory holding ``hosts`` and ``resolv.conf``, mounted at ``net_files_target``
(``/etc/.pod``); ``etc_links``: the overlay's top layer over the image's /etc, with the links ``hosts`` and
``resolv.conf`` into that mount and its empty mount point.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x04000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_STRICTATIME = 32, 4096, 16384, 1 << 18, 1 << 24
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, PR_CAPBSET_DROP = 38, 1, 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# capability(7)'s numbers, by the names Kubernetes uses (without CAP_)
CAPABILITIES = {
    name: number
    for number, name in enumerate(
        [
            "CHOWN",
            "DAC_OVERRIDE",
            "DAC_READ_SEARCH",
            "FOWNER",
            "FSETID",
            "KILL",
            "SETGID",
            "SETUID",
            "SETPCAP",
            "LINUX_IMMUTABLE",
            "NET_BIND_SERVICE",
            "NET_BROADCAST",
            "NET_ADMIN",
            "NET_RAW",
            "IPC_LOCK",
            "IPC_OWNER",
            "SYS_MODULE",
            "SYS_RAWIO",
            "SYS_CHROOT",
            "SYS_PTRACE",
            "SYS_PACCT",
            "SYS_ADMIN",
            "SYS_BOOT",
            "SYS_NICE",
            "SYS_RESOURCE",
            "SYS_TIME",
            "SYS_TTY_CONFIG",
            "MKNOD",
            "LEASE",
            "AUDIT_WRITE",
            "AUDIT_CONTROL",
            "SETFCAP",
            "MAC_OVERRIDE",
            "MAC_ADMIN",
            "SYSLOG",
            "WAKE_ALARM",
            "BLOCK_SUSPEND",
            "AUDIT_READ",
            "PERFMON",
            "BPF",
            "CHECKPOINT_RESTORE",
        ]
    )
}
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # the nodes runc creates in a container's /dev
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1"}
DEV_LINKS |= {"stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # no glibc wrapper: the raw system call
libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def bind(source: str, target: str, read_only: bool) -> None:
    """A recursive bind mount; read-only takes a second call (the kernel ignores MS_RDONLY on a bind)."""
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def in_root(root: Path, target: str) -> Path:
    """``target`` (an absolute path inside the container) under ``root``."""
    return root / target.lstrip("/")


def make_target(path: Path, source: str | None) -> None:
    """The mount point inside the root: a file for a file's bind mount, else a directory."""
    if source is not None and Path(source).is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    else:
        path.mkdir(parents=True, exist_ok=True)


def mount_one(root: Path, m: dict, etc_links: str | None = None) -> None:
    target = in_root(root, m["target"])
    if m["kind"] == "symlink":  # merged /usr: /bin -> usr/bin, as in the image
        target.symlink_to(m["source"])
        return
    if m["kind"] == "dev":
        make_dev(target)
        return
    make_target(target, m.get("source"))
    if m["kind"] == "etc" and etc_links is not None:
        # A read-only overlay: the pod's links over the image's /etc (no upper layer, nothing changes in it)
        mount("overlay", str(target), "overlay", MS_NOSUID | MS_NODEV, f"lowerdir={etc_links}:{m['source']}")
    elif m["kind"] == "tmpfs":
        gid = f",gid={m['gid']}" if m.get("gid") is not None else ""
        mount("tmpfs", str(target), "tmpfs", MS_NOSUID | MS_NODEV, f"size={m['size']},mode=1777{gid}")
    else:  # bind (image layer, ConfigMap, PVC) or dir (plain emptyDir: a directory that outlives restarts)
        bind(m["source"], str(target), bool(m.get("read_only")))


def make_dev(dev: Path) -> None:
    """runc's /dev: a tmpfs with the host's six plain device nodes bind-mounted in, the usual links, a devpts
    of its own and the runtime's default 64 MiB /dev/shm. Remounted read-only once the volumes are in
    (``seal``): a container writes its devices, never new files there."""
    dev.mkdir(parents=True, exist_ok=True)
    mount("tmpfs", str(dev), "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=755,size=65536k")
    for name in DEVICES:
        (dev / name).touch()
        bind(f"/dev/{name}", str(dev / name), False)
    for name, to in DEV_LINKS.items():
        (dev / name).symlink_to(to)
    (dev / "pts").mkdir()
    mount("devpts", str(dev / "pts"), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5")
    (dev / "shm").mkdir()
    mount("tmpfs", str(dev / "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")


def build_root(spec: dict) -> Path:
    """The container's root filesystem, in this (private) mount namespace only."""
    root = Path(spec["root"])
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    mount("tmpfs", str(root), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")  # the writable layer
    for layer in spec["layers"]:
        mount_one(root, layer, spec["etc_links"])
    bind(spec["net_files"], str(in_root(root, spec["net_files_target"])), True)  # replaced by rename on the host
    make_target(in_root(root, "/sys"), None)
    mount("sysfs", str(in_root(root, "/sys")), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in ("/proc", "/run"):
        make_target(in_root(root, path), None)
    for path in ("/tmp", "/var/tmp"):  # sticky and world-writable, as in every image
        make_target(in_root(root, path), None)
        in_root(root, path).chmod(0o1777)
    for m in spec["mounts"]:
        mount_one(root, m)
    seal(root, spec["security"]["read_only_root"])
    return root


def seal(root: Path, read_only_root: bool) -> None:
    """Once every mount point exists: /dev read-only (its devices stay usable: writing one is no write to
    the tmpfs), and the writable layer too for ``readOnlyRootFilesystem`` (its mounted volumes keep theirs)."""
    dev = in_root(root, "/dev")
    if os.path.ismount(dev):
        mount(None, str(dev), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_STRICTATIME)
    if read_only_root:
        mount(None, str(root), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def pivot_root(root: Path) -> None:
    """Make ``root`` this mount namespace's root and detach the host's tree (pivot_root(2), ". ." form)."""
    os.chdir(root)
    _check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")


def join_netns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns {path}")
    finally:
        os.close(fd)


def drop_privileges(security: dict) -> None:
    """The container's capabilities, groups and user, as runc sets them before it executes the command."""
    keep = {CAPABILITIES[name] for name in security["capabilities"]}
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if cap not in keep:
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(CAPBSET_DROP, {cap})")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(CAP_AMBIENT_CLEAR_ALL)")
    os.setgroups(security["groups"])
    os.setresgid(security["gid"], security["gid"], security["gid"])
    if security["uid"] == 0:  # root keeps exactly these (after exec: the bounding set)
        set_capabilities(keep)
    os.setresuid(security["uid"], security["uid"], security["uid"])  # any other user: the kernel clears them all


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def set_capabilities(caps: set[int]) -> None:
    """capset(2): effective and permitted ``caps``, inheritable none."""
    mask = sum(1 << cap for cap in caps)
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective, data[i].permitted, data[i].inheritable = word, word, 0
    _check(libc.capset(ctypes.byref(_CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")


def exec_container(spec: dict) -> None:
    """In the new PID namespace (as PID 1): /proc, the container's user and privileges, then its command."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    security = spec["security"]
    drop_privileges(security)
    # after the change of user, which clears the parent-death signal
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if security["no_new_privs"]:
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    os.chdir(spec.get("cwd") or "/")  # as the container's user, as runc does
    os.execvpe(spec["command"][0], spec["command"], spec["env"])


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    pid_file = open(spec["pid_file"], "w")  # noqa: SIM115 (opened on the host's tree, written after the fork)
    join_netns(spec["netns"])  # before the new mount namespace: its sysfs shows this network namespace
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare(mount, uts)")
    socket.sethostname(spec["hostname"])
    pivot_root(build_root(spec))
    _check(libc.unshare(CLONE_NEWPID), "unshare(pid)")  # its first child becomes PID 1
    pid = os.fork()
    if pid == 0:
        try:
            exec_container(spec)
        except BaseException as e:
            print(f"k8s_pod: cannot start {spec['command']!r}: {e}", file=sys.stderr, flush=True)
            os._exit(127 if isinstance(e, FileNotFoundError) else 128)
    with pid_file:  # the simulation signals PID 1 by this host PID
        pid_file.write(str(pid))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the shim outlives its container, as a real shim does
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
