"""What several test modules share."""

import subprocess

import pytest


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(size)``: a fresh tmpfs of ``size`` (tmpfs's syntax: "1M",
    "16k") under tmp_path, for a disk that fills up; unmounted after the test
    (lazily if still busy). Skips where this process may not mount one."""
    mounted = []

    def mount(size):
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True)  # never leave it mounted
