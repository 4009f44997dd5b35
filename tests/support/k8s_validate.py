"""Offline validation of the Kubernetes manifests, as a real cluster would do it (test helper).

Three gates, in the order a cluster applies them (see docs/kubernetes.md):

1. the API server: built-in kinds against the Kubernetes OpenAPI schemas (``kubernetes-validate``,
   strict: unknown fields rejected); the PyTorchJob against the CRD's ``openAPIV3Schema`` with the
   structural-schema rules a plain JSON-Schema validator lacks (unknown fields, int32/int64 ranges,
   list-map key uniqueness, ObjectMeta fields);
2. the training operator's validating webhook (``webhook_errors``), on the un-defaulted object;
3. the project's own rules (``project_errors``): what the cluster accepts but would not run well.

Every check returns a list of messages that name the field, the bad value and the fix; an empty list
means valid. ``kubectl kustomize`` renders overlays (``render``).
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kvu
import yaml
from referencing import Registry, Resource

from job.cluster.env import NOTICE_VAR
from support.ci import kubectl

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CRD_PATH = Path(__file__).resolve().parents[1] / "data" / "k8s" / "kubeflow.org_pytorchjobs.yaml"
KUBE_VERSION = "1.32"  # schemas of an older API server: a field newer than that is flagged
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
OBJECT_META = {
    "name",
    "generateName",
    "namespace",
    "labels",
    "annotations",
    "finalizers",
    "ownerReferences",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
}
INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
RESTART_POLICIES = {"OnFailure", "Never", "ExitCode", "Always"}
CLEAN_POD_POLICIES = {"None", "Running", "All"}
MANAGED_BY = {"kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue"}
# Set by the operator after the user's env, so a user value is silently overridden (§3).
OPERATOR_ENV = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PYTHONUNBUFFERED"}
# torchrun options whose PET_* values the operator injects: hard-coding them breaks the layout.
INJECTED_FLAGS = (
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--nproc-per-node",
    "--nproc_per_node",
    "--standalone",
)


def render(overlay: Path) -> list[dict]:
    """Render a kustomize directory with ``kubectl kustomize`` (the client a user runs)."""
    out = subprocess.run(
        [kubectl() or "kubectl", "kustomize", str(overlay)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def load(path: Path) -> list[dict]:
    """The documents of a plain manifest file (``kubectl apply -f``)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@functools.cache
