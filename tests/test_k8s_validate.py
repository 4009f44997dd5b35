"""The shipped Kubernetes manifests pass what a real cluster checks, and each check catches its mistake.

Every kustomize directory under k8s/overlays is rendered with `kubectl kustomize`, and
k8s/pytorchjob.yaml is read as `kubectl apply -f` would; then tests/support/k8s_validate.py applies the
API server's schemas (built-in kinds and the real PyTorchJob CRD), the operator's webhook rules and
the project's rules. The negative tests break one thing in a valid rendering and require the
validator to name it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import yaml
from support import k8s_validate as kv
from support.ci import KUBECTL_MISSING, kubectl, require

OVERLAYS = sorted(p.parent for p in (kv.K8S / "overlays").glob("*/kustomization.yaml"))


def _need_kubectl() -> None:
    require(kubectl() is not None, KUBECTL_MISSING)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    _need_kubectl()
    docs = {p.name: kv.render(p) for p in OVERLAYS}
    docs["pytorchjob.yaml"] = kv.load(kv.K8S / "pytorchjob.yaml")
    return docs


def test_the_expected_overlays_exist() -> None:
    assert {"cpu-smoke", "multi-gpu", "elastic", "cpu-smoke-elastic"} <= {p.name for p in OVERLAYS}


@pytest.mark.parametrize("name", [p.name for p in OVERLAYS] + ["pytorchjob.yaml"])
def test_manifest_passes_every_gate(rendered: dict[str, list[dict]], name: str) -> None:
    docs = rendered[name]
    assert {d["kind"] for d in docs} >= {"PyTorchJob", "ConfigMap", "PersistentVolumeClaim"}
    assert kv.all_errors(docs) == []


def test_layouts(rendered: dict[str, list[dict]]) -> None:
    """What each overlay promises: processes per pod, pods, GPUs, elastic range, TensorBoard."""

    def job(name: str) -> dict:
        return next(d for d in rendered[name] if d["kind"] == "PyTorchJob")["spec"]

    smoke, gpu, el = job("cpu-smoke"), job("multi-gpu"), job("cpu-smoke-elastic")
    assert smoke["nprocPerNode"] == "2" and smoke["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert "nvidia.com/gpu" not in str(smoke["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"])
    limits = gpu["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nprocPerNode"] == "8" and limits["nvidia.com/gpu"] == 8
    assert "Master" not in el["pytorchReplicaSpecs"]
    assert (el["elasticPolicy"]["minReplicas"], el["elasticPolicy"]["maxReplicas"]) == (1, 2)
    kinds = {d["kind"]: d for d in rendered["multi-gpu"]}
    assert kinds["Service"]["spec"]["type"] == "ClusterIP"
    assert "Deployment" not in {d["kind"] for d in rendered["cpu-smoke"]}


def test_config_maps_hold_valid_job_configs(rendered: dict[str, list[dict]]) -> None:
    """Each ConfigMap's job.yaml is a config the trainer accepts (job.config rejects unknown keys)."""
    from job import config

    for name, docs in rendered.items():
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
        raw = yaml.safe_load(cm["data"]["job.yaml"])
        cfg = config.JobConfig.model_validate(raw)
        assert str(cfg.run.output_dir).startswith("/workspace/"), name


# --------------------------------------------------------------------------- negative tests
def _job(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "PyTorchJob")


def _rs(docs: list[dict], rtype: str = "Master") -> dict:
    return _job(docs)["spec"]["pytorchReplicaSpecs"][rtype]


def _c(docs: list[dict], rtype: str = "Master") -> dict:
    return _rs(docs, rtype)["template"]["spec"]["containers"][0]


def _set(path: str, value: object) -> Callable[[list[dict]], None]:
    def go(docs: list[dict]) -> None:
        node: dict = _job(docs)
        *parents, last = path.split("/")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return go


_DELETE = object()


def _kind(kind: str, fn: Callable[[dict], None]) -> Callable[[list[dict]], None]:
    return lambda docs: fn(next(d for d in docs if d["kind"] == kind))


def _rename_master(docs: list[dict]) -> None:
    specs = _job(docs)["spec"]["pytorchReplicaSpecs"]
    specs["master"] = specs.pop("Master")


def _env(name: str, value: str, rtype: str = "Master") -> Callable[[list[dict]], None]:
    return lambda docs: _c(docs, rtype).setdefault("env", []).append({"name": name, "value": value})


def _config(key: str, value: object) -> Callable[[list[dict]], None]:
    def go(docs: list[dict]) -> None:
        cm = next(d for d in docs if d["kind"] == "ConfigMap")
        cfg = yaml.safe_load(cm["data"]["job.yaml"])
        section, field = key.split(".")
        cfg[section][field] = value
        cm["data"]["job.yaml"] = yaml.safe_dump(cfg)

    return go


