"""Checkpoint waste under simulated interruptions: ``ckpt.every: auto``'s interval against fixed ones.

A job of ``W`` seconds of work saves after every ``tau`` seconds of work; a save stops training for
``delta``; interruptions arrive as a Poisson process of rate ``1/M`` (at any moment: during work, a save or
a restart); each one loses the work since the last completed save and costs a restart of ``R`` seconds.
Waste = wall time - W: the saves plus the recomputed work plus the restarts.

For each scenario (delta, M) the simulation runs the same interruption sequences (common random numbers) at
Daly's interval (``job.checkpoint.cadence.daly_interval``, what ``auto`` chooses), at 1/2x and 2x it, and
at Young's ``sqrt(2 delta M)``, and compares each with Daly's expected-wall-time model, minimised
numerically (J. T. Daly, FGCS 22, 2006, eq. 5):

    T_w(tau) = M exp(R/M) (exp((tau + delta)/M) - 1) W / tau

    ddp-job bench ckpt-waste [--quick] [--runs 4000] [--seed 0]

Pure arithmetic: no training, no timing; it checks the interval, not the save (``bench checkpoint`` times that).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from job.bench import common
from job.checkpoint.cadence import daly_interval

# (save stall delta, MTBF M) in seconds: a fast local save on a reliable queue up to a slow store on a
# preemptible one. The restart cost is the same for every interval, so it shifts waste, not the ranking.
SCENARIOS = ((10.0, 86_400.0), (60.0, 21_600.0), (30.0, 3_600.0), (300.0, 3_600.0))
RESTART_S = 120.0
WORK_MTBFS = 20.0
"""Each simulated job needs this many MTBFs of work: enough interruptions per run for the mean to settle."""
FACTORS = {"daly": 1.0, "half": 0.5, "double": 2.0}


@dataclass(frozen=True)
class Scenario:
    delta_s: float
    mtbf_s: float
    restart_s: float = RESTART_S

    @property
    def work_s(self) -> float:
        return WORK_MTBFS * self.mtbf_s


def model_wall_s(tau_s: float, s: Scenario) -> float:
    """Daly's expected wall time for ``s.work_s`` of work saved every ``tau_s`` (exponential interruptions)."""
    m = s.mtbf_s
    return m * math.exp(s.restart_s / m) * math.expm1((tau_s + s.delta_s) / m) * s.work_s / tau_s


def model_optimum(s: Scenario) -> float:
    """The interval minimising ``model_wall_s`` (golden-section search on log tau; the model is unimodal)."""
    lo, hi = math.log(1e-3 * s.mtbf_s), math.log(10 * s.mtbf_s)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if model_wall_s(math.exp(a), s) < model_wall_s(math.exp(b), s):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)


def simulate_wall_s(tau_s: float, s: Scenario, rng: random.Random) -> float:
    """One job's wall time: segments of ``tau_s`` work (the last one shorter) each followed by a save."""
    t, done = 0.0, 0.0
    next_fail = rng.expovariate(1 / s.mtbf_s)
    restarting = False
    while s.work_s - done > 1e-9 * s.work_s:  # float sums of segments land a hair short of the work
        if not restarting:  # jump over the whole segments that end before the next interruption
            k = min(math.floor((next_fail - t) / (tau_s + s.delta_s)), math.floor((s.work_s - done) / tau_s))
            if k > 0:
                t, done = t + k * (tau_s + s.delta_s), done + k * tau_s
                continue
        need = s.restart_s if restarting else min(tau_s, s.work_s - done) + s.delta_s
        if t + need <= next_fail:
            t += need
            if not restarting:
                done += need - s.delta_s
            restarting = False
            continue
        t = next_fail  # the segment (or restart) is lost; the restart begins now
        next_fail = t + rng.expovariate(1 / s.mtbf_s)
        restarting = True
    return t


def waste_fracs(tau_s: float, s: Scenario, runs: int, seed: int) -> list[float]:
    """Waste / work of ``runs`` jobs; the same ``seed`` gives every interval the same interruption times."""
    rng = random.Random(seed)
    return [simulate_wall_s(tau_s, s, rng) / s.work_s - 1 for _ in range(runs)]


def compare(s: Scenario, runs: int, seed: int) -> dict[str, Any]:
    """Every interval's simulated waste (mean and standard error) next to the model's optimum."""
    daly = daly_interval(s.delta_s, s.mtbf_s)
    taus = {name: f * daly for name, f in FACTORS.items()}
    taus["young"] = math.sqrt(2 * s.delta_s * s.mtbf_s)
    best_tau = model_optimum(s)
    out: dict[str, Any] = {
        "delta_s": s.delta_s,
        "mtbf_s": s.mtbf_s,
        "restart_s": s.restart_s,
        "model_best_tau_s": best_tau,
        "model_best_waste": model_wall_s(best_tau, s) / s.work_s - 1,
        "intervals": {},
    }
    for name, tau in taus.items():
        fracs = waste_fracs(tau, s, runs, seed)
        out["intervals"][name] = {
            "tau_s": tau,
            "waste": statistics.fmean(fracs),
            "stderr": statistics.stdev(fracs) / math.sqrt(runs),
            "model_waste": model_wall_s(tau, s) / s.work_s - 1,
            "save_overhead": s.delta_s / tau,
        }
    return out


def verdict(r: dict[str, Any]) -> dict[str, bool]:
    """The claims: Daly's interval within 10 % of the model's least waste, and less waste than 1/2x and 2x."""
    iv = r["intervals"]
    return {
        "within_10pct_of_optimum": iv["daly"]["waste"] <= 1.10 * r["model_best_waste"],
        "beats_half": iv["daly"]["waste"] < iv["half"]["waste"],
        "beats_double": iv["daly"]["waste"] < iv["double"]["waste"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench ckpt-waste", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer simulated jobs (CI)")
    p.add_argument("--runs", type=int, default=4000, help="simulated jobs per interval and scenario")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    runs = 400 if a.quick else a.runs
    results = [compare(Scenario(d, m), runs, a.seed) for d, m in SCENARIOS]
    rows = []
    for r in results:
        v = verdict(r)
        r["verdict"] = v
        for name, iv in r["intervals"].items():
            rows.append(
                [
                    f"{r['delta_s']:g} s / {r['mtbf_s'] / 3600:g} h",
                    name,
                    f"{iv['tau_s']:.0f}",
                    f"{100 * iv['waste']:.2f} ± {100 * iv['stderr']:.2f}",
                    f"{100 * iv['model_waste']:.2f}",
                    f"{100 * iv['save_overhead']:.2f}",
                ]
            )
        rows.append(["", "model optimum", f"{r['model_best_tau_s']:.0f}", "", f"{100 * r['model_best_waste']:.2f}", ""])
    common.table(
        f"ckpt-waste: {runs} simulated jobs of {WORK_MTBFS:g} MTBFs each per row, restart {RESTART_S:g} s, seed {a.seed}",
        ["delta / MTBF", "interval", "tau s", "waste % (sim)", "waste % (model)", "save overhead %"],
        rows,
    )
    common.emit(
        "ckpt-waste", {"quick": a.quick, "runs": runs, "seed": a.seed, "restart_s": RESTART_S, "results": results}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
