"""User code named in the config: ``package.module:callable`` import paths, resolved and called in one place.

``model.name`` and ``data.source`` take such a path (docs/user-code.md has the contracts). Resolving imports the
module and walks the attribute path; calling checks the keyword arguments against the callable's signature first,
so a wrong signature is reported as such rather than as whatever ``TypeError`` the body would raise. Every failure
is a ``UserCodeError`` (exit 2) naming the setting, the value and the fix.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from job.errors import UserCodeError

IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
"""``package.module:callable`` (the callable may be an attribute path, ``module:Class.create``)."""
CONTRACT_DOC = "docs/user-code.md"


def is_import_path(value: str) -> bool:
    """Whether ``value`` names user code (``package.module:callable``) rather than a built-in choice."""
    return IMPORT_PATH.fullmatch(value) is not None


def _import(setting: str, path: str) -> Any:
    module_name = path.split(":", 1)[0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not f"{module_name}.".startswith(f"{e.name}."):  # a dependency is missing
            raise _raised(setting, path, f"importing module {module_name}", e) from e
        raise UserCodeError(
            f"{setting}={path!r}: no module named {e.name!r} in this Python environment.",
            "install the package where the job runs (pip install it into the job's venv or image, or add its "
            f"directory to PYTHONPATH), or correct the spelling; see {CONTRACT_DOC}.",
            setting=setting,
            value=path,
        ) from e
    except Exception as e:
        raise _raised(setting, path, f"importing module {module_name}", e) from e


def resolve(setting: str, path: str) -> Callable[..., Any]:
    """The callable ``path`` names.

    Raises:
        UserCodeError: the module cannot be imported, lacks the attribute, or the attribute is not callable.
    """
    obj = _import(setting, path)
    module_name, attrs = path.split(":", 1)
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise UserCodeError(
                f"{setting}={path!r}: {module_name} has no attribute {attr!r}.",
                f"name one of its callables, e.g. {public[:8]} ({module_name}:NAME).",
                setting=setting,
                value=path,
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UserCodeError(
            f"{setting}={path!r} is a {type(obj).__name__}, not a callable.",
            f"name a function or class that follows the contract in {CONTRACT_DOC}.",
            setting=setting,
            value=path,
        )
    return obj  # type: ignore[no-any-return]


def call(setting: str, path: str, fn: Callable[..., Any], kwargs: Mapping[str, Any], options: str) -> Any:
    """``fn(**kwargs)``, after checking that its signature accepts them.

    Args:
        options: the setting that supplies the optional keywords (``model.options``), for the fix.

    Raises:
        UserCodeError: the signature does not take these keywords, or the call raised.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: the call itself will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as e:
            raise UserCodeError(
                f"{setting}={path!r} cannot be called as {path}({', '.join(f'{k}=...' for k in kwargs)}): {e}; its "
                f"signature is {signature}.",
                f"give it the keyword parameters of the contract in {CONTRACT_DOC}, and only the extra ones that "
                f"{options} passes.",
                setting=setting,
                value=path,
            ) from None
    try:
        return fn(**kwargs)
    except Exception as e:
        raise _raised(setting, path, "calling it", e) from e


def _raised(setting: str, path: str, doing: str, e: BaseException) -> UserCodeError:
    return UserCodeError(
        f"{setting}={path!r}: {doing} raised {type(e).__name__}: {str(e).strip()[:300]}",
        "fix the user code (JOB_TRACEBACK=1 prints the traceback).",
        setting=setting,
        value=path,
    )
