"""Offline validation of the Kubeflow Trainer v2 manifests (TrainJob + TrainingRuntime), as a cluster would do it.

The same three gates as tests/k8s_validate.py for the PyTorchJob, from the v2.3.0 sources
(kubeflow/trainer tag v2.3.0, kubernetes-sigs/jobset v0.12.0):

1. the API server: TrainJob and TrainingRuntime against their CRDs' ``openAPIV3Schema``
   (``tests/data/k8s/``), unknown fields rejected, plus the CRDs' CEL rules that apply on creation;
   every replicated Job of the runtime checked as a core batch/v1 Job (strict built-in schema), which
   covers the pod template embedded in it;
2. the Trainer and JobSet webhooks (``webhook_errors``): ``PET_*`` names reserved in
   ``spec.trainer.env``, ``numProcPerNode`` > 0, the JobSet pod hostname ``<name>-node-0-<i>`` (the
   first node resolves as ``<name>-node-0-0.<name>``) a DNS label;
3. the project's rules (``project_errors``): our launcher, the restart and suspend contract, volumes,
   security.

Every check returns messages that name the field, the bad value and the fix; an empty list means valid.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jsonschema
import yaml

from support import k8s_trainjob_sim as ts
from support import k8s_validate as kv

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
API_VERSION = "trainer.kubeflow.org/v1alpha1"
CRDS = {
    "TrainJob": DATA / "trainer.kubeflow.org_trainjobs.yaml",
    "TrainingRuntime": DATA / "trainer.kubeflow.org_trainingruntimes.yaml",
}
TRAINER_JOB = "node"  # the replicated job and the container the torch plugin fills (BEHAVIOUR.md)
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
RUNTIME_KINDS = {"TrainingRuntime", "ClusterTrainingRuntime"}
MANAGED_BY = {"trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"}
ML_POLICIES = ("torch", "mpi", "jax", "xgboost", "flux")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 143  # job.errors.EXIT_PREEMPTED: only with a stop save on storage
# JobSet v0.12.0 pkg/webhooks/jobset_webhook.go: failure policy rule names and the Job failure reasons it knows
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
RULE_NAME_MAX = 128
JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)


@functools.cache
def crd_schema(kind: str) -> dict:
    crd = yaml.safe_load(CRDS[kind].read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def _cel_errors(doc: dict) -> list[str]:
    """The CRDs' x-kubernetes-validations that apply on creation (``self == oldSelf`` rules are update-only)."""
    errs = []
    spec = doc.get("spec") or {}
    name = str((doc.get("metadata") or {}).get("name", ""))
    if doc.get("kind") == "TrainJob":
        if not kv.DNS1035.match(name) or len(name) > 63:
            errs.append(
                f"metadata.name={name!r}: must match RFC 1035 DNS label format and be no more than 63 "
                "characters (lowercase letters, digits, '-', starting with a letter)"
            )
        if "managedBy" in spec and spec["managedBy"] not in MANAGED_BY:
            errs.append(f"spec.managedBy={spec['managedBy']!r}: use one of {sorted(MANAGED_BY)} or leave it unset")
    policy = spec.get("mlPolicy") or {}
    chosen = [p for p in ML_POLICIES if p in policy]
    if len(chosen) > 1:
        errs.append(f"spec.mlPolicy sets {chosen}: only one of the policies can be configured")
    return errs


def crd_errors(doc: dict) -> list[str]:
    """The API server's check of a TrainJob or TrainingRuntime against its CRD."""
    kind = str(doc.get("kind"))
    if doc.get("apiVersion") != API_VERSION or kind not in CRDS:
        return [
            f"apiVersion/kind: got {doc.get('apiVersion')}/{kind}, want {API_VERSION} / one of "
            f"{sorted(CRDS)} (the only version the v2.3.0 CRDs serve)"
        ]
    schema = crd_schema(kind)
    validator = jsonschema.Draft4Validator(schema)
    errs = [
        f"{kind}: {kv._where(list(e.absolute_path))}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))
    ]
    errs += [f"{kind}: {m}" for m in kv.structural_errors(doc, schema, [])]
    return errs + [f"{kind}: {m}" for m in _cel_errors(doc)]


def replicated_jobs(runtime: dict) -> list[dict]:
    return ((runtime.get("spec") or {}).get("template") or {}).get("spec", {}).get("replicatedJobs") or []


