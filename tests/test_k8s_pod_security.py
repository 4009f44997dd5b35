"""Simulated pods apply the manifests' securityContext as a cluster does (tests/support/k8s_pod.py).

Each test runs cpu-smoke's PyTorchJob with its Master only and ``restartPolicy: Never``, its container's
command replaced by a few lines of Python, its securityContext as shipped or changed in one place. What the
manifest forbids must fail in the pod by the kernel's own refusal (a read-only filesystem, a missing
capability, a non-root user), and the same command must succeed where the manifest allows it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from support import k8s_sim as ks
from support import k8s_validate as kv
from support.ci import KUBECTL_MISSING, kubectl, require

pytestmark = [pytest.mark.netns, pytest.mark.integration]
TIMEOUT = 300  # one pod starting python: a loaded 2-core machine is 5-10x slower than an idle one
EROFS, EPERM = "[Errno 30] Read-only file system", "[Errno 1] Operation not permitted"

# What a pod of the shipped manifests is, as the kernel sees it: printed as one JSON line.
REPORT = """
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
def write(directory):
    try:
        with open(os.path.join(directory, "probe"), "w") as f:
            f.write("x")
    except OSError as e:
        return f"[Errno {e.errno}] {e.strerror}"
    os.unlink(os.path.join(directory, "probe"))
    return "ok"
with open("/dev/null", "w") as null, open("/dev/urandom", "rb") as random:
    null.write("x")
    devices = len(random.read(8))
paths = ("/workspace", "/tmp", "/dev/shm", "/var/tmp", "/run", "/", "/dev", "/etc", "/opt/venv")
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "caps": {k: status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb")},
    "no_new_privs": status["NoNewPrivs"].strip(),
    "write": {p: write(p) for p in paths},
    "dev": sorted(os.listdir("/dev")), "devices": devices,
}))
"""
# Writes a file outside the container's volumes (its image's /var/tmp, sticky and world-writable there).
WRITE_OUTSIDE_VOLUMES = "open('/var/tmp/state', 'w').write('x')"
# Hands a file to another user, as an entrypoint that chowns its data directory does: root's CAP_CHOWN.
CHOWN = "import os; p = '/workspace/data'; open(p, 'w').close(); os.chown(p, 4242, -1)"
RUNTIME_DEFAULT = {"capabilities": {"drop": []}}  # containerd's default capabilities
AS_ROOT = {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0}


@pytest.fixture(scope="module", autouse=True)
def _requirements() -> None:
    require(os.geteuid() == 0, "the pod simulation needs root (network namespaces, mounts)")
    require(shutil.which("ip") is not None, "ip not found (scripts/test.sh installs the Debian packages)")
    require(kubectl() is not None, KUBECTL_MISSING)
    require((ks.REPO / ".venv" / "bin" / "python").exists(), "the simulated image runs .venv/bin/python")


def _job(script: str, pod: dict | None = None, container: dict | None = None) -> list[dict]:
    """cpu-smoke's PyTorchJob, Master only, running ``script``; ``pod`` and ``container`` update the pod's
    and the container's securityContext."""
    docs = kv.render(kv.K8S / "overlays" / "cpu-smoke")
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    del specs["Worker"]
    specs["Master"]["restartPolicy"] = "Never"  # a failed container fails the job at once
    pod_spec = specs["Master"]["template"]["spec"]
    c = next(c for c in pod_spec["containers"] if c["name"] == "pytorch")
    c["command"], c["args"] = ["python", "-c", script], []
    pod_spec["securityContext"].update(pod or {})
    c["securityContext"].update(container or {})
    return docs


def _run(docs: list[dict], workdir: Path) -> tuple[str, str]:
    """The job's final condition and its one pod's log."""
    with ks.Simulation(docs, workdir) as sim:
        sim.start()
        condition = sim.wait(TIMEOUT)
        (name,) = sim.pods
        return condition, sim.log(name)


def test_a_shipped_pod_is_a_non_root_user_without_capabilities_on_a_read_only_root(tmp_path: Path) -> None:
    condition, log = _run(_job(REPORT), tmp_path)
    assert condition == "Succeeded", log
    report = json.loads(log.strip().splitlines()[-1])
    assert (report["uid"], report["gid"]) == (1000, 1000), report  # runAsUser, runAsGroup
    assert 1000 in report["groups"], report  # fsGroup
    assert set(report["caps"].values()) == {"0000000000000000"}, report  # drop: [ALL], bounding set too
    assert report["no_new_privs"] == "1", report  # allowPrivilegeEscalation: false
    volumes = {"/workspace", "/tmp", "/dev/shm"}  # the PVC (fsGroup), an emptyDir, a Memory emptyDir
    assert {p: r for p, r in report["write"].items() if p in volumes} == dict.fromkeys(volumes, "ok"), report
    assert {p: r for p, r in report["write"].items() if p not in volumes} == {
        p: EROFS for p in report["write"] if p not in volumes
    }, report
    devices = ["fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom"]
    assert report["dev"] == [*devices, "zero"], report  # a container's devices, not the host's
    assert report["devices"] == 8, report


@pytest.mark.parametrize(
    ("container", "condition"),
    [({}, "Failed"), ({"readOnlyRootFilesystem": False}, "Succeeded")],
    ids=["read-only-root", "writable-root"],
)
def test_writing_outside_the_volumes_fails_on_a_read_only_root(tmp_path: Path, container: dict, condition: str) -> None:
    result, log = _run(_job(WRITE_OUTSIDE_VOLUMES, container=container), tmp_path)
    assert result == condition, log
    if condition == "Failed":
        assert EROFS in log, log


@pytest.mark.parametrize(
    ("pod", "container", "condition"),
    [
        ({}, {}, "Failed"),  # as shipped: user 1000
        ({}, RUNTIME_DEFAULT, "Failed"),  # user 1000 with the runtime's capabilities: gone on the change of user
        (AS_ROOT, {}, "Failed"),  # root with every capability dropped
        (AS_ROOT, RUNTIME_DEFAULT, "Succeeded"),  # root with the runtime's capabilities, CAP_CHOWN among them
    ],
    ids=["non-root", "non-root-default-capabilities", "root-capabilities-dropped", "root"],
)
def test_what_needs_root_fails_without_it(tmp_path: Path, pod: dict, container: dict, condition: str) -> None:
    result, log = _run(_job(CHOWN, pod=pod, container=container), tmp_path)
    assert result == condition, log
    if condition == "Failed":
        assert EPERM in log, log
