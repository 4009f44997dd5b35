"""Decode on the device (data.decode=device/gpu) against decode in the workers (cpu), on the CPU.

The device path runs here with the CPU as its device: the same code as on a GPU but for torchcodec's
decoder (libjpeg-turbo here, nvJPEG there). Stated tolerance: on the CPU both paths decode with
libjpeg-turbo's default IDCT, so pixels must be identical (measured: max difference 0); nvJPEG rounds its
IDCT differently, by a few levels on some pixels, which only the GPU run in tools/gpu_run.sh sees.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from support.cli import run_cli
from test_faults import STEPS, Job, assert_bitwise_equal, final_state, jobs, train_args  # noqa: F401

from job.config import DataConfig
from job.data import device_decode
from job.data.augment import eval_transform, train_transform
from job.data.device_decode import EncodedFiles, choose_decode, decode_batch
from job.data.images import ImageFiles
from job.data.loaders import to_device
from job.data.source import build_loaders, validate_data
from job.errors import EXIT_BAD_INPUT, BadInput

CPU = torch.device("cpu")
MAX_PIXEL_DIFFERENCE_ON_CPU = 0  # see the module docstring


def _make(out: Path, fmt: str, size: int = 48, per_class: int = 8) -> Path:
    if not (out / "train").is_dir():
        args = ["make-data", "--out", str(out), "--classes", "4", "--per-class", str(per_class), "--size", str(size)]
        r = run_cli([*args, "--format", fmt, "--val-per-class", "3"])
        assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def jpeg_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp("jpeg") / "d", "jpeg")


def _cfg(path: Path, **kw: object) -> DataConfig:
    settings: dict[str, object] = dict(source="imagefolder", path=path, num_classes=4, image_size=24, num_workers=0)
    return DataConfig(**{**settings, **kw})  # type: ignore[arg-type]


# --- choosing the path ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("decode", "source", "files", "cuda", "codec", "on_device"),
    [
        ("cpu", "imagefolder", ["a.jpg"], True, True, False),
        ("auto", "imagefolder", ["a.jpg", "b.JPEG"], True, True, True),
        ("auto", "imagefolder", ["a.jpg"], False, True, False),
        ("auto", "imagefolder", ["a.jpg"], True, False, False),
        ("auto", "imagefolder", ["a.jpg", "b.png"], True, True, False),
        ("auto", "synthetic", [], True, True, False),
        ("device", "imagefolder", ["a.jpg"], False, True, True),
        ("gpu", "imagefolder", ["a.jpg"], True, True, True),
    ],
)
def test_choice_follows_the_setting_and_what_is_present(
    decode: str, source: str, files: list[str], cuda: bool, codec: bool, on_device: bool
) -> None:
    cfg = DataConfig(source=source, decode=decode)  # type: ignore[arg-type]
    choice = choose_decode(cfg, files, cuda, codec)
    assert choice.on_device is on_device
    assert choice.reason  # logged on rank 0: says why


@pytest.mark.parametrize(
    ("decode", "source", "files", "cuda", "codec", "says"),
    [
        ("gpu", "imagefolder", ["a.jpg"], False, True, "CUDA is not available"),
        ("device", "imagefolder", ["a.jpg"], True, False, "torchcodec"),
        ("device", "synthetic", [], False, True, "data.source=synthetic"),
        ("gpu", "imagefolder", ["a.jpg", "dir/b.png"], True, True, "dir/b.png is not a JPEG"),
    ],
)
def test_a_path_that_cannot_run_is_bad_input_naming_the_setting(
    decode: str, source: str, files: list[str], cuda: bool, codec: bool, says: str
) -> None:
    cfg = DataConfig(source=source, decode=decode)  # type: ignore[arg-type]
    with pytest.raises(BadInput) as err:
        choose_decode(cfg, files, cuda, codec)
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert err.value.setting == "data.decode" and err.value.value == decode
    assert says in str(err.value) and err.value.fix


# --- same samples, crops and pixels -----------------------------------------------------------------------
@pytest.mark.parametrize("augment", [True, False])
def test_device_path_gives_the_pixels_of_the_worker_path(jpeg_data: Path, augment: bool) -> None:
    layout = validate_data(_cfg(jpeg_data))
    assert layout is not None
    transform = eval_transform(24)
    if augment:
        transform = train_transform(24, True)
    workers = ImageFiles(layout.train, transform, seed=7, random=augment)
    encoded = EncodedFiles(layout.train, 24, seed=7, random=augment)
    keys = [(3, i) for i in range(len(layout.train))]
    want = torch.stack([workers[k][0] for k in keys])
    batch = encoded.__getitems__(keys)
    assert not isinstance(batch, device_decode.WorkerFailure)
    got = decode_batch(batch, CPU)
    assert got.shape == want.shape == (len(keys), 3, 24, 24) and got.dtype == torch.uint8
    assert (got.int() - want.int()).abs().max() <= MAX_PIXEL_DIFFERENCE_ON_CPU
    # Another epoch draws other crops: the comparison above would see a wrong seed.
    other = decode_batch(encoded.__getitems__([(4, i) for i in range(len(layout.train))]), CPU)  # type: ignore[arg-type]
    assert augment != torch.equal(other, got)


def test_loaders_hand_out_the_same_batches_in_the_same_order(jpeg_data: Path) -> None:
    """Through build_loaders and two worker processes: labels (order) exact, images within the tolerance."""
    batches = {}
    for decode in ("cpu", "device"):
        cfg = _cfg(jpeg_data, decode=decode, num_workers=2)
        loaders = build_loaders(cfg, rank=1, world_size=2, micro_batch_size=4, seed=3, device=CPU, grad_accum_steps=2)
        assert loaders.decodes_on_device is (decode == "device")
        loaders.train_sampler.set_position(1, 2)  # mid-epoch, as after a resume
        train = [to_device(b, CPU) for _, b in zip(range(3), loaders.train)]
        val = [to_device(b, CPU) for b in loaders.val]
        batches[decode] = train + val
    assert len(batches["cpu"]) == len(batches["device"]) > 3
    for (xa, ya), (xb, yb) in zip(batches["cpu"], batches["device"], strict=True):
        assert torch.equal(ya, yb)
        assert xa.shape == xb.shape and xa.dtype == xb.dtype == torch.float32
        assert torch.equal(xa, xb)  # identical uint8 pixels normalise identically


def test_a_corrupt_jpeg_is_named(tmp_path: Path, jpeg_data: Path) -> None:
    layout = validate_data(_cfg(jpeg_data))
    assert layout is not None
    good = [Path(p) for p, _ in layout.train[:3]]
    bad = tmp_path / "bad.jpg"
    raw = good[1].read_bytes()
    bad.write_bytes(raw[:400] + bytes(len(raw) - 400))  # header intact, scan data zeroed
    samples = ((str(good[0]), 0), (str(bad), 1), (str(good[2]), 2))
    batch = EncodedFiles(samples, 24, seed=0, random=False).__getitems__([0, 1, 2])
    with pytest.raises(BadInput) as err:
        decode_batch(batch, CPU)  # type: ignore[arg-type]
    assert err.value.setting == "data.path" and err.value.value == str(bad)


# --- exact resume on 2 processes --------------------------------------------------------------------------
def test_device_decode_resumes_bitwise_after_sigterm_on_two_processes(
    tmp_path: Path,
    jobs: list[Job],  # noqa: F811  (the fixture from test_faults)
) -> None:
    data = _make(tmp_path / "d", "jpeg", size=24, per_class=16)
    out = tmp_path / "runs"
    extra = ["--data.decode", "device"]
    ref = Job(tmp_path, [], train_args(data, out, "ref", *extra))
    jobs.append(ref)
    first = Job(tmp_path, [], train_args(data, out, "chain", *extra, "--ckpt.every", "0"))
    jobs.append(first)
    first.wait_for(r"data: decoding on cpu \(torchcodec\)")
    first.wait_for(rf"\[rank 1/2\] INFO step 3/{STEPS} ")
    first.signal(signal.SIGTERM)
    _, m = first.wait_for(r"stop requested \(signal SIGTERM[^)]*\): saving at step (\d+)")
    assert first.finish() == 143, first.tail()
    assert int(m[1]) < STEPS
    time.sleep(0.5)
    second = Job(tmp_path, [], train_args(data, out, "chain", *extra))
    jobs.append(second)
    second.wait_for(rf"resumed from .*step-{int(m[1]):07d}")
    assert second.finish() == 0, second.tail()
    assert ref.finish() == 0, ref.tail()
    want, got = final_state(out / "ref"), final_state(out / "chain")
    for key in ("model", "optimizer", "scheduler"):
        assert_bitwise_equal(want[key], got[key], key)
    # And the same run decoded in the workers: identical pixels, so identical parameters.
    cpu = Job(tmp_path, [], train_args(data, out, "cpu", "--data.decode", "cpu"))
    jobs.append(cpu)
    assert cpu.finish() == 0, cpu.tail()
    assert_bitwise_equal(final_state(out / "cpu")["model"], want["model"], "model")
