"""titan_ledger's config functions (``--module titan_ledger --config NAME``).

Design decision: derive from torchtitan's llama3 registry rather than restating
models and optimizers. Each function takes torchtitan's config and re-homes it in
``LedgerTrainer.Config`` (same fields plus ``ledger``), then changes only what
titan_ledger needs: the bundled corpus/tokenizer for the debug configs, and the
CPU-rehearsal defaults (fp32, no activation checkpointing, no validator).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from titan_ledger.rehearsal import backend

backend.ensure_installed()

from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.components.quantization import Float8LinearConverter  # noqa: E402
from torchtitan.config import CompileConfig, TrainingConfig  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.llama3 import config_registry as llama3  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan_ledger.components.prevention.optimizer import LedgerOptimizers  # noqa: E402
from titan_ledger.components.signals.doc_loss import ChunkedDocLoss, DocLossCrossEntropy, as_ledger_loss  # noqa: E402
from titan_ledger.data.loader import LedgerDataLoader  # noqa: E402
from titan_ledger.data.text import BUNDLED_CORPUS, BUNDLED_DATASET  # noqa: E402
from titan_ledger.trainer import LedgerTrainer  # noqa: E402

ASSETS = Path(__file__).resolve().parent / "assets"
CORPUS_DIR = BUNDLED_CORPUS
TOKENIZER_DIR = ASSETS / "tokenizer"


def _ledger_optimizer(opt) -> LedgerOptimizers.Config:
    """torchtitan's ``OptimizersContainer.Config`` as ``LedgerOptimizers.Config`` (the same
    fields, plus the weight-decay presets)."""
    if isinstance(opt, LedgerOptimizers.Config):
        return opt
    return LedgerOptimizers.Config(**{f.name: getattr(opt, f.name) for f in dataclasses.fields(type(opt)) if f.init})


def _as_ledger_config(base: Trainer.Config) -> LedgerTrainer.Config:
    """Re-home a torchtitan ``Trainer.Config`` in ``LedgerTrainer.Config`` (its optimizer
    config in ``LedgerOptimizers.Config``)."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    fields["optimizer"] = _ledger_optimizer(fields["optimizer"])
    fields["loss"] = as_ledger_loss(fields["loss"])  # the same loss, plus --loss.z_loss_weight
    return LedgerTrainer.Config(**fields)


def _use_bundled_data(config: LedgerTrainer.Config) -> None:
    # the corpus is registered in torchtitan's DATASETS under its own name (data/text.py),
    # so neither loader needs a dataset_path
    config.hf_assets_path = str(TOKENIZER_DIR)
    config.dataloader = LedgerDataLoader.Config(dataset=BUNDLED_DATASET)
    # no held-out split is bundled: validation (when enabled) reads the same corpus
    config.validator.dataloader.dataset = BUNDLED_DATASET
    config.validator.dataloader.dataset_path = None


def debug_cpu() -> LedgerTrainer.Config:
    """llama3 debug model (6 layers, dim 256, vocab 2048) on the bundled corpus.

    Sized for the CPU rehearsal backend: fp32 everywhere (signals compare exactly
    with an unsharded model), seq_len 256, 4 rows per DP rank, no activation
    checkpointing, no validation, checkpoints only when enabled.
    """
    config = _as_ledger_config(llama3.llama3_debugmodel())
    _use_bundled_data(config)
    config.dump_folder = "./outputs/debug_cpu"
    config.training.seq_len = 256
    config.training.local_batch_size = 4
    config.training.steps = 20
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    config.parallelism.pipeline_parallel_microbatch_size = 2
    config.activation_checkpoint = None  # the `activation-checkpoint:none` choice
    config.validator.enable = False
    config.checkpoint.enable = False
    config.checkpoint.interval = 10
    config.metrics.log_freq = 1
    config.debug.seed = 0
    return config


