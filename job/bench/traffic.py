"""Bytes each rank sends per optimizer step, by link class (within its node, across nodes), under ddp, fsdp and
hsdp: the formulas, and the counts of ``job/bench/traffic_worker.py`` beside them.

The formulas are gloo's on CPU, the backend the counts are taken on (NCCL moves the same collectives over
NVLink and the network, and its reduce-scatter sends half of what gloo's does). P is the parameter bytes (fp32,
each parameter's dim 0 padded to a multiple of the shard degree as FSDP2 pads it), N the world size, L the
ranks per node, S x R the hsdp mesh (shard within a node: S = L), a rank's local rank ``l``:

- ddp: one ring all-reduce of the gradients: each rank sends 2(N-1)/N x P to the rank before it (gloo's ring),
  across nodes where ``l == 0``.
- fsdp (one shard group of all N ranks, every parameter in a unit resharded after forward): per unit an
  all-gather before forward and again before backward, each sending (N-1)/N x P in all to the next rank (across
  where ``l == L-1``), and a reduce-scatter, which gloo runs as a whole all-reduce of the unsharded gradients
  (torch's ProcessGroupGloo.reduce_scatter_tensor_coalesced): 2(N-1)/N x P to the rank before (across where
  ``l == 0``).
- hsdp: the same gathers and reduce-scatter within the node's shard group, 4(S-1)/S x P, none across; then each
  rank all-reduces its 1/S of the gradients with its R - 1 copies on the other nodes: 2(R-1)/R x P/S across.

So per node and step, across nodes: ddp 2(N-1)/N x P, fsdp 4(N-1)/N x P, hsdp 2(R-1)/R x P: hsdp crosses the
nodes with one gradient reduction's bytes, as ddp does, and keeps the gathers on the node's own links.

    torchrun --nnodes 2 --nproc-per-node 2 ... -m job.bench.traffic_worker --out DIR    (on every node)
    ddp-job bench traffic DIR     (DIR/<strategy>/rank<R>.json of the workers; prints a table + JSON)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from job.bench import common


def padded_bytes(shapes: list[tuple[int, ...]], element_size: int, shard_degree: int) -> int:
    """Bytes of parameters of ``shapes`` with dim 0 padded to a multiple of ``shard_degree`` (FSDP2's padding)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += -(-rows // shard_degree) * shard_degree * rest
    return total * element_size


def expected(
    strategy: str, param_bytes: int, shape: tuple[int, int], local_world_size: int, local_rank: int
) -> dict[str, float]:
    """Bytes rank ``local_rank`` of a node sends per optimizer step, ``node`` and ``cross``, on gloo (module doc).
    ``shape``: (replicate, shard) of the fsdp mesh ((1, N) for fsdp, (N, 1) for ddp)."""
    replicate, shard = shape
    world_size = replicate * shard
    ring = 2 * (world_size - 1) / world_size * param_bytes
    first, last = local_rank == 0, local_rank == local_world_size - 1
    several_nodes = world_size > local_world_size
    out = {"node": 0.0, "cross": 0.0}
    if strategy == "ddp":
        out[_link(first and several_nodes)] += ring
    elif strategy == "fsdp" and replicate == 1:
        out[_link(last and several_nodes)] += 2 * (world_size - 1) / world_size * param_bytes
        out[_link(first and several_nodes)] += ring
    else:
        out["node"] += 4 * (shard - 1) / shard * param_bytes
        out["cross"] += 2 * (replicate - 1) / replicate * param_bytes / shard
    return out


def _link(crosses: bool) -> str:
    if crosses:
        return "cross"
    return "node"


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: counted bytes per step by link class, the formula's, and the state bytes it holds."""
    out = []
    for r in sorted(records, key=lambda r: r["rank"]):
        want = expected(r["strategy"], r["param_bytes"], tuple(r["shape"]), r["local_world_size"], r["local_rank"])
        got = {k: v / r["steps"] for k, v in r["sent"].items()}
        out.append(
            {
                "strategy": r["label"],
                "rank": r["rank"],
                "node": r["node"],
                "sent": got,
                "expected": want,
                "state_bytes": r["state"]["state"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    records = [json.loads(p.read_text()) for p in sorted(Path(args[0]).glob("*/rank*.json"))]
    table = rows(records)
    mib = 2**20
    common.table(
        "bytes sent per optimizer step and rank (MiB), counted vs formula",
        ("strategy", "rank", "node", "within node", "formula", "across nodes", "formula", "state MiB"),
        [
            (
                r["strategy"],
                r["rank"],
                r["node"],
                f"{r['sent']['node'] / mib:.4f}",
                f"{r['expected']['node'] / mib:.4f}",
                f"{r['sent']['cross'] / mib:.4f}",
                f"{r['expected']['cross'] / mib:.4f}",
                f"{r['state_bytes'] / mib:.2f}",
            )
            for r in table
        ],
    )
    common.emit("traffic", {"ranks": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
