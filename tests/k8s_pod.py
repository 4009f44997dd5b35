"""A minimal container runtime for the operator simulation (tests/k8s_sim.py): one container of a pod.

Run as ``ip netns exec <pod-netns> python k8s_pod.py SPEC.json`` (the network namespace is the pod's).
It does what containerd's shim and runc do for a container, as far as the simulation needs:

* new UTS namespace with the pod name as hostname (the kubelet sets the pod's hostname to its name);
* new mount namespace (private propagation) with the pod's volume mounts: bind mounts for the
  ConfigMap and PVC directories, a size-limited tmpfs for ``emptyDir: {medium: Memory}``, a directory
  for a plain emptyDir; then ``/proc`` for the new PID namespace;
* new PID namespace: the container's command is PID 1 there, so it only gets the signals it handles,
  and when it dies every process of the container dies with it (the kernel kills the namespace);
* ``no_new_privs`` (``allowPrivilegeEscalation: false``);
* the container's exact environment (nothing of the caller's leaks in) and its command + args;
* the exit status as Kubernetes reports it: the code, or 128 + N for a process killed by signal N.

SPEC: {"hostname", "command": [...], "env": {...}, "cwd", "pid_file",
       "mounts": [{"kind": "bind"|"tmpfs"|"dir", "source", "target", "size", "read_only"}]}
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWPID = 0x00020000, 0x04000000, 0x20000000
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG = 38, 1
libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(args: list[str]) -> None:
    subprocess.run(["mount", *args], check=True)


def setup_mounts(mounts: list[dict]) -> None:
    _mount(["--make-rprivate", "/"])  # nothing we mount leaks into the host's namespace
    for m in mounts:
        os.makedirs(m["target"], exist_ok=True)
        if m["kind"] == "tmpfs":
            _mount(["-t", "tmpfs", "-o", f"size={m['size']},mode=1777", "tmpfs", m["target"]])
        else:  # bind (ConfigMap, PVC) or dir (plain emptyDir: a directory that outlives restarts)
            _mount(["--bind", m["source"], m["target"]])
            if m.get("read_only"):
                _mount(["-o", "remount,bind,ro", m["target"]])


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    # Opened before the mounts: a volume mounted at /tmp hides the host's /tmp from here on.
    pid_file = open(spec["pid_file"], "w")  # noqa: SIM115
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare(mount, uts)")
    socket.sethostname(spec["hostname"])
    setup_mounts(spec["mounts"])  # forks `mount`: must happen before the PID namespace exists, whose
    _check(libc.unshare(CLONE_NEWPID), "unshare(pid)")  # first child becomes its PID 1
    pid = os.fork()  # the child is PID 1 of the new PID namespace
    if pid == 0:
        try:
            _check(libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount /proc")
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
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
