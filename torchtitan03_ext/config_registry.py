"""Config functions for ``--module torchtitan03_ext --config <name>``.

Each returns a :class:`torchtitan03_ext.Trainer.Config`, so ``activation-checkpoint:tapesac``
(and torchtitan's own ``selective``, ``full``, ``memory-budget``, ``none``) can be chosen on the
command line, with TapeSAC's fields as ``--activation-checkpoint.<field>``.
"""

from __future__ import annotations

from torchtitan.components.validate import Validator
from torchtitan.config import TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.llama3 import config_registry as llama3

from . import TOKENIZER_PATH
from .activation_checkpoint import TapeSAC
from .trainer import Trainer, with_tapesac


def llama3_debug_cpu() -> Trainer.Config:
    """torchtitan's llama3 debug model (6 blocks, dim 256) on CPU ranks (FSDP2 over gloo), TapeSAC
    planned mode, offline data; 8 steps of 2 x 256 tokens per rank.

    A CPU has no device memory: this job pretends its "device" holds 0.1 GiB, so that budget 0.9
    falls between the smallest step peak (everything recomputed) and the largest (everything
    kept), and the plan makes real choices.
    """
    config = with_tapesac(llama3.llama3_debugmodel())
    config.dump_folder = "./outputs/llama3_debug_cpu03"
    config.hf_assets_path = TOKENIZER_PATH
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="tapesac_text")
    config.training = TrainingConfig(local_batch_size=2, seq_len=256, steps=8, mixed_precision_param="float32",
                                     disable_cuda_graphs=True)
    config.validator = Validator.Config(enable=False)
    config.parallelism.spmd_backend = "partial_dtensor"  # see torch_compat
    config.debug = DebugConfig(seed=0)
    config.activation_checkpoint = TapeSAC.Config(budget=0.9, cpu_capacity_gib=0.1, warmup_steps=1)
    return config


def llama3_8b() -> Trainer.Config:
    """torchtitan's llama3 8B job (8192 tokens per rank, C4) with TapeSAC at 90% of GPU memory
    instead of selective AC. Needs the model's HF assets (``hf_assets_path``) and GPUs."""
    config = with_tapesac(llama3.llama3_8b())
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"  # see torch_compat
    config.activation_checkpoint = TapeSAC.Config(budget=0.9)
    return config
