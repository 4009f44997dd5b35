"""Run a rendered TrainJob pod by pod, as Kubeflow Trainer v2.3.0, JobSet v0.12.0, the Job controller and
the kubelet would (their behaviour read from the sources of those tags). The pods are those of tests/support/k8s_sim.py
(one network namespace per pod with its own IP, hostname, /etc/hosts, mount and PID namespace, the
image stand-in at /opt/ddp-job + /opt/venv), on a network of their own so that both simulations can
run at once. What is Trainer v2 here:

* the TrainJob's ``spec.trainer`` merged into the runtime's replicated job ``node``, container ``node``;
  pods of one Indexed Job ``<job>-node-0``: pod i has hostname ``<job>-node-0-<i>``, subdomain
  ``<job>`` (the headless Service), completion index i;
* DNS as the headless Service gives it: every pod resolves ``<host>.<job>`` (and its FQDN) of the pods
  whose container runs; its own hosts file also holds its own names, as the kubelet writes it;
* the environment: the image's, ``HOSTNAME``, the runtime container's env, the TrainJob's env, the
  torch plugin's ``PET_*`` (``torch_env``) and the Job controller's ``JOB_COMPLETION_INDEX``;
* restarts: the pod's restartPolicy (kubelet, in place), the Job's backoffLimit and podFailurePolicy
  (``pod_failure_rule``; a FailJob rule fails the Job with the controller's message, ``fail_job_message``),
  JobSet's failurePolicy rules on the failure's reason and message (``jobset_action``): a restart deletes every
  pod, waits for all of them to be gone (BlockingRecreate) and creates new ones with new IPs; only
  RestartJobSet counts towards maxRestarts, RestartJobSetAndIgnoreMaxRestarts does not;
* suspend: every pod deleted (SIGTERM, SIGKILL after terminationGracePeriodSeconds), the TrainJob kept;
  resume: new pods, new IPs. A TrainJob created with ``spec.suspend: true`` starts no pod;
* the ``TrainJobStatus`` feature gate (``trainjob_status``, off by default as upstream): the controller's status
  endpoint (tests/support/trainjob_status.py) listens in a network namespace of its own on the pods' network
  (``CONTROLLER_IP``), as the controller pod does, and every pod resolves its Service name there; the
  TrainJobStatus plugin's three variables go into the trainer container and its projected volume
  (``kubeflow-trainer-token``: ``token`` and ``ca.crt``) is mounted at ``/var/run/secrets/kubeflow/trainer``.
  The kubelet's token manager writes each new pod a token of its own and replaces it at 80 % of its lifetime
  (``token_rotate_s``, seconds here where the real one is 48 min of 1 h), so the previous token stays valid
  for the last 20 %: the overlap a real one has, and a client that kept its first token is refused within
  ``token_rotate_s / 4``. Files change as the kubelet's AtomicWriter changes them: a new timestamped
  directory, then the ``..data`` link swapped.

Needs root, iproute2 and mount.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

from support import k8s_sim as ks
from support import trainjob_status as tjs

SUBNET = "10.233.0"  # the first three octets of the TrainJob pods' addresses
TRAINER_JOB = "node"  # the replicated job and the container the torch plugin fills
MASTER_PORT = 29500
JOB_BACKOFF_DEFAULT = 6  # a Job's backoffLimit when unset
GRACE_DEFAULT_S = 30
COMPLETE, FAILED, RUNNING, SUSPENDED = "Complete", "Failed", "Running", "Suspended"
CONTROLLER_IP = 2  # the last octet of the controller's address on the pods' network
CONTROLLER_VETH = 99  # its veth pair's index (the pods' are 0..numNodes-1)
TOKEN_VOLUME = "kubeflow-trainer-token"
TOKEN_REFRESH = 0.8  # the kubelet replaces a projected token once 80 % of its lifetime has passed


# ----------------------------------------------------------------------------- pure controller logic
def runtime_of(docs: list[dict], job: dict) -> dict:
    ref = job["spec"]["runtimeRef"]
    kind = ref.get("kind", "ClusterTrainingRuntime")
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == ref["name"])


def trainer_job(runtime: dict) -> dict:
    """The runtime's replicated job ``node`` (its Job template)."""
    return next(r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == TRAINER_JOB)


