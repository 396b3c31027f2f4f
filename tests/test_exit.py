"""A TapeSAC error met inside torchtitan's trainer ends the rank with status 2, whatever the
trainer left running (the trainer is never closed on this path)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading
    import torch.distributed as dist
    from tapesac.errors import PlanError
    from torchtitan_common.errors import TapeSACExit, exit_with, raising

    # what a trainer leaves behind: a live process group and a thread that never ends
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    threading.Thread(target=threading.Event().wait, daemon=False).start()
    atexit.register(print, "atexit handler ran", flush=True)
    try:
        with raising():
            exit_with(PlanError("first"))
    except TapeSACExit as e:
        print("caught", e.code, e.error, flush=True)
    exit_with(PlanError("limit 1 MiB is infeasible"))
    print("not reached", flush=True)
""")


def test_error_ends_the_process_with_status_2(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    # inside raising(): raised, with the error; outside: the process ends at once, after the
    # atexit handlers (loggers, metric writers) ran
    assert out.stdout.splitlines() == ["caught 2 first", "atexit handler ran"], out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("[tapesac] error:")]
    assert errors == ["[tapesac] error: TapeSAC: first",
                      "[tapesac] error: TapeSAC: limit 1 MiB is infeasible"], out.stderr
    assert "Traceback" not in out.stderr
