"""The package itself: the extension, its stubs, info() beside the CLI, and the
translation of tierflow's C++ errors into Python's."""

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import tierflow

REPO = pathlib.Path(__file__).resolve().parents[2]


def tierflow_cli():
    """The CLI of the build beside this checkout (TIERFLOW_CLI overrides)."""
    for candidate in (os.environ.get("TIERFLOW_CLI"), REPO / "build" / "bin" / "tierflow",
                      shutil.which("tierflow")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.skip("no tierflow CLI built (build/bin/tierflow or TIERFLOW_CLI) to compare info() with")


def test_the_stubs_and_the_typed_marker_ship_with_the_package():
    package = pathlib.Path(tierflow.__file__).parent
    stub = (package / "_core.pyi").read_text()
    assert "def adam_step(" in stub and "class Store" in stub and "def info(" in stub
    assert "def muon_step(" in stub and "class MuonWorkspace" in stub and "def group_parameters(" in stub
    assert "def zenflow_config(" in stub and "def aio_config(" in stub and "def parse_size(" in stub
    assert "class OffloadedAdam" in stub and "def stream_without_update(" in stub
    assert (package / "py.typed").exists()


def without_live_figures(facts):
    """info()'s facts minus those that change from one probe to the next."""
    facts = json.loads(json.dumps(facts))
    facts["memory"].pop("available_bytes")
    facts.get("path", {}).pop("free_bytes", None)
    return facts


def test_info_is_the_dict_of_the_clis_info_json(tmp_path):
    cli = tierflow_cli()
    printed = subprocess.run([cli, "info", "--json", "--path", str(tmp_path)], check=True,
                             capture_output=True, text=True).stdout
    assert without_live_figures(tierflow.info(tmp_path)) == without_live_figures(json.loads(printed))


def test_info_probes_this_machine(tmp_path):
    facts = tierflow.info(tmp_path)
    assert facts["version"] == tierflow.__version__
    assert facts["cpus"] >= 1 and facts["memory"]["total_bytes"] > 0
    assert facts["simd"] in tierflow.simd_targets() or facts["simd"]
    assert facts["path"]["path"] == str(tmp_path) and facts["path"]["total_bytes"] > 0
    assert isinstance(facts["io_uring"]["available"], bool)


def test_a_bad_argument_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="home"):
        tierflow.Store(host_budget=1 << 20).create_block("w", 4096, home="disk")


def test_the_config_readers_are_the_cpp_parsers_and_name_the_bad_key():
    from tierflow import _core

    read = _core.zenflow_config({"topk_ratio": 0.2, "select_strategy": "step", "select_interval": 8,
                                 "update_interval": 4})
    assert read["topk_ratio"] == 0.2 and read["select_interval"] == 8 and read["update_interval"] == 4
    assert read["schedule"]["select_interval"] == 8 and read["importance_norm"] == "l1"
    with pytest.raises(ValueError, match=r"zenflow.topk: unknown key"):
        _core.zenflow_config({"topk": 0.2})
    aio = _core.aio_config({"block_size": 65536, "thread_count": 3, "queue_depth": 16})
    assert (aio["block_size"], aio["threads"], aio["queue_depth"]) == (65536, 3, 16)
    with pytest.raises(ValueError, match=r"aio.block_size: 1000 is not a multiple of 4096"):
        _core.aio_config({"block_size": 1000})
    assert _core.parse_size("8G", "tierflow.host_memory") == 8 << 30
    with pytest.raises(ValueError, match=r"tierflow.host_memory: '8X'"):
        _core.parse_size("8X", "tierflow.host_memory")


def test_a_path_info_cannot_probe_is_an_os_error_naming_it(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(tierflow.TierflowError) as raised:
        tierflow.info(missing)
    assert raised.value.errno == errno.ENOENT and raised.value.filename == str(missing)
    assert str(raised.value) == f"directory {missing}: No such file or directory"
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(tierflow.TierflowError) as raised:
        tierflow.info(plain)
    assert raised.value.errno == errno.ENOTDIR and "not a directory" in str(raised.value)


def test_a_budget_overrun_is_a_memory_error_naming_the_tier_and_budget():
    store = tierflow.Store(host_budget=1 << 20)
    with pytest.raises(tierflow.BudgetError) as raised:
        store.create_block("big", 2 << 20)
    e = raised.value
    assert isinstance(e, MemoryError) and isinstance(e, OSError)
    assert e.errno == errno.ENOMEM and e.tier == "host" and e.block == "big"
    assert e.budget == 1 << 20 and e.request == 2 << 20
    assert "host" in str(e)
    assert store.block_count == 0  # nothing half-made
    store.create_block("fits", 4096)
    (host,) = store.telemetry()["tiers"]
    assert host["kind"] == "host" and host["budget_bytes"] == 1 << 20 and host["used_bytes"] == 4096


@pytest.fixture
def full_disk(small_tmpfs):
    """A 1 MiB tmpfs: any real preallocation there fails with ENOSPC."""
    return small_tmpfs("1M")


def test_an_environment_failure_is_an_os_error_with_errno_filename_and_context(full_disk):
    store = tierflow.Store(host_budget=1 << 20, nvme_dir=str(full_disk), nvme_budget=64 << 20)
    kept = store.create_block("small", 4096)  # a host block made before the failure
    with pytest.raises(tierflow.TierflowError) as raised:
        store.create_block("state", 8 << 20, home="nvme")
    e = raised.value
    assert isinstance(e, OSError) and not isinstance(e, MemoryError)
    assert e.errno == errno.ENOSPC
    assert e.filename is not None and e.filename.startswith(str(full_disk))
    assert e.operation.startswith("preallocate") and e.length is not None
    assert ".cpp:" in e.where
    assert str(full_disk) in str(e)
    assert store.block_count == 1 and kept == 0
    del store, raised  # closes the store's files before the tmpfs is unmounted


def test_the_package_without_its_extension_says_how_to_build_it(tmp_path):
    source = REPO / "bindings"  # the pure-Python files alone, as in a checkout
    done = subprocess.run([sys.executable, "-c", "import tierflow"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(source)},
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "pip install --no-build-isolation ." in done.stderr
