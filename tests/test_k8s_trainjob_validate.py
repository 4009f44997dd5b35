"""The Kubeflow Trainer v2 manifests pass what a v2.3.0 cluster checks, and each check catches its mistake.

Every kustomize directory under k8s/trainjob/overlays is rendered with `kubectl kustomize`, and
k8s/trainjob.yaml is read as `kubectl apply -f` would; tests/support/k8s_trainjob_validate.py then applies the
TrainJob and TrainingRuntime CRD schemas (unknown fields rejected), the Trainer and JobSet webhook
rules and the project's rules. The negative tests break one thing in a valid rendering and require
the validator to name it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from support import k8s_trainjob_validate as tv
from support import k8s_validate as kv
from support.ci import KUBECTL_MISSING, kubectl, require

ROOT = kv.K8S / "trainjob"
OVERLAYS = sorted(p.parent for p in (ROOT / "overlays").glob("*/kustomization.yaml"))
RJ = "spec/template/spec/replicatedJobs/0/template/spec"
POD = f"{RJ}/template/spec"
NODE = f"{POD}/containers/0"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    require(kubectl() is not None, KUBECTL_MISSING)
    docs = {p.name: kv.render(p) for p in OVERLAYS}
    docs["trainjob.yaml"] = kv.load(kv.K8S / "trainjob.yaml")
    return docs


def _doc(docs: list[dict], kind: str) -> dict:
    return next(d for d in docs if d["kind"] == kind)


def test_the_expected_overlays_exist() -> None:
    assert {"cpu-smoke", "multi-gpu", "kueue", "cpu-smoke-kueue"} <= {p.name for p in OVERLAYS}


@pytest.mark.parametrize("name", [p.name for p in OVERLAYS] + ["trainjob.yaml"])
def test_manifest_passes_every_gate(rendered: dict[str, list[dict]], name: str) -> None:
    docs = rendered[name]
    assert {d["kind"] for d in docs} >= {"TrainJob", "TrainingRuntime", "ConfigMap", "PersistentVolumeClaim"}
    assert tv.all_errors(docs) == []


def test_layouts(rendered: dict[str, list[dict]]) -> None:
    """What each overlay promises: nodes, processes per node, GPUs, Kueue's label and suspend."""
    smoke = _doc(rendered["cpu-smoke"], "TrainJob")
    gpu = _doc(rendered["multi-gpu"], "TrainJob")
    queued = _doc(rendered["kueue"], "TrainJob")
    assert (smoke["spec"]["trainer"]["numNodes"], smoke["spec"]["trainer"]["numProcPerNode"]) == (2, 2)
    assert "nvidia.com/gpu" not in str(smoke["spec"]["trainer"]["resourcesPerNode"])
    assert gpu["spec"]["trainer"]["numNodes"] == 4 and "numProcPerNode" not in gpu["spec"]["trainer"]
    assert gpu["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert "suspend" not in gpu["spec"] and tv.QUEUE_LABEL not in gpu["metadata"]["labels"]
    assert queued["spec"]["suspend"] is True and queued["metadata"]["labels"][tv.QUEUE_LABEL] == "training-queue"
    assert queued["spec"]["trainer"] == gpu["spec"]["trainer"]
    assert "Deployment" in {d["kind"] for d in rendered["multi-gpu"]}


def test_one_config_for_both_apis(rendered: dict[str, list[dict]]) -> None:
    """The TrainJob and PyTorchJob smoke overlays run the same training config (k8s/components)."""
    v1 = _doc(kv.render(kv.K8S / "overlays" / "cpu-smoke"), "ConfigMap")
    assert _doc(rendered["cpu-smoke"], "ConfigMap")["data"] == v1["data"]


def test_single_file_runtime_is_the_base_one(rendered: dict[str, list[dict]]) -> None:
    """k8s/trainjob.yaml carries the base's TrainingRuntime: the same pod apart from the /dev/shm size and
    the ConfigMap's name (kustomize adds a content hash)."""
    base = _doc(kv.render(ROOT / "base"), "TrainingRuntime")["spec"]
    single = copy.deepcopy(_doc(rendered["trainjob.yaml"], "TrainingRuntime")["spec"])
    volumes = single["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"]
    assert volumes[2]["name"] == "dshm" and volumes[0]["configMap"]["name"] == "ddp-job-config"
    volumes[2]["emptyDir"]["sizeLimit"] = "16Gi"
    volumes[0]["configMap"]["name"] = base["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]["volumes"][0]["configMap"]["name"]
    assert single == base


def test_config_maps_hold_valid_job_configs(rendered: dict[str, list[dict]]) -> None:
    from job import config

    for name, docs in rendered.items():
        cfg = config.JobConfig.model_validate(yaml.safe_load(_doc(docs, "ConfigMap")["data"]["job.yaml"]))
        assert str(cfg.run.output_dir).startswith("/workspace/"), name


def test_kustomize_renders_the_references(rendered: dict[str, list[dict]]) -> None:
    """The generated ConfigMap name carries a content hash: the runtime's pod must point at it."""
    for name in ("cpu-smoke", "multi-gpu"):
        docs = rendered[name]
        cm = _doc(docs, "ConfigMap")["metadata"]["name"]
        assert cm.startswith("ddp-job-config-")
        pod, _ = tv.trainer_pod(_doc(docs, "TrainingRuntime")) or ({}, {})
        assert {"name": "config", "configMap": {"name": cm}} in pod["volumes"]
        assert _doc(docs, "TrainJob")["spec"]["runtimeRef"]["name"] == _doc(docs, "TrainingRuntime")["metadata"]["name"]


# --------------------------------------------------------------------------- negative tests
_DELETE = object()


def _set(kind: str, path: str, value: object) -> Callable[[list[dict]], None]:
    def go(docs: list[dict]) -> None:
        node: Any = _doc(docs, kind)
        *parents, last = path.split("/")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        key: Any = last
        if isinstance(node, list):
            key = int(last)
        if value is _DELETE:
            del node[key]
        else:
            node[key] = value

    return go


def _job(path: str, value: object) -> Callable[[list[dict]], None]:
    return _set("TrainJob", path, value)


def _rt(path: str, value: object) -> Callable[[list[dict]], None]:
    return _set("TrainingRuntime", path, value)


def _trainer_env(name: str, value: str) -> Callable[[list[dict]], None]:
    return lambda d: _doc(d, "TrainJob")["spec"]["trainer"].setdefault("env", []).append({"name": name, "value": value})


def _node_env(name: str, value: str) -> Callable[[list[dict]], None]:
    def go(docs: list[dict]) -> None:
        _, c = tv.trainer_pod(_doc(docs, "TrainingRuntime")) or ({}, {})
        c["env"] = [e for e in c["env"] if e["name"] != name] + [{"name": name, "value": value}]

    return go


def _rule(docs: list[dict], index: int, **change: object) -> dict:
    """A copy of the runtime's failure policy rule ``index``, with ``change`` applied."""
    rule = _doc(docs, "TrainingRuntime")["spec"]["template"]["spec"]["failurePolicy"]["rules"][index]
    return {**copy.deepcopy(rule), **change}


T = "spec/trainer"
FP = "spec/template/spec/failurePolicy"
MUTATIONS: dict[str, tuple[Callable[[list[dict]], None], str]] = {
    # API server: CRD schemas and their CEL rules
    "nodes-string": (_job(f"{T}/numNodes", "2"), "'2' is not of type 'integer'"),
    "nproc-auto-string": (_job(f"{T}/numProcPerNode", "auto"), "'auto' is not of type 'integer'"),
    "renamed-field": (_job("spec/podTemplateOverrides", []), "unknown field 'podTemplateOverrides'"),
    "unknown-trainer-field": (_job(f"{T}/gpus", 1), "unknown field 'gpus'"),
    "no-runtime-ref": (_job("spec/runtimeRef", _DELETE), "'runtimeRef' is a required property"),
    "nodes-over-int32": (_job(f"{T}/numNodes", 2**31), "out of int32 range"),
    "suspend-string": (_job("spec/suspend", "true"), "'true' is not of type 'boolean'"),
    "name-not-dns1035": (_job("metadata/name", "1-Smoke"), "must match RFC 1035"),
    "managed-by": (_job("spec/managedBy", "me"), "spec.managedBy='me'"),
    "wrong-version": (_job("apiVersion", "trainer.kubeflow.org/v1"), "want trainer.kubeflow.org/v1alpha1"),
    "runtime-unknown-field": (_rt("spec/template/spec/failurePolicy/maxRetries", 3), "unknown field 'maxRetries'"),
    "restart-strategy-enum": (_rt("spec/template/spec/failurePolicy/restartStrategy", "Blocking"), "is not one of"),
    "two-ml-policies": (_rt("spec/mlPolicy/mpi", {}), "only one of the policies"),
    "job-unknown-field": (_rt(f"{RJ}/restartPolicy", "Never"), "replicatedJobs.node: Job/node-template"),
    "container-unknown-field": (_rt(f"{NODE}/gpus", 1), "unknown field 'gpus'"),
    # webhooks
    "reserved-pet-env": (_trainer_env("PET_NNODES", "4"), "spec.trainer.env sets ['PET_NNODES']"),
    "reserved-pet-other": (_trainer_env("PET_MAX_RESTARTS", "3"), "PET_* names are reserved"),
    "nproc-zero": (_job(f"{T}/numProcPerNode", 0), "numProcPerNode=0: must be > 0"),
    "nproc-negative": (_job(f"{T}/numProcPerNode", -1), "numProcPerNode=-1: must be > 0"),
    "name-too-long-for-pods": (_job("metadata/name", "a" * 55), "shorten metadata.name to at most 54"),
    "runtime-kind": (_job("spec/runtimeRef/kind", "Runtime"), "spec.runtimeRef.kind='Runtime'"),
    "no-node-container": (_rt(f"{NODE}/name", "trainer"), "no replicatedJob 'node' with a container 'node'"),
    "no-ancestor-label": (
        _rt("spec/template/spec/replicatedJobs/0/template/metadata/labels", {}),
        "set it to 'trainer'",
    ),
    # project rules
    "plain-torchrun": (_job(f"{T}/command", ["torchrun", "-m", "job", "train"]), "spec.trainer.command+args"),
    "python-train": (_job(f"{T}/command", ["python", "-m", "job", "train"]), "must start with ['ddp-job', 'launch'"),
    "hard-coded-nnodes": (_job(f"{T}/args", ["--nnodes=2", "--", "--config", "/config/job.yaml"]), "hard-code"),
    "nproc-unset-on-cpu": (_job(f"{T}/numProcPerNode", _DELETE), "numProcPerNode is unset without GPUs"),
    "gpu-mismatch": (
        lambda d: _job(f"{T}/resourcesPerNode/limits", {"nvidia.com/gpu": 4})(d),
        "numProcPerNode=2 != nvidia.com/gpu limit 4",
    ),
    "queue-not-suspended": (
        lambda d: _doc(d, "TrainJob")["metadata"]["labels"].__setitem__(tv.QUEUE_LABEL, "q"),
        "also set spec.suspend: true",
    ),
    "queued-suspend-false": (
        lambda d: (
            _doc(d, "TrainJob")["metadata"]["labels"].__setitem__(tv.QUEUE_LABEL, "q"),
            _job("spec/suspend", False)(d),
        ),
        "also set spec.suspend: true",
    ),
    "missing-runtime": (lambda d: d.remove(_doc(d, "TrainingRuntime")), "is not in the rendered manifests"),
    "runtime-pet-env": (_node_env("PET_MASTER_PORT", "1"), "env ['PET_MASTER_PORT']"),
    "grace-too-short": (_rt(f"{POD}/terminationGracePeriodSeconds", 60), "terminationGracePeriodSeconds=60"),
    "notice-not-the-grace": (
        _rt(f"{POD}/terminationGracePeriodSeconds", 200),
        "env DDP_JOB_NOTICE_S='120' must equal terminationGracePeriodSeconds=200",
    ),
    "agent-default-shutdown": (
        lambda d: (_node_env(kv.SHUTDOWN_ENV, "30")(d), _rt(f"{POD}/terminationGracePeriodSeconds", 30)(d)),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30 + 10",
    ),
    "no-max-restarts": (_rt("spec/template/spec/failurePolicy/maxRestarts", _DELETE), "maxRestarts is unset"),
    "recreate": (_rt("spec/template/spec/failurePolicy/restartStrategy", "Recreate"), "use BlockingRecreate"),
    "no-fail-rule": (_rt("spec/template/spec/failurePolicy/rules", []), "bad input is permanent"),
    "no-pod-failure-policy": (_rt(f"{RJ}/podFailurePolicy", _DELETE), "must FailJob on exit code 2"),
    "stop-save-counted": (_rt(f"{RJ}/podFailurePolicy/rules/1", _DELETE), "exit code 143 (a stop save)"),
    "no-stop-save-rule": (_rt(f"{FP}/rules/0", _DELETE), "exit code 143 (a stop save) after maxRestarts=5"),
    "bad-input-rule-catches-all": (
        lambda d: _rt(f"{FP}/rules", [_rule(d, 1, onJobFailureMessagePatterns=[]), _rule(d, 0)])(d),
        "exit code 143 (a stop save) after maxRestarts=5 restarts gets 'FailJobSet'",
    ),
    "rule-name-with-dash": (_rt(f"{FP}/rules/0/name", "stop-save"), "'stop-save': JobSet rejects it"),
    "rule-names-repeat": (_rt(f"{FP}/rules/1/name", "stop_save_resumes"), "rule names must be unique"),
    "rule-unknown-reason": (_rt(f"{FP}/rules/1/onJobFailureReasons", ["Evicted"]), "not a job failure reason"),
    "on-failure": (_rt(f"{POD}/restartPolicy", "OnFailure"), "restartPolicy: Never"),
    "backoff": (_rt(f"{RJ}/backoffLimit", 6), "set backoffLimit: 0"),
    "no-dshm": (_rt(f"{POD}/volumes/2/emptyDir", {}), "medium: Memory"),
    "config-key-missing": (_job(f"{T}/args", ["--", "--config", "/config/x.yaml"]), "is not a key of ConfigMap"),
    "root": (_rt(f"{POD}/securityContext/runAsNonRoot", False), "runAsNonRoot: true"),
    "escalation": (_rt(f"{NODE}/securityContext/allowPrivilegeEscalation", True), "allowPrivilegeEscalation"),
    "missing-pvc": (lambda d: d.remove(_doc(d, "PersistentVolumeClaim")), "PVC 'ddp-job-workspace' is not in"),
    "two-trainjobs": (lambda d: d.append(copy.deepcopy(_doc(d, "TrainJob"))), "exactly one TrainJob, found 2"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_validation_catches(rendered: dict[str, list[dict]], case: str) -> None:
    mutate, expected = MUTATIONS[case]
    docs = copy.deepcopy(rendered["cpu-smoke"])
    mutate(docs)
    errors = tv.all_errors(docs)
    assert any(expected in e for e in errors), f"{case}: {expected!r} not in {errors}"


def test_name_length_counts_the_last_node(rendered: dict[str, list[dict]]) -> None:
    """<name>-node-0-<numNodes-1> must fit in 63 characters: 10 nodes need one more digit than 2."""
    docs = copy.deepcopy(rendered["cpu-smoke"])
    job = _doc(docs, "TrainJob")
    job["metadata"]["name"] = "a" * 54  # 54 + len("-node-0-1") = 63
    assert tv.all_errors(docs) == []
    job["spec"]["trainer"]["numNodes"] = 11  # -node-0-10: 64 characters
    assert any("'" + "a" * 54 + "-node-0-10'" in e for e in tv.all_errors(docs))


def test_gpu_overlay_may_set_nproc_equal_to_gpus(rendered: dict[str, list[dict]]) -> None:
    docs = copy.deepcopy(rendered["multi-gpu"])
    _doc(docs, "TrainJob")["spec"]["trainer"]["numProcPerNode"] = 8
    assert tv.all_errors(docs) == []
