"""Config functions for ``--module torchtitan03_ext --config <name>``.

Each returns a :class:`torchtitan03_ext.Trainer.Config`, so ``activation-checkpoint:tapesac``
(and torchtitan's own ``selective``, ``full``, ``memory-budget``, ``none``) can be chosen on the
command line, with TapeSAC's fields as ``--activation-checkpoint.<field>``.
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.validate import Validator
from torchtitan.config import TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.llama3 import config_registry as llama3

from . import TOKENIZER_PATH
from .activation_checkpoint import TapeSAC
from .trainer import Trainer, with_tapesac


QWEN3_MOE_CAPACITY = 0.24
"""Step frontier (2026-12-06, FSDP2): 175.7 MiB with everything recomputed to 264.8 MiB; limit 221.2 MiB."""
DEEPSEEK_V3_CAPACITY = 0.5
"""Step frontier (2026-12-06, FSDP2): 346.4 MiB with everything recomputed to 571.5 MiB; limit 460.8 MiB."""


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


DEBUG_VOCAB_SIZE = 2048
"""The vocabulary of the CPU debug jobs: torchtitan's llama3 debug model's, which holds every id
of the offline tokenizer (``TOKENIZER_PATH``). Qwen3.5's debug models have Qwen3.5's 248,320,
whose output layer alone takes most of a CPU step."""


def _with_vocab(model_spec, vocab_size: int):
    """``model_spec`` with a decoder whose embedding and output layer have ``vocab_size`` rows."""
    model = model_spec.model
    model = dataclasses.replace(
        model, vocab_size=vocab_size,
        tok_embeddings=dataclasses.replace(model.tok_embeddings, num_embeddings=vocab_size),
        lm_head=dataclasses.replace(model.lm_head, out_features=vocab_size))
    return dataclasses.replace(model_spec, model=model)


def _debug_cpu(model_spec, dump_folder: str, cpu_capacity_gib: float) -> Trainer.Config:
    """``llama3_debug_cpu``'s job (offline data and tokenizer, two CPU ranks, TapeSAC planned
    mode at budget 0.9) with another model, on a "device" of ``cpu_capacity_gib``: chosen so
    that the limit falls inside the model's step frontier."""
    config = llama3_debug_cpu()
    config.activation_checkpoint.cpu_capacity_gib = cpu_capacity_gib
    config.model_spec = _with_vocab(model_spec, DEBUG_VOCAB_SIZE)
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=DEBUG_VOCAB_SIZE))
    config.dump_folder = dump_folder
    return config


def qwen35_debug_cpu() -> Trainer.Config:
    """torchtitan's Qwen3.5 debug model (8 blocks of dim 256: gated-DeltaNet linear attention, full
    attention every fourth block) on CPU ranks, text only, with the offline tokenizer's
    vocabulary. Its flash-linear-attention kernels run as CPU stand-ins as opaque to TapeSAC as
    the Triton kernels are on a GPU (``torchtitan03_ext.fla_cpu``)."""
    from torchtitan.models.qwen3_5 import model_registry

    # Step frontier (2026-12-05): 81.4 MiB with everything recomputed to 157.1 MiB; limit 119.8 MiB.
    return _debug_cpu(model_registry("debugmodel"), "./outputs/qwen35_debug_cpu03", cpu_capacity_gib=0.13)


def qwen35_moe_debug_cpu() -> Trainer.Config:
    """torchtitan's Qwen3.5 MoE debug model (4 blocks, 8 routed experts of which 2 per token, and
    a gated shared expert) on CPU ranks, as :func:`qwen35_debug_cpu`, under FSDP2; add
    ``--parallelism.expert_parallel_degree 2`` for expert parallelism across the two ranks."""
    from torchtitan.models.qwen3_5 import model_registry

    # Step frontier (2026-12-05): 112.4 MiB with everything recomputed to 156.5 MiB; limit 134.6 MiB.
    return _debug_cpu(model_registry("debugmodel_moe", moe_comm_backend="standard"), "./outputs/qwen35_moe_debug_cpu03",
                      cpu_capacity_gib=0.146)


