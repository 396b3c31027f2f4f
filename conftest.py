"""Both suites (tests/, tests03/) run one intra-op thread per process unless ``OMP_NUM_THREADS``
says otherwise, and inductor compiles in the test's own process.

The suites run two workers on two cores (``scripts/test.sh``), each of which may launch a
two-rank torchrun job of its own: with torch's default of one thread per core, the workers'
thread pools contend for the cores and a step of the Qwen3.5 debug model takes 6 to 8 times as
long as alone (measured 2026-12-07: 13.1 s against 1.7 s with one thread each). The models are
small enough that one thread runs them as fast as two alone. Every comparison a test makes is
between runs in one process, at one thread count. Inductor's pool of compile workers would be
more processes on the same two cores; alone, the Qwen3.5 compiled tests took 233 s compiling
in-process against 227 s with two workers (2026-12-07), so the pool buys nothing here."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
