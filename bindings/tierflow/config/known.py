"""What tierflow knows of DeepSpeed's keys beyond those it acts on.

Two kinds, by what they would do to a run:

* keys that change nothing in what is trained (monitoring, profilers,
  collective and kernel tuning, features that act only through DeepSpeed's
  own APIs): reported by name in ``Config.not_used`` and one
  :class:`~tierflow.config.TierflowConfigWarning`, the ``*_UNUSED`` tables;
* keys whose value changes the result of training in DeepSpeed and which
  tierflow does not do: refused with a ValueError when given anything but
  the value that matches what tierflow does, the ``*_REFUSED`` tables —
  ``{key: (agrees, why)}``, ``agrees(value)`` true for the accepted values.

Keys that are neither, nor read by the reader, are unknown: refused with the
nearest known key unless ``tierflow.strict_config`` is false.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

__all__ = ["TOP_UNUSED", "ZERO_UNUSED", "FP16_UNUSED", "BF16_UNUSED", "TOP_REFUSED", "ENABLED_REFUSED",
           "ZERO_REFUSED", "FP16_REFUSED", "BF16_REFUSED", "FP32_NAMES", "enabled"]

_MONITORING = "not used by tierflow: DeepSpeed's monitoring and logging"
_PROFILING = "not used by tierflow: DeepSpeed's profilers (tierflow reports its own telemetry and traces)"
_COLLECTIVES = "not used by tierflow: a tuning of DeepSpeed's collectives"
_ZERO_PLUS = "not used by tierflow: a ZeRO++/MiCS feature of DeepSpeed"
_INTERNALS = "not used by tierflow: a switch of DeepSpeed's own engine"
_TRAINING = "not used by tierflow: a DeepSpeed feature that acts only through DeepSpeed's own API"
_PARALLELISM = "not used by tierflow: a DeepSpeed parallelism tierflow does not run (the same result, on one device)"

TOP_UNUSED: dict[str, str] = {
    **{k: _MONITORING for k in ("comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "timers",
                                "memory_breakdown", "dump_state", "log_level", "steps_per_print")},
    **{k: _PROFILING for k in ("flops_profiler", "autotuning", "eigenvalue")},
    **{k: _COLLECTIVES for k in ("seq_parallel_communication_data_type", "disable_allgather")},
    **{k: _TRAINING for k in ("activation_checkpointing", "sparse_attention", "compression_training",
                              "weight_quantization", "hybrid_engine", "compile", "graph_harvesting",
                              "vocabulary_size")},
    **{k: _PARALLELISM for k in ("pipeline", "tensor_parallel", "expert_parallel", "sequence_parallel_size",
                                 "use_data_before_expert_parallelism")},
    **{k: "not used by tierflow: DeepSpeed's checkpointing" for k in ("checkpoint", "nebula", "datastates_ckpt")},
    "zero_allow_untested_optimizer": "not used by tierflow: it runs its own optimizers",
    "zero_force_ds_cpu_optimizer": "not used by tierflow: it runs its own optimizers",
    "disable_python_gc": _INTERNALS,
}

ZERO_UNUSED: dict[str, str] = {
    **{k: _COLLECTIVES for k in ("allgather_partitions", "allgather_bucket_size", "reduce_scatter",
                                 "use_multi_rank_bucket_allreduce", "round_robin_gradients",
                                 "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
                                 "stage3_allgather_sequential", "allgather_sequential")},
    "reduce_bucket_size": "not used by tierflow: it reduces and moves each gradient on its own as it is produced, "
                          "in no bucket",
    **{k: _ZERO_PLUS for k in ("zero_hpz_partition_size", "zeropp_loco_param", "mics_shard_size",
                               "mics_hierarchical_params_gather")},
    **{k: _INTERNALS for k in ("elastic_checkpoint", "ignore_unused_parameters", "legacy_stage1",
                               "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
                               "log_trace_cache_warnings", "enable_sanity_checks", "leaf_module",
                               "stage3_module_granularity_threshold", "module_granularity_threshold",
                               "stage3_model_persistence_threshold", "model_persistence_threshold",
                               "compute_grad_norm", "parameter_alignment")},
    "save_muon_momentum_buffer_in_memory":
        "not used by tierflow: it places the Muon momentum by the tier budgets",
    "cpu_offload_use_pin_memory": "not used by tierflow: deprecated, and ignored by DeepSpeed too "
                                  "(use offload_optimizer.pin_memory / offload_param.pin_memory)",
}

FP16_UNUSED: dict[str, str] = {"auto_cast": "not used by tierflow: casting inputs is the model's business"}
BF16_UNUSED: dict[str, str] = {
    "immediate_grad_update": "not used by tierflow: its gradients go to the host as they are produced"}


def _equals(*accepted: Any) -> Callable[[Any], bool]:
    """A number equal to one of ``accepted`` (written as a number or a string)."""

    def agrees(value: Any) -> bool:
        if isinstance(value, bool):
            return False
        try:
            number = float(value)
        except (TypeError, ValueError):
            return False
        return math.isfinite(number) and number in accepted

    return agrees


def _is(*accepted: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is a or (type(value) is type(a) and value == a) for a in accepted)


def enabled(value: Any) -> bool:
    """Whether a feature's section turns it on (``{"enabled": true, ...}``)."""
    return isinstance(value, Mapping) and value.get("enabled") is True


