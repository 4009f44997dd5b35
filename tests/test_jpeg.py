"""The batched JPEG decoder (job.data.jpeg): torchcodec's on the pinned install, torchvision's where torchcodec
has no image decoder (a GPU image on an older torch), and a refusal naming data.decode where neither exists.
Each decoder runs for real on the CPU."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torchvision.io

from job.bench import crops as crops_bench
from job.config import DataConfig
from job.data import imagefolder
from job.data.device_decode import EncodedBatch, EncodedFiles, decode_batch
from job.data.images import pil_to_tensor
from job.data.jpeg import jpeg_decoder
from job.errors import BadInput

CPU = torch.device("cpu")


@pytest.fixture
def fresh() -> Iterator[None]:
    """jpeg_decoder() chooses once per process: forget its choice around a test that changes what is installed."""
    jpeg_decoder.cache_clear()
    yield
    jpeg_decoder.cache_clear()


@pytest.fixture
def no_torchcodec(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing torchcodec's decoders fails with ImportError, as where it is absent or predates them."""
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)


def _batch(samples: tuple[tuple[str, int], ...]) -> EncodedBatch:
    batch = EncodedFiles(samples, 24, seed=3, random=True).__getitems__([(1, i) for i in range(len(samples))])
    assert isinstance(batch, EncodedBatch)
    return batch


def test_the_pinned_install_decodes_with_torchcodec(fresh: None) -> None:
    decoder = jpeg_decoder()
    assert decoder is not None and decoder.name == "torchcodec"


def test_torchvision_decodes_the_same_batches_where_torchcodec_has_no_decoder(
    ragged: tuple[tuple[str, int], ...], fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device path's output through torchvision's decoder is bitwise torchcodec's: both run libjpeg-turbo
    on the CPU (and nvJPEG's batched call on CUDA)."""
    want = decode_batch(_batch(ragged), CPU)
    jpeg_decoder.cache_clear()
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    decoder = jpeg_decoder()
    assert decoder is not None and decoder.name == "torchvision"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision announces the decoder's deprecation
        got = decode_batch(_batch(ragged), CPU)
    assert got.shape == want.shape == (len(ragged), 3, 24, 24) and torch.equal(got, want)


def test_torchvision_names_a_corrupt_file(
    ragged: tuple[tuple[str, int], ...], tmp_path: Path, no_torchcodec: None
) -> None:
    bad = tmp_path / "bad.jpg"
    raw = Path(ragged[2][0]).read_bytes()
    bad.write_bytes(raw[:400] + bytes(len(raw) - 400))  # header intact, scan data zeroed
    with warnings.catch_warnings(), pytest.raises(BadInput) as err:
        warnings.simplefilter("ignore", DeprecationWarning)
        decode_batch(_batch((ragged[0], (str(bad), 1), ragged[3])), CPU)
    assert err.value.setting == "data.path" and err.value.value == str(bad)


def test_without_any_decoder_device_decode_is_refused_and_auto_decodes_in_the_workers(
    no_torchcodec: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torchvision.io, "decode_jpeg")
    assert jpeg_decoder() is None
    files = ["a/0.jpg", "b/1.jpg"]
    with pytest.raises(BadInput) as err:
        imagefolder.decode_choice(DataConfig(source="imagefolder", decode="device"), files, cuda=False)
    assert err.value.setting == "data.decode" and err.value.value == "device" and "torchcodec" in err.value.fix
    choice = imagefolder.decode_choice(DataConfig(source="imagefolder", decode="auto"), files, cuda=True)
    assert not choice.on_device and "decoder" in choice.reason


def test_torchvision_turns_images_of_every_orientation_upright_as_torchcodec_does(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    raws = []
    for orientation in range(1, 9):
        raw = crops_bench.jpeg_bytes(48, 96, orientation, orientation)
        raws.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    codec = jpeg_decoder()
    assert codec is not None and codec.name == "torchcodec"
    want = codec.decode(raws, CPU)
    jpeg_decoder.cache_clear()
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    vision = jpeg_decoder()
    assert vision is not None and vision.name == "torchvision"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = vision.decode(raws, CPU)
    assert [tuple(g.shape) for g in got] == [(3, 48, 96)] * 4 + [(3, 96, 48)] * 4
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for raw, g in zip(raws, got, strict=True):  # and as PIL turns them, the workers' decoder
        assert torch.equal(g, pil_to_tensor(io.BytesIO(raw.numpy().tobytes())))
