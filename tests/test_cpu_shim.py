"""The CPU shim's exit guard: a torchtitan job that destroyed its gloo groups ends with status 0
before the interpreter's teardown; every other exit keeps its normal path and status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import atexit, os, sys
atexit.register(lambda: print("handler registered before the shim ran", flush=True))
import torch, torch.distributed as dist
import torchtitan_ext  # installs the shim on CPU
atexit.register(lambda: print("handler registered after the shim ran", flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
source = "def main():\\n    dist.destroy_process_group()\\n" + {extra!r}
namespace = {{"dist": dist}}
exec(compile(source, sys.argv[1], "exec"), namespace)
namespace["main"]()
{after}
"""


def _run(tmp_path: Path, caller_file: str, extra: str = "", after: str = "") -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(extra=extra, after=after))
    caller = tmp_path / caller_file
    caller.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(script), str(caller), str(port)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the shim is for machines without CUDA")
def test_finished_torchtitan_job_skips_interpreter_teardown(tmp_path):
    out = _run(tmp_path, "torchtitan/train.py")
    assert out.returncode == 0, out.stderr
    assert "handler registered after the shim ran" in out.stdout
    assert "handler registered before the shim ran" not in out.stdout  # the guard ended the process


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the shim is for machines without CUDA")
def test_other_callers_and_failures_keep_their_exit(tmp_path):
    other = _run(tmp_path, "mytool/train.py")  # destroy_process_group from code that is not torchtitan's main
    assert other.returncode == 0, other.stderr
    assert "handler registered before the shim ran" in other.stdout

    failed = _run(tmp_path, "torchtitan/train.py", after="raise RuntimeError('after teardown')")
    assert failed.returncode == 1
    assert "after teardown" in failed.stderr
    assert "handler registered before the shim ran" in failed.stdout

