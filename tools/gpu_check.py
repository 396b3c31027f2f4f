"""The GPU check: correctness on CUDA and a short benchmark, in one result file (< 8 minutes).

1. ``tests/test_devices.py`` on CUDA: bit-identical gradients for torchtitan llama3 and qwen3 MoE
   blocks, dropout (CUDA generator state), in-place ops, with and without bf16 autocast; a planned
   step whose peak, read from the caching allocator, stays under its limit and matches the
   prediction within 5%.
   With ``--python03`` (a Python with torchtitan 0.3 and fla-core): ``tests03/test_qwen35_blocks.py``
   on CUDA, Qwen3.5's blocks with fla's real Triton kernels recorded as launches.
2. ``tools/bench.py --device cuda --fsdp --bf16`` on torchtitan llama3 and qwen3 at realistic
   widths (dim 2048, 8 layers, 2 x 4096 tokens), FSDP2 on one GPU with bf16 mixed precision: no
   AC, torchtitan full AC and op SAC, TapeSAC replay-only and planned limits.

    python tools/gpu_check.py --result gpu_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], timeout: int) -> tuple[int, str, float]:
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return p.returncode, p.stdout + p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(timed out after {timeout} s)", time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", default="gpu_check.json")
    ap.add_argument("--test-timeout", type=int, default=200)
    ap.add_argument("--bench-timeout", type=int, default=240)
    ap.add_argument("--python03", default=None,
                    help="a Python with torchtitan 0.3 and fla-core: also run the Qwen3.5 CUDA tests")
    a = ap.parse_args()

    import torch

    result: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        result["error"] = "no CUDA device"
        Path(a.result).write_text(json.dumps(result, indent=1))
        sys.exit(2)
    result["gpu"] = torch.cuda.get_device_name()
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))

    junit = tmp / "tests.xml"
    rc, out, secs = run([sys.executable, "-m", "pytest", "-q", "tests/test_devices.py", "-k", "cuda",
                         f"--junitxml={junit}"], a.test_timeout)
    tests = {"returncode": rc, "seconds": round(secs, 1), "tail": out[-4000:]}
    if junit.exists():
        root = ET.parse(junit).getroot()
        suite = root.find("testsuite")
        suite = root if suite is None else suite
        tests.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        tests["failed"] = [c.get("name") for c in suite.iter("testcase")
                           if c.find("failure") is not None or c.find("error") is not None]
    result["tests"] = tests
    if a.python03:
        rc, out, secs = run([a.python03, "-m", "pytest", "-q", "tests03/test_qwen35_blocks.py", "-k", "cuda"],
                            a.test_timeout)
        result["tests03"] = {"returncode": rc, "seconds": round(secs, 1), "tail": out[-4000:]}

    bench_json = tmp / "bench.json"
    rc, out, secs = run([sys.executable, "tools/bench.py", "--device", "cuda", "--fsdp", "--bf16",
                         "--models", "llama3,qwen3", "--rounds", "5", "--compile-budgets", "",
                         "--json", str(bench_json)], a.bench_timeout)
    result["bench"] = {"returncode": rc, "seconds": round(secs, 1), "tail": out[-6000:],
                       "records": json.loads(bench_json.read_text()) if bench_json.exists() else []}
    Path(a.result).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.result}: tests rc={tests['returncode']} bench rc={rc}")


if __name__ == "__main__":
    main()
