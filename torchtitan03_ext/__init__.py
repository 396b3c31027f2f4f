"""TapeSAC for torchtitan 0.3.x: ``tapesac`` as an activation-checkpointing choice.

    torchrun --nproc_per_node=2 -m torchtitan.train --module torchtitan03_ext \\
        --config llama3_debug_cpu activation-checkpoint:tapesac --activation-checkpoint.budget 0.9

- :class:`TapeSAC` (``activation_checkpoint.py``): the ``ActivationCheckpointing`` policy and its
  ``Config``, whose fields are torchtitan 0.2.x's ``[tapesac]`` section (one definition,
  ``torchtitan_common.settings``);
- :class:`Trainer` and :func:`with_tapesac` (``trainer.py``): torchtitan's trainer, with
  ``tapesac`` among the command line's ``activation-checkpoint:`` choices;
- ``config_registry.py``: config functions for ``--module torchtitan03_ext`` (CPU debug jobs of
  llama3 and Qwen3.5 dense and MoE, llama3 8B);
- ``cpu_shim.py``: torchtitan 0.3 on a machine without an accelerator, and ``fla_cpu.py``:
  Qwen3.5's flash-linear-attention kernels on CPU, as opaque to the dispatcher as on a GPU;
- ``torch_compat.py``: what torchtitan 0.3.0 needs from torch that 2.13 lacks.

Importing this package checks torchtitan's version (a clear error for any other than 0.3.x),
registers the offline ``tapesac_text`` dataset and, without CUDA, points torchtitan at the CPU.
For torchtitan 0.2.x, see ``torchtitan_ext``.
"""

from __future__ import annotations

from torchtitan_common import DATASET_PATH, TOKENIZER_PATH, errors
from torchtitan_common.versions import require

errors.install()
require("torchtitan03_ext")

from . import cpu_shim, torch_compat  # noqa: E402  (after the version check: these import torchtitan 0.3)
from .activation_checkpoint import TapeSAC, active  # noqa: E402
from .trainer import Trainer, with_tapesac  # noqa: E402

__all__ = ["DATASET_PATH", "TOKENIZER_PATH", "TapeSAC", "Trainer", "active", "with_tapesac"]


def _register_dataset() -> None:
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def load(path: str):
        from datasets import load_dataset

        return load_dataset("json", data_files=path, split="train")

    DATASETS.setdefault("tapesac_text", DatasetConfig(
        path=DATASET_PATH, loader=load, sample_processor=lambda sample: sample["text"]))


torch_compat.install()
cpu_shim.install()
_register_dataset()
