"""The ``arrayio`` command, on real files: every subcommand's help, output, exit codes and
one-line errors; conversions round-trip bit-exactly; a damaged file fails ``verify``.

Most cases call :func:`arrayio.cli.main` in-process (fast); the console script and
``python -m arrayio`` run as subprocesses once each.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayio
from arrayio import cli
from arrayio.cli import _failures, _verify
from arrayio.integrity import _atomic
from arrayio.testing import damage_array, strategies

ml_dtypes = pytest.importorskip("ml_dtypes")

SUBCOMMANDS = ("info", "verify", "clean", "convert", "bench", "tune", "explain")


def run(capsys: pytest.CaptureFixture[str], *args: str | os.PathLike[str]) -> tuple[int, str, str]:
    code = cli.main([os.fspath(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def sample_tree() -> dict:
    return {
        "emb": np.arange(4000, dtype=np.float32).reshape(1000, 4),
        "layers": [{"w": np.eye(3), "b": np.arange(3, dtype=ml_dtypes.bfloat16)}],
        "step": 7,
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.safetensors"
    arrayio.save(path, sample_tree(), metadata={"run": "baseline", "cfg": {"lr": 0.1}})
    return path


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- the command


def test_the_console_script_and_python_m_run(ckpt, tmp_path):
    env = {**os.environ, "ARRAYIO_CACHE_DIR": "none"}
    script = shutil.which("arrayio", path=os.path.dirname(sys.executable))
    commands = [[sys.executable, "-m", "arrayio"]] + ([[script]] if script else [])
    for command in commands:
        result = subprocess.run(
            [*command, "info", str(ckpt), "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["checksums"] == {"present": 3, "arrays": 3, "header": True}
        missing = subprocess.run(
            [*command, "verify", str(tmp_path / "nope.safetensors")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert missing.returncode == 2
        assert missing.stderr.startswith("arrayio verify: ")
        assert "nope.safetensors" in missing.stderr and "Traceback" not in missing.stderr
    if script is None:
        pytest.skip("the arrayio console script is not installed beside this Python")


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: arrayio {command}")
    assert "--progress" in out and "exit codes:" in out


def test_the_top_level_help_lists_the_commands_and_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in SUBCOMMANDS:
        assert f"    {command} " in out
    assert "  3    an optional dependency is missing" in out


def test_version_and_usage_errors(capsys):
    assert run(capsys, "--version")[1].strip() == f"arrayio {arrayio.__version__}"
    code, _, err = run(capsys)
    assert code == 2 and "required: COMMAND" in err
    code, _, err = run(capsys, "info")
    assert code == 2 and "FILE" in err
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "invalid choice" in err


# --------------------------------------------------------------------------- info


def test_info_lists_arrays_metadata_and_checksums(capsys, ckpt):
    code, out, err = run(capsys, "info", ckpt)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"{ckpt}: safetensors, 3 arrays,")
    assert "saved from numpy" in lines[0]
    assert lines[1] == "checksums: CRC-32C on the header and 3 of 3 arrays"
    assert "  run = baseline" in lines and '  cfg = {"lr": 0.1}' in lines
    table = lines[lines.index("metadata:") + 3 :]
    assert table[0].split() == ["key", "dtype", "shape", "size", "offset", "crc32c"]
    with arrayio.open(ckpt) as reader:
        for line, key in zip(table[1:], reader.keys(), strict=True):
            info = reader[key]
            assert line.split()[0] == key and line.split()[1] == info.dtype
            assert line.endswith(f"{info.file_offset}  {info.crc32c}")
    assert "(1000, 4)" in out and "bfloat16" in out and "(3,)" in out


def test_info_json(capsys, ckpt):
    code, out, _ = run(capsys, "info", ckpt, "--json")
    assert code == 0
    info = json.loads(out)
    assert info["format"] == "safetensors" and info["framework"] == "numpy"
    assert info["metadata"] == {"run": "baseline", "cfg": {"lr": 0.1}}
    assert info["file_bytes"] == ckpt.stat().st_size
    with arrayio.open(ckpt) as reader:
        assert [a["key"] for a in info["arrays"]] == reader.keys()
        assert info["nbytes"] == reader.nbytes
        for entry in info["arrays"]:
            expected = reader[entry["key"]]
            assert entry == {
                "key": expected.key,
                "dtype": expected.dtype,
                "shape": list(expected.shape),
                "nbytes": expected.nbytes,
                "offset": expected.file_offset,
                "crc32c": expected.crc32c,
            }


def test_info_on_a_foreign_safetensors_file_shows_no_checksums(capsys, tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "foreign.safetensors"
    save_file({"a": np.ones((2, 2), np.float16)}, str(path), metadata={"who": "hf"})
    code, out, _ = run(capsys, "info", path, "--json")
    info = json.loads(out)
    assert code == 0 and info["framework"] is None and info["metadata"] == {"who": "hf"}
    assert info["checksums"] == {"present": 0, "arrays": 1, "header": False}
    assert info["arrays"][0]["crc32c"] is None


@pytest.mark.parametrize(
    "content, code", [(None, 2), (b"", 1), (b"\x00" * 100, 1), (b"garbage, not a container", 1)]
)
def test_info_errors_name_the_file(capsys, tmp_path, content, code):
    path = tmp_path / "x.safetensors"
    if content is not None:
        path.write_bytes(content)
    got, out, err = run(capsys, "info", path)
    assert got == code and out == ""
    assert err.startswith("arrayio info: ") and str(path) in err
    assert len(err.strip().splitlines()) == 1


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError):
        cli.main(["info", str(tmp_path / "nope.safetensors"), "--debug"])


def test_a_directory_is_a_usage_error(capsys, tmp_path):
    code, _, err = run(capsys, "info", tmp_path)
    assert code == 2 and f"{tmp_path}: is a directory" in err


@pytest.mark.parametrize("command", ["info", "verify", "explain"])
@pytest.mark.parametrize("name, what", [("x.pt", "a .pt file"), ("x.zarr", "a Zarr store")])
def test_other_formats_get_a_hint_to_convert(capsys, tmp_path, command, name, what):
    (tmp_path / name).write_bytes(b"PK\x03\x04")
    code, _, err = run(capsys, command, tmp_path / name)
    assert code == 2
    assert f"{tmp_path / name} is {what}" in err
    assert f"arrayio convert {tmp_path / name} {tmp_path / 'x'}.safetensors" in err


# --------------------------------------------------------------------------- verify


def test_verify_a_good_file(capsys, ckpt):
    code, out, err = run(capsys, "verify", ckpt, "-v")
    assert code == 0 and err == ""
    assert out.splitlines()[-1].startswith(f"{ckpt}: OK, the header and 3 of 3 arrays verified")
    assert "ok  emb" in out and "ok  layers.0.b" in out


def test_verify_names_each_damaged_array(capsys, ckpt):
    damage_array(ckpt, "emb")
    damage_array(ckpt, "layers.0.w")
    code, out, err = run(capsys, "verify", ckpt)
    assert code == cli.EXIT_DATA
    assert "OK" not in out
    assert f"{ckpt}: array 'emb': CRC-32C" in err
    assert f"{ckpt}: array 'layers.0.w': CRC-32C" in err
    assert "'layers.0.b'" not in err.split("failed verification")[0].split("\n")[-1]
    assert err.strip().splitlines()[-1] == (
        f"arrayio verify: {ckpt}: 2 of 3 checksummed arrays failed verification: "
        "'emb', 'layers.0.w'"
    )
    # arrayio's own load agrees.
    with pytest.raises(arrayio.ChecksumError, match="emb"):
        arrayio.load(ckpt)


def test_verify_reads_large_arrays_in_pieces(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(_verify, "_VERIFY_CHUNK", 4096)
    path = tmp_path / "big.safetensors"
    arrayio.save(path, {"a": np.arange(10_000, dtype=np.float64), "b": np.ones(3)})
    assert run(capsys, "verify", path)[0] == 0
    damage_array(path, "a", at=70_000)  # in the 18th piece
    code, _, err = run(capsys, "verify", path)
    assert code == 1 and "'a'" in err


def test_verify_a_truncated_file(capsys, ckpt):
    size = ckpt.stat().st_size
    with open(ckpt, "r+b") as f:
        f.truncate(size - 100)
    code, _, err = run(capsys, "verify", ckpt)
    assert code == 1 and str(ckpt) in err


def test_verify_a_npy_file_says_it_has_no_place_for_a_checksum(capsys, tmp_path):
    path = tmp_path / "a.npy"
    arrayio.save(path, np.arange(5))  # arrayio's own .npy: no checksum either
    code, out, err = run(capsys, "verify", path)
    assert code == 0 and err == ""
    assert out == (
        f"{path}: .npy header and size valid; no checksums to verify (.npy has no place for one)\n"
    )
    code, out, err = run(capsys, "verify", path, "--strict")
    assert code == cli.EXIT_DATA and out == ""
    assert err == (
        f"arrayio verify: {path}: --strict: .npy has no place for a checksum; "
        "header and size valid, data not verified\n"
    )
    with open(path, "r+b") as f:  # a .npy cut short still fails
        f.truncate(path.stat().st_size - 8)
    assert run(capsys, "verify", path)[0] == cli.EXIT_DATA


def test_verify_a_safetensors_file_without_checksums(capsys, tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "foreign.safetensors"
    save_file({"a": np.ones(3, np.float32)}, str(path))
    code, out, err = run(capsys, "verify", path)
    assert code == 0 and err == ""
    assert out == (
        f"{path}: header and sizes valid; no checksums to verify (no arrayio "
        "metadata: written by another safetensors writer)\n"
    )
    code, out, err = run(capsys, "verify", path, "--strict")
    assert code == cli.EXIT_DATA and out == ""
    assert err.endswith(f"arrayio verify: {path}: --strict and 1 array carries no checksum\n")


# --------------------------------------------------------------------------- convert


def load_flat(path: Path) -> dict[str, np.ndarray]:
    with arrayio.open(path) as reader:
        return {key: reader.read(key) for key in reader.keys()}


@pytest.mark.parametrize("target", ["out.npz", "out.pt", "out.zarr", "copy.safetensors"])
def test_convert_round_trips(capsys, tmp_path, target):
    if target.endswith(".pt"):
        pytest.importorskip("torch")
    if target.endswith(".zarr"):
        pytest.importorskip("zarr")
    source = tmp_path / "src.safetensors"
    tree = {
        "a": {"x": np.arange(6.0).reshape(2, 3), "y": np.arange(3, dtype=np.int8)},
        "c": np.array([1 + 2j, 3 - 4j]),
        "u": np.arange(4, dtype=np.uint64),
        "z": np.zeros((0, 3), np.float32),
        "s": np.float32(2.5).reshape(()),
    }
    arrayio.save(source, tree, metadata={"m": [1, 2]})
    code, out, _ = run(capsys, "convert", source, tmp_path / target)
    assert code == 0 and out.strip().endswith("6 arrays")
    back = tmp_path / "back.safetensors"
    code, _, _ = run(capsys, "convert", tmp_path / target, back)
    assert code == 0
    original, result = load_flat(source), load_flat(back)
    assert sorted(result) == sorted(original)
    for key in original:
        assert_same(result[key], original[key])
    with arrayio.open(back) as reader:
        # Metadata survives where the format holds it.
        expected = {} if target.endswith((".npz", ".pt")) else {"m": [1, 2]}
        assert reader.metadata == expected


def test_convert_keeps_the_pytree_through_pt(capsys, tmp_path, ckpt):
    pytest.importorskip("torch")
    assert run(capsys, "convert", ckpt, tmp_path / "c.pt")[0] == 0
    assert run(capsys, "convert", tmp_path / "c.pt", tmp_path / "back.safetensors")[0] == 0
    back = arrayio.load(tmp_path / "back.safetensors")
    assert back["step"] == 7  # a constant: torch.save keeps it
    assert_same(back["layers"][0]["b"], sample_tree()["layers"][0]["b"])  # bfloat16
    assert_same(back["emb"], sample_tree()["emb"])


@pytest.mark.parametrize("middle", ["x.npz", "x.zarr"])
def test_convert_from_numpy_formats_to_pt_and_back(capsys, tmp_path, middle):
    torch = pytest.importorskip("torch")
    if middle.endswith(".zarr"):
        pytest.importorskip("zarr")
    arrays = {
        "s": np.float32(1.5).reshape(()),
        "m": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "f": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    }
    arrayio.save(tmp_path / "a.safetensors", arrays)
    assert run(capsys, "convert", tmp_path / "a.safetensors", tmp_path / middle)[0] == 0
    assert run(capsys, "convert", tmp_path / middle, tmp_path / "x.pt")[0] == 0
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in loaded.items()} == {"s": (), "m": (2, 3), "f": (2, 3)}
    assert run(capsys, "convert", tmp_path / "x.pt", tmp_path / "back.safetensors")[0] == 0
    back = load_flat(tmp_path / "back.safetensors")
    for key, array in arrays.items():
        assert_same(back[key], array)


def test_bfloat16_from_pt_into_npz_is_refused_clearly(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "w.pt")
    code, _, err = run(capsys, "convert", tmp_path / "w.pt", tmp_path / "w.npz")
    assert code == 1 and "bfloat16" in err and "'w'" in err


def test_convert_a_torch_state_dict(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    layer = torch.nn.Linear(3, 2).to(torch.bfloat16)
    torch.save(layer.state_dict(), tmp_path / "model.pt")
    assert run(capsys, "convert", tmp_path / "model.pt", tmp_path / "m.safetensors")[0] == 0
    loaded = arrayio.load(tmp_path / "m.safetensors", like="torch")
    assert set(loaded) == {"weight", "bias"}
    assert torch.equal(loaded["weight"], layer.weight.detach())
    assert loaded["weight"].dtype == torch.bfloat16


def test_convert_refuses_a_pickle_that_weights_only_refuses(capsys, tmp_path):
    torch = pytest.importorskip("torch")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    code, _, err = run(capsys, "convert", tmp_path / "evil.pt", tmp_path / "e.safetensors")
    assert code == 1 and "weights_only" in err and "evil.pt" in err
    assert not (tmp_path / "e.safetensors").exists()


def test_convert_from_npy_and_foreign_safetensors(capsys, tmp_path):
    from safetensors.numpy import save_file

    np.save(tmp_path / "a.npy", np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)))
    assert run(capsys, "convert", tmp_path / "a.npy", tmp_path / "a.safetensors")[0] == 0
    assert_same(
        arrayio.load(tmp_path / "a.safetensors"),  # one array, as it was
        np.arange(12, dtype=np.int32).reshape(3, 4),
    )
    save_file({"w": np.ones((2, 2), np.float16)}, str(tmp_path / "hf.safetensors"))
    assert run(capsys, "convert", tmp_path / "hf.safetensors", tmp_path / "ours")[0] == 0
    with arrayio.open(tmp_path / "ours") as reader:  # any name but .npy: a container
        assert reader["w"].crc32c is not None


def test_convert_one_array_to_npy(capsys, tmp_path, ckpt):
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "x.npy")
    assert code == 2 and "--key" in err and "emb" in err
    assert not (tmp_path / "x.npy").exists()
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "x.npy", "--key", "emb")
    assert code == 0
    assert_same(np.load(tmp_path / "x.npy"), sample_tree()["emb"])
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "y.npy", "--key", "nope")
    assert code == 2 and "'nope'" in err and str(ckpt) in err


@pytest.mark.parametrize("target", ["x.npz", "x.zarr", "x.npy"])
def test_bfloat16_where_the_target_cannot_hold_it(capsys, tmp_path, ckpt, target):
    if target.endswith(".zarr"):
        pytest.importorskip("zarr")
    extra = ["--key", "layers.0.b"] if target.endswith(".npy") else []
    code, _, err = run(capsys, "convert", ckpt, tmp_path / target, *extra)
    assert code == cli.EXIT_DATA
    assert "bfloat16" in err and target in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]  # nothing left


def test_convert_notes_what_the_target_drops(capsys, tmp_path, ckpt):
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "x.npz", "--key", "emb")
    assert code == 0 and "no metadata; not converted: run, cfg" in err
    with arrayio.open(ckpt):
        pass
    arrayio.save(tmp_path / "c.safetensors", {"w": np.ones(2), "step": 3, "name": "x"})
    code, _, err = run(capsys, "convert", tmp_path / "c.safetensors", tmp_path / "c.npz")
    assert code == 0 and "arrays only; not converted: step, name" in err
    assert list(np.load(tmp_path / "c.npz").files) == ["w"]


def test_convert_to_pt_notes_the_metadata_it_drops(capsys, tmp_path, ckpt):
    torch = pytest.importorskip("torch")
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "x.pt")
    assert code == 0
    assert err == "arrayio convert: note: pt holds no metadata; not converted: run, cfg\n"
    assert torch.load(tmp_path / "x.pt", weights_only=True)["step"] == 7  # constants stay
    arrayio.save(tmp_path / "plain.safetensors", {"w": np.ones(2)})
    code, _, err = run(capsys, "convert", tmp_path / "plain.safetensors", tmp_path / "y.pt")
    assert code == 0 and err == ""


def test_convert_refuses_to_overwrite_unless_asked(capsys, tmp_path, ckpt):
    target = tmp_path / "x.npz"
    target.write_bytes(b"precious")
    code, _, err = run(capsys, "convert", ckpt, target, "--key", "emb")
    assert code == 2 and "--overwrite" in err
    assert target.read_bytes() == b"precious"
    assert run(capsys, "convert", ckpt, target, "--key", "emb", "--overwrite")[0] == 0
    assert_same(np.load(target)["emb"], sample_tree()["emb"])
    assert run(capsys, "convert", ckpt, ckpt)[0] == 2


def test_convert_never_replaces_a_directory_that_is_not_zarr(capsys, tmp_path, ckpt):
    pytest.importorskip("zarr")
    keep = tmp_path / "home"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "convert", ckpt, keep, "--overwrite", "--key", "emb")
    assert code == 2 and "not a Zarr store" in err
    assert (keep / "notes.txt").read_text() == "mine"


def test_convert_replaces_a_zarr_store_with_overwrite(capsys, tmp_path, ckpt):
    zarr = pytest.importorskip("zarr")
    store = tmp_path / "s.zarr"
    assert run(capsys, "convert", ckpt, store, "--key", "emb")[0] == 0
    assert run(capsys, "convert", ckpt, store, "--key", "layers.0.w", "--overwrite")[0] == 0
    assert_same(zarr.open(str(store), mode="r")["layers/0/w"][...], np.eye(3))
    assert "emb" not in zarr.open_group(str(store), mode="r")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors", "s.zarr"]


def test_convert_a_zarr_group_written_by_zarr(capsys, tmp_path):
    zarr = pytest.importorskip("zarr")
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    group.create_array("params/w", data=np.arange(6, dtype=np.float32).reshape(2, 3))
    group.create_array("step", data=np.int64(5).reshape(()))
    group.attrs["note"] = "from zarr"
    assert run(capsys, "convert", tmp_path / "g.zarr", tmp_path / "g.safetensors")[0] == 0
    tree = arrayio.load(tmp_path / "g.safetensors")
    assert_same(tree["params"]["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    with arrayio.open(tmp_path / "g.safetensors") as reader:
        assert sorted(reader.keys()) == ["params.w", "step"]
        assert reader.metadata == {"note": "from zarr"}


def test_convert_errors(capsys, tmp_path, ckpt):
    code, _, err = run(capsys, "convert", tmp_path / "none.npz", tmp_path / "x.safetensors")
    assert code == 2 and "none.npz" in err
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    code, _, err = run(capsys, "convert", tmp_path / "bad.npz", tmp_path / "x.safetensors")
    assert code == 1 and "bad.npz" in err
    np.savez(tmp_path / "obj.npz", a=np.array(["text"]))
    code, _, err = run(capsys, "convert", tmp_path / "obj.npz", tmp_path / "x.safetensors")
    assert code == 1 and "obj.npz" in err and "'a'" in err
    assert not (tmp_path / "x.safetensors").exists()


def test_a_missing_optional_dependency_exits_3(capsys, tmp_path, ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "zarr", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    for target in ("x.zarr", "x.pt"):
        code, _, err = run(capsys, "convert", ckpt, tmp_path / target)
        assert code == cli.EXIT_DEPENDENCY
        assert "pip install 'arrayio[" in err


NATIVE_DTYPES = [d for d in arrayio.arrays._dtypes.DTYPES if d.numpy_native]  # what .npz can hold


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    arrays=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_.]{0,8}", fullmatch=True),
        st.sampled_from(NATIVE_DTYPES).flatmap(lambda dtype: strategies.arrays(dtype=dtype)),
        min_size=1,
        max_size=4,
    )
)
def test_npz_round_trips_through_a_container(capsys, tmp_path_factory, arrays):
    directory = tmp_path_factory.mktemp("npz")
    np.savez(directory / "in.npz", **arrays)
    assert cli.main(["convert", str(directory / "in.npz"), str(directory / "c.arrayio")]) == 0
    assert cli.main(["convert", str(directory / "c.arrayio"), str(directory / "out.npz")]) == 0
    capsys.readouterr()
    with np.load(directory / "out.npz") as out:
        assert sorted(out.files) == sorted(arrays)
        for key, array in arrays.items():
            assert_same(out[key], array)


# --------------------------------------------------------------------------- environment


def mounted_tmpfs(directory: Path, options: str):
    """A tmpfs mounted on ``directory`` for the test (skipped where mounting fails)."""
    directory.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except OSError as error:
        pytest.skip(f"cannot mount a tmpfs here: {error}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield directory
    subprocess.run(["umount", str(directory)], capture_output=True, timeout=30, check=False)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (a tmpfs mounted ro: chmod does not stop root)."""
    yield from mounted_tmpfs(tmp_path / "ro", "size=1m,ro")


