"""``jax_processes``: run one script in two processes joined by ``jax.distributed``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def jax_processes(tmp_path: Path) -> Callable[..., list]:
    """Run ``script`` as processes 0 and 1 (arguments: rank, coordinator port, ``tmp_path``)
    on 4 host devices each; fail on any nonzero exit, else return each process's last line
    of output, parsed as JSON."""

    def run(script: str, *, timeout: float = 300, env: dict[str, str] | None = None) -> list:
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            port = str(probe.getsockname()[1])
        environment = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            **(env or {}),
        }
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(rank), port, str(tmp_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=environment,
            )
            for rank in range(2)
        ]
        outputs = [process.communicate(timeout=timeout) for process in processes]
        for process, (out, err) in zip(processes, outputs, strict=True):
            assert process.returncode == 0, out + err[-4000:]
        return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]

    return run
