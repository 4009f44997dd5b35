"""job/data/loaders.py and job/data/datagen.py: generated data, sample order, resume, augmentation, sharding, errors."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from job.checkpoint.resume import map_data_position
from job.config import DataConfig
from job.data import datagen
from job.data.datagen import make_data_main, make_dataset
from job.data.loaders import IMAGENET_MEAN, IMAGENET_STD, to_device
from job.data.sampler import ResumableSampler, shard_range
from job.data.source import build_loaders, validate_data
from job.errors import BadInput

CPU = torch.device("cpu")


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """3 classes x 16 train x 3 val images of 16 px: 48 train, 9 val (odd, so val shards are uneven)."""
    root = tmp_path_factory.mktemp("data") / "shapes"
    make_dataset(root, classes=3, per_class=16, size=16, seed=0, val_per_class=3)
    return root


def cfg_for(root: Path, **kw) -> DataConfig:
    base = dict(path=root, num_classes=3, image_size=16, num_workers=0, augment=True)
    base.update(kw)
    return DataConfig(**base)


def copy_of(shapes: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(shapes, dst)
    return dst


# ---------------------------------------------------------------------------------------- make-data
def test_make_data_is_byte_identical_for_same_args_and_differs_by_seed(tmp_path):
    for fmt in ("png", "jpeg"):
        a, b, c = (tmp_path / f"{fmt}-{n}" for n in "abc")
        make_dataset(a, classes=4, per_class=3, size=16, seed=7, val_per_class=2, fmt=fmt)
        make_dataset(b, classes=4, per_class=3, size=16, seed=7, val_per_class=2, fmt=fmt)
        make_dataset(c, classes=4, per_class=3, size=16, seed=8, val_per_class=2, fmt=fmt)
        da, db, dc = tree_digest(a), tree_digest(b), tree_digest(c)
        assert len(da) == 4 * (3 + 2) + 1  # images + manifest
        assert da == db
        images = [k for k in da if not k.endswith(".json")]
        assert all(da[k] != dc[k] for k in images), "another seed must give other pixels"
        ext = ".png" if fmt == "png" else ".jpg"
        assert all(k.endswith(ext) for k in images)
        assert sorted(os.listdir(a / "train")) == ["class_00", "class_01", "class_02", "class_03"]


def test_make_data_cli_rerun_is_noop_and_conflict_is_bad_input(tmp_path, capsys):
    out = tmp_path / "d"
    args = ["--out", str(out), "--classes", "2", "--per-class", "2", "--size", "8"]
    assert make_data_main(args) == 0
    before = tree_digest(out)
    assert make_data_main(args) == 0  # same arguments: keeps the existing set
    assert tree_digest(out) == before
    assert make_data_main(args[:-1] + ["12"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and "size: 8 there, 12 asked" in err and "delete it" in err
    assert make_data_main(["--out", str(tmp_path / "e"), "--classes", "999"]) == 2
    assert "--classes 999" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_make_data_through_the_real_cli(tmp_path):
    out = tmp_path / "d"
    cmd = [
        sys.executable,
        "-m",
        "job",
        "make-data",
        "--out",
        str(out),
        "--classes",
        "2",
        "--per-class",
        "3",
        "--size",
        "8",
        "--val-per-class",
        "1",
        "--format",
        "jpeg",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (out / "val" / "class_01").iterdir()) == ["000000.jpg"]
    done = subprocess.run(cmd[:-1] + ["png"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "format: 'jpeg' there, 'png' asked" in done.stderr
    assert "Traceback" not in done.stderr


def test_make_data_crash_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    calls = []

    def failing(c, size, rng):
        calls.append(c)
        if len(calls) == 5:
            raise RuntimeError("simulated crash")
        return real(c, size, rng)

    real = datagen.render_image
    monkeypatch.setattr(datagen, "render_image", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_dataset(tmp_path / "d", classes=2, per_class=4, size=8)
    assert os.listdir(tmp_path) == []  # neither OUT nor the temporary directory


def test_generated_classes_are_learnable_by_a_tiny_cnn(tmp_path):
    # 10 classes (two pairs share a colour, so shape matters too), chance = 10 %. A 2-layer CNN trained
    # for 60 full-batch Adam steps on 300 images reached 100 % val top-1 when this was written (~1.5 s of
    # one core); 60 % leaves room while a broken generator (labels unrelated to pixels) stays near 10 %.
    root = tmp_path / "d"
    make_dataset(root, classes=10, per_class=30, size=16, seed=1, val_per_class=10)
    cfg = cfg_for(root, num_classes=10, augment=False)
    loaders = build_loaders(cfg, 0, 1, 300, seed=0, device=CPU)
    x, y = to_device(next(iter(loaders.train)), CPU)
    vx, vy = to_device(next(iter(loaders.val)), CPU)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveMaxPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only fight the other tests for the cores
    try:
        for _ in range(60):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        with torch.no_grad():
            acc = (net(vx).argmax(1) == vy).float().mean().item()
    finally:
        torch.set_num_threads(threads)
    print(f"tiny CNN val top-1 on generated shapes: {acc:.3f}")
    assert len(vy) == 100 and acc >= 0.6


# ------------------------------------------------------------------------------------------ sampler
def all_rank_batches(n, world, micro, accum=1, epoch=0, seed=3):
    return [ResumableSampler(n, r, world, micro, seed, accum).rank_batches(epoch) for r in range(world)]


@pytest.mark.parametrize("world,micro,accum", [(1, 8, 1), (2, 4, 1), (3, 2, 2), (4, 3, 1)])
def test_rank_shards_are_disjoint_and_rows_are_contiguous_slices_of_the_epoch_order(world, micro, accum):
    n = 100
    s0 = ResumableSampler(n, 0, world, micro, 3, accum)
    order = s0.order(0)
    per_rank = all_rank_batches(n, world, micro, accum)
    bpe = s0.batches_per_epoch
    assert bpe == n // (world * micro * accum) * accum and bpe % accum == 0
    assert all(b.shape == (bpe, micro) for b in per_rank)
    for k in range(bpe):
        row = torch.cat([b[k] for b in per_rank])
        assert torch.equal(row, order[k * world * micro : (k + 1) * world * micro])
    flat = torch.cat([b.flatten() for b in per_rank])
    assert len(set(flat.tolist())) == len(flat)  # no sample twice in an epoch


def test_same_samples_per_optimizer_step_whatever_the_split():
    n, global_batch = 96, 16
    splits = [(1, 16, 1), (2, 8, 1), (1, 8, 2), (2, 4, 2), (4, 4, 1)]  # (world, micro, accum)
    steps = []
    for world, micro, accum in splits:
        per_rank = all_rank_batches(n, world, micro, accum, epoch=2)
        micro_steps = per_rank[0].shape[0]
        steps.append(
            [
                sorted(torch.cat([b[s * accum + a] for b in per_rank for a in range(accum)]).tolist())
                for s in range(micro_steps // accum)
            ]
        )
        assert len(steps[-1]) == n // global_batch
    assert all(st == steps[0] for st in steps)


def test_order_depends_only_on_seed_and_epoch():
    a = ResumableSampler(50, 0, 1, 5, seed=1)
    assert torch.equal(a.order(0), ResumableSampler(50, 1, 2, 3, seed=1).order(0))
    assert not torch.equal(a.order(0), a.order(1))
    assert not torch.equal(a.order(0), ResumableSampler(50, 0, 1, 5, seed=2).order(0))
    assert sorted(a.order(4).tolist()) == list(range(50))


def test_set_position_yields_exactly_the_remaining_batches():
    s = ResumableSampler(40, 1, 2, 3, seed=0)
    s.set_epoch(1)
    full = list(s)
    assert len(full) == len(s) == s.batches_per_epoch * 3
    s.set_position(1, 4)
    assert list(s) == full[4 * 3 :] and len(s) == (s.batches_per_epoch - 4) * 3
    assert all(e == 1 for e, _ in full)
    with pytest.raises(ValueError):
        s.set_position(1, s.batches_per_epoch + 1)


def test_position_maps_across_world_sizes():
    """Position 3 of 2 ranks x 4 = 24 samples = 3 micro-batches of 1 rank x 8; 24 is no row of 4 ranks x 4."""
    trainer, plan = (
        {"micro_batches_in_epoch": 3, "epoch": 0},
        {"world_size": 2, "micro_batch_size": 4, "global_batch_size": 8},
    )
    assert map_data_position(trainer, plan, 1, 8) == 3
    with pytest.raises(BadInput, match="not a multiple of 16"):
        map_data_position(trainer, plan, 4, 4)


# ------------------------------------------------------------------------------------ real loaders
def collect(loaders, epoch, start, count):
    """(epoch, micro-batch index, images, labels) of ``count`` micro-batches from the position on."""
    position = SimpleNamespace(epoch=epoch, micro_batches_in_epoch=start)
    out = []
    for x, y in loaders.batches(position):
        e, k = position.epoch, position.micro_batches_in_epoch - 1
        out.append((e, k, x.clone(), y.clone()))
        if len(out) == count:
            return out


def same(a, b):
    return len(a) == len(b) and all(
        ea == eb and ka == kb and torch.equal(xa, xb) and torch.equal(ya, yb)
        for (ea, ka, xa, ya), (eb, kb, xb, yb) in zip(a, b)
    )


def test_resume_mid_epoch_with_persistent_workers_matches_uninterrupted(shapes):
    cfg = cfg_for(shapes, num_workers=2)
    ref = build_loaders(cfg, 1, 2, 4, seed=5, device=CPU)
    assert ref.batches_per_epoch == 6 and ref.train.loader.persistent_workers
    uninterrupted = collect(ref, 0, 0, 15)  # epochs 0, 1 and half of 2
    assert [(e, k) for e, k, *_ in uninterrupted][5:8] == [(0, 5), (1, 0), (1, 1)]
    # a "restarted process": fresh loaders at the position the trainer saves after 8 micro-batches, (1, 2)
    position = SimpleNamespace(epoch=0, micro_batches_in_epoch=0)
    batches = ref.batches(position)
    for _ in range(8):
        next(batches)
    assert (position.epoch, position.micro_batches_in_epoch) == (1, 2)
    resumed = build_loaders(cfg, 1, 2, 4, seed=5, device=CPU)
    assert same(collect(resumed, 1, 2, 7), uninterrupted[8:15])
    # and the same loader object (persistent workers reused) repositioned after a partial epoch
    assert same(collect(resumed, 0, 3, 4), uninterrupted[3:7])


def test_one_rank_batch_equals_two_rank_batches_concatenated_even_with_augmentation(shapes):
    # augmentation depends on (seed, epoch, index), not on the rank: the W=1 x micro 8 batch of each step
    # is bit-for-bit rank 0's micro 4 batch followed by rank 1's, over an epoch boundary too.
    one = collect(build_loaders(cfg_for(shapes), 0, 1, 8, 5, CPU), 0, 0, 8)
    r0, r1 = (collect(build_loaders(cfg_for(shapes), r, 2, 4, 5, CPU), 0, 0, 8) for r in (0, 1))
    assert [(e, k) for e, k, *_ in one] == [(e, k) for e, k, *_ in r0] == [(0, k) for k in range(6)] + [(1, 0), (1, 1)]
    for (_, _, x, y), (_, _, x0, y0), (_, _, x1, y1) in zip(one, r0, r1):
        assert torch.equal(x, torch.cat([x0, x1])) and torch.equal(y, torch.cat([y0, y1]))


def test_augmentation_is_identical_with_0_and_2_workers_and_varies_by_epoch(shapes):
    with_workers = collect(build_loaders(cfg_for(shapes, num_workers=2), 0, 1, 8, 5, CPU), 0, 0, 12)
    torch.manual_seed(123)
    in_process = collect(build_loaders(cfg_for(shapes, num_workers=0), 0, 1, 8, 5, CPU), 0, 0, 12)
    after_loading = torch.rand(4)
    assert same(with_workers, in_process)
    # the per-sample seeds did not leak into the caller's global RNG (num_workers=0 runs in-process)
    torch.manual_seed(123)
    assert torch.equal(after_loading, torch.rand(4))
    # epoch 1 shows the same images with other crops/flips: gather sample 0 from both epochs
    plain = build_loaders(cfg_for(shapes, augment=False), 0, 1, 8, 5, CPU)
    crops = {}
    for e, k, x, y in in_process:
        order = plain.train_sampler.rank_batches(e)[k].tolist()
        if 0 in order:
            crops[e] = x[order.index(0)]
    assert set(crops) == {0, 1} and not torch.equal(crops[0], crops[1])


def test_without_augment_train_images_are_the_files(shapes):
    loaders = build_loaders(cfg_for(shapes, augment=False), 0, 1, 48, 0, CPU)
    x, y = next(iter(loaders.train))
    order = loaders.train_sampler.rank_batches(0)[0].tolist()
    layout = validate_data(cfg_for(shapes))
    for j in (0, 17, 47):
        path, label = layout.train[order[j]]
        assert y[j].item() == label
        assert torch.equal(x[j], torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1))


@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_val_shards_cover_every_sample_exactly_once(shapes, world):
    cfg = cfg_for(shapes, num_workers=0)
    seen, labels = [], []
    for r in range(world):
        loaders = build_loaders(cfg, r, world, 2, 0, CPU)
        info = loaders.val_info
        assert info.total == 9 and (info.start, info.stop) == (r * 9 // world, (r + 1) * 9 // world)
        for x, y in loaders.val:
            seen.append(x)
            labels.append(y)
    full = build_loaders(cfg, 0, 1, 9, 0, CPU)
    ((fx, fy),) = list(full.val)
    assert torch.equal(torch.cat(seen), fx) and torch.equal(torch.cat(labels), fy)
    assert sorted(fy.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_shard_range_sizes():
    for n in range(0, 30):
        for w in range(1, 7):
            parts = [shard_range(n, r, w) for r in range(w)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_synthetic_source_is_deterministic_and_shaped():
    cfg = DataConfig(source="synthetic", image_size=8, num_classes=5, synthetic_train_size=40, synthetic_val_size=11)
    a = build_loaders(cfg, 0, 2, 4, seed=1, device=CPU)
    b = build_loaders(cfg, 1, 2, 4, seed=1, device=CPU)
    assert a.batches_per_epoch == 5 and len(a.train) == 5
    xa, ya = next(iter(a.train))
    xb, yb = next(iter(b.train))
    assert xa.dtype == torch.uint8 and xa.shape == (4, 3, 8, 8) and not torch.equal(xa, xb)
    assert torch.equal(torch.cat([xa, xb]), a.train.images[a.train_sampler.order(0)[:8]])
    assert same(collect(a, 0, 0, 8)[3:], collect(build_loaders(cfg, 0, 2, 4, 1, CPU), 0, 3, 5))
    assert sum(len(y) for _, y in a.val) + sum(len(y) for _, y in b.val) == 11
    assert int(ya.max()) < 5


def test_to_device_normalises_and_keeps_channels_last():
    x = torch.tensor([0, 128, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2).contiguous()
    out, labels = to_device((x, torch.tensor([1, 2])), CPU, channels_last=True)
    want = (torch.tensor([0, 128, 255.0]) / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out[0, :, 0, 0], want, atol=1e-5) and labels.tolist() == [1, 2]


# ------------------------------------------------------------------------------------------- errors
def test_missing_path_says_how_to_make_data(tmp_path):
    cfg = cfg_for(tmp_path / "nope", num_classes=4)
    with pytest.raises(BadInput) as e:
        validate_data(cfg)
    msg = str(e.value)
    assert f"data.path={tmp_path / 'nope'} does not exist" in msg
    assert f"ddp-job make-data --out {tmp_path / 'nope'} --classes 4" in msg


def test_missing_val_split(shapes, tmp_path):
    root = copy_of(shapes, tmp_path)
    shutil.rmtree(root / "val")
    with pytest.raises(BadInput, match=rf"missing {root / 'val'}/"):
        validate_data(cfg_for(root))


def test_empty_class_folder_is_named(shapes, tmp_path):
    root = copy_of(shapes, tmp_path)
    for f in (root / "train" / "class_01").iterdir():
        f.unlink()
    (root / "train" / "class_01" / "notes.txt").write_text("not an image")
    with pytest.raises(BadInput, match=rf"class folder {root / 'train' / 'class_01'} holds no image files"):
        validate_data(cfg_for(root))


def test_class_count_mismatch_names_setting_and_fix(shapes):
    with pytest.raises(BadInput) as e:
        validate_data(cfg_for(shapes, num_classes=10))
    msg = str(e.value)
    assert "data.num_classes=10" in msg and "has 3 class folders" in msg and "--data.num-classes 3" in msg


def test_train_val_class_lists_differ(shapes, tmp_path):
    root = copy_of(shapes, tmp_path)
    (root / "val" / "class_02").rename(root / "val" / "class_zz")
    with pytest.raises(BadInput, match=r"only in train: \['class_02'\], only in val: \['class_zz'\]"):
        validate_data(cfg_for(root))


def test_training_set_smaller_than_one_global_batch(shapes):
    with pytest.raises(BadInput, match=r"48 samples, fewer than one global batch .*= 64"):
        build_loaders(cfg_for(shapes), 0, 2, 16, 0, CPU, grad_accum_steps=2)


@pytest.mark.parametrize("fmt,workers", [("png", 2), ("jpeg", 2), ("png", 0)])
def test_corrupt_image_error_names_the_file_in_the_main_process(tmp_path, fmt, workers):
    root = tmp_path / "d"
    make_dataset(root, classes=2, per_class=4, size=16, val_per_class=1, fmt=fmt)
    ext = "png" if fmt == "png" else "jpg"
    bad = root / "train" / "class_01" / f"000002.{ext}"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # truncated, like an interrupted copy
    cfg = cfg_for(root, num_classes=2, num_workers=workers)
    validate_data(cfg)  # the cheap check does not decode: it passes
    loaders = build_loaders(cfg, 0, 1, 2, 0, CPU)
    with pytest.raises(BadInput) as e:
        for _ in loaders.train:
            pass
    msg = str(e.value)
    assert f"cannot read image file {bad}" in msg and "truncated" in msg and "Fix:" in msg
    assert "Traceback" not in msg
    # the error itself crossed the worker boundary, not torch's rebuild of it from the traceback text
    assert (e.value.setting, e.value.value) == ("data.path", str(bad)) and "delete or replace" in e.value.fix


def test_worker_start_failure_reaches_the_trainer_whole(tmp_path, monkeypatch):
    """init_worker's error (TMPDIR unusable for the workers' sockets) arrives in place of the first batch."""
    from job.data import workers

    root = tmp_path / "d"
    make_dataset(root, classes=2, per_class=4, size=16, val_per_class=1)

    def unusable_tmpdir() -> None:
        raise BadInput("TMPDIR=/x is too long.", "set TMPDIR shorter.", setting="TMPDIR", value="/x")

    monkeypatch.setattr(workers, "use_short_socket_tempdir", unusable_tmpdir)  # the workers fork with it
    loaders = build_loaders(cfg_for(root, num_classes=2, num_workers=2), 0, 1, 2, 0, CPU)
    with pytest.raises(BadInput) as e:
        next(iter(loaders.train))
    assert (e.value.setting, e.value.value, e.value.fix) == ("TMPDIR", "/x", "set TMPDIR shorter.")
    assert str(e.value) == "TMPDIR=/x is too long. Fix: set TMPDIR shorter."


EXIT_SCRIPT = """
import sys, torch
from pathlib import Path
from job.config import DataConfig
from job.data.source import build_loaders
from job.errors import BadInput
cfg = DataConfig(path=Path(sys.argv[1]), num_classes=2, image_size=16, num_workers=2)
LOADERS = build_loaders(cfg, 0, 1, 2, 0, torch.device("cpu"))  # still referenced at exit
next(iter(LOADERS.val))
try:
    for _ in LOADERS.train:
        pass