@pytest.fixture
def full_dir(tmp_path):
    """A file system of 256 KiB."""
    yield from mounted_tmpfs(tmp_path / "small", "size=256k")


@pytest.mark.parametrize("target", ["x.npz", "x.safetensors", "x.npy", "x.pt", "x.zarr"])
def test_a_read_only_file_system_is_the_environment(capsys, ckpt, read_only_dir, target):
    if target.endswith(".pt"):
        pytest.importorskip("torch")
    if target.endswith(".zarr"):
        pytest.importorskip("zarr")
    dst = read_only_dir / target
    code, _, err = run(capsys, "convert", ckpt, dst, "--key", "emb")
    assert code == cli.EXIT_ENVIRONMENT == 4
    assert err.splitlines()[-1] == f"arrayio convert: {dst}: Read-only file system"
    assert all(line.startswith("arrayio convert: note: ") for line in err.splitlines()[:-1])


@pytest.mark.parametrize("target", ["x.npz", "x.safetensors", "x.npy"])
def test_a_full_disk_is_the_environment(capsys, tmp_path, full_dir, target):
    source = tmp_path / "big.safetensors"
    arrayio.save(source, {"w": np.ones(1 << 17)})  # 1 MiB
    dst = full_dir / target
    code, _, err = run(capsys, "convert", source, dst)
    assert code == cli.EXIT_ENVIRONMENT
    assert err.splitlines()[-1].startswith(f"arrayio convert: {dst}: ")
    assert len(err.splitlines()) == 1
    assert list(full_dir.iterdir()) == []  # nothing half-written left


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_tune_and_bench_on_a_read_only_file_system(capsys, fresh, read_only_dir, command):
    args = [read_only_dir] if command == "tune" else ["--dir", read_only_dir]
    code, _, err = run(capsys, command, *args, "--sizes", "64K")
    assert code == cli.EXIT_ENVIRONMENT
    assert err == f"arrayio {command}: {read_only_dir}: Read-only file system\n"


