"""The arrayio error hierarchy.

Every error has one base, :class:`ArrayioError`, and also subclasses the builtin a caller
would catch without knowing arrayio (``ValueError`` for a damaged file, ``KeyError`` for a
missing key...), as zarr-python does.
"""

from __future__ import annotations

__all__ = [
    "ArrayioError",
    "ChecksumError",
    "ConfigError",
    "DeviceError",
    "DiskFullError",
    "FormatError",
    "FrameworkNotAvailableError",
    "HeaderTooLargeError",
    "KeyNotFoundError",
    "MismatchError",
    "OutOfMemoryError",
    "ToolUnavailableError",
    "TruncatedFileError",
    "UnknownToolError",
    "UnsupportedDtypeError",
    "UnsupportedFormatError",
    "UnsupportedObjectError",
]


class ArrayioError(Exception):
    """Base of every error arrayio raises on purpose."""


class FormatError(ArrayioError, ValueError):
    """A file is not a valid container: bad header, bad offsets, inconsistent shapes."""


class HeaderTooLargeError(FormatError):
    """A header claims more bytes than arrayio accepts."""


class TruncatedFileError(FormatError, EOFError):
    """A file ends before the header or the data that it describes."""


class ChecksumError(FormatError):
    """The bytes read do not match the checksum recorded when the file was written."""


class UnsupportedDtypeError(ArrayioError, TypeError):
    """A dtype unknown to the format, or one the target framework cannot represent."""


class UnsupportedObjectError(ArrayioError, TypeError):
    """An object that is neither an array nor a pytree node arrayio can save."""


class UnsupportedFormatError(ArrayioError, ValueError):
    """A path whose extension names a format arrayio does not write (``.pt``, ``.h5``...)."""


class KeyNotFoundError(ArrayioError, KeyError):
    """A key that the file does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; a sentence reads better.
        return str(self.args[0]) if self.args else ""


class MismatchError(ArrayioError, ValueError):
    """An output array whose dtype or shape differs from what the file holds."""


class FrameworkNotAvailableError(ArrayioError, ImportError):
    """The requested framework (or the library a code path needs) is not installed."""


class ConfigError(ArrayioError, ValueError):
    """A setting, environment variable or tool specification that cannot be understood."""


class OutOfMemoryError(ArrayioError, MemoryError):
    """A load would need more memory than the machine has available."""


class DiskFullError(ArrayioError, OSError):
    """The file system ran out of space (or quota) during a write; the previous file, if
    any, is intact."""


class DeviceError(ArrayioError, ValueError):
    """A device that cannot be parsed, or that does not fit the requested framework."""


class ToolUnavailableError(ArrayioError, OSError):
    """A transfer tool cannot serve this request here (O_DIRECT refused, no libcuda...).

    The dispatcher catches it, marks the tool unavailable for that context and falls back.
    """


class UnknownToolError(ArrayioError, KeyError):
    """A transfer tool name that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