def num_nodes(job: dict, runtime: dict) -> int:
    return int(job["spec"].get("trainer", {}).get("numNodes") or runtime["spec"]["mlPolicy"].get("numNodes") or 1)


def hostnames(job: dict, runtime: dict) -> list[str]:
    """JobSet's pod hostnames ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>``: one Job, numNodes pods."""
    name = job["metadata"]["name"]
    return [f"{name}-{TRAINER_JOB}-0-{i}" for i in range(num_nodes(job, runtime))]


def nproc_per_node(trainer: dict) -> str:
    """PET_NPROC_PER_NODE: numProcPerNode; unset ("auto"): with GPUs requested "auto" for torchrun, else
    the CPU request (or limit) of a node rounded up, at least 1."""
    if trainer.get("numProcPerNode") is not None:
        return str(trainer["numProcPerNode"])
    res = trainer.get("resourcesPerNode") or {}
    if "nvidia.com/gpu" in {**(res.get("requests") or {}), **(res.get("limits") or {})}:
        return "auto"
    cpu = str((res.get("requests") or {}).get("cpu") or (res.get("limits") or {}).get("cpu") or "1")
    cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    return str(max(1, math.ceil(cores)))


def torch_env(job: dict, runtime: dict, index: int) -> list[tuple[str, str]]:
    """The torch plugin's variables for the pod with completion index ``index``, in its order."""
    name = job["metadata"]["name"]
    return [
        ("PET_NNODES", str(num_nodes(job, runtime))),
        ("PET_NPROC_PER_NODE", nproc_per_node(job["spec"].get("trainer") or {})),
        ("PET_NODE_RANK", str(index)),  # fieldRef to the completion-index annotation
        ("PET_MASTER_ADDR", f"{name}-{TRAINER_JOB}-0-0.{name}"),
        ("PET_MASTER_PORT", str(MASTER_PORT)),
    ]


def merged_container(job: dict, runtime: dict) -> dict:
    """Container ``node`` of the runtime with the TrainJob's spec.trainer merged in (env by name)."""
    pod = trainer_job(runtime)["template"]["spec"]["template"]["spec"]
    c = dict(next(c for c in pod["containers"] if c["name"] == TRAINER_JOB))
    trainer = job["spec"].get("trainer") or {}
    for key in ("image", "command", "args"):
        if key in trainer:
            c[key] = trainer[key]
    if "resourcesPerNode" in trainer:
        c["resources"] = trainer["resourcesPerNode"]
    env = {e["name"]: e for e in c.get("env") or []}
    env.update({e["name"]: e for e in trainer.get("env") or []})
    c["env"] = list(env.values())
    return c


def status_env(job: dict) -> list[tuple[str, str]]:
    """The TrainJobStatus plugin's variables (``createEnvVars``): the endpoint's URL, the CA and the token files
    of its projected volume."""
    ns = job["metadata"].get("namespace", ks.NAMESPACE)
    return [
        ("KUBEFLOW_TRAINER_SERVER_URL", tjs.url(ns, job["metadata"]["name"])),
        ("KUBEFLOW_TRAINER_SERVER_CA_CERT", f"{tjs.MOUNT}/ca.crt"),
        ("KUBEFLOW_TRAINER_SERVER_TOKEN", f"{tjs.MOUNT}/token"),
    ]


def container_env(job: dict, runtime: dict, index: int, trainjob_status: bool = False) -> dict[str, str]:
    """The container's environment for the pod of completion index ``index``, as the pod starts it."""
    host = hostnames(job, runtime)[index]
    env = {**ks.IMAGE_ENV, "HOSTNAME": host}
    for e in merged_container(job, runtime).get("env") or []:
        if "value" not in e:
            raise ValueError(f"{host}: env {e['name']} has no value (valueFrom is not simulated)")
        env[e["name"]] = e["value"]
    env.update(torch_env(job, runtime, index))
    if trainjob_status:
        env.update(status_env(job))
    env["JOB_COMPLETION_INDEX"] = str(index)  # the Job controller's, for Indexed Jobs
    return env


def pod_failure_rule(code: int, policy: dict | None) -> tuple[str, int | None]:
    """The Job's podFailurePolicy for a container that exited ``code``: the action (FailJob, Ignore or Count)
    and the index of the rule that gave it (None: no rule matched, so Count)."""
    for index, rule in enumerate((policy or {}).get("rules") or []):
        on = rule.get("onExitCodes")
        if not on:
            continue
        hit = code in on.get("values", [])
        if (on.get("operator") == "In") == hit:
            return rule["action"], index
    return "Count", None