def crd_schema() -> dict:
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def _where(path: list[Any]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def structural_errors(obj: Any, schema: dict, path: list[Any]) -> list[str]:
    """What the API server adds to JSON Schema for a structural CRD schema: unknown fields are
    errors (strict field validation) unless ``x-kubernetes-preserve-unknown-fields``, integer
    formats are range-checked, and ``x-kubernetes-list-type: map`` lists have unique keys."""
    errs: list[str] = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if path == ["metadata"]:  # the CRD says only `type: object`; the server checks ObjectMeta
            props = {k: {} for k in OBJECT_META}
        for key, val in obj.items():
            if props is not None and key in props:
                errs += structural_errors(val, props[key], [*path, key])
            elif isinstance(extra, dict):
                errs += structural_errors(val, extra, [*path, key])
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errs.append(
                    f"{_where([*path, key])}: unknown field {key!r}; known fields here: "
                    f"{sorted(props)} (move or remove it)"
                )
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errs += structural_errors(item, schema["items"], [*path, i])
        keys = schema.get("x-kubernetes-list-map-keys")
        if schema.get("x-kubernetes-list-type") == "map" and keys:
            seen: dict[tuple, int] = {}
            for i, item in enumerate(obj):
                ident = tuple(item.get(k, schema["items"]["properties"].get(k, {}).get("default")) for k in keys)
                if ident in seen:
                    errs.append(
                        f"{_where(path)}[{i}]: duplicate {dict(zip(keys, ident))} (also at "
                        f"[{seen[ident]}]); entries must be unique by {keys}"
                    )
                seen.setdefault(ident, i)
    elif isinstance(obj, int) and not isinstance(obj, bool) and schema.get("format") in INT_RANGE:
        lo, hi = INT_RANGE[schema["format"]]
        if not lo <= obj <= hi:
            errs.append(f"{_where(path)}: {obj} is out of {schema['format']} range [{lo}, {hi}]")
    return errs


def crd_errors(job: dict) -> list[str]:
    """The API server's check of a PyTorchJob against the CRD (types, required, unknown fields)."""
    schema = crd_schema()
    validator = jsonschema.Draft4Validator(schema)
    errs = [
        f"{_where(list(e.absolute_path))}: {e.message}"
        for e in sorted(validator.iter_errors(job), key=lambda e: list(map(str, e.path)))
    ]
    if job.get("apiVersion") != "kubeflow.org/v1" or job.get("kind") != "PyTorchJob":
        errs.append(
            f"apiVersion/kind: got {job.get('apiVersion')}/{job.get('kind')}, "
            "want kubeflow.org/v1 / PyTorchJob (the only version the CRD serves)"
        )
    return errs + structural_errors(job, schema, [])


@functools.cache
def _builtin_validator(kind: str, api_version: str) -> jsonschema.protocols.Validator | None:
    """kubernetes-validate's strict schema for a built-in kind (cached: the shared definitions file is
    large, and kubernetes_validate.validate re-reads it on every call and stops at the first error)."""
    version = [v for v in kvu.all_versions() if kvu.major_minor(v) <= KUBE_VERSION][-1]
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kvu.schema_contents(f"{folder}/{kind.lower()}-{group}.json", KUBE_VERSION)
    except FileNotFoundError:
        return None
    defs = kvu.schema_contents(f"{folder}/_definitions.json", KUBE_VERSION)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def builtin_errors(doc: dict) -> list[str]:
    """Built-in kinds against the Kubernetes OpenAPI schemas, strict (unknown fields rejected)."""
    what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    validator = _builtin_validator(str(doc.get("kind")), str(doc.get("apiVersion")))
    if validator is None:
        return [
            f"{what}: no Kubernetes {KUBE_VERSION} schema for apiVersion "
            f"{doc.get('apiVersion')!r} kind {doc.get('kind')!r}: check both"
        ]
    return [f"{what}: {_where(list(e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def pod_template_errors(job: dict) -> list[str]:
    """Each replica's pod template checked as a core v1 PodTemplate, so the built-in schema (strict)
    covers the pod spec embedded in the custom resource too."""
    errs = []
    for rtype, rspec in (job.get("spec", {}).get("pytorchReplicaSpecs") or {}).items():
        holder = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{rtype.lower()}-template"},
            "template": rspec.get("template", {}),
        }
        errs += [f"pytorchReplicaSpecs.{rtype}: {m}" for m in builtin_errors(holder)]
    return errs


def _containers(rspec: dict) -> list[dict]:
    return rspec.get("template", {}).get("spec", {}).get("containers") or []


def _pytorch(rspec: dict) -> dict | None:
    return next((c for c in _containers(rspec) if c.get("name") == "pytorch"), None)


def webhook_errors(job: dict) -> list[str]:
    """The training operator's validating webhook (v1.9.4, §1b) plus the values a real cluster
    rejects later (restartPolicy becomes the pod's) or treats as another value (cleanPodPolicy)."""
    errs = []
    name = job.get("metadata", {}).get("name", "")
    spec = job.get("spec", {})
    specs = spec.get("pytorchReplicaSpecs")
    if not DNS1035.match(name) or len(name) > 63:
        errs.append(
            f"metadata.name={name!r} is not a DNS-1035 label (lowercase letters, digits, '-', "
            "starting with a letter, at most 63 characters)"
        )
    if not isinstance(specs, dict) or not specs:
        return errs + ["spec.pytorchReplicaSpecs is missing: add Master and/or Worker replica specs"]
    elastic = spec.get("elasticPolicy")
    for rtype, rspec in specs.items():
        if rtype not in ("Master", "Worker"):
            errs.append(
                f"spec.pytorchReplicaSpecs key {rtype!r} is not allowed: use exactly "
                "'Master' or 'Worker' (case-sensitive)"
            )
            continue
        n = rspec.get("replicas") if isinstance(rspec.get("replicas"), int) else 1  # type: schema
        if elastic and rtype == "Worker":
            n = max(n or 1, elastic.get("maxReplicas") or 0)  # scaling up adds higher indexes
        pod = f"{name}-{rtype.lower()}-{max((n or 1) - 1, 0)}"
        if len(pod) > 63 or not DNS1123_LABEL.match(pod):
            errs.append(
                f"pod/Service name {pod!r} ({len(pod)} chars) is not a 63-character DNS "
                f"label: shorten metadata.name {name!r} to at most "
                f"{63 - len(pod) + len(name)} characters"
            )
        containers = _containers(rspec)
        if not containers:
            errs.append(f"pytorchReplicaSpecs.{rtype}: the pod template has no containers")
        for c in containers:
            if not c.get("image"):
                errs.append(f"pytorchReplicaSpecs.{rtype}: container {c.get('name')!r} has no image")
        if containers and _pytorch(rspec) is None:
            errs.append(
                f"pytorchReplicaSpecs.{rtype}: no container is named 'pytorch' (found "
                f"{[c.get('name') for c in containers]}); the operator needs that name"
            )
        if rspec.get("restartPolicy", "OnFailure") not in RESTART_POLICIES:
            errs.append(
                f"pytorchReplicaSpecs.{rtype}.restartPolicy={rspec['restartPolicy']!r}: use "
                f"one of {sorted(RESTART_POLICIES)} (case-sensitive; pod creation fails)"
            )
    if "Master" in specs and specs["Master"].get("replicas") != 1:
        errs.append(
            f"pytorchReplicaSpecs.Master.replicas={specs['Master'].get('replicas')!r}: must be set explicitly to 1"
        )
    if "Worker" in specs and isinstance(specs["Worker"].get("replicas"), int) and specs["Worker"]["replicas"] < 1:
        errs.append(f"pytorchReplicaSpecs.Worker.replicas={specs['Worker']['replicas']}: must be >= 1")
    if elastic is not None:
        if "Worker" not in specs:
            errs.append("elasticPolicy is set but there is no Worker replica spec: add one")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errs.append(
                "elasticPolicy.nProcPerNode (deprecated) and spec.nprocPerNode are both set: "
                "keep only spec.nprocPerNode"
            )
    run_policy = spec.get("runPolicy") or {}
    if run_policy.get("cleanPodPolicy", "None") not in CLEAN_POD_POLICIES:
        errs.append(
            f"runPolicy.cleanPodPolicy={run_policy['cleanPodPolicy']!r}: use one of "
            f"{sorted(CLEAN_POD_POLICIES)} (anything else acts as All)"
        )
    if run_policy.get("managedBy") not in (None, *MANAGED_BY):
        errs.append(f"runPolicy.managedBy={run_policy['managedBy']!r}: use one of {sorted(MANAGED_BY)}")
    return errs


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def _mount_for(container: dict, volumes: dict[str, dict], kind: str) -> list[tuple[str, dict]]:
    """(mountPath, volume source) of the container's mounts whose volume is of ``kind``."""
    return [
        (m["mountPath"], volumes[m["name"]][kind])
        for m in container.get("volumeMounts") or []
        if kind in volumes.get(m["name"], {})
    ]


SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
AGENT_SHUTDOWN_DEFAULT_S = 30  # torchrun's agent: SIGTERM to the workers, SIGKILL this much later
GRACE_MARGIN_S = 10  # after the agent's SIGKILL: its own exit and the exit-code mapping


def grace_errors(pod: dict, c: dict) -> list[str]:
    """Either API: SIGTERM -> the agent waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT for the save -> the kubelet's
    SIGKILL after terminationGracePeriodSeconds must come later, or the save is cut off."""
    if SHUTDOWN_ENV not in _env(c):
        return [
            f"env {SHUTDOWN_ENV} is unset: torchrun's agent would SIGKILL the trainers {AGENT_SHUTDOWN_DEFAULT_S} s "
            "after a SIGTERM, whatever the grace period; set it to one step + one save (docs/kubernetes.md)"
        ]
    grace = pod.get("terminationGracePeriodSeconds", 30)
    raw = _env(c).get(SHUTDOWN_ENV, str(AGENT_SHUTDOWN_DEFAULT_S))
    shutdown = int(raw) if raw.isdigit() else AGENT_SHUTDOWN_DEFAULT_S
    if grace < shutdown + GRACE_MARGIN_S:
        return [
            f"terminationGracePeriodSeconds={grace} must be >= {SHUTDOWN_ENV}={shutdown} + {GRACE_MARGIN_S}: "
            "the kubelet would kill the pod while the trainers still save (docs/kubernetes.md)"
        ]
    notice = _env(c).get(NOTICE_VAR)
    if notice != str(grace):
        return [
            f"env {NOTICE_VAR}={notice!r} must equal terminationGracePeriodSeconds={grace}: it states the pod's "
            "stop notice to the job (ddp-job doctor, ckpt.every auto), which the downward API cannot expose"
        ]
    return []


def project_errors(job: dict, docs: list[dict]) -> list[str]:
    """What a cluster accepts but this project must not ship (the semantic checks of §9 and the
    contracts of docs/design.md)."""
    errs = []
    spec = job.get("spec", {})
    nproc = spec.get("nprocPerNode")
    run_policy = spec.get("runPolicy") or {}
    elastic = spec.get("elasticPolicy")
    if not (isinstance(nproc, str) and nproc.isdigit() and int(nproc) >= 1):
        errs.append(
            f"spec.nprocPerNode={nproc!r}: write the processes per pod as a quoted integer, "
            'e.g. "8" (auto would use the host\'s CPU count on CPU nodes)'
        )
    if run_policy.get("cleanPodPolicy") not in ("Running", "All"):
        errs.append(
            f"runPolicy.cleanPodPolicy={run_policy.get('cleanPodPolicy')!r}: use Running so "
            "workers stop when the Master finishes (trainer#1982)"
        )
    if not isinstance(run_policy.get("backoffLimit"), int):
        errs.append("runPolicy.backoffLimit is unset: OnFailure would restart a crash-looping job forever")
    if elastic and elastic.get("standalone"):
        errs.append("elasticPolicy.standalone=true sets PET_STANDALONE='' which torchrun cannot parse: remove it")
    for rtype, rspec in (spec.get("pytorchReplicaSpecs") or {}).items():
        where = f"pytorchReplicaSpecs.{rtype}"
        pod = rspec.get("template", {}).get("spec", {})
        c = _pytorch(rspec)
        if c is None:
            continue  # reported by webhook_errors
        if rspec.get("restartPolicy") != "OnFailure":
            errs.append(
                f"{where}.restartPolicy={rspec.get('restartPolicy')!r}: use OnFailure (exit "
                "1/124 of a pod whose peer died must restart; see docs/kubernetes.md)"
            )
        if "restartPolicy" in pod:
            errs.append(f"{where}.template.spec.restartPolicy is set: the operator overwrites it; remove it")
        cmd = [*(c.get("command") or []), *(c.get("args") or [])]
        if cmd[:2] != ["ddp-job", "launch"] or "--" not in cmd:
            errs.append(
                f"{where}: command+args {cmd} must start with ['ddp-job', 'launch', ..., '--'] "
                "(torchrun reads the PET_* variables; plain torchrun loses the exit codes)"
            )
        launch_opts = cmd[2 : cmd.index("--")] if "--" in cmd else cmd[2:]
        hard = [a for a in launch_opts if a.split("=")[0] in INJECTED_FLAGS]
        if hard:
            errs.append(f"{where}: {hard} hard-code what the operator injects as PET_*: remove them")
        errs += [f"{where}: {e}" for e in grace_errors(pod, c)]
        env = _env(c)
        bad_env = sorted(k for k in env if k in OPERATOR_ENV or k.startswith("PET_"))
        if bad_env:
            errs.append(f"{where}: env {bad_env} is overridden by the operator's values: remove it")
        if elastic and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
            errs.append(
                f"{where}: set env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for reliable elastic restarts (pytorch#135712)"
            )
        gpus = (c.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu")
        if gpus is not None and str(gpus) != nproc:
            errs.append(
                f"{where}: nvidia.com/gpu limit {gpus} != spec.nprocPerNode {nproc!r}: "
                "run one process per GPU (set both to the same number)"
            )
        ports = c.get("ports") or []
        if ports and "pytorchjob-port" not in [p.get("name") for p in ports]:
            errs.append(
                f"{where}: declare the rendezvous port with name 'pytorchjob-port' "
                "(the operator takes MASTER_PORT from that name)"
            )
        errs += storage_errors(where, c, pod, cmd, docs)
        errs += security_errors(where, c, pod, "pytorch")
    return errs


def _config_errors(where: str, cmd: list[str], cms: list, pvcs: list, by_kind: dict) -> list[str]:
    """``--config`` names a key of a mounted ConfigMap whose run.output_dir is on a mounted PVC."""
    errs = []
    for mount, src in cms:
        cm = by_kind.get(("ConfigMap", src["name"]))
        if cm is None:
            errs.append(f"{where}: ConfigMap {src['name']!r} is not in the rendered manifests")
            continue
        cfg_arg = cmd[cmd.index("--config") + 1] if "--config" in cmd else None
        key = cfg_arg[len(mount) + 1 :] if cfg_arg and cfg_arg.startswith(mount + "/") else None
        if key is None or key not in (cm.get("data") or {}):
            errs.append(f"{where}: --config {cfg_arg!r} is not a key of ConfigMap {src['name']!r} mounted at {mount}")
            continue
        out_dir = str((yaml.safe_load(cm["data"][key]).get("run") or {}).get("output_dir", ""))
        if not any(out_dir == p or out_dir.startswith(p + "/") for p, _ in pvcs):
            errs.append(
                f"{where}: run.output_dir={out_dir!r} in {key} is not on the shared "
                f"volume ({[p for p, _ in pvcs]}): checkpoints would die with the pod"
            )
    return errs


def storage_errors(where: str, c: dict, pod: dict, cmd: list[str], docs: list[dict]) -> list[str]:
    """The training container's volumes: /dev/shm in memory, the PVC and ConfigMap it mounts exist in
    the rendered set, and the config it reads writes its run directory onto the shared volume."""
    errs = []
    by_kind = {(d.get("kind"), d.get("metadata", {}).get("name")): d for d in docs}
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    shm = [src for path, src in _mount_for(c, volumes, "emptyDir") if path == "/dev/shm"]
    if not shm or shm[0].get("medium") != "Memory":
        errs.append(
            f"{where}: mount an emptyDir with medium: Memory at /dev/shm (the runtime "
            "default is 64 MiB; DataLoader workers fail: pytorch#16979)"
        )
    pvcs = _mount_for(c, volumes, "persistentVolumeClaim")
    for _, src in pvcs:
        if ("PersistentVolumeClaim", src["claimName"]) not in by_kind:
            errs.append(f"{where}: PVC {src['claimName']!r} is not in the rendered manifests")
    return errs + _config_errors(where, cmd, _mount_for(c, volumes, "configMap"), pvcs, by_kind)


def security_errors(where: str, c: dict, pod: dict, container: str) -> list[str]:
    errs = []
    psc, csc = pod.get("securityContext") or {}, c.get("securityContext") or {}
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
        errs.append(f"{where}: set securityContext.runAsNonRoot: true")
    if csc.get("allowPrivilegeEscalation") is not False or csc.get("privileged"):
        errs.append(f"{where}: set the {container} container's securityContext.allowPrivilegeEscalation: false")
    return errs


def all_errors(docs: list[dict]) -> list[str]:
    """Every gate over a rendered manifest set; PyTorchJobs get the CRD, webhook and project checks."""
    errs: list[str] = []
    jobs = [d for d in docs if d.get("kind") == "PyTorchJob"]
    if len(jobs) != 1:
        errs.append(f"expected exactly one PyTorchJob, found {len(jobs)}")
    for d in docs:
        if d.get("kind") == "PyTorchJob":
            errs += crd_errors(d) + webhook_errors(d) + pod_template_errors(d) + project_errors(d, docs)
        else:
            errs += builtin_errors(d)
    return errs