@pytest.mark.parametrize(
    "error, code",
    [
        (OSError(errno.ENOSPC, "No space left on device", "/x"), 4),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "/x"), 4),
        (OSError(errno.EROFS, "Read-only file system", "/x"), 4),
        (PermissionError(errno.EACCES, "Permission denied", "/x"), 4),
        (arrayio.DiskFullError("/x: the disk is full"), 4),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"), 2),
        (OSError(errno.EIO, "Input/output error", "/x"), 1),
    ],
)
def test_exit_codes_of_environment_errors(error, code):
    assert _failures.exit_code(error) == code


def test_the_help_documents_the_environment_exit_code(capsys):
    out = run(capsys, "--help")[1]
    assert "  4    the environment failed: permission denied, a read-only file system" in out


# --------------------------------------------------------------------------- bench, tune


def test_bench_json_and_png(capsys, tmp_path, fresh):
    png = tmp_path / "bench.png"
    code, out, _ = run(
        capsys,
        "bench",
        "--dir",
        tmp_path,
        "--sizes",
        "64K,2M",
        "--repeats",
        "1",
        "--json",
        "--png",
        png,
    )
    assert code == 0
    result = json.loads(out)
    rows = result["rows"]
    assert {(r["direction"], r["cache"]) for r in rows} == {("read", "warm"), ("write", "-")}
    assert {r["nbytes"] for r in rows} == {64 << 10, 2 << 20}
    assert {r["arm"] for r in rows} >= {"dispatcher", "naive"}
    assert all((r["gbps"] or 0) > 0 or r["error"] for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]  # scratch files removed