def qwen35_debug_cpu_custom_ops() -> Trainer.Config:
    """:func:`qwen35_debug_cpu` with its kernels' stand-ins as ``torch.library`` custom ops, so that
    ``--compile.enable`` traces its blocks whole: fla-core 0.6.0's own gated delta rule is
    compile-disabled, and torchtitan compiles blocks with ``fullgraph=True``
    (``torchtitan03_ext.fla_cpu``). Same functions and numbers as :func:`qwen35_debug_cpu`."""
    from . import fla_cpu

    fla_cpu.use_custom_ops()
    return qwen35_debug_cpu()


def qwen35_moe_debug_cpu_custom_ops() -> Trainer.Config:
    """:func:`qwen35_moe_debug_cpu` as :func:`qwen35_debug_cpu_custom_ops`."""
    from . import fla_cpu

    fla_cpu.use_custom_ops()
    return qwen35_moe_debug_cpu()


def qwen3_moe_debug_cpu() -> Trainer.Config:
    """torchtitan's qwen3 MoE debug model on CPU ranks, as :func:`llama3_debug_cpu` with the
    offline tokenizer's vocabulary; add ``--parallelism.expert_parallel_degree 2`` for expert
    parallelism across the two ranks."""
    return _debug_cpu(_qwen3_moe_small(), "./outputs/qwen3_moe_debug_cpu03", cpu_capacity_gib=QWEN3_MOE_CAPACITY)


def _qwen3_moe_small():
    """torchtitan's qwen3 ``debugmodel_moe`` (8 blocks, 64 experts of which 8 per token: about 20 s
    a step on two CPU ranks) cut to the 0.2.x debug flavor ``debugmodel_moe_small``'s size: 4
    blocks, 8 experts of which 2 per token, built by torchtitan's own builder of its layers."""
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers, model_registry

    spec = model_registry("debugmodel_moe", moe_comm_backend="standard")
    attention = spec.model.layers[0].attention
    layers = _build_qwen3_moe_layers(
        n_layers=4, dim=spec.model.dim, n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim, moe_hidden_dim=256, num_experts=8, top_k=2, attn_backend="flex",
        moe_comm_backend="standard", rope=attention.rope)
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, layers=layers))


def deepseek_v3_debug_cpu() -> Trainer.Config:
    """torchtitan's DeepSeek-V3 debug model (multi-head latent attention, MoE blocks after a dense
    first block) on CPU ranks, as :func:`llama3_debug_cpu` with the offline tokenizer's
    vocabulary."""
    from torchtitan.models.deepseek_v3 import model_registry

    return _debug_cpu(model_registry("debugmodel"), "./outputs/deepseek_v3_debug_cpu03",
                      cpu_capacity_gib=DEEPSEEK_V3_CAPACITY)


PROBE_TOKENS = 576
"""Tokens per step of the layer probes (``qwen35_*_layers_cpu``): 9 chunks of the DeltaNet kernel's
64, and no multiple of it is a width of Qwen3.5-397B-A17B, so a tensor dimension that is a
multiple of it counts tokens (``tools/paper_shape.py`` scales those)."""


def _local_experts(moe, n: int):
    """``moe`` (an MoE config) with ``n`` experts: what one expert-parallel rank holds."""
    routed = moe.routed_experts
    return dataclasses.replace(
        moe, num_experts=n,
        routed_experts=dataclasses.replace(
            routed, inner_experts=dataclasses.replace(routed.inner_experts, num_experts=n),
            token_dispatcher=dataclasses.replace(routed.token_dispatcher, num_experts=n)),
        router=dataclasses.replace(moe.router, num_experts=n,
                                   gate=dataclasses.replace(moe.router.gate, out_features=n)))


