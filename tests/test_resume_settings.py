"""Every setting is classified for resume (job.checkpoint.resume): free to change, or part of the math; and a
checkpoint saved before a setting existed resumes while that setting holds its default."""

from __future__ import annotations

from job.checkpoint.resume import MUST_MATCH, config_differences, unclassified
from job.config import config_to_dict, flatten, load_config


def test_every_setting_is_classified_for_resume() -> None:
    """A new setting must be listed in MAY_CHANGE or MUST_MATCH: unlisted, it would make every older checkpoint
    refuse to resume, with nothing saying why."""
    keys = flatten(config_to_dict(load_config([], {})))
    assert unclassified(keys) == [], "classify these settings in job/checkpoint/resume.py (MAY_CHANGE or MUST_MATCH)"
    assert set(keys) >= MUST_MATCH, sorted(MUST_MATCH - set(keys))  # no name left behind by a rename
    assert unclassified(["train.brand_new"]) == ["train.brand_new"]


def test_a_checkpoint_older_than_a_setting_resumes_while_it_holds_its_default() -> None:
    saved = config_to_dict(load_config([], {}))
    del saved["train"]["label_smoothing"]  # as if saved before the setting existed
    assert config_differences(saved, load_config([], {})) == []
    changed = config_differences(saved, load_config(["--train.label-smoothing", "0.1"], {}))
    assert changed == ["train.label_smoothing: checkpoint None -> now 0.1"]
