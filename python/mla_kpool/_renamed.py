"""Keyword arguments renamed for one release: the old name still works, warned.

A leaf module (it imports nothing of the package) so that the runner and
:mod:`mla_kpool.reference` share one rename rule.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keyword(old: str, new: str) -> Callable[[F], F]:
    """Decorates a function whose parameter ``new`` was called ``old``.

    The decorated function takes ``old=`` as ``new=``, with a
    ``DeprecationWarning`` that names ``new``; its signature (and
    ``inspect.signature``) shows only ``new``.

    Args:
        old: The parameter's former keyword.
        new: Its name now, a parameter of the decorated function.

    Returns:
        The decorator.

    Raises:
        ValueError: At decoration, if ``new`` is not a parameter of the
            function.
        TypeError: From the decorated function, when a call passes both
            ``old`` and ``new`` (by keyword or by position).
    """

    def decorate(function: F) -> F:
        names = list(inspect.signature(function).parameters)
        if new not in names:
            raise ValueError(
                f"{function.__qualname__} has no parameter {new!r}"
            )
        position = names.index(new)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs or len(args) > position:
                    raise TypeError(
                        f"{function.__qualname__}() got both {new}= and its"
                        f" former name {old}=; pass {new}= only"
                    )
                warnings.warn(
                    f"{function.__qualname__}(): the keyword {old}= is"
                    f" renamed {new}=; {old}= will be removed",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
