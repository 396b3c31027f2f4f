"""``python -m torchtitan_ext.train``: torchtitan's trainer with TapeSAC's config section.

Same arguments as ``python -m torchtitan.train``; adds ``--job.custom_config_module
torchtitan_ext.config`` when neither the command line nor the TOML names one.
"""

from __future__ import annotations

import sys

import torchtitan_ext  # noqa: F401  (before torchtitan.train: CPU shim, converter, dataset)


def main(argv: list[str] | None = None) -> None:
    from torchtitan.train import Trainer, main as torchtitan_main

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module") for a in args):
        args += ["--job.custom_config_module", "torchtitan_ext.config"]
    sys.argv = [sys.argv[0], *args]
    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()