def _tiny_model(dim: int = 64, n_layers: int = 2, n_heads: int = 4, embedding_std: float | None = None,
                vocab: int = 2048):
    """A llama3 model small enough for 10^4-step runs on a CPU core (issue 36).

    Copied from torchtitan.models.llama3._debugmodel (0.3.0); CHANGED: dim 256 -> 64,
    6 layers -> 2, 16 heads -> 4 (head_dim 16, as the debug model's), ffn 256 (multiple_of
    64). Vocabulary 2048 (the bundled tokenizer's), the same inits (embedding std 1.0,
    depth-scaled output projections), the same RoPE."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
        model_registry,
    )

    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(  # CHANGED: embedding_std (issue 36: Takase et al.'s 0.02)
            num_embeddings=vocab, embedding_dim=dim,
            param_init=_EMBEDDING_INIT if embedding_std is None else {
                "weight": functools.partial(torch.nn.init.normal_, std=embedding_std)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),  # CHANGED: 256 -> 64
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    spec = model_registry("debugmodel")  # the llama3 spec (parallelize, pipelining, adapter)
    return dataclasses.replace(spec, flavor="tiny", model=config)


def tiny_cpu() -> LedgerTrainer.Config:
    """A 2-layer llama3 (dim 64, 4 heads, vocab 2048: about 0.36 M parameters) on the
    bundled corpus, seq_len 128, 8 rows per DP rank: tens of milliseconds a step on one
    CPU core, so the real instabilities (issue 36: logit growth, output drift, Adam's
    state, warm-up, precision) can be trained for 10^4 steps here. The full ledger is on;
    one process (``--parallelism.data_parallel_shard_degree 1``) or DP 2 (the TOML's)."""
    config = debug_cpu()
    config.model_spec = _tiny_model()
    config.loss = ChunkedDocLoss.Config(
        loss_fn=DocLossCrossEntropy.Config(global_vocab_size=decoder_vocab_size(config.model_spec)))
    config.dump_folder = "./outputs/tiny_cpu"
    config.training.seq_len = 128
    config.training.local_batch_size = 8
    config.training.steps = 2000
    config.checkpoint.interval = 500
    return config


def tiny_cpu_small_embedding() -> LedgerTrainer.Config:
    """``tiny_cpu`` with the token embedding initialised at std 0.02 and not scaled (the
    GPT-2/Megatron default; torchtitan's llama3 uses std 1.0): the embedding cause of
    Takase et al., "Spike No More" (issue 36)."""
    config = tiny_cpu()
    config.model_spec = _tiny_model(embedding_std=0.02)
    config.dump_folder = "./outputs/tiny_cpu_small_embedding"
    return config


def wortsman_small() -> LedgerTrainer.Config:
    """The GPU scenario set's model (issue 61, ``bench/device/scenarios.py``): a 4-layer
    llama3, dim 256, 4 heads (about 3.1 M non-embedding parameters: Wortsman et al.
    2023's small proxies), a 32,768-token output layer over the bundled tokenizer's
    2,048 tokens (the rest are never a label: their logits are what drifts in an
    output-logit divergence), seq_len 256, 32 rows a step."""
    config = tiny_cpu()
    config.model_spec = _tiny_model(dim=256, n_layers=4, n_heads=4, vocab=32768)
    config.loss = ChunkedDocLoss.Config(
        loss_fn=DocLossCrossEntropy.Config(global_vocab_size=decoder_vocab_size(config.model_spec)))
    config.dump_folder = "./outputs/wortsman_small"
    config.training.seq_len = 256
    config.training.local_batch_size = 32
    return config


def llama3_debugmodel() -> LedgerTrainer.Config:
    """torchtitan's llama3 debug model, bundled corpus/tokenizer, GPU defaults."""
    config = _as_ledger_config(llama3.llama3_debugmodel())
    _use_bundled_data(config)
    return config


def llama3_8b() -> LedgerTrainer.Config:
    """torchtitan's Llama 3.1 8B recipe (FSDP, C4) under LedgerTrainer."""
    return _as_ledger_config(llama3.llama3_8b())


def llama3_70b() -> LedgerTrainer.Config:
    """torchtitan's Llama 3.1 70B recipe (FSDP + TP 8) under LedgerTrainer."""
    return _as_ledger_config(llama3.llama3_70b())


def llama3_405b() -> LedgerTrainer.Config:
    """torchtitan's Llama 3.1 405B recipe (FSDP + TP 8, float8 linears, compile).

    On the CPU backend (dry runs) float8 is emulated: torchao's real float8 kernels
    need SM89+, and torchtitan's converter refuses to build without them.
    """
    if backend.installed() != "cpu":
        return _as_ledger_config(llama3.llama3_405b())
    # Copied from torchtitan.models.llama3.config_registry.llama3_405b.
    compile_config = CompileConfig(enable=False)  # CHANGED from torchtitan: no compile on CPU
    model_spec = llama3.model_registry(
        "405B",
        converters=[
            Float8LinearConverter.Config(
                filter_fqns=["lm_head"],
                model_compile_enabled=False,
                emulate=True,  # CHANGED from torchtitan: CPU has no float8 kernels
            ),
        ],
    )
    config = _as_ledger_config(llama3.llama3_70b())  # CHANGED: same recipe fields as 405B below
    config.model_spec = model_spec
    config.loss = ChunkedDocLoss.Config(  # CHANGED: our chunked loss (--loss.z_loss_weight), same CE
        loss_fn=DocLossCrossEntropy.Config(global_vocab_size=decoder_vocab_size(model_spec))
    )
    config.hf_assets_path = "./assets/hf/Llama-3.1-405B"
    config.optimizer = _ledger_optimizer(default_adamw(lr=8e-5))
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=600)
    config.training = TrainingConfig(local_batch_size=2, seq_len=8192, steps=3000)
    config.compile = compile_config
    return config


def llama3_1b_bench() -> LedgerTrainer.Config:
    """One-GPU benchmark of the GPU validation pack (``bench/device/run.sh``).

    torchtitan's Llama 3.2 1B flavor (dim 2048, 16 layers, 32 heads, 8 kv heads, ffn
    8192, vocab 128256, tied embeddings; FlexAttention with the per-document causal
    mask) on the bundled corpus and tokenizer (its ids are < 2048, a subset of the
    vocabulary; nothing is downloaded), seq_len 4096 x 2 rows, bf16 through FSDP2's
    mixed-precision policy (torchtitan applies it also at shard degree 1), no
    activation checkpointing, no validation, no checkpoints, no profiler or
    TensorBoard. ``--compile.enable`` toggles torch.compile.
    """
    model_spec = llama3.model_registry("1B")
    config = _as_ledger_config(llama3.llama3_8b())  # the recipe's optimizer/schedule shapes
    config.model_spec = model_spec
    config.loss = ChunkedDocLoss.Config(
        loss_fn=DocLossCrossEntropy.Config(global_vocab_size=decoder_vocab_size(model_spec))
    )
    _use_bundled_data(config)
    config.dump_folder = "./outputs/llama3_1b_bench"
    config.optimizer = _ledger_optimizer(default_adamw(lr=3e-4))
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=10)
    config.training = TrainingConfig(local_batch_size=2, seq_len=4096, steps=40,
                                     mixed_precision_param="bfloat16")
    config.compile = CompileConfig(enable=False)
    config.activation_checkpoint = None  # the `activation-checkpoint:none` choice
    config.profiler.enable_profiling = False
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = 10
    config.validator.enable = False
    config.checkpoint.enable = False
    config.debug.seed = 0
    return config