def test_bench_table(capsys, tmp_path, fresh):
    code, out, _ = run(
        capsys,
        "bench",
        "--dir",
        tmp_path,
        "--sizes",
        "1M",
        "--repeats",
        "1",
        "--tools",
        "naive,posix",
        "--no-dispatcher",
    )
    assert code == 0
    assert "read warm, host memory (GB/s, checksums on)" in out
    assert "write, host memory" in out
    assert "naive" in out and "posix(" in out and "dispatcher" not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tools", "nope"], "no transfer tool named 'nope'"),
        (["--sizes", "0"], "sizes must be positive"),
        (["--sizes", "lots"], "cannot read 'lots' as a size"),
        (["--dir", "/nonexistent/dir"], "not a directory"),
    ],
)
def test_bench_usage_errors(capsys, args, message):
    code, _, err = run(capsys, "bench", *args)
    assert code == 2 and message in err


def test_tune_then_explain(capsys, tmp_path, fresh, ckpt):
    code, out, _ = run(capsys, "tune", tmp_path, "--sizes", "2M", "--no-cold", "--json")
    assert code == 0
    tuned = json.loads(out)
    assert {c["key"].split("/")[0] for c in tuned["contexts"]} == {"read", "write"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".arrayio-tune")]
    code, out, _ = run(capsys, "explain", "--json")
    assert code == 0
    learned = {c["key"] for c in json.loads(out)["contexts"]}
    assert {c["key"] for c in tuned["contexts"]} <= learned
    code, out, _ = run(capsys, "explain")
    assert code == 0 and out.startswith("arrayio dispatch table:")
    code, out, _ = run(capsys, "explain", ckpt, "--key", "emb")
    assert code == 0 and "arrayio dispatch table" in out
    code, _, err = run(capsys, "explain", ckpt, "--key", "nope")
    assert code == 2 and "'nope'" in err
    code, _, err = run(capsys, "explain", "--key", "emb")
    assert code == 2 and "need a FILE" in err


