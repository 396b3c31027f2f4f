"""TapeSAC for torchtitan 0.2.x: the ``tapesac`` model converter, the ``[tapesac]`` config
section (``torchtitan_ext.config``), an offline dataset and tokenizer, and a CPU shim. For
torchtitan 0.3.x, see ``torchtitan03_ext``; what both share is ``torchtitan_common``.

Importing this package checks torchtitan's version (a clear error for any other than 0.2.x),
registers the converter and the ``tapesac_text`` dataset, and, on a machine without CUDA, points
torchtitan at the CPU.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_PATH = str(ASSETS / "tokenizer")
DATASET_PATH = str(ASSETS / "text" / "corpus.jsonl")


def _register_dataset() -> None:
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def load(path: str):
        from datasets import load_dataset

        return load_dataset("json", data_files=path, split="train")

    DATASETS.setdefault("tapesac_text", DatasetConfig(
        path=DATASET_PATH, loader=load, sample_processor=lambda sample: sample["text"]))


def _register_flavors() -> None:
    """qwen3 ``debugmodel_untied``: the debug flavor without tied embeddings (torchtitan 0.2.2's
    FSDP2 wrapping rejects the tied debugmodel on more than one rank); ``debugmodel_moe_small``."""
    import dataclasses

    from torchtitan.models.qwen3 import qwen3_args

    if "debugmodel_untied" not in qwen3_args:
        qwen3_args["debugmodel_untied"] = dataclasses.replace(qwen3_args["debugmodel"], enable_weight_tying=False)
    if "debugmodel_moe_small" not in qwen3_args:
        # The MoE debug model with 8 experts (top 2) in 4 layers instead of 64 (top 8) in 8: an
        # expert-parallel CPU step in seconds instead of half a minute, for tests and CPU jobs.
        moe = qwen3_args["debugmodel_moe"]
        qwen3_args["debugmodel_moe_small"] = dataclasses.replace(
            moe, n_layers=4, moe_inter_dim=256,
            moe_args=dataclasses.replace(moe.moe_args, num_experts=8, top_k=2))


def _setup() -> None:
    from torchtitan_common import errors
    from torchtitan_common.versions import require

    errors.install()
    require("torchtitan_ext")
    from . import converter, cpu_shim

    cpu_shim.install()
    converter.register()
    _register_dataset()
    _register_flavors()


_setup()
