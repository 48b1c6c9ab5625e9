"""How a failure becomes what ``arrayio`` reports: one line on stderr naming the file, and the
exit code of its kind (see :mod:`arrayio.cli`)."""

from __future__ import annotations

import errno
import os

from .. import errors
from ._common import EXIT_DATA, EXIT_DEPENDENCY, EXIT_ENVIRONMENT, EXIT_USAGE, CommandError

# What the machine refuses, whatever the file holds: permissions, a read-only file system,
# no space (or quota) left.
_ENVIRONMENT_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
)


def exit_code(error: BaseException) -> int:
    """The exit code for ``error``: its own for a :class:`CommandError`, else by its kind."""
    if isinstance(error, CommandError):
        return error.code
    if isinstance(error, errors.FrameworkNotAvailableError | ImportError):
        return EXIT_DEPENDENCY
    if isinstance(error, errors.DiskFullError) or (
        isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS
    ):
        return EXIT_ENVIRONMENT
    if isinstance(
        error,
        errors.KeyNotFoundError
        | errors.UnknownToolError
        | errors.DeviceError
        | errors.ConfigError
        | FileNotFoundError
        | IsADirectoryError
        | NotADirectoryError
        | FileExistsError,
    ):
        return EXIT_USAGE
    return EXIT_DATA  # FormatError (checksum, truncation), UnsupportedDtypeError, OSError...


def message(error: BaseException, subject: str | None) -> str:
    """One line, naming the file: ``subject`` (the command's file) if the error does not."""
    if isinstance(error, OSError) and error.strerror:
        filename = error.filename if error.filename is not None else subject
        if filename is not None and _is_scratch(os.fspath(filename)):
            filename = os.path.dirname(os.fspath(filename))  # where the user pointed us
        return f"{filename}: {error.strerror}" if filename else error.strerror
    text = str(error) or type(error).__name__
    if isinstance(error, ImportError):
        text = text.splitlines()[0]
    if (
        subject
        and subject not in text
        and not isinstance(error, CommandError | ImportError | errors.ConfigError)
    ):  # not about the file
        text = f"{subject}: {text}"
    return text


def _is_scratch(path: str) -> bool:
    """Whether ``path`` names one of arrayio's hidden temporary files (``.arrayio-tune-*``,
    ``.ckpt.safetensors.arrayio-tmp-*``), which the user never named."""
    name = os.path.basename(path)
    return name.startswith(".") and "arrayio-" in name