def pod_failure_action(code: int, policy: dict | None) -> str:
    """The Job's podFailurePolicy for a container that exited ``code``: FailJob, Ignore or Count."""
    return pod_failure_rule(code, policy)[0]


def fail_job_message(pod: str, code: int, index: int, namespace: str = "default") -> str:
    """The message of the Job's Failed condition (reason PodFailurePolicy) after rule ``index`` said FailJob,
    as the Job controller writes it (pkg/controller/job/pod_failure_policy.go); JobSet's rules match it."""
    return (
        f"Container {TRAINER_JOB} for pod {namespace}/{pod} failed with exit code {code} "
        f"matching FailJob rule at index {index}"
    )


def _rule_applies(rule: dict, reason: str, message: str) -> bool:
    """JobSet's ruleIsApplicable: the reason is listed (or none is) and a pattern matches the message (or none is
    given); Go's regexp.MatchString finds a match anywhere, as re.search does."""
    reasons = rule.get("onJobFailureReasons") or []
    patterns = rule.get("onJobFailureMessagePatterns") or []
    return (not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns))


def jobset_action(reason: str, message: str, failure_policy: dict | None, counted: int) -> str:
    """JobSet's answer to a failed child Job: FailJobSet, RestartJobSet or RestartJobSetAndIgnoreMaxRestarts.
    ``counted`` is the restarts so far that count towards maxRestarts (status.restartsCountTowardsMax)."""
    if failure_policy is None:
        return "FailJobSet"  # no failurePolicy: the first failed Job fails the JobSet
    rule = next((r for r in failure_policy.get("rules") or [] if _rule_applies(r, reason, message)), None)
    action = "RestartJobSet" if rule is None else rule["action"]
    if action == "RestartJobSet" and counted >= int(failure_policy.get("maxRestarts") or 0):
        return "FailJobSet"  # reason ReachedMaxRestarts
    return action


