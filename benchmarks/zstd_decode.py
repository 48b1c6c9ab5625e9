"""zstd decode and encode throughput: arrayio's nvCOMP codec on the GPU against zarr's CPU zstd.

``python -m benchmarks.zstd_decode --out DIR [--gib 2] [--chunk-mib 1 4 16] [--repeats 3]
[--level 0] [--data quantized|walk] [--threads N]``

For each chunk size, one float32 array of ``--gib`` GiB is cut into chunks and compressed
with numcodecs' ``Zstd`` at ``--level`` (what zarr's ``ZstdCodec`` writes). The same frames
are then decoded by:

* ``numcodecs_1_thread``: ``Zstd.decode`` chunk after chunk, the work zarr does per chunk
  (timed on the first ``--one-thread-gib`` of the chunks, which is enough for a per-chunk
  rate and keeps a 2 GiB run short);
* ``numcodecs_threads``: the same calls spread over a thread pool of ``--threads`` (all cores);
* ``zarr_codec``: zarr's own ``ZstdCodec.decode`` on the whole batch of host buffers, with
  its default concurrency (one thread hop per chunk, ``async.concurrency`` at a time);
* ``arrayio_gpu``: ``arrayio.zarr.codecs.ZstdCodec`` on the same frames already in GPU
  memory (zarr GPU buffers), all chunks in one batched nvCOMP call, frame checks included;
* ``nvcomp_raw``: nvCOMP's batched decode alone on the same device buffers (its ceiling).

Encode is measured the same way (numcodecs at ``--level`` on the CPU, nvCOMP on the GPU,
which has no levels: the two compression ratios are reported). Throughput is uncompressed
bytes per second (GB/s, 1e9), the median of ``--repeats`` timed runs after one warm-up; GPU
timings end with a device synchronisation. Without a usable GPU, CuPy or nvCOMP the GPU
rows are ``null`` and ``gpu_skipped`` says why. Writes ``DIR/zstd_decode.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20


def make_chunk(index: int, count: int, kind: str, seed: int) -> np.ndarray:
    """One chunk of a float32 field: a random walk, quantized (realistic) or raw (hard)."""
    rng = np.random.default_rng([seed, index])
    walk = np.cumsum(rng.standard_normal(count, dtype=np.float32)) + np.float32(index)
    if kind == "walk":
        return walk
    # Values on a 1/64 grid, as instruments and models store them, and one chunk in four
    # with a masked (zero) stretch: zstd gets about 2x to 3x on such data.
    quantized = np.round(walk * 64) / np.float32(64)
    if index % 4 == 0:
        quantized[: count // 2] = 0
    return quantized.astype(np.float32)


def timed(
    fn: Callable[[], Any], repeats: int, sync: Callable[[], None] | None = None
) -> list[float]:
    """Seconds of ``repeats`` runs; GPU runs (with a ``sync``) after a warm-up run."""
    if sync is not None:
        fn()  # warm-up: kernels compiled, nvCOMP's scratch space allocated
        sync()
    sync = sync or (lambda: None)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def rate(nbytes: int, seconds: list[float] | None) -> float | None:
    return None if seconds is None else nbytes / statistics.median(seconds) / 1e9


def gpu_modules() -> tuple[Any, Any, str | None]:
    """CuPy and nvCOMP, or the reason the GPU rows are skipped."""
    try:
        import cupy
    except ImportError as error:
        return None, None, f"CuPy is not installed ({error})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, None, "no CUDA device"
    except Exception as error:  # noqa: BLE001 - no driver, no device: both mean no GPU
        return None, None, f"no usable CUDA device ({error})"
    try:
        from nvidia import nvcomp
    except ImportError as error:
        return None, None, f"nvCOMP is not installed ({error})"
    return cupy, nvcomp, None


def versions(cupy: Any, nvcomp: Any) -> dict[str, str | None]:
    import numcodecs
    import zarr

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "numcodecs": numcodecs.__version__,
        "cupy": getattr(cupy, "__version__", None),
        "nvcomp": getattr(nvcomp, "__version__", None),
    }


def machine(cupy: Any) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    gpu = None
    if cupy is not None:
        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "gpu": gpu}


def bench_chunk_size(
    chunk_bytes: int,
    args: argparse.Namespace,
    cupy: Any,
    nvcomp: Any,
    pool: concurrent.futures.ThreadPoolExecutor,
) -> dict[str, Any]:
    from numcodecs import Zstd
    from zarr.codecs import ZstdCodec as ZarrZstdCodec
    from zarr.core.array_spec import ArrayConfig, ArraySpec
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.dtype import get_data_type_from_native_dtype

    from arrayio.zarr.codecs import ZstdCodec

    count = chunk_bytes // 4
    n_chunks = max(1, int(args.gib * (1 << 30)) // chunk_bytes)
    chunks = list(pool.map(lambda i: make_chunk(i, count, args.data, args.seed), range(n_chunks)))
    nbytes = n_chunks * chunk_bytes
    zstd = Zstd(level=args.level)
    frames = list(pool.map(zstd.encode, chunks))
    compressed = sum(len(f) for f in frames)
    row: dict[str, Any] = {
        "chunk_bytes": chunk_bytes,
        "chunks": n_chunks,
        "bytes": nbytes,
        "compressed_bytes": compressed,
        "ratio": nbytes / compressed,
    }
    print(
        f"chunks of {chunk_bytes / MiB:g} MiB: {n_chunks} chunks, {nbytes / 1e9:.2f} GB, "
        f"zstd level {args.level} ratio {nbytes / compressed:.2f}",
        flush=True,
    )

    def spec(prototype: Any) -> Any:
        return ArraySpec(
            shape=(count,),
            dtype=get_data_type_from_native_dtype(np.float32),
            fill_value=0,
            config=ArrayConfig.from_dict({}),
            prototype=prototype,
        )

    host = default_buffer_prototype()
    host_items = [(host.buffer.from_bytes(f), spec(host)) for f in frames]
    zarr_codec = ZarrZstdCodec(level=args.level)
    few = max(1, min(n_chunks, int(args.one_thread_gib * (1 << 30)) // chunk_bytes))
    row["one_thread_chunks"] = few
    decode: dict[str, list[float] | None] = {
        "numcodecs_1_thread": timed(lambda: [zstd.decode(f) for f in frames[:few]], args.repeats),
        "numcodecs_threads": timed(lambda: list(pool.map(zstd.decode, frames)), args.repeats),
        "zarr_codec": timed(lambda: asyncio.run(zarr_codec.decode(host_items)), args.repeats),
        "arrayio_gpu": None,
        "nvcomp_raw": None,
    }
    encode: dict[str, list[float] | None] = {
        "numcodecs_1_thread": timed(lambda: [zstd.encode(c) for c in chunks[:few]], args.repeats),
        "numcodecs_threads": timed(lambda: list(pool.map(zstd.encode, chunks)), args.repeats),
        "arrayio_gpu": None,
        "nvcomp_raw": None,
    }
    assert all(zstd.decode(f) == c.tobytes() for f, c in zip(frames[:4], chunks, strict=False))

    if cupy is not None:
        from zarr.core.buffer import gpu

        sync = cupy.cuda.Device().synchronize
        device_frames = [cupy.asarray(np.frombuffer(f, dtype=np.uint8)) for f in frames]
        device_chunks = [cupy.asarray(c.view(np.uint8)) for c in chunks]
        gpu_items = [
            (gpu.Buffer.from_array_like(f), spec(gpu.buffer_prototype)) for f in device_frames
        ]
        ours = ZstdCodec(level=args.level)
        decoded = asyncio.run(ours.decode(gpu_items))
        assert all(
            bool((d.as_array_like() == c).all())
            for d, c in zip(decoded, device_chunks, strict=True)
        ), "GPU decode differs"
        del decoded
        decode["arrayio_gpu"] = timed(
            lambda: asyncio.run(ours.decode(gpu_items)), args.repeats, sync
        )

        stream = cupy.cuda.Stream(non_blocking=False)
        raw = nvcomp.Codec(
            algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=stream.ptr
        )
        outs = [cupy.empty(chunk_bytes, dtype=np.uint8) for _ in range(n_chunks)]

        def raw_decode() -> None:
            with stream:
                raw.decode(
                    nvcomp.as_arrays(device_frames, cuda_stream=stream.ptr),
                    out=nvcomp.as_arrays(outs, cuda_stream=stream.ptr),
                )
                stream.synchronize()

        decode["nvcomp_raw"] = timed(raw_decode, args.repeats, sync)
        del outs

        chunk_items = [
            (gpu.Buffer.from_array_like(c), spec(gpu.buffer_prototype)) for c in device_chunks
        ]
        gpu_frames = asyncio.run(ours.encode(chunk_items))
        gpu_compressed = sum(f.as_array_like().size for f in gpu_frames)
        row["gpu_ratio"] = nbytes / gpu_compressed
        assert all(
            zstd.decode(f.to_bytes()) == c.tobytes()
            for f, c in zip(gpu_frames[:4], chunks, strict=False)
        ), "GPU frames differ"
        del gpu_frames
        encode["arrayio_gpu"] = timed(
            lambda: asyncio.run(ours.encode(chunk_items)), args.repeats, sync
        )

        def raw_encode() -> None:
            with stream:
                result = raw.encode(nvcomp.as_arrays(device_chunks, cuda_stream=stream.ptr))
                result.buffer_sizes  # noqa: B018 - waits for the compressed sizes
                stream.synchronize()

        encode["nvcomp_raw"] = timed(raw_encode, args.repeats, sync)
        del device_frames, device_chunks, gpu_items, chunk_items
        cupy.get_default_memory_pool().free_all_blocks()

    def rates(seconds: dict[str, list[float] | None]) -> dict[str, float | None]:
        return {
            name: rate(few * chunk_bytes if name == "numcodecs_1_thread" else nbytes, s)
            for name, s in seconds.items()
        }

    row["decode_GBps"], row["encode_GBps"] = rates(decode), rates(encode)
    row["seconds"] = {"decode": decode, "encode": encode}
    gpu_rate = row["decode_GBps"]["arrayio_gpu"]
    row["decode_speedup"] = (
        None
        if gpu_rate is None
        else {
            f"arrayio_gpu_vs_{name}": gpu_rate / row["decode_GBps"][name]
            for name in ("numcodecs_1_thread", "numcodecs_threads", "zarr_codec")
        }
    )
    for kind in ("decode", "encode"):
        print(
            f"  {kind}: "
            + "  ".join(
                f"{name} {value:.2f}" if value is not None else f"{name} -"
                for name, value in row[f"{kind}_GBps"].items()
            )
            + "  GB/s",
            flush=True,
        )
    if row["decode_speedup"]:
        print(
            "  decode speedup: "
            + "  ".join(
                f"{k.removeprefix('arrayio_gpu_vs_')} {v:.1f}x"
                for k, v in row["decode_speedup"].items()
            ),
            flush=True,
        )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for zstd_decode.json")
    parser.add_argument("--gib", type=float, default=2.0, help="uncompressed data per size")
    parser.add_argument("--chunk-mib", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--level", type=int, default=0, help="zstd level (zarr's default: 0)")
    parser.add_argument("--data", choices=["quantized", "walk"], default="quantized")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--one-thread-gib",
        type=float,
        default=0.25,
        help="data timed by the single-thread CPU rows",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gpu", action="store_true", help="measure the CPU rows only")
    args = parser.parse_args(argv)

    if args.no_gpu:
        cupy, nvcomp, skipped = None, None, "--no-gpu"
    else:
        cupy, nvcomp, skipped = gpu_modules()
    if skipped:
        print(f"GPU rows skipped: {skipped}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        rows = [
            bench_chunk_size(int(mib * MiB) // 4 * 4, args, cupy, nvcomp, pool)
            for mib in args.chunk_mib
        ]

    report = {
        "benchmark": "zstd_decode",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [
                os.path.basename(sys.executable),
                "-m",
                "benchmarks.zstd_decode",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "machine": machine(cupy),
        "versions": versions(cupy, nvcomp),
        "data": args.data,
        "dtype": "float32",
        "level": args.level,
        "repeats": args.repeats,
        "threads": args.threads,
        "gib": args.gib,
        "one_thread_gib": args.one_thread_gib,
        "gpu_skipped": skipped,
        "target": "arrayio_gpu decode >= 5x zarr's CPU zstd decode on the same chunks",
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zstd_decode.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'zstd_decode.json'}", flush=True)


if __name__ == "__main__":
    main()
