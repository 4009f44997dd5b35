"""A minimal container runtime for the pod simulations (tests/support/k8s_sim.py): one container of a pod.

Run as ``python k8s_pod.py SPEC.json``. It does what containerd's shim and runc do for a container, as far
as the simulations need:

* joins the pod's network namespace (``/run/netns/NAME``, made by ``ip netns add``);
* new UTS namespace with the pod name as hostname (the kubelet sets the pod's hostname to its name);
* new mount namespace (private propagation) with a root of its own, as runc gives a container: a fresh
  tmpfs (the container's writable layer) with the image's read-only layers bind-mounted into it, the
  pod's ``/etc/hosts`` and ``/etc/resolv.conf`` over the image's, a fresh ``/dev/shm``, a sysfs of the
  pod's network namespace, then the pod's volume mounts: bind mounts for the ConfigMap and PVC
  directories, a size-limited tmpfs for ``emptyDir: {medium: Memory}``, a directory for a plain emptyDir;
  then ``pivot_root`` into it and ``/proc`` for the new PID namespace. Every mount target is made inside
  that root, never on the host: a directory the host creates or removes at the same path cannot touch a
  running container (removing a directory on the host lazily detaches every mount on it in every mount
  namespace, which is why targets on the host would not do);
* new PID namespace: the container's command is PID 1 there, so it only gets the signals it handles,
  and when it dies every process of the container dies with it (the kernel kills the namespace);
* ``no_new_privs`` (``allowPrivilegeEscalation: false``);
* the container's exact environment (nothing of the caller's leaks in) and its command + args;
* the exit status as Kubernetes reports it: the code, or 128 + N for a process killed by signal N.

SPEC: {"hostname", "netns", "root", "hosts", "resolv_conf", "command": [...], "env": {...}, "cwd", "pid_file",
       "layers": [{"kind": "bind"|"symlink", "source", "target"}],
       "mounts": [{"kind": "bind"|"tmpfs"|"dir", "source", "target", "size", "read_only"}]}
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
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG = 38, 1
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


def mount_one(root: Path, m: dict) -> None:
    target = in_root(root, m["target"])
    if m["kind"] == "symlink":  # merged /usr: /bin -> usr/bin, as in the image
        target.symlink_to(m["source"])
        return
    make_target(target, m.get("source"))
    if m["kind"] == "tmpfs":
        mount("tmpfs", str(target), "tmpfs", MS_NOSUID | MS_NODEV, f"size={m['size']},mode=1777")
    else:  # bind (image layer, ConfigMap, PVC) or dir (plain emptyDir: a directory that outlives restarts)
        bind(m["source"], str(target), bool(m.get("read_only")))


def build_root(spec: dict) -> Path:
    """The container's root filesystem, in this (private) mount namespace only."""
    root = Path(spec["root"])
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    mount("tmpfs", str(root), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")  # the writable layer
    for layer in spec["layers"]:
        mount_one(root, layer)
    bind(spec["hosts"], str(in_root(root, "/etc/hosts")), False)  # rewritten in place by the simulation
    bind(spec["resolv_conf"], str(in_root(root, "/etc/resolv.conf")), True)
    make_target(in_root(root, "/sys"), None)
    mount("sysfs", str(in_root(root, "/sys")), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount_one(root, {"kind": "tmpfs", "target": "/dev/shm", "size": "64m"})  # the runtime's default /dev/shm
    for path in ("/proc", "/tmp", "/run", "/var/tmp"):
        make_target(in_root(root, path), None)
    for m in spec["mounts"]:
        mount_one(root, m)
    return root


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
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
            _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
            os.chdir(spec.get("cwd") or "/")
            os.execvpe(spec["command"][0], spec["command"], spec["env"])
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