except BadInput as e:
    ERROR = e  # keeps the traceback (and the DataLoader iterator) alive too
    print("bad input:", e, flush=True)
    sys.exit(2)
"""


def test_process_exits_although_workers_ignore_sigterm_and_loaders_live_on(tmp_path):
    # Workers ignore SIGTERM (job.train.preempt) and multiprocessing's exit hook only SIGTERMs and then joins
    # them: without job.data.loaders's own exit hook this process never ends (observed: hung until killed).
    root = tmp_path / "d"
    make_dataset(root, classes=2, per_class=4, size=16, val_per_class=1)
    bad = root / "train" / "class_00" / "000001.png"
    bad.write_bytes(bad.read_bytes()[:40])
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(root)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot read image file {bad}" in done.stdout


LONG_TMPDIR_SCRIPT = """
import sys, tempfile, torch
from pathlib import Path
from job.config import DataConfig
from job.data.source import build_loaders
cfg = DataConfig(path=Path(sys.argv[1]), num_classes=2, image_size=16, num_workers=2, loader_timeout_s=60)
loaders = build_loaders(cfg, 0, 1, 2, 0, torch.device("cpu"))
train = sum(images.shape[0] for images, _ in loaders.train)
val = sum(images.shape[0] for images, _ in loaders.val)
print("tmpdir", len(tempfile.gettempdir()), "train", train, "val", val, flush=True)
"""


def test_workers_deliver_batches_when_tmpdir_is_too_long_for_unix_sockets(tmp_path):
    # A worker sends each batch's shared-memory fds through a Unix socket under $TMPDIR/pymp-*/listener-*; past
    # 107 characters bind() fails in the worker's feeder thread, the batch is dropped and the trainer waited
    # forever (the bench data hang inside the pytest-xdist suite, TMPDIR of 76 characters).
    root = tmp_path / "d"
    make_dataset(root, classes=2, per_class=4, size=16, val_per_class=1)
    long_tmp = tmp_path / ("t" * max(1, 90 - len(str(tmp_path)) - 1))
    long_tmp.mkdir()
    assert len(str(long_tmp)) + len("/pymp-12345678/listener-12345678") > 107
    env = {**os.environ, "TMPDIR": str(long_tmp), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", LONG_TMPDIR_SCRIPT, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tmpdir {len(str(long_tmp))} train 8 val 2" in done.stdout
    assert "AF_UNIX path too long" not in done.stderr
    assert not list(long_tmp.glob("pymp-*")), "the workers' sockets were made under the long TMPDIR"
