"""The doctor's stop-notice check (job.doctor.checks.check_stop_notice): a checkpoint's save time against the
launcher's stop notice, a WARN naming both numbers and the fix when the save does not fit. The doctor run that
shows it is tests/test_doctor.py's healthy run."""

from __future__ import annotations

from pathlib import Path

from job.cluster.env import NOTICE_VAR
from job.config import load_config
from job.doctor.checks import FAIL, PASS, WARN, check_notice, check_stop_notice, measured_save_s


def test_a_save_that_does_not_fit_in_the_notice_warns_naming_both_numbers_and_the_fix() -> None:
    fits = check_stop_notice(12.5, "timed", 30.0, NOTICE_VAR)
    assert fits.status == PASS and "12.50 s" in fits.detail and "30 s (DDP_JOB_NOTICE_S)" in fits.detail
    for save_s in (30.0, 45.25):  # a save as long as the notice is cut off too: the process still has to exit
        late = check_stop_notice(save_s, "timed", 30.0, "ckpt.grace_s")
        assert late.status == WARN, late
        assert f"{save_s:.2f} s (timed)" in late.detail and "30 s (ckpt.grace_s)" in late.detail
        assert "does not fit" in late.detail and late.data == {
            "save_s": save_s,
            "notice_s": 30.0,
            "source": "ckpt.grace_s",
        }
        for fix in ("--signal", "terminationGracePeriodSeconds", "train.max_time", "faster storage"):
            assert fix in late.fix, (fix, late.fix)
    unknown = check_stop_notice(0.0, "", 0.0, NOTICE_VAR)
    assert unknown.status == PASS and "nothing to compare" in unknown.detail


def test_the_notice_comes_from_the_config_else_the_launcher(tmp_path: Path) -> None:
    cfg = load_config(["--run.output-dir", str(tmp_path)])
    none = check_notice(cfg, {}, tmp_path, 2**20)
    assert none.status == PASS and none.data["notice_s"] == 0  # nothing stated: nothing timed either
    stated = check_notice(cfg, {NOTICE_VAR: "1e-6"}, tmp_path, 2**20)
    assert stated.status == WARN and stated.data["source"] == NOTICE_VAR and stated.data["notice_s"] == 1e-6
    configured = load_config(["--run.output-dir", str(tmp_path), "--ckpt.grace-s", "1e-6"])
    wins = check_notice(configured, {NOTICE_VAR: "300"}, tmp_path, 2**20)
    assert wins.data["source"] == "ckpt.grace_s" and wins.status == WARN
    bad = check_notice(cfg, {NOTICE_VAR: "soon"}, tmp_path, 2**20)
    assert bad.status == FAIL and NOTICE_VAR in bad.detail and "'soon'" in bad.detail
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the timed write leaves nothing behind"


def test_a_checkpoint_bigger_than_the_probe_is_timed_on_the_probe(tmp_path: Path) -> None:
    seconds, how = measured_save_s(tmp_path, 8 * 2**20, probe_bytes=2**20)
    assert seconds > 0 and how == "writing its 8.0 MiB from one process, timed now on 1.0 MiB"
    seconds, how = measured_save_s(tmp_path, 2**19, probe_bytes=2**20)
    assert seconds > 0 and how.endswith("timed now on 0.5 MiB")