# ----------------------------------------------------------------------------- the simulation
class TrainJobSimulation:
    """Trainer + JobSet + Job controller + kubelets for one rendered TrainJob. Use as a context manager:
    namespaces, bridge, hosts files and processes are removed on exit, also after a failure."""

    def __init__(
        self,
        docs: list[dict],
        workdir: Path,
        *,
        venv: Path = ks.REPO / ".venv",
        trainjob_status: bool = False,
        token_rotate_s: float = 3.0,
    ) -> None:
        self.job = next(d for d in docs if d["kind"] == "TrainJob")
        self.trainjob_status, self.token_rotate_s = trainjob_status, token_rotate_s
        self.status_server: tjs.StatusServer | None = None
        """The controller's status endpoint, with the feature gate on (from ``__enter__``)."""
        self.controller: ks.Pod | None = None  # the controller's pod, with the feature gate on
        self.tokens: dict[str, list[tuple[float, str]]] = {}
        """Each pod's projected tokens (``<pod>.<generation>``), in the order the kubelet wrote them."""
        self.token_removed = threading.Event()
        self._token_lock = threading.Lock()  # the token manager against pod creation and the test's faults
        self.runtime = runtime_of(docs, self.job)
        self.config_maps = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d["kind"] == "ConfigMap"}
        self.workdir, self.venv = workdir, venv
        self.job_spec = trainer_job(self.runtime)["template"]["spec"]
        self.pod_spec = self.job_spec["template"]["spec"]
        self.container = merged_container(self.job, self.runtime)
        names = hostnames(self.job, self.runtime)
        self.net = ks.Network(SUBNET)
        self.pods = {n: ks.Pod(n, TRAINER_JOB, i, self.net.ns_prefix + n, i) for i, n in enumerate(names)}
        self.events: list[tuple[float, str, str]] = []
        self.condition = SUSPENDED if self.job["spec"].get("suspend") else "Created"
        self.restart_attempt = 0  # JobSet's status.restarts, the pods' jobset.sigs.k8s.io/restart-attempt label
        self.restarts_counted = 0  # JobSet's status.restartsCountTowardsMax, against failurePolicy.maxRestarts
        self.failures = 0  # the Job's failed pods, against backoffLimit
        self.image: list[dict] = []
        self._next_ip = 10
        self._lock = threading.RLock()  # hosts files and events (the kubelet threads take it)
        self._control = threading.Lock()  # the controller's pass against the test's suspend/resume
        self._stopped = threading.Event()

    # --------------------------------------------------------------------- network
    def __enter__(self) -> TrainJobSimulation:
        ks.sweep_orphans()  # what a simulation killed hard left behind
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        ks.make_bridge(self.net)
        for pod in self.pods.values():
            ks.make_pod_network(pod, self.net, self.workdir / "net")
        self.image = ks.image_layers(self.venv, ks.image_bin(self.venv, self.workdir / "image" / "bin"))
        if self.trainjob_status:
            self._start_controller()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        for pod in self.pods.values():
            pod.stop.set()
        if self.status_server is not None:
            self.status_server.down()
        ks.teardown(self.net)
        for pod in self.pods.values():
            if pod.thread:
                pod.thread.join(timeout=10)

    def _start_controller(self) -> None:
        """The controller's pod on the pods' network, its status endpoint listening there, the token manager."""
        ctrl = ks.Pod("controller", "controller", 0, self.net.ns_prefix + "controller", CONTROLLER_VETH)
        ks.make_pod_network(ctrl, self.net, self.workdir / "net")
        ks.set_pod_ip(ctrl, f"{self.net.subnet}.{CONTROLLER_IP}")
        ns = self.job["metadata"].get("namespace", ks.NAMESPACE)
        server = tjs.StatusServer(self.workdir / "controller", ns, self.job["metadata"]["name"], ctrl.ip)
        server.up(lambda make: ks.call_in_netns(ctrl.netns, make))
        self.controller = ctrl
        self.status_server = server
        threading.Thread(target=self._token_manager, name="token-manager", daemon=True).start()

    def _token_dir(self, pod: ks.Pod) -> Path:
        return self.workdir / "pods" / f"{pod.name}.{pod.generation}" / TOKEN_VOLUME

    def _write_token(self, pod: ks.Pod) -> None:
        """The projected volume as the kubelet's AtomicWriter updates it: the files in a new timestamped
        directory, the ``..data`` link swapped to it, the old directory removed. With ``token_removed`` set the
        new directory has no token: the ``token`` link dangles."""
        server = self.status_server
        if server is None:
            return
        with self._token_lock:
            self._swap_token(pod, server)

    def _swap_token(self, pod: ks.Pod, server: tjs.StatusServer) -> None:
        vol = self._token_dir(pod)
        vol.mkdir(parents=True, exist_ok=True)
        key = f"{pod.name}.{pod.generation}"
        new = vol / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
        new.mkdir()
        (new / "ca.crt").write_bytes(server.ca_file.read_bytes())
        if not self.token_removed.is_set():
            token = server.issuer.issue(server.namespace, server.name, pod.name, self.token_rotate_s / TOKEN_REFRESH)
            (new / "token").write_text(token)
            self.tokens.setdefault(key, []).append((time.time(), token))
        old = os.readlink(vol / "..data") if (vol / "..data").is_symlink() else None
        (vol / "..data_tmp").symlink_to(new.name)
        os.replace(vol / "..data_tmp", vol / "..data")
        for name in ("token", "ca.crt"):
            if not (vol / name).is_symlink():
                (vol / name).symlink_to(f"..data/{name}")
        if old is not None:
            shutil.rmtree(vol / old, ignore_errors=True)

    def _token_manager(self) -> None:
        """The kubelet's: every running pod's token replaced each ``token_rotate_s``."""
        while not self._stopped.wait(self.token_rotate_s):
            for pod in list(self.pods.values()):
                if pod.thread is not None and pod.thread.is_alive() and self._token_dir(pod).is_dir():
                    self._write_token(pod)

    def remove_token(self) -> None:
        """Fault: the projected token disappears from every pod's volume until ``restore_token``."""
        self.token_removed.set()
        for pod in self.pods.values():
            if self._token_dir(pod).is_dir():
                self._write_token(pod)

    def restore_token(self) -> None:
        self.token_removed.clear()
        for pod in self.pods.values():
            if self._token_dir(pod).is_dir():
                self._write_token(pod)

    def _publish(self) -> None:
        """Every pod's /etc/hosts: its own names (kubelet) plus the headless Service's records of the pods
        whose container runs (``<host>.<subdomain>``; a bare peer hostname does not resolve)."""
        sub = self.job["metadata"]["name"]
        fqdn = f"{sub}.{ks.NAMESPACE}.svc.{ks.CLUSTER_DOMAIN}"
        with self._lock:
            ready = [p for p in self.pods.values() if p.ready]
            for pod in self.pods.values():
                lines = ["127.0.0.1 localhost", f"{pod.ip} {pod.name}.{fqdn} {pod.name}.{sub} {pod.name}"]
                lines += [f"{p.ip} {p.name}.{sub} {p.name}.{fqdn}" for p in ready if p is not pod]
                if self.controller is not None:  # the controller's Service, always resolvable
                    lines.append(f"{self.controller.ip} {tjs.SERVICE_HOST} {tjs.SERVICE_HOST}.{ks.CLUSTER_DOMAIN}")
                ks.write_hosts(pod, lines)

    def _event(self, pod: str, what: str) -> None:
        with self._lock:
            self.events.append((time.monotonic(), pod, what))

    # --------------------------------------------------------------------- kubelet
    def _spec(self, pod: ks.Pod, run: int) -> dict:
        pod_dir = self.workdir / "pods" / f"{pod.name}.{pod.generation}"
        mounts = ks.volume_mounts(pod.name, self.container, self.pod_spec, self.config_maps, self.workdir, pod_dir)
        if self.status_server is not None:  # the TrainJobStatus plugin's projected volume
            mounts.append({"kind": "bind", "source": str(self._token_dir(pod)), "target": tjs.MOUNT, "read_only": True})
        return ks.container_spec(
            pod,
            str(run),
            self.workdir,
            self.image,
            mounts,
            command=[*(self.container.get("command") or []), *(self.container.get("args") or [])],
            env=container_env(self.job, self.runtime, pod.index, self.status_server is not None),
            cwd=self.container.get("workingDir", "/"),
            security=ks.security_context(self.pod_spec, self.container),
        )

    def _run_once(self, pod: ks.Pod, run: int) -> int:
        return ks.run_container_once(self, pod, run, f"started ip={pod.ip} generation={pod.generation} run={run}")

    def _kubelet(self, pod: ks.Pod) -> None:
        policy = self.pod_spec.get("restartPolicy", "OnFailure")  # the JobSet webhook's default
        run = 0
        while not pod.stop.is_set():
            rc = self._run_once(pod, run)
            if pod.deleting or pod.stop.is_set():
                pod.phase, pod.reason = "Failed", "Deleted"
                return
            if policy == "OnFailure" and rc != 0:
                pod.restarts += 1
                run += 1
                if pod.stop.wait(ks.backoff_s(pod.restarts, 10.0)):
                    return
                continue
            pod.phase = "Succeeded" if rc == 0 else "Failed"
            return

    def _create(self, pod: ks.Pod) -> None:
        """A new pod for this completion index: a new IP, fresh emptyDirs."""
        if pod.thread is not None:  # generation 0 is the first pod of the index
            pod.generation += 1
        ks.set_pod_ip(pod, f"{self.net.subnet}.{self._next_ip}")
        self._next_ip += 1
        pod.phase, pod.reason, pod.restarts, pod.deleting, pod.ready = "Pending", "", 0, False, False
        pod.stop = threading.Event()
        self._write_token(pod)  # a new pod: its projected volume, with a token of its own
        pod.thread = threading.Thread(target=self._kubelet, args=(pod,), name=pod.name, daemon=True)
        self._event(pod.name, f"created generation={pod.generation} restart-attempt={self.restart_attempt}")
        pod.thread.start()

    def _delete(self, pod: ks.Pod) -> None:
        """Pod deletion: SIGTERM to PID 1, SIGKILL after terminationGracePeriodSeconds."""
        pod.deleting = True
        pod.stop.set()
        if pod.pid1 is None:
            return
        grace = self.pod_spec.get("terminationGracePeriodSeconds", GRACE_DEFAULT_S)
        try:
            self.kill(pod.name, signal.SIGTERM)
        except (ProcessLookupError, RuntimeError):  # its container exited between the check and the signal
            return

        def sigkill(gen: int = pod.generation) -> None:
            if pod.generation == gen and pod.pid1:
                os.kill(pod.pid1, signal.SIGKILL)

        timer = threading.Timer(grace, sigkill)
        timer.daemon = True
        timer.start()

    def _delete_all_and_wait(self) -> None:
        for pod in self.pods.values():
            if pod.thread is not None and pod.thread.is_alive():
                self._delete(pod)
        for pod in self.pods.values():
            if pod.thread is not None:
                pod.thread.join()

    # --------------------------------------------------------------------- the test's controls
    def start(self) -> None:
        """kubectl apply: the controllers start; pods only if the TrainJob is not suspended."""
        if self.condition != SUSPENDED:
            self.resume()
        threading.Thread(target=self._controller, name="controller", daemon=True).start()

    def resume(self) -> None:
        """spec.suspend: false (Kueue admits the workload): new pods for every index, new IPs."""
        with self._control:
            self.condition = RUNNING
            self._event("trainjob", "resume")
            for pod in self.pods.values():
                self._create(pod)

    def suspend(self) -> None:
        """spec.suspend: true (Kueue preemption, kubectl patch): every pod is deleted, the TrainJob kept.
        Returns once every pod is gone."""
        with self._control:
            self.condition = SUSPENDED
            self._event("trainjob", "suspend")
            self._delete_all_and_wait()
            self._event("trainjob", "suspended: no pods left")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the container's PID 1; SIGKILL takes every process of the pod with it."""
        ks.signal_pod(self, name, sig)

    def wait(self, timeout: float) -> str:
        """Wait until the TrainJob is Complete or Failed; returns the condition."""
        return ks.wait_for_condition(self, (COMPLETE, FAILED), timeout)

    # --------------------------------------------------------------------- controllers
    def _controller(self) -> None:
        while self.condition not in (COMPLETE, FAILED) and not self._stopped.is_set():
            with self._control:
                if self.condition == RUNNING:
                    self._reconcile()
            self._stopped.wait(0.2)

    def _reconcile(self) -> None:
        """One pass of the Job controller (pod failures, backoffLimit, podFailurePolicy, completion)."""
        finished = [p for p in self.pods.values() if p.thread is not None and not p.thread.is_alive()]
        for pod in finished:
            if pod.phase != "Failed" or pod.deleting:
                continue
            code = pod.exit_codes[-1]
            action, index = pod_failure_rule(code, self.job_spec.get("podFailurePolicy"))
            if action == "FailJob" and index is not None:
                return self._job_failed("PodFailurePolicy", fail_job_message(pod.name, code, index))
            if action == "Count":
                self.failures += 1
                if self.failures > self.job_spec.get("backoffLimit", JOB_BACKOFF_DEFAULT):
                    return self._job_failed("BackoffLimitExceeded", "Job has reached the specified backoff limit")
            self._event(pod.name, f"recreate after exit {pod.exit_codes[-1]} ({action})")
            self._create(pod)
        if all(p.phase == "Succeeded" for p in self.pods.values()):
            self._finish(COMPLETE)
        return None

    def _job_failed(self, reason: str, message: str) -> None:
        """JobSet's failurePolicy for the failed Job: fail the TrainJob, or recreate every pod."""
        policy = self.runtime["spec"]["template"]["spec"].get("failurePolicy")
        action = jobset_action(reason, message, policy, self.restarts_counted)
        self._event("jobset", f"job failed ({reason}: {message}): {action}")
        if action == "FailJobSet":
            self._finish(FAILED)
            return
        if (policy or {}).get("restartStrategy") != "BlockingRecreate":
            raise ValueError("the simulation recreates pods only after the old ones are gone: use BlockingRecreate")
        self._delete_all_and_wait()
        self.restart_attempt += 1  # either restart action; only RestartJobSet counts towards maxRestarts
        if action == "RestartJobSet":
            self.restarts_counted += 1
        self.failures = 0
        for pod in self.pods.values():
            self._create(pod)

    def _finish(self, condition: str) -> None:
        self.condition = condition
        for pod in self.pods.values():
            pod.stop.set()
            if pod.pid1:
                try:
                    os.kill(pod.pid1, signal.SIGKILL)
                except ProcessLookupError:  # it exited between the check and the kill
                    pass
        self._event("trainjob", condition)

    def log(self, name: str) -> str:
        """Every container run of every pod of this completion index, in order."""
        files = sorted(
            (self.workdir / "logs").glob(f"{name}.*.log"), key=lambda p: tuple(int(x) for x in p.name.split(".")[-3:-1])
        )
        return "".join(f.read_text(errors="replace") for f in files)
