"""arrayio: fast, framework-neutral array I/O between storage and CPU or GPU memory.

>>> import arrayio, numpy as np
>>> arrayio.save("/tmp/example.safetensors", {"w": np.ones((2, 3), np.float32), "step": 7})
>>> arrayio.load("/tmp/example.safetensors")["step"]
7

Importing arrayio imports no framework (JAX, CuPy, torch), no KvikIO and no zarr: arrays are
recognised through ``sys.modules``, and a framework is imported only when the caller asks
for it by name (``like="jax"``).
"""

from __future__ import annotations

from . import config, errors, offload
from .api._async import AsyncFuture, load_async, save_async, wait
from .api._load import load, open, read_into
from .api._reader import ArrayInfo, Reader
from .api._save import save
from .api._sharded_reader import ShardedReader
from .api._tuning import DispatchReport, explain, tune
from .errors import (
    ArrayioError,
    ChecksumError,
    ConfigError,
    DeviceError,
    DiskFullError,
    FormatError,
    FrameworkNotAvailableError,
    HeaderTooLargeError,
    KeyNotFoundError,
    MismatchError,
    OutOfMemoryError,
    ToolUnavailableError,
    TruncatedFileError,
    UnknownToolError,
    UnsupportedDtypeError,
    UnsupportedFormatError,
    UnsupportedObjectError,
)
from .offload import Offloader

__version__ = "0.1.0"

__all__ = [
    "ArrayInfo",
    "ArrayioError",
    "AsyncFuture",
    "ChecksumError",
    "ConfigError",
    "DispatchReport",
    "DeviceError",
    "DiskFullError",
    "FormatError",
    "FrameworkNotAvailableError",
    "HeaderTooLargeError",
    "KeyNotFoundError",
    "MismatchError",
    "Offloader",
    "OutOfMemoryError",
    "Reader",
    "ShardedReader",
    "ToolUnavailableError",
    "TruncatedFileError",
    "UnknownToolError",
    "UnsupportedDtypeError",
    "UnsupportedFormatError",
    "UnsupportedObjectError",
    "config",
    "errors",
    "explain",
    "load",
    "load_async",
    "offload",
    "open",
    "read_into",
    "save",
    "save_async",
    "tune",
    "wait",
]
