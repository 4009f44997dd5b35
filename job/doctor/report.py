"""What the doctor says: one line per check (the worst status over ranks), the summary, the exit code and
the JSON report."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from job.doctor import checks as dc
from job.doctor.checks import FAIL, ORDER, PASS, WARN
from job.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK


def merge(
    per_rank: list[list[dict[str, Any]]], world: int, shared: frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """One line per check name: the worst status over ranks, its distinct details and which ranks.
    ``shared`` names checks computed from all ranks' facts (no rank suffix)."""
    names: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rank, checks in enumerate(per_rank):
        for c in checks:
            names.setdefault(c["name"], []).append((rank, c))
    merged = []
    for name, items in names.items():
        worst = max(ORDER[c["status"]] for _, c in items)
        groups: dict[str, list[int]] = {}
        for rank, c in items:
            if ORDER[c["status"]] == worst:
                # PASS details differ only in numbers (ports, timings): one line, rank 0's words
                groups.setdefault(items[0][1]["detail"] if worst == 0 else c["detail"], []).append(rank)
        for detail, ranks in groups.items():
            c = next((c for r, c in items if c["detail"] == detail), items[0][1])
            who = (
                ""
                if world == 1 or name in shared
                else (
                    " [all ranks]"
                    if len(ranks) == world
                    else f" [rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}]"
                )
            )
            merged.append({**c, "ranks": ranks, "line": f"{c['status']} {name:<24} {detail}{who}"})
    return merged


def exit_code(merged: list[dict[str, Any]]) -> int:
    fails = [m for m in merged if m["status"] == FAIL]
    if not fails:
        return EXIT_OK
    return EXIT_FAILURE if all(m["name"].startswith(dc.TRANSIENT) for m in fails) else EXIT_BAD_INPUT


def print_checks(merged: list[dict[str, Any]], only_problems: bool) -> None:
    for m in merged:
        if only_problems and m["status"] == PASS:
            continue
        print(m["line"], flush=True)
        for row in m["data"].get("rows", []) if not only_problems else []:  # nccl-tests style table
            print(bandwidth_line(row), flush=True)
        if m["status"] != PASS and m["fix"]:
            print(f"     fix: {m['fix']}", flush=True)


def bandwidth_line(row: dict[str, Any]) -> str:
    """One size of the bandwidth sweep, nccl-tests style; busbw n/a on one rank (nothing crosses ranks)."""
    busbw = "    n/a"
    if row["busbw_GBps"] is not None:
        busbw = f"{row['busbw_GBps']:7.3f}"
    return f"     {row['size_bytes']:>10} B {row['time_us']:>10.0f} us  algbw {row['algbw_GBps']:7.3f} GB/s  busbw {busbw} GB/s"


def summary(merged: list[dict[str, Any]], wall: float) -> str:
    n = {s: sum(m["status"] == s for m in merged) for s in (FAIL, WARN, PASS)}
    return f"doctor: {n[FAIL]} FAIL, {n[WARN]} WARN, {n[PASS]} PASS in {wall:.2f} s"


def write_report(run_dir: Path, report: dict[str, Any], name: str) -> Path | None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        os.replace(tmp, path)
        return path
    except OSError as e:
        print(f"doctor: report not written to {run_dir} ({e.strerror})", file=sys.stderr, flush=True)
        return None