FP32_NAMES = ("fp32", "float32", "float", "torch.float32")

TOP_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "prescale_gradients": (_is(False), "tierflow reduces each gradient in fp32 and averages it after, it never "
                                       "pre-scales it; remove the key"),
    "gradient_predivide_factor": (_equals(1.0), "tierflow divides each gradient by the world size after its fp32 "
                                                "reduction, a factor of 1; remove the key"),
    "gradient_allreduce_op": (lambda v: v == "mean", 'tierflow averages the gradients over the ranks ("mean")'),
    "communication_data_type": (lambda v: v is None or v in FP32_NAMES, "tierflow reduces the gradients in fp32"),
    "sparse_gradients": (_is(False), "tierflow reduces and steps dense gradients (build the embedding with "
                                     "sparse=False)"),
    "managed_gradient_accumulation": (_is(True), "tierflow's step() updates the parameters only at the "
                                                 "gradient_accumulation_steps boundary"),
    "dataloader_drop_last": (_is(False), "initialize()'s DataLoader keeps the last, smaller batch; give it none "
                                         "and build your own DataLoader with drop_last=True"),
}

# Sections whose feature, when enabled, changes what DeepSpeed trains.
ENABLED_REFUSED: dict[str, str] = {
    "amp": "tierflow does not run NVIDIA Apex AMP (DeepSpeed has removed it too); use bf16 or fp16",
    "torch_autocast": "tierflow does not autocast the forward; use bf16 or fp16, or autocast inside the model",
    "curriculum_learning": "tierflow does not change the batches' sequence length (DeepSpeed's curriculum learning)",
    "data_efficiency": "tierflow does not run DeepSpeed's data sampling and routing",
    "progressive_layer_drop": "tierflow does not drop layers during training",
    "elasticity": "tierflow does not choose the batch size; give train_batch_size or its parts",
    "quantize_training": "tierflow trains the weights unquantized",
}

ZERO_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "zero_quantized_weights": (_is(False), "tierflow gathers the weights unquantized"),
    "zero_quantized_nontrainable_weights": (_is(False), "tierflow keeps frozen weights in the training dtype"),
    "zero_quantized_gradients": (_is(False), "tierflow reduces the gradients unquantized, in fp32"),
    "load_from_fp32_weights": (_is(True), "tierflow restores the fp32 master weights its checkpoints hold, never "
                                          "rebuilds them from the 16-bit weights"),
}

FP16_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "fp16_master_weights_and_grads": (_is(False), "tierflow keeps fp32 master weights and gradients"),
    "consecutive_hysteresis": (_is(False), "tierflow's loss scaler refills the hysteresis only when it raises the "
                                           "scale, as false does"),
}
BF16_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bf16_master_weights_and_grads": (_is(False), "tierflow keeps fp32 master weights and gradients"),
    "bf16_optimizer_states": (_is(False), "tierflow keeps the optimizer state in fp32"),
}