def test_tune_like_a_file_learns_its_save_and_load(capsys, tmp_path, fresh):
    rng = np.random.default_rng(2)
    path = tmp_path / "big.safetensors"
    mib = 1 << 20
    arrayio.save(path, {f"w{i}": rng.standard_normal(mib // 8) for i in range(4)})  # 4 x 1 MiB
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    code, out, _ = run(capsys, "tune", scratch, "--like", path, "--no-cold", "--json")
    assert code == 0
    keys = sorted(c["key"] for c in json.loads(out)["contexts"])
    assert [k.split("/")[0] for k in keys] == ["read", "write"]  # no single sizes
    assert all(k.endswith("/of2^20") for k in keys)
    path.read_bytes()  # in the page cache, as tuned (--no-cold)
    [load] = arrayio.explain(path).explanations  # what a load of that file uses: learned
    assert load.key in keys and load.phase == "exploiting"
    code, _, err = run(capsys, "tune", scratch, "--like", tmp_path / "nope.safetensors")
    assert code == 2 and "nope.safetensors" in err


def test_tune_max_calls_bounds_each_context(capsys, tmp_path, fresh):
    path = tmp_path / "big.safetensors"
    arrayio.save(path, {f"w{i}": np.ones(1 << 18, np.float32) for i in range(2)})  # 2 x 1 MiB
    code, out, _ = run(
        capsys, "tune", tmp_path, "--like", path, "--no-cold", "--max-calls", "1", "--json"
    )
    assert code == 0
    contexts = json.loads(out)["contexts"]
    assert {c["phase"] for c in contexts} == {"exploring"}  # left for real use to finish
    code, out, _ = run(capsys, "tune", tmp_path, "--like", path, "--no-cold", "--json")
    assert {c["phase"] for c in json.loads(out)["contexts"]} == {"exploiting"}
    for bad in ("0", "x"):
        code, _, err = run(capsys, "tune", tmp_path, "--max-calls", bad)
        assert code == 2 and "positive whole number" in err


def test_tune_errors(capsys, tmp_path, monkeypatch):
    code, _, err = run(capsys, "tune", tmp_path / "missing")
    assert code == 2 and "missing" in err
    code, _, err = run(capsys, "tune", tmp_path, "--device", "tpu:7")
    assert code == 2 and "tpu:7" in err


# --------------------------------------------------------------------------- clean

# A save killed outright (SIGKILL) while writing its temporary.
KILLED_SAVE = """
import os, signal, sys
from arrayio.integrity import _atomic
with _atomic.atomic_write(sys.argv[1]) as fd:
    os.write(fd, b"partial")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _temporaries(root) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if ".arrayio-tmp-" in p.name)


def test_clean_removes_dead_writers_temporaries_below_a_directory(tmp_path, capsys) -> None:
    (tmp_path / "run" / "deep").mkdir(parents=True)
    for target in (tmp_path / "a.safetensors", tmp_path / "run" / "deep" / "b.npy"):
        subprocess.run([sys.executable, "-c", KILLED_SAVE, str(target)], check=False)
    assert len(_temporaries(tmp_path)) == 2
    with _atomic.atomic_write(tmp_path / "run" / "live.safetensors") as fd:  # a live writer
        os.write(fd, b"writing")
        code, out, err = run(capsys, "clean", tmp_path, "--dry-run")
        assert code == 0 and len(out.splitlines()) == 2 and "would remove 2" in err
        assert len(_temporaries(tmp_path)) == 3
        code, out, err = run(capsys, "clean", tmp_path)
        assert code == 0 and "removed 2 temporary files" in err
        (live,) = _temporaries(tmp_path)
        assert live.startswith(".live.safetensors.arrayio-tmp-")
    assert _temporaries(tmp_path) == []


def test_clean_of_a_missing_directory_is_a_usage_error(tmp_path, capsys) -> None:
    code, _, err = run(capsys, "clean", tmp_path / "nowhere")
    assert code == 2 and "no such directory" in err


@pytest.mark.parametrize("target", ["c.npz", "c.pt"])
def test_convert_creates_files_as_any_program_would_and_keeps_an_old_files_mode(
    tmp_path, capsys, target
) -> None:
    if target.endswith(".pt"):
        pytest.importorskip("torch")
    source = tmp_path / "c.safetensors"
    arrayio.save(source, {"w": np.ones(3)})
    old_umask = os.umask(0o022)
    try:
        assert run(capsys, "convert", source, tmp_path / target)[0] == 0
        assert (tmp_path / target).stat().st_mode & 0o777 == 0o644
        (tmp_path / target).chmod(0o600)
        assert run(capsys, "convert", source, tmp_path / target, "--overwrite")[0] == 0
        assert (tmp_path / target).stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)


@pytest.mark.parametrize("writer", [np.savez, np.savez_compressed])
def test_verify_of_an_npz_says_it_has_no_checksums(tmp_path, capsys, writer) -> None:
    path = tmp_path / "a.npz"
    writer(path, w=np.arange(10))
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and ".npz members' headers and sizes valid; no checksums" in out
    assert run(capsys, "verify", path, "--strict")[0] == 1


def test_info_reads_an_npz(tmp_path, capsys) -> None:
    path = tmp_path / "a.npz"
    np.savez(path, w=np.arange(10), b=np.ones((2, 3)))
    code, out, _ = run(capsys, "info", path)
    assert code == 0 and out.startswith(f"{path}: npz, 2 arrays")


def test_info_of_a_foreign_file_claims_no_header_checksum(tmp_path, capsys) -> None:
    safetensors = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "f.safetensors"
    safetensors.save_file({"w": np.arange(3)}, str(path))
    code, out, _ = run(capsys, "info", path)
    assert code == 0 and "checksums: CRC-32C on 0 of 1 array" in out