def _layers_probe(flavor: str, dump_folder: str) -> Trainer.Config:
    """Two blocks of Qwen3.5 ``flavor`` (a gated-DeltaNet block and a full-attention block, both
    MoE, at the flavor's widths) with as many local experts as it routes each token to, on one
    CPU rank: one sequence of :data:`PROBE_TOKENS` tokens a step. For ``tools/paper_shape.py``,
    which plans the flavor's whole layer pattern from these blocks' measured costs."""
    from torchtitan.models.qwen3_5 import model_registry

    spec = model_registry(flavor, moe_comm_backend="standard")
    kinds = [spec.model.layers[0], spec.model.layers[3]]  # every fourth block has full attention
    assert kinds[0].delta_net is not None and kinds[1].attention is not None
    top_k = kinds[0].moe.router.top_k
    layers = [dataclasses.replace(layer, moe=_local_experts(layer.moe, top_k)) for layer in kinds]
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, layers=layers))
    config = _debug_cpu(spec, dump_folder, cpu_capacity_gib=1024.0)
    config.training = TrainingConfig(local_batch_size=1, seq_len=PROBE_TOKENS, steps=4,
                                     mixed_precision_param="float32", disable_cuda_graphs=True)
    return config


def qwen35_397b_layers_cpu() -> Trainer.Config:
    """Qwen3.5-397B-A17B's two block kinds at its widths (dim 4096, 32 query heads of 256, DeltaNet
    16 key and 64 value heads of 128, experts of 1024), 10 local experts, 576 tokens a step: about
    0.5 B parameters on one CPU rank."""
    return _layers_probe("397B-A17B", "./outputs/qwen35_397b_layers_cpu03")


def qwen35_debug_layers_cpu() -> Trainer.Config:
    """As :func:`qwen35_397b_layers_cpu` at the MoE debug model's widths (dim 256): seconds a step."""
    return _layers_probe("debugmodel_moe", "./outputs/qwen35_debug_layers_cpu03")


def llama3_8b() -> Trainer.Config:
    """torchtitan's llama3 8B job (8192 tokens per rank, C4) with TapeSAC at 90% of GPU memory
    instead of selective AC. Needs the model's HF assets (``hf_assets_path``) and GPUs."""
    config = with_tapesac(llama3.llama3_8b())
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"  # see torch_compat
    config.activation_checkpoint = TapeSAC.Config(budget=0.9)
    return config


def _paper_job(flavor: str, hf_assets_path: str, tensor_parallel: int, expert_parallel: int = 1) -> Trainer.Config:
    """One of the paper's Qwen3.5 models as torchtitan 0.3 ships its job (``qwen3_5``'s config
    registry: 4 x 4096 tokens per rank, AdamW at 5e-4, 20 warm-up steps, FSDP2 with the TP and
    EP degrees given), trained on text (C4, as ``llama3_8b``; torchtitan's own job reads the
    image-text ``cc12m``) with TapeSAC at 90% of GPU memory instead of full activation
    checkpointing. Needs GPUs and the model's HF assets (tokenizer, weights) at ``hf_assets_path``."""
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.qwen3_5 import model_registry

    model_spec = (model_registry(flavor, moe_comm_backend="standard") if expert_parallel > 1
                  else model_registry(flavor))
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=hf_assets_path,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        optimizer=default_adamw(lr=5e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=20),
        training=TrainingConfig(local_batch_size=4, seq_len=4096, steps=1000, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, tensor_parallel_degree=tensor_parallel,
                                      expert_parallel_degree=expert_parallel,
                                      spmd_backend="partial_dtensor"),  # see torch_compat
        activation_checkpoint=TapeSAC.Config(budget=0.9),
    )


def qwen35_27b() -> Trainer.Config:
    """Qwen3.5 27B (dense), FSDP2 x TP 4, as torchtitan's ``qwen35_27b``."""
    return _paper_job("27B", "./assets/hf/Qwen3.5-27B", tensor_parallel=4)


def qwen35_35b_a3b() -> Trainer.Config:
    """Qwen3.5 35B-A3B (MoE), FSDP2 x TP 2 x EP 8, as torchtitan's ``qwen35_35b_a3b``."""
    return _paper_job("35B-A3B", "./assets/hf/Qwen3.5-35B-A3B", tensor_parallel=2, expert_parallel=8)


def qwen35_397b_a17b() -> Trainer.Config:
    """Qwen3.5 397B-A17B (MoE), FSDP2 x TP 8 x EP 16, as torchtitan's ``qwen35_397b_a17b``."""
    return _paper_job("397B-A17B", "./assets/hf/Qwen3.5-397B-A17B", tensor_parallel=8, expert_parallel=16)
