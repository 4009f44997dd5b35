"""``task.name`` to a task: a built-in one, or a user's ``package.module:callable`` called with task.options."""

from __future__ import annotations

from typing import Any

from job import usercode
from job.config import JobConfig
from job.errors import BadInput, UserCodeError
from job.tasks.contract import DOC, Bound


def load_task(cfg: JobConfig) -> Bound:
    """The configured task, bound (its required members checked).

    Raises:
        UserCodeError: a user task that is not importable, fails to construct, or lacks a member; BadInput:
            options a built-in task does not take.
    """
    name = cfg.task.name
    if name == "image_classification":
        return Bound(_image_task(cfg), name, builtin=True)
    if name == "causal_lm":
        from job.tasks.lm.task import CausalLM

        return Bound(CausalLM.from_options(cfg.task.options), name, builtin=True)
    fn = usercode.resolve("task.name", name)
    task = usercode.call("task.name", name, fn, cfg.task.options, "task.options")
    if task is None:
        raise UserCodeError(
            f"task.name={name!r} returned None, not a task.",
            f"return the task object (with build_model, dataset, loss and metrics; {DOC}).",
            setting="task.name",
            value=name,
        )
    return Bound(task, name)


def _image_task(cfg: JobConfig) -> Any:
    if cfg.task.options:
        raise BadInput(
            f"task.options={cfg.task.options} with task.name='image_classification': the image task takes its "
            "settings from the model and data sections.",
            "remove task.options (set e.g. --model.name, --data.path, --data.num-classes instead).",
            setting="task.options",
            value=cfg.task.options,
        )
    from job.tasks.image.task import ImageClassification

    return ImageClassification(cfg)
