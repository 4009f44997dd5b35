"""``train.tf32``: after the job sets it, every getter of torch's legacy and new precision APIs reads it back
(inductor's autotuning reads the legacy ``get_float32_matmul_precision``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from job.parallel.ddp import apply_tf32


@pytest.fixture(autouse=True)
def restore_precision() -> Iterator[None]:
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


def getters() -> dict[str, object]:
    """Every getter's value, or the error it raised."""
    reads = {
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        "cuda.matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
        "cudnn.conv.fp32_precision": lambda: torch.backends.cudnn.conv.fp32_precision,  # type: ignore[attr-defined]
    }
    out: dict[str, object] = {}
    for name, read in reads.items():
        try:
            out[name] = read()
        except RuntimeError as e:
            out[name] = e
    return out


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("before", ["untouched", "new api"])
def test_every_precision_getter_reads_the_setting_back(enabled: bool, before: str) -> None:
    if before == "new api":  # another library set the new flags first
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
    apply_tf32(enabled)
    got = getters()
    errors = {k: v for k, v in got.items() if isinstance(v, Exception)}
    assert errors == {}
    assert got["cuda.matmul.allow_tf32"] is enabled and got["cudnn.allow_tf32"] is enabled
    assert got["get_float32_matmul_precision"] == ("high" if enabled else "highest")
    assert got["cuda.matmul.fp32_precision"] == ("tf32" if enabled else "ieee")
    assert (got["cudnn.conv.fp32_precision"] == "tf32") is enabled