def job_template_errors(runtime: dict) -> list[str]:
    """Each replicated Job's spec checked as a batch/v1 Job: the built-in schema (strict) covers the Job
    fields (backoffLimit, podFailurePolicy) and the pod template embedded in the custom resource."""
    errs = []
    for rjob in replicated_jobs(runtime):
        holder = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{rjob.get('name')}-template"},
            "spec": (rjob.get("template") or {}).get("spec", {}),
        }
        errs += [f"replicatedJobs.{rjob.get('name')}: {m}" for m in kv.builtin_errors(holder)]
    return errs


def trainer_pod(runtime: dict) -> tuple[dict, dict] | None:
    """(pod spec, container ``node``) of the replicated job the trainer runs in, or None."""
    for rjob in replicated_jobs(runtime):
        if rjob.get("name") != TRAINER_JOB:
            continue
        pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
        c = next((c for c in pod.get("containers") or [] if c.get("name") == TRAINER_JOB), None)
        if c is not None:
            return pod, c
    return None


def _name_errors(job: dict) -> list[str]:
    """JobSet names node i's pod (and hostname) ``<name>-node-0-<i>``; the first node is reached as
    ``<name>-node-0-0.<name>`` (the headless Service is the subdomain). The hostname must be a DNS label."""
    name = str((job.get("metadata") or {}).get("name", ""))
    nodes = (job.get("spec", {}).get("trainer") or {}).get("numNodes") or 1
    host = f"{name}-{TRAINER_JOB}-0-{max(int(nodes) - 1, 0)}"
    if len(host) <= 63 and kv.DNS1123_LABEL.match(host):
        return []
    return [
        f"metadata.name={name!r}: the pod hostname {host!r} ({len(host)} chars) in {host}.{name} is not a "
        f"63-character DNS label: shorten metadata.name to at most {63 - len(host) + len(name)} characters"
    ]


def webhook_errors(job: dict) -> list[str]:
    """The Trainer v2.3.0 TrainJob webhook (reserved PET_* names, numProcPerNode) and the JobSet name rule."""
    errs = _name_errors(job)
    spec = job.get("spec") or {}
    trainer = spec.get("trainer") or {}
    reserved = sorted(e.get("name", "") for e in trainer.get("env") or [] if str(e.get("name", "")).startswith("PET_"))
    if reserved:
        errs.append(
            f"spec.trainer.env sets {reserved}: PET_* names are reserved for the torch plugin's values "
            "(the rendezvous comes from them): remove them"
        )
    nproc = trainer.get("numProcPerNode")
    if isinstance(nproc, int) and nproc <= 0:
        errs.append(f"spec.trainer.numProcPerNode={nproc}: must be > 0, or unset for one process per GPU")
    ref = spec.get("runtimeRef") or {}
    if ref.get("kind", "ClusterTrainingRuntime") not in RUNTIME_KINDS:
        errs.append(f"spec.runtimeRef.kind={ref.get('kind')!r}: use one of {sorted(RUNTIME_KINDS)}")
    return errs


def runtime_webhook_errors(runtime: dict) -> list[str]:
    """What the torch plugin needs from the runtime: a replicated job and container named ``node`` whose
    Job template carries the trainer's ancestor label."""
    if trainer_pod(runtime) is None:
        return [
            f"TrainingRuntime {runtime.get('metadata', {}).get('name')!r}: no replicatedJob {TRAINER_JOB!r} with a "
            f"container {TRAINER_JOB!r}: spec.trainer and the PET_* variables have nowhere to go"
        ]
    rjob = next(r for r in replicated_jobs(runtime) if r.get("name") == TRAINER_JOB)
    label = ((rjob.get("template") or {}).get("metadata") or {}).get("labels", {}).get(ANCESTOR_LABEL)
    if label != "trainer":
        return [
            f"replicatedJobs.{TRAINER_JOB}.template.metadata.labels[{ANCESTOR_LABEL!r}]={label!r}: set it to 'trainer'"
        ]
    return []


def jobset_webhook_errors(runtime: dict) -> list[str]:
    """JobSet's validateFailurePolicy, which the JobSet that Trainer creates from this runtime must pass: rule
    names of 1-128 characters matching its pattern and unique, known job failure reasons, existing targets."""
    policy = ((runtime.get("spec") or {}).get("template") or {}).get("spec", {}).get("failurePolicy") or {}
    rjobs = {r.get("name") for r in replicated_jobs(runtime)}
    errs, seen = [], set()
    for i, rule in enumerate(policy.get("rules") or []):
        name, where = str(rule.get("name", "")), f"failurePolicy.rules[{i}]"
        if not 1 <= len(name) <= RULE_NAME_MAX or not RULE_NAME.match(name):
            errs.append(
                f"{where}.name={name!r}: JobSet rejects it: 1-{RULE_NAME_MAX} characters, a letter first, then "
                "letters, digits or '_,:', ending in a letter, digit or '_' (use '_' for '-')"
            )
        if name in seen:
            errs.append(f"{where}.name={name!r}: rule names must be unique: rename it")
        seen.add(name)
        bad = [r for r in rule.get("onJobFailureReasons") or [] if r not in JOB_FAILURE_REASONS]
        if bad:
            errs.append(f"{where}.onJobFailureReasons {bad}: not a job failure reason; use {list(JOB_FAILURE_REASONS)}")
        missing = [t for t in rule.get("targetReplicatedJobs") or [] if t not in rjobs]
        if missing:
            errs.append(f"{where}.targetReplicatedJobs {missing}: no such replicatedJob; use {sorted(rjobs)}")
    return errs