SPEC = "spec"
M = "spec/pytorchReplicaSpecs/Master"
MC = f"{M}/template/spec/containers/0"
MUTATIONS: dict[str, tuple[Callable[[list[dict]], None], str]] = {
    # API server: CRD schema
    "nproc-int": (_set(f"{SPEC}/nprocPerNode", 2), "2 is not of type 'string'"),
    "ttl-under-spec": (_set(f"{SPEC}/ttlSecondsAfterFinished", 60), "unknown field 'ttlSecondsAfterFinished'"),
    "replicas-string": (_set(f"{M}/replicas", "1"), "'1' is not of type 'integer'"),
    "unknown-container-field": (_set(f"{MC}/gpus", 1), "unknown field 'gpus'"),
    "unknown-metadata-field": (_set("metadata/label", {"a": "b"}), "unknown field 'label'"),
    "backoff-over-int32": (_set(f"{SPEC}/runPolicy/backoffLimit", 2**31), "out of int32 range"),
    "duplicate-container": (
        lambda d: _rs(d)["template"]["spec"]["containers"].append(copy.deepcopy(_c(d))),
        "duplicate {'name': 'pytorch'}",
    ),
    "duplicate-port": (
        lambda d: _c(d)["ports"].append({"name": "other", "containerPort": 23456}),
        "duplicate {'containerPort': 23456, 'protocol': 'TCP'}",
    ),
    "bad-quantity": (_set(f"{MC}/resources/limits/memory", "4 GB"), "does not match"),
    "wrong-kind": (_set("kind", "PytorchJob"), "kind 'PytorchJob': check both"),
    "wrong-version": (_set("apiVersion", "kubeflow.org/v2"), "want kubeflow.org/v1 / PyTorchJob"),
    # webhook
    "master-replicas-unset": (_set(f"{M}/replicas", _DELETE), "Master.replicas=None"),
    "master-replicas-2": (_set(f"{M}/replicas", 2), "Master.replicas=2"),
    "worker-replicas-0": (_set("spec/pytorchReplicaSpecs/Worker/replicas", 0), "Worker.replicas=0"),
    "no-pytorch-container": (_set(f"{MC}/name", "trainer"), "no container is named 'pytorch'"),
    "no-image": (_set(f"{MC}/image", ""), "has no image"),
    "lowercase-key": (_rename_master, "key 'master' is not allowed"),
    "name-not-dns1035": (_set("metadata/name", "1-Smoke"), "not a DNS-1035 label"),
    "name-too-long-for-pods": (_set("metadata/name", "a" * 56), "shorten metadata.name"),
    "restart-policy-case": (_set(f"{M}/restartPolicy", "onFailure"), "restartPolicy='onFailure'"),
    "clean-pod-policy": (_set(f"{SPEC}/runPolicy/cleanPodPolicy", "Finished"), "cleanPodPolicy='Finished'"),
    "managed-by": (_set(f"{SPEC}/runPolicy/managedBy", "me"), "runPolicy.managedBy='me'"),
    "elastic-without-worker": (
        lambda d: (
            _set(f"{SPEC}/elasticPolicy", {"rdzvBackend": "c10d"})(d),
            _set("spec/pytorchReplicaSpecs/Worker", _DELETE)(d),
        ),
        "no Worker replica spec",
    ),
    "elastic-nproc-twice": (_set(f"{SPEC}/elasticPolicy", {"nProcPerNode": 2}), "both set"),
    # project rules
    "nproc-auto": (_set(f"{SPEC}/nprocPerNode", "auto"), "nprocPerNode='auto'"),
    "restart-exitcode": (_set(f"{M}/restartPolicy", "ExitCode"), "restartPolicy='ExitCode': use OnFailure"),
    "no-backoff-limit": (_set(f"{SPEC}/runPolicy/backoffLimit", _DELETE), "backoffLimit is unset"),
    "clean-none": (_set(f"{SPEC}/runPolicy/cleanPodPolicy", "None"), "use Running"),
    "pod-restart-policy": (_set(f"{M}/template/spec/restartPolicy", "Never"), "the operator overwrites it"),
    "plain-torchrun": (_set(f"{MC}/command", ["torchrun", "-m", "job", "train"]), "must start with"),
    "hard-coded-nnodes": (
        _set(f"{MC}/args", ["--nnodes=2", "--", "--config", "/config/job.yaml"]),
        "hard-code what the operator injects",
    ),
    "user-master-addr": (_env("MASTER_ADDR", "x"), "overridden by the operator"),
    "grace-below-agent-shutdown": (_set(f"{M}/template/spec/terminationGracePeriodSeconds", 60), "must be >= TORCH"),
    "notice-not-the-grace": (
        _set(f"{M}/template/spec/terminationGracePeriodSeconds", 200),
        "env DDP_JOB_NOTICE_S='120' must equal terminationGracePeriodSeconds=200",
    ),
    "agent-default-shutdown": (
        lambda d: _c(d).__setitem__("env", [e for e in _c(d)["env"] if e["name"] != kv.SHUTDOWN_ENV]),
        "env TORCH_ELASTIC_SHUTDOWN_TIMEOUT is unset",
    ),
    "gpu-mismatch": (_set(f"{MC}/resources/limits", {"nvidia.com/gpu": 4}), "!= spec.nprocPerNode '2'"),
    "port-name": (_set(f"{MC}/ports/0/name", "rdzv"), "'pytorchjob-port'"),
    "no-dshm": (
        lambda d: _c(d).__setitem__("volumeMounts", [m for m in _c(d)["volumeMounts"] if m["mountPath"] != "/dev/shm"]),
        "at /dev/shm",
    ),
    "dshm-on-disk": (_set(f"{M}/template/spec/volumes/2/emptyDir", {}), "medium: Memory"),
    "output-not-on-pvc": (_config("run.output_dir", "/tmp/runs"), "is not on the shared volume"),
    "config-key-missing": (_set(f"{MC}/args", ["--", "--config", "/config/other.yaml"]), "is not a key of ConfigMap"),
    "root": (_set(f"{M}/template/spec/securityContext/runAsNonRoot", False), "runAsNonRoot: true"),
    "escalation": (_set(f"{MC}/securityContext/allowPrivilegeEscalation", True), "allowPrivilegeEscalation"),
    "missing-pvc": (
        lambda d: d.remove(next(x for x in d if x["kind"] == "PersistentVolumeClaim")),
        "is not in the rendered manifests",
    ),
    # built-in kinds (kubernetes-validate, strict)
    "pvc-unknown-field": (
        _kind("PersistentVolumeClaim", lambda p: p["spec"].__setitem__("size", "1Gi")),
        "PersistentVolumeClaim/ddp-job-workspace",
    ),
    "configmap-data-not-string": (_kind("ConfigMap", lambda c: c["data"].__setitem__("n", 3)), "ConfigMap/"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_validation_catches(rendered: dict[str, list[dict]], case: str) -> None:
    mutate, expected = MUTATIONS[case]
    docs = copy.deepcopy(rendered["cpu-smoke"])
    mutate(docs)
    errors = kv.all_errors(docs)
    assert any(expected in e for e in errors), f"{case}: {expected!r} not in {errors}"


def test_elastic_needs_the_share_store_switch(rendered: dict[str, list[dict]]) -> None:
    docs = copy.deepcopy(rendered["cpu-smoke-elastic"])
    env = _c(docs, "Worker")["env"]
    env[:] = [e for e in env if e["name"] != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
    assert any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in e for e in kv.all_errors(docs))


def test_elastic_standalone_is_rejected(rendered: dict[str, list[dict]]) -> None:
    docs = copy.deepcopy(rendered["cpu-smoke-elastic"])
    _job(docs)["spec"]["elasticPolicy"]["standalone"] = True
    assert any("PET_STANDALONE" in e for e in kv.all_errors(docs))


def test_elastic_name_length_counts_max_replicas(rendered: dict[str, list[dict]]) -> None:
    """Scaling up to maxReplicas creates worker-<max-1>: its name must fit too."""
    docs = copy.deepcopy(rendered["cpu-smoke-elastic"])
    job = _job(docs)
    job["metadata"]["name"] = "a" * 54  # 54 + len("-worker-1") = 63: fits with 2 workers
    assert kv.all_errors(docs) == []
    job["spec"]["elasticPolicy"]["maxReplicas"] = 11  # worker-10: 64 characters
    assert any("worker-10" in e for e in kv.all_errors(docs))


def test_kustomize_renders_the_config_map_reference(rendered: dict[str, list[dict]]) -> None:
    """The generated ConfigMap name carries a content hash; the PyTorchJob must point at it (the
    base's kustomizeconfig.yaml teaches kustomize that field of the custom resource)."""
    for name in ("cpu-smoke", "multi-gpu"):
        docs = rendered[name]
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
        assert cm["metadata"]["name"].startswith("ddp-job-config-")
        vols = _rs(docs, "Worker")["template"]["spec"]["volumes"]
        assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in vols
