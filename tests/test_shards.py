"""data.source=webdataset (job/data/shards.py) and make-data --format webdataset: the same images as the
ImageFolder, the same batches through the loaders (local index, directory, HTTP URLs), exact resume of a
2-process run after SIGTERM, and every bad input ending in exit 2 with the setting and the shard named."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import tarfile
import threading
from pathlib import Path

import pytest
import torch
from support.runs import assert_bitwise_equal
from test_faults import STEPS, Job, final_state, jobs, train_args  # noqa: F401  (jobs: fixture)

from job.cluster.env import LAUNCHER_VAR_PREFIXES
from job.config import DataConfig
from job.data.datagen import make_dataset
from job.data.shard_format import write_shard
from job.data.source import build_loaders
from job.errors import BadInput, BadShard

CPU = torch.device("cpu")


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def make_shards(out: Path, seed: int = 0, shard_size: int = 20, **kw: int) -> Path:
    """4 classes x 16 train x 4 val images of 16 px (the fault tests' set) as shards of 20: 64 = 20+20+20+4."""
    make_dataset(
        out, **{"classes": 4, "per_class": 16, "size": 16, "seed": seed, **kw}, fmt="webdataset", shard_size=shard_size
    )
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data") / "shards")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same images (same arguments and seed) as an ImageFolder."""
    out = tmp_path_factory.mktemp("data") / "folder"
    make_dataset(out, classes=4, per_class=16, size=16, seed=0)
    return out


def cfg(path: Path, source: str = "webdataset", **kw: object) -> DataConfig:
    return DataConfig(**{"source": source, "path": path, "num_classes": 4, "image_size": 16, "num_workers": 0, **kw})


def members(tar_path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(tar_path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------- make-data
def test_make_data_webdataset_is_deterministic_and_holds_the_imagefolder_files(tmp_path, shards, folder):
    again = make_shards(tmp_path / "again")
    assert digest(again) == digest(shards)
    other = digest(make_shards(tmp_path / "other", seed=1))
    assert all(other[k] != v for k, v in digest(shards).items() if k.endswith(".tar")), "another seed, other pixels"
    for split, per_class in (("train", 16), ("val", 4)):
        index = json.loads((shards / f"{split}.json").read_text())
        assert index["classes"] == ["class_00", "class_01", "class_02", "class_03"]
        samples = []
        for entry in index["shardlist"]:
            got = members(shards / entry["url"])
            assert len(got) == 2 * entry["nsamples"] and entry["filesize"] == (shards / entry["url"]).stat().st_size
            samples += [(got[i], got[i + 1]) for i in range(0, len(got), 2)]
        files = sorted((folder / split).glob("*/*.png"))  # the ImageFolder's sample order
        assert len(samples) == len(files) == 4 * per_class
        for ((image_name, image), (label_name, label)), path in zip(samples, files):
            key = f"{path.parent.name}/{path.stem}"
            assert (image_name, label_name) == (f"{key}.png", f"{key}.cls")
            assert image == path.read_bytes() and int(label) == int(path.parent.name[-2:])
    assert [e["nsamples"] for e in json.loads((shards / "train.json").read_text())["shardlist"]] == [20, 20, 20, 4]
    make_shards(shards)  # the same set again: a no-op
    assert digest(shards) == digest(again)


def test_make_data_refuses_a_bad_shard_size_writing_nothing(tmp_path):
    with pytest.raises(BadInput) as e:
        make_shards(tmp_path / "x", shard_size=0)
    assert e.value.setting == "--shard-size" and not any(tmp_path.iterdir())
    make_shards(tmp_path / "y")
    with pytest.raises(BadInput, match="other arguments"):  # same out, another shard size
        make_shards(tmp_path / "y", shard_size=7)


# ------------------------------------------------------------------------------------------- loaders
def collect(loaders, epoch: int, start: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loaders.train_sampler.set_position(epoch, start)
    out = []
    for batch in loaders.train:
        out.append(batch)
        if len(out) == n:
            break
    return out


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_batches_equal_the_imagefolder_batches(shards, folder, workers):
    """Same images in the same order: rank 1 of 2 with accumulation sees the same augmented batches (across
    shard and epoch boundaries) and the same validation shard."""
    kw = dict(rank=1, world_size=2, micro_batch_size=4, seed=3, device=CPU, grad_accum_steps=2)
    a = build_loaders(cfg(shards, num_workers=workers), **kw)
    b = build_loaders(cfg(folder, "imagefolder", num_workers=workers), **kw)
    assert a.batches_per_epoch == b.batches_per_epoch == 8
    assert_same_batches(collect(a, 0, 5, 6), collect(b, 0, 5, 6))  # 3 of epoch 0, 3 of epoch 1
    assert_same_batches(list(a.val), list(b.val))
    assert a.val_info == b.val_info


def test_a_directory_of_shards_and_an_http_index_read_the_same_samples(tmp_path, shards, monkeypatch):
    local = build_loaders(cfg(shards), 0, 1, 8, 0, CPU)
    want = collect(local, 0, 0, 8)
    for split in ("train", "val"):  # the make-data layout's other form: data.path/<split>/*.tar, no index
        (tmp_path / "dirs" / split).mkdir(parents=True)
        for tar in shards.glob(f"{split}-*.tar"):
            shutil.copy(tar, tmp_path / "dirs" / split)
    assert_same_batches(collect(build_loaders(cfg(tmp_path / "dirs"), 0, 1, 8, 0, CPU), 0, 0, 8), want)

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(shards))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("WIDS_CACHE", str(tmp_path / "cache"))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = cfg(tmp_path / "unused", train_shards=f"{url}/train.json", val_shards=f"{url}/val.json")
        loaders = build_loaders(remote, 0, 1, 8, 0, CPU)
        assert_same_batches(collect(loaders, 0, 0, 8), want)
        assert_same_batches(list(loaders.val), list(local.val))
    finally:
        server.shutdown()
    assert len(list((tmp_path / "cache").iterdir())) == 5  # 4 train + 1 val shards downloaded once


def corrupt_image(shard: Path) -> str:
    """Overwrite the middle of the shard's second image with zeros (same size: the tar stays valid)."""
    with tarfile.open(shard) as tar:
        image = [m for m in tar.getmembers() if m.name.endswith(".png")][1]
    data = bytearray(shard.read_bytes())
    start = image.offset_data + image.size // 3
    data[start : start + image.size // 3] = bytes(image.size // 3)
    shard.write_bytes(bytes(data))
    return image.name[: -len(".png")]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_image_in_a_later_shard_names_the_shard_and_sample(tmp_path, shards, workers):
    root = tmp_path / "d"
    shutil.copytree(shards, root)
    key = corrupt_image(root / "train-000002.tar")
    loaders = build_loaders(cfg(root, num_workers=workers, augment=False), 0, 1, 8, 0, CPU)  # validates: passes
    with pytest.raises(BadShard) as e:
        for _ in loaders.train:
            pass
    assert e.value.value == str(root / "train-000002.tar") and e.value.setting == "data.path"
    assert f"sample {key}: cannot decode .png" in e.value.what and "re-create this shard" in e.value.fix


def test_a_label_out_of_range_past_the_first_samples_names_the_shard(tmp_path, shards):
    root = tmp_path / "d"
    shutil.copytree(shards, root)
    for split in ("train", "val"):  # an index without class names (as widsindex writes it)
        index = json.loads((root / f"{split}.json").read_text())
        del index["classes"]
        (root / f"{split}.json").write_text(json.dumps(index))
    loaders = build_loaders(cfg(root, num_classes=3), 0, 1, 8, 0, CPU)  # the first samples are class 0: passes
    with pytest.raises(BadShard) as e:
        for _ in loaders.train:
            pass
    assert "has label 3, outside [0, data.num_classes=3)" in e.value.what
    assert e.value.value in {str(root / f"train-{n:06d}.tar") for n in (2, 3)}  # class 3 is in shards 2 and 3


def test_a_shard_holding_other_counts_than_its_index_is_refused_when_opened(tmp_path, shards):
    root = tmp_path / "d"
    shutil.copytree(shards, root)
    index = json.loads((root / "train.json").read_text())
    index["shardlist"][1]["nsamples"] = 19  # the index lies about shard 1 (the total is still > one batch)
    (root / "train.json").write_text(json.dumps(index))
    loaders = build_loaders(cfg(root), 0, 1, 8, 0, CPU)
    with pytest.raises(BadShard, match="holds 20 samples, the index says 19") as e:
        for _ in loaders.train:
            pass
    assert e.value.value == str(root / "train-000001.tar")


# ------------------------------------------------------------------------------------- exact resume
def test_interrupted_two_process_run_on_shards_is_bitwise_identical(tmp_path, jobs):  # noqa: F811  (the fixture)
    """An uninterrupted 2-process run against one stopped by SIGTERM (during gradient accumulation) and resumed;
    the arguments are the ImageFolder fault test's (2 DataLoader workers, augmentation, 4 steps an epoch)."""
    data = make_shards(tmp_path / "shards")
    out = tmp_path / "runs"
    web = ["--data.source", "webdataset"]
    ref = Job(tmp_path, [], train_args(data, out, "ref", *web))
    jobs.append(ref)
    chain = train_args(data, out, "chain", *web, "--ckpt.every", "0")
    straggle = ["--debug.straggler-delay-s", "10", "--debug.straggler-rank", "0", "--debug.straggler-steps", "3"]
    first = Job(tmp_path, [], [*chain, *straggle])
    jobs.append(first)
    # rank 0 sleeps 10 s before step 3's first forward: the signal lands inside step 3
    first.wait_for(r"\[rank 0/2\] INFO debug.straggler: sleeping 10 s before step 3's first forward")
    first.signal(signal.SIGTERM)
    _, m = first.wait_for(r"stop requested \(signal SIGTERM, received during ([^)]*)\): saving at step (\d+)")
    assert first.finish() == 143, first.tail()
    landed = re.findall(r"received during (step \d+ micro-batch \d/2)", first.text)  # rank 1 may be further on
    assert any(w.endswith("1/2") for w in landed), f"the signal did not land during accumulation: {landed}"
    second = Job(tmp_path, [], chain)
    jobs.append(second)
    second.wait_for(rf"resumed from .*step-{int(m[2]):07d}")
    assert second.finish() == 0, second.tail()
    assert ref.finish() == 0, ref.tail()
    want, got = final_state(out / "ref"), final_state(out / "chain")
    for key in ("model", "optimizer", "scheduler", "scaler"):
        assert_bitwise_equal(want[key], got[key], key)
    for key in ("step", "epoch", "micro_batches_in_epoch", "samples_seen"):
        assert want["trainer"][key] == got["trainer"][key], key
    assert want["trainer"]["epoch"] >= 2, "the run crosses epochs (shards re-read in a new order)"


# ---------------------------------------------------------------------------------------- bad input
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _empty_index(tmp: Path, data: Path) -> None:
    _write(tmp / "empty.json", json.dumps({"wids_version": 1, "shardlist": []}))


def _truncate(tmp: Path, data: Path) -> None:
    shard = data / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:5000])


def _garbage(tmp: Path, data: Path) -> None:
    shard = data / "val-000000.tar"
    shard.write_bytes(os.urandom(shard.stat().st_size))


def _first_label_too_big(tmp: Path, data: Path) -> None:
    image = members(data / "train-000000.tar")[0][1]
    write_shard(data / "train-000000.tar", [(f"s{i}", ".png", image, 9 * (i == 0)) for i in range(20)])


# (case, arguments, setup(tmp, data copy), text the error must hold: the setting, the value, the shard)
BAD = [
    ("no-index-or-directory", ["--data.path", "{tmp}/nothing"], None, "data.path={tmp}/nothing/train.json"),
    ("missing-index", ["--data.train-shards", "{tmp}/gone.json"], None, "data.train_shards={tmp}/gone.json: no such"),
    ("empty-index", ["--data.val-shards", "{tmp}/empty.json"], _empty_index, "lists no shards"),
    (
        "directory-without-shards",
        ["--data.train-shards", "{tmp}"],
        None,
        "data.train_shards={tmp}: the directory holds no .tar",
    ),
    ("truncated-shard", [], _truncate, "shard {data}/train-000001.tar (data.path={data}/train.json): 5000 bytes"),
    ("not-a-tar", [], _garbage, "shard {data}/val-000000.tar (data.path={data}/val.json): does not start with a tar"),
    ("label-out-of-range", [], _first_label_too_big, "sample s0 has label 9, outside [0, data.num_classes=4)"),
    ("classes-mismatch", ["--data.num-classes", "5"], None, "data.num_classes=5 but the shard index names 4 classes"),
    ("decode-on-device", ["--data.decode", "device"], None, "data.decode=device"),
    (
        "fewer-samples-than-a-batch",
        ["--train.global-batch-size", "128"],
        None,
        "data.path={data}/train.json: the training set has 64 samples",
    ),
]


@pytest.mark.parametrize(("case", "argv", "setup", "names"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_exits_2_naming_setting_and_shard(tmp_path, shards, monkeypatch, capfd, case, argv, setup, names):
    """In-process through the CLI's entry point; a process group must not start; nothing is written."""
    import torch.distributed as dist

    from job import cli

    data = tmp_path / "data"
    shutil.copytree(shards, data)
    if setup is not None:
        setup(tmp_path, data)
    out = tmp_path / "runs"
    sub = {"{tmp}": str(tmp_path), "{data}": str(data)}
    for k, v in sub.items():
        argv, names = [a.replace(k, v) for a in argv], names.replace(k, v)
    for k in [k for k in os.environ if k.startswith(("JOB_", *LAUNCHER_VAR_PREFIXES))]:
        monkeypatch.delenv(k)

    def no_process_group(*a: object, **kw: object) -> None:
        raise AssertionError("a process group was started before the input was checked")

    monkeypatch.setattr(dist, "init_process_group", no_process_group)
    base = ["--run.output-dir", str(out), "--data.source", "webdataset", "--data.path", str(data)]
    base += ["--data.num-classes", "4", "--data.image-size", "16", "--data.num-workers", "0", "--train.steps", "2"]
    base += ["--train.global-batch-size", "8", "--log.tensorboard", "false"]
    rc = cli.main(["train", *base, *argv])
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    assert names in err and "Fix:" in err and "Traceback" not in err, err
    assert not out.exists(), "the run directory was written"


def test_the_doctor_checks_the_shards(tmp_path, shards):
    from job.config.load import load_config
    from job.data.source import describe_data
    from job.doctor.checks import check_data

    args = ["--data.source", "webdataset", "--data.num-classes", "4"]
    good = check_data(load_config([*args, "--data.path", str(shards)], {}), describe_data)
    assert good.status == "PASS" and "64 train samples in 4 shard(s)" in good.detail, good
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    _garbage(tmp_path, data)
    bad = check_data(load_config([*args, "--data.path", str(data)], {}), describe_data)
    assert bad.status == "FAIL" and f"shard {data}/val-000000.tar" in bad.detail and "re-create" in bad.fix, bad