def jobset_answer(runtime: dict, code: int, counted: int) -> str:
    """What JobSet does when the trainer container of node 0 exits ``code`` after ``counted`` restarts that
    count towards maxRestarts: the Job controller's podFailurePolicy and backoffLimit, then JobSet's rules
    (tests/support/k8s_trainjob_sim.py holds both)."""
    rjob = next((r for r in replicated_jobs(runtime) if r.get("name") == TRAINER_JOB), {})
    jspec = rjob.get("template", {}).get("spec", {})
    action, index = ts.pod_failure_rule(code, jspec.get("podFailurePolicy"))
    if action == "FailJob" and index is not None:
        reason, message = "PodFailurePolicy", ts.fail_job_message(f"job-{TRAINER_JOB}-0-0-x1y2z", code, index)
    elif action == "Count" and jspec.get("backoffLimit", ts.JOB_BACKOFF_DEFAULT) == 0:
        reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    else:
        return f"the Job replaces the pod ({action})"
    policy = ((runtime.get("spec") or {}).get("template") or {}).get("spec", {}).get("failurePolicy")
    return ts.jobset_action(reason, message, policy, counted)


def _launch_errors(trainer: dict) -> list[str]:
    cmd = [*(trainer.get("command") or []), *(trainer.get("args") or [])]
    if cmd[:2] != ["ddp-job", "launch"] or "--" not in cmd:
        return [
            f"spec.trainer.command+args {cmd} must start with ['ddp-job', 'launch', ..., '--'] (torchrun "
            "reads the PET_* variables; plain torchrun loses the exit codes)"
        ]
    hard = [a for a in cmd[2 : cmd.index("--")] if a.split("=")[0] in kv.INJECTED_FLAGS]
    if hard:
        return [f"spec.trainer.args: {hard} hard-code what the torch plugin injects as PET_*: remove them"]
    return []


def _nproc_errors(trainer: dict) -> list[str]:
    nproc = trainer.get("numProcPerNode")
    resources = trainer.get("resourcesPerNode") or {}
    gpus = (resources.get("limits") or {}).get("nvidia.com/gpu")
    if gpus is None and nproc is None:
        return [
            "spec.trainer.numProcPerNode is unset without GPUs: 'auto' then starts one process per "
            "requested CPU; set the number of processes per node"
        ]
    if gpus is not None and nproc is not None and nproc != int(gpus):
        return [
            f"spec.trainer.numProcPerNode={nproc} != nvidia.com/gpu limit {gpus}: run one process per "
            "GPU (leave numProcPerNode unset, or set both to the same number)"
        ]
    return []


def _restart_errors(runtime: dict) -> list[str]:
    """The restart contract of docs/kubernetes.md: any failure restarts all pods through JobSet, after the
    old ones are gone; a stop save does so without spending maxRestarts; bad input fails the TrainJob at once."""
    errs = []
    js = runtime.get("spec", {}).get("template", {}).get("spec", {})
    policy = js.get("failurePolicy") or {}
    if not isinstance(policy.get("maxRestarts"), int):
        errs.append("failurePolicy.maxRestarts is unset: the first pod failure would fail the TrainJob")
    if policy.get("restartStrategy") != "BlockingRecreate":
        errs.append(
            f"failurePolicy.restartStrategy={policy.get('restartStrategy')!r}: use BlockingRecreate (new pods "
            "must not write the run directory while old ones still save)"
        )
    errs += _exit_code_errors(runtime, int(policy.get("maxRestarts") or 0))
    rjob = next((r for r in replicated_jobs(runtime) if r.get("name") == TRAINER_JOB), {})
    jspec = rjob.get("template", {}).get("spec", {})
    if jspec.get("backoffLimit") != 0 or jspec.get("template", {}).get("spec", {}).get("restartPolicy") != "Never":
        errs.append(
            f"replicatedJobs.{TRAINER_JOB}: set backoffLimit: 0 and the pod's restartPolicy: Never (a restart "
            "of one pod alone meets peers whose collectives already failed; JobSet restarts them all)"
        )
    return errs


def _exit_code_errors(runtime: dict, max_restarts: int) -> list[str]:
    """The exit codes' contract (docs/kubernetes.md, "Exit codes and restarts"), as JobSet would answer them."""
    errs = []
    if jobset_answer(runtime, EXIT_BAD_INPUT, 0) != "FailJobSet":
        errs.append(
            f"exit code {EXIT_BAD_INPUT} (bad input) gets {jobset_answer(runtime, EXIT_BAD_INPUT, 0)!r}, not "
            f"FailJobSet: podFailurePolicy must FailJob on exit code {EXIT_BAD_INPUT}, and a failurePolicy rule "
            "FailJobSet on reason PodFailurePolicy must match its message (bad input is permanent)"
        )
    stop = jobset_answer(runtime, EXIT_PREEMPTED, max_restarts)
    if stop != "RestartJobSetAndIgnoreMaxRestarts":
        errs.append(
            f"exit code {EXIT_PREEMPTED} (a stop save) after maxRestarts={max_restarts} restarts gets {stop!r}: "
            f"podFailurePolicy must FailJob on exit code {EXIT_PREEMPTED}, and a failurePolicy rule "
            "RestartJobSetAndIgnoreMaxRestarts on reason PodFailurePolicy must match its message (time-budget "
            "attempts and drains must not spend the failure budget)"
        )
    for code in (1, 124, 137):
        if jobset_answer(runtime, code, 0) != "RestartJobSet":
            errs.append(f"exit code {code} gets {jobset_answer(runtime, code, 0)!r}: a failure must restart all pods")
    return errs


def _runtime_of(job: dict, docs: list[dict]) -> dict | None:
    ref = job.get("spec", {}).get("runtimeRef") or {}
    kind = ref.get("kind", "ClusterTrainingRuntime")
    return next(
        (d for d in docs if d.get("kind") == kind and d.get("metadata", {}).get("name") == ref.get("name")), None
    )


def project_errors(job: dict, docs: list[dict]) -> list[str]:
    """What a cluster accepts but this project must not ship."""
    trainer = job.get("spec", {}).get("trainer") or {}
    errs = _launch_errors(trainer) + _nproc_errors(trainer)
    labels = (job.get("metadata") or {}).get("labels") or {}
    if QUEUE_LABEL in labels and job.get("spec", {}).get("suspend") is not True:
        errs.append(f"metadata.labels[{QUEUE_LABEL!r}] is set: also set spec.suspend: true (Kueue admits it)")
    runtime = _runtime_of(job, docs)
    if runtime is None:
        ref = job.get("spec", {}).get("runtimeRef")
        return errs + [f"spec.runtimeRef {ref} is not in the rendered manifests: ship the TrainingRuntime ddp-job"]
    found = trainer_pod(runtime)
    if found is None:
        return errs  # reported by runtime_webhook_errors
    pod, c = found
    where = f"TrainingRuntime {runtime['metadata']['name']}: container {TRAINER_JOB}"
    bad_env = sorted(k for k in kv._env(c) if k.startswith("PET_"))
    if bad_env:
        errs.append(f"{where}: env {bad_env}: PET_* are the torch plugin's to set: remove them")
    cmd = [*(trainer.get("command") or []), *(trainer.get("args") or [])]
    errs += kv.grace_errors(pod, c) + _restart_errors(runtime)
    errs += kv.storage_errors(where, c, pod, cmd, docs) + kv.security_errors(where, c, pod, TRAINER_JOB)
    return errs


def all_errors(docs: list[dict]) -> list[str]:
    """Every gate over a rendered Trainer v2 manifest set: exactly one TrainJob and its runtime."""
    errs: list[str] = []
    jobs = [d for d in docs if d.get("kind") == "TrainJob"]
    if len(jobs) != 1:
        errs.append(f"expected exactly one TrainJob, found {len(jobs)}")
    for d in docs:
        if str(d.get("apiVersion", "")).startswith("trainer.kubeflow.org/"):
            errs += crd_errors(d)
        else:
            errs += kv.builtin_errors(d)
        if d.get("kind") == "TrainingRuntime":
            errs += job_template_errors(d) + runtime_webhook_errors(d) + jobset_webhook_errors(d)
        if d.get("kind") == "TrainJob":
            errs += webhook_errors(d) + project_errors(d, docs)
    return errs
