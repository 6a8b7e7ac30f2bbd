"""tierflow.config.from_deepspeed(): DeepSpeed configs as their users write them,
read into tierflow's typed config with DeepSpeed's defaults and rules; "auto"
resolved from a model and an optimizer as Hugging Face's Trainer does; every
key not acted on named; bad values refused naming the key; the schedulers'
learning rates against DeepSpeed's formulas."""

import copy
import json
import math
import pickle
import types
import warnings

import pytest
import torch

import tierflow
import tierflow.zero.init
from tierflow import _core
from tierflow.config import (AUTO, AdamConfig, Config, MuonConfig, TierflowConfigWarning, UnusedKey,
                             from_deepspeed)
from tierflow.torch.optim import Adam, AdamW, Muon

PAGE = 4096


def read(config, unused=(), **kwargs):
    """from_deepspeed() that fails the test on any warning but the one naming
    exactly the keys ``unused`` as not acted on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = from_deepspeed(config, **kwargs)
    assert {u.key for u in c.not_used} == set(unused), c.not_used
    assert len(caught) == (1 if unused else 0) and all(w.category is TierflowConfigWarning for w in caught)
    return c


# ---- real-looking configs ------------------------------------------------------------------

ZERO2_CPU = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 500, "total_num_steps": 10000}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 5e8,
    },
}


# What tierflow's stage 2 leaves alone in ZERO2_CPU: one process moves no
# gradients, and it prints no DeepSpeed log.
ZERO2_UNUSED = {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                "zero_optimization.reduce_bucket_size", "steps_per_print"}


def test_zero2_with_cpu_offload_reads_every_value_and_deepspeeds_defaults():
    c = read(ZERO2_CPU, unused=ZERO2_UNUSED)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (64, 8, 8)
    assert c.source("gradient_accumulation_steps").startswith("derived:")
    assert c.gradient_clipping == 1.0
    assert c.optimizer == AdamConfig(type="AdamW", lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert c.optimizer.decoupled_weight_decay
    z = c.zero
    assert z.stage == 2 and z.offload_optimizer.device == "cpu" and z.zenflow is None
    assert c.precision == "bf16" and c.fp16.enabled is False and c.bf16.check_grad_overflow is True
    # No aio section: the store keeps tierflow's own I/O engine defaults.
    assert c.aio is None
    assert c.unresolved == ()
    assert c.scheduler.type == "WarmupDecayLR" and c.scheduler.total_num_steps == 10000
    reasons = {u.key: u.reason for u in c.not_used}
    assert reasons["zero_optimization.overlap_comm"].startswith("not used at stage 2: one process")
    assert "in no bucket" in reasons["zero_optimization.reduce_bucket_size"]


ZERO3_NVME = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 16,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 12,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "Adam", "params": {"lr": "1e-4", "betas": [0.9, 0.999], "eps": "1e-8",
                                             "weight_decay": 0.0, "adam_w_mode": False}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "pin_memory": True, "buffer_count": 5, "buffer_size": 1e8,
                          "max_in_cpu": 1e9},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": False,
            "overlap_events": True},
    "tierflow": {"host_memory": "64G", "device_memory": 8 << 30, "nvme_dir": "/scratch/tierflow", "threads": 8},
}


def test_zero3_with_nvme_offload_of_both_and_an_aio_section():
    c = from_deepspeed(ZERO3_NVME, strict=True)  # fast_init false: DeepSpeed's default, nothing to report
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (16, 16)
    assert c.source("train_batch_size") == (
        "derived: DeepSpeed's train_batch_size = micro × accumulation × world size (1 × 16 × 1)")
    o, p = c.zero.offload_optimizer, c.zero.offload_param
    assert (o.device, o.nvme_path, o.buffer_count) == ("nvme", "/local_nvme", 4)
    # No nvme_path for the parameters: the tierflow section's NVMe directory.
    assert (p.device, p.nvme_path) == ("nvme", "/scratch/tierflow")
    assert c.source("zero_optimization.offload_param.nvme_path") == "tierflow.nvme_dir"
    assert (p.buffer_count, p.buffer_size, p.max_in_cpu) == (5, 100_000_000, 1_000_000_000)
    z = c.zero
    assert (z.sub_group_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        1_000_000_000, 50_000_000, 100_000)
    assert z.stage3_max_live_parameters == z.stage3_max_reuse_distance == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is True
    # "Adam" with adam_w_mode false is Adam with L2 decay, as in DeepSpeed; "1e-4" strings are numbers.
    assert c.optimizer.type == "Adam" and not c.optimizer.decoupled_weight_decay
    assert c.optimizer.lr == 1e-4 and c.optimizer.eps == 1e-8
    f = c.fp16
    assert c.precision == "fp16" and f.dynamic and f.initial_scale == 2.0 ** 12
    assert (f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (1000, 2, 1)
    # thread_count, DeepSpeed's older name for intra_op_parallelism.
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.intra_op_parallelism) == (262144, 32, 2)
    t = c.tierflow
    assert (t.host_memory, t.device_memory, t.nvme_dir, t.threads) == (64 << 30, 8 << 30, "/scratch/tierflow", 8)


ZENFLOW = {
    "train_batch_size": 8,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "zenflow": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 300,
                    "update_interval": 4, "full_warm_up_rounds": 10, "overlap_step": True},
    },
    "optimizer": {"type": "adamw", "params": {"lr": 1e-5}},
}


def test_zero_with_zenflow_is_read_by_the_engines_parser_with_its_schedule():
    c = read(ZENFLOW)
    z = c.zero.zenflow
    assert (z.topk_ratio, z.select_strategy, z.select_interval, z.update_interval) == (0.05, "step", 300, 4)
    assert z.overlap_step and z.full_warm_up_rounds == 10
    assert (z.auto_ratio, z.pt_reserved_cores_perc, z.importance_norm) == (0.99, 0.5, "l1")  # C++ defaults
    assert (z.warm_up_steps, z.select_every) == (10, 300) and z.select_every_source == "select_interval steps"
    assert c.source("zero_optimization.zenflow.auto_ratio") == "default"
    assert c.optimizer.type == "AdamW"  # "adamw": DeepSpeed takes its optimizers' names in any case
    # "auto" intervals are ZenFlow's own automatic mode, not placeholders; the
    # epoch strategy without steps_per_epoch refreshes on the C++ fallback.
    auto = copy.deepcopy(ZENFLOW)
    auto["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1, "select_strategy": "auto",
                                            "select_interval": "auto", "update_interval": "auto"}
    z = read(auto).zero.zenflow
    assert (z.select_interval, z.update_interval, z.select_every) == ("auto", "auto", 100)
    assert "steps_per_epoch unknown" in z.select_every_source


@pytest.mark.parametrize("zenflow,message", [
    ({"topk": 0.1}, "zero_optimization.zenflow.topk: unknown key"),
    ({"topk_ratio": 1.5}, "zero_optimization.zenflow.topk_ratio: 1.5 is outside (0, 1]"),
    ({"select_strategy": "often"}, 'zero_optimization.zenflow.select_strategy: "often" is not'),
    ({"select_strategy": "step", "select_interval": 2, "update_interval": 4},
     "zero_optimization.zenflow.select_interval: 2 is less than update_interval 4"),
    ({"offload": True}, "zero_optimization.zenflow.offload: true is not supported"),
])
def test_a_bad_zenflow_key_or_value_is_refused_by_the_cpp_parser_naming_it(zenflow, message):
    config = copy.deepcopy(ZENFLOW)
    config["zero_optimization"]["zenflow"] = zenflow
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        from_deepspeed(config)


def test_zenflow_needs_the_optimizer_offloaded():
    config = copy.deepcopy(ZENFLOW)
    config["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    with pytest.raises(ValueError, match=r"zero_optimization.zenflow: needs "
                                         r'zero_optimization.offload_optimizer.device "cpu" or "nvme"'):
        from_deepspeed(config)
    # Without the section the state is in host memory, where tierflow keeps it: ZenFlow runs.
    del config["zero_optimization"]["offload_optimizer"]
    c = read(config)
    assert c.zero.offload_optimizer.device == "cpu" and c.zero.zenflow is not None


def test_aio_spellings_and_the_engines_checks():
    base = {"train_batch_size": 1}
    assert read({**base, "aio": {"intra_op_parallelism": 4}}).aio.intra_op_parallelism == 4
    both = read({**base, "aio": {"intra_op_parallelism": 4, "thread_count": 4.0}})
    assert both.aio.intra_op_parallelism == 4
    single = read({**base, "aio": {"single_submit": True, "block_size": "2.097152e6"}})
    assert single.aio.single_submit and single.aio.block_size == 2097152
    with pytest.raises(ValueError, match=r"aio.thread_count 2 and aio.intra_op_parallelism 4 disagree"):
        from_deepspeed({**base, "aio": {"intra_op_parallelism": 4, "thread_count": 2}})
    with pytest.raises(ValueError, match=r"aio.block_size: 1000 is not a multiple of 4096"):
        from_deepspeed({**base, "aio": {"block_size": 1000}})
    with pytest.raises(ValueError, match=r"aio.queue_depth: 0 is not in 1..4096"):
        from_deepspeed({**base, "aio": {"queue_depth": 0}})
    with pytest.raises(ValueError, match=r"aio.overlap_events: false .* is not supported"):
        from_deepspeed({**base, "aio": {"overlap_events": False}})
    with pytest.warns(TierflowConfigWarning, match=r"aio.use_gds \(not used by tierflow: .*GPUDirect"):
        from_deepspeed({**base, "aio": {"use_gds": True}})


# ---- "auto": Hugging Face Trainer style -------------------------------------------------------------

HF_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

class TinyLM(torch.nn.Module):
    """A small decoder-shaped model: hidden 48, MLP 192, vocabulary 100."""

    def __init__(self, hidden=48):
        super().__init__()
        self.embed = torch.nn.Embedding(100, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"q": torch.nn.Linear(hidden, hidden), "k": torch.nn.Linear(hidden, hidden),
                                 "v": torch.nn.Linear(hidden, hidden), "o": torch.nn.Linear(hidden, hidden),
                                 "up": torch.nn.Linear(hidden, 4 * hidden),
                                 "down": torch.nn.Linear(4 * hidden, hidden), "norm": torch.nn.LayerNorm(hidden)})
            for _ in range(2))
        self.lm_head = torch.nn.Linear(hidden, 100, bias=False)


def hf_style_optimizer(model, lr=2e-4, weight_decay=0.05):
    """Two param groups as HF's Trainer makes them: decay for the matrices, none for biases and norms."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.85, 0.98), eps=1e-7)


# What tierflow leaves alone in HF_AUTO, Hugging Face's ZeRO-3 template.
HF_UNUSED = {"zero_optimization.reduce_bucket_size", "steps_per_print"}


def test_auto_values_are_resolved_from_a_torch_model_and_optimizer_as_hfs_trainer_does():
    model = TinyLM(hidden=48)
    c = read(HF_AUTO, HF_UNUSED, model=model, optimizer=hf_style_optimizer(model))
    h = 48
    assert c.model.hidden_size == h and c.model.parameters == sum(p.numel() for p in model.parameters())
    assert "most common among its" in c.model.hidden_size_source
    z = c.zero
    assert z.stage3_prefetch_bucket_size == int(0.9 * h * h) == 2073
    assert z.stage3_param_persistence_threshold == 10 * h
    assert c.source("zero_optimization.stage3_prefetch_bucket_size") == (
        "auto: 0.9·h² rounded down, the model's hidden size 48")
    o = c.optimizer
    assert (o.lr, o.betas, o.eps) == (2e-4, (0.85, 0.98), 1e-7)
    # The groups disagree on weight_decay: the decay group holds most of the parameters.
    assert o.weight_decay == 0.05 and "param group 0, its largest" in c.source("optimizer.params.weight_decay")
    assert c.scheduler.warmup_min_lr == 0.0 and c.scheduler.warmup_max_lr == 2e-4
    assert c.scheduler.warmup_num_steps is AUTO
    assert set(c.unresolved) == {"train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps", "gradient_clipping",
                                 "scheduler.params.warmup_num_steps", "fp16.enabled", "bf16.enabled"}
    assert c.fp16.enabled is AUTO and c.precision is AUTO
    text = str(c)
    for line in ("zero_optimization.stage3_prefetch_bucket_size", "2073", "480", "optimizer.params.lr", "0.0002", "[0.85, 0.98]", "1e-07",
                 "auto: the optimizer's lr", "auto (unresolved)", "hidden size 48"):
        assert line in text, line
    assert "unresolved: train_batch_size, train_micro_batch_size_per_gpu" in text


def test_the_hidden_size_of_an_hf_model_is_its_configs():
    model = TinyLM(hidden=48)
    model.config = types.SimpleNamespace(hidden_size=64)
    c = read(HF_AUTO, HF_UNUSED, model=model)
    assert c.model.hidden_size_source == "model.config.hidden_size"
    assert (c.zero.stage3_prefetch_bucket_size, c.zero.stage3_param_persistence_threshold) == (3686, 640)
    model.config = types.SimpleNamespace(hidden_sizes=[32, 96, 64])
    assert read(HF_AUTO, HF_UNUSED, model=model).zero.stage3_param_persistence_threshold == 10 * 96


def test_auto_without_a_model_or_optimizer_is_reported_unresolved():
    c = read(HF_AUTO, HF_UNUSED)
    for key in ("optimizer.params.lr", "optimizer.params.betas", "zero_optimization.stage3_prefetch_bucket_size",
                "scheduler.params.warmup_max_lr"):
        assert key in c.unresolved, key
    assert c.optimizer.lr is AUTO and c.zero.stage3_prefetch_bucket_size is AUTO
    assert c.scheduler.warmup_min_lr == 0.0  # HF's Trainer fills it with 0 regardless
    with pytest.raises(ValueError, match=r'optimizer.params.lr: "auto" is unresolved'):
        c.optimizer.build([torch.nn.Parameter(torch.zeros(2))])
    assert "auto (unresolved)" in str(c) and c.to_dict()["optimizer"]["params"]["lr"] == "auto"


def test_the_warmup_max_lr_auto_takes_the_configs_lr_without_an_optimizer():
    c = read({"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 5e-4}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    assert c.scheduler.warmup_max_lr == 5e-4
    assert c.source("scheduler.params.warmup_max_lr") == "auto: optimizer.params.lr"


def test_a_config_value_that_disagrees_with_the_optimizer_given_is_refused():
    model = TinyLM()
    config = copy.deepcopy(HF_AUTO)
    config["optimizer"]["params"]["lr"] = 1e-3
    with pytest.raises(ValueError, match=r"optimizer.params.lr is 0.001 in the config but 0.0002 in the optimizer"):
        from_deepspeed(config, model=model, optimizer=hf_style_optimizer(model))


# ---- what is not acted on is named -------------------------------------------------------------

NOISY = {
    "train_batch_size": 8,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pipline_read": True},
                          "allgather_bucket_size": 5e8, "stage3_max_live_parameters": 1e9, "foo": 1},
    "comms_logger": {"enabled": True},
    "tensorboard": {"enabled": True, "output_path": "logs/"},
    "flops_profiler": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "momentum": 0.9}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
    "train_batch": 8,
}

# Keys tierflow does not know (refused, or with strict_config false reported)...
NOISY_UNKNOWN = [
    UnusedKey("optimizer.params.momentum", "unknown key for AdamW"),
    UnusedKey("scheduler.params.total_num_steps", "not a WarmupLR parameter"),
    UnusedKey("zero_optimization.offload_optimizer.pipline_read", "unknown key"),
    UnusedKey("zero_optimization.foo", "unknown key"),
    UnusedKey("train_batch", "unknown key"),
]
# ... and DeepSpeed's that it leaves alone (always reported).
NOISY_KNOWN = [
    UnusedKey("zero_optimization.stage3_max_live_parameters", "not used at stage 2 (a ZeRO-3 setting)"),
    UnusedKey("zero_optimization.allgather_bucket_size",
              "not used by tierflow: a tuning of DeepSpeed's collectives"),
    UnusedKey("comms_logger", "not used by tierflow: DeepSpeed's monitoring and logging"),
    UnusedKey("tensorboard", "not used by tierflow: DeepSpeed's monitoring and logging"),
    UnusedKey("flops_profiler",
              "not used by tierflow: DeepSpeed's profilers (tierflow reports its own telemetry and traces)"),
]
NOISY_KEYS = NOISY_UNKNOWN + NOISY_KNOWN


def test_unknown_and_misspelt_keys_are_refused_with_the_nearest_known_key():
    with pytest.raises(ValueError) as raised:
        from_deepspeed(NOISY)
    message = str(raised.value)
    for text in ("zero_optimization.offload_optimizer.pipline_read: unknown key; did you mean 'pipeline_read'?",
                 "train_batch: unknown key; did you mean 'train_batch_size'?",
                 "zero_optimization.foo: unknown key;", "optimizer.params.momentum: unknown key for AdamW",
                 "scheduler.params.total_num_steps: not a WarmupLR parameter",
                 "(tierflow.strict_config: false reports these as a warning instead)"):
        assert text in message, text
    # The one in the issue, in each section the nearest key of that section.
    with pytest.raises(ValueError, match=r"^zero_optimization.offload_optimizer.devcie: unknown key; did you mean "
                                         r"'device'\?"):
        from_deepspeed({"train_batch_size": 1, "zero_optimization": {"stage": 2,
                                                                      "offload_optimizer": {"devcie": "cpu"}}})
    with pytest.raises(ValueError, match=r"zero_optimization.zenflow.topk: unknown key; did you mean 'topk_ratio'"):
        from_deepspeed({**ZENFLOW, "zero_optimization": {**ZENFLOW["zero_optimization"], "zenflow": {"topk": 0.1}}})
    with pytest.raises(ValueError, match=r"fp16.loss_scal: unknown key; did you mean 'loss_scale'"):
        from_deepspeed({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scal": 0}})
    with pytest.raises(ValueError, match=r"aio.queue_dept: unknown key; did you mean 'queue_depth'"):
        from_deepspeed({"train_batch_size": 1, "aio": {"queue_dept": 8}})
    with pytest.raises(ValueError, match=r"gradient_clip: unknown key; did you mean 'gradient_clipping'"):
        from_deepspeed({"train_batch_size": 1, "gradient_clip": 1.0})
    # tierflow's own section refuses a typo whatever strict_config says.
    with pytest.raises(ValueError, match=r"tierflow.strict_cofig: unknown key; did you mean 'strict_config'"):
        from_deepspeed({"train_batch_size": 1, "tierflow": {"strict_cofig": False}})


def test_gather_chunk_is_whole_pages_or_zero_and_reaches_the_plan():
    stage3 = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    assert from_deepspeed(stage3).tierflow.gather_chunk == 16 << 20
    assert from_deepspeed({**stage3, "tierflow": {"gather_chunk": "8M"}}).tierflow.gather_chunk == 8 << 20
    assert from_deepspeed({**stage3, "tierflow": {"gather_chunk": 0}}).tierflow.gather_chunk == 0
    with pytest.raises(ValueError, match=r"^tierflow.gather_chunk: 5000 bytes is not a whole number of 4 KiB pages"):
        from_deepspeed({**stage3, "tierflow": {"gather_chunk": 5000}})
    with pytest.raises(ValueError, match=r"^tierflow.gather_chunk: "):
        from_deepspeed({**stage3, "tierflow": {"gather_chunk": -4096}})
    from tierflow.zero.plan import make_plan
    model = torch.nn.Linear(4, 4)
    config = from_deepspeed({**stage3, "tierflow": {"gather_chunk": 1 << 20}})
    assert make_plan(model, config).gather_chunk_bytes == 1 << 20


def test_strict_config_false_reports_them_in_one_warning_as_before():
    config = {**NOISY, "tierflow": {"strict_config": False}}
    with pytest.warns(TierflowConfigWarning) as caught:
        c = from_deepspeed(config)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"{len(NOISY_KEYS)} key(s) of the DeepSpeed config not acted on: ")
    assert sorted(c.not_used) == sorted(NOISY_KEYS)
    for item in NOISY_KEYS:
        assert str(item) in message
    assert caught[0].filename == __file__  # points at the caller
    text = str(c)
    assert f"not acted on ({len(NOISY_KEYS)}):" in text and "zero_optimization.foo (unknown key)" in text
    # The keys still read are read: nothing else is dropped.
    assert c.optimizer.lr == 1e-4 and c.zero.offload_optimizer.device == "cpu" and not c.tierflow.strict_config
    assert c.to_dict()["tierflow"] == {"strict_config": False}


def test_strict_raises_one_value_error_listing_them():
    with pytest.raises(ValueError) as raised:
        from_deepspeed({**NOISY, "tierflow": {"strict_config": False}}, strict=True)
    for item in NOISY_KEYS:
        assert str(item) in str(raised.value)
    # DeepSpeed's keys left alone are reported, not refused, with strict_config on too.
    with pytest.raises(ValueError, match=r"1 key\(s\) .*comms_logger \(not used by tierflow"):
        from_deepspeed({"train_batch_size": 1, "comms_logger": {"enabled": True}}, strict=True)


def test_deepspeeds_keys_that_match_what_tierflow_does_are_not_reported():
    config = {"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pipeline_read": True, "pipeline_write": True,
                                          "ratio": 1.0, "super_offload": False},
        "offload_param": {"device": "cpu", "nvme_path": None}},
        "optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": True, "bias_correction": True}},
        "aio": {"use_gds": False, "overlap_events": True}}
    assert read(config).not_used == ()
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    config["zero_optimization"]["offload_optimizer"]["pipeline_read"] = False
    with pytest.warns(TierflowConfigWarning) as caught:
        c = from_deepspeed(config)
    assert {u.key for u in c.not_used} == {"zero_optimization.offload_optimizer.ratio",
                                           "zero_optimization.offload_optimizer.pipeline_read"}
    assert "tier budgets" in str(caught[0].message)


def test_offload_and_zenflow_outside_their_stages_are_reported():
    config = {"train_batch_size": 2, "zero_optimization": {
        "stage": 0, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}
    with pytest.warns(TierflowConfigWarning) as caught:
        c = from_deepspeed(config)
    assert set(c.not_used) == {
        UnusedKey("zero_optimization.offload_optimizer", "not used at stage 0 (ZeRO is off)"),
        UnusedKey("zero_optimization.offload_param", "not used at stage 0 (parameter offload is ZeRO-3's)")}
    assert len(caught) == 1 and c.zero.offload_optimizer.device == "none"


# ---- bad values ---------------------------------------------------------------------------------

def with_(path, value, base=None):
    """A copy of `base` (ZERO3_NVME) with the dotted `path` set to `value`."""
    config = copy.deepcopy(ZERO3_NVME if base is None else base)
    node = config
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return config


BAD = [
    # wrong type
    (with_("zero_optimization.stage", "two"), 'zero_optimization.stage: "two" is not a number'),
    (with_("zero_optimization.overlap_comm", "yes"), 'zero_optimization.overlap_comm: "yes" is not true or false'),
    (with_("optimizer.params.lr", True), "optimizer.params.lr: true is not a number"),
    (with_("optimizer.params.betas", 0.9), "optimizer.params.betas: 0.9 is not a pair of numbers"),
    (with_("zero_optimization.offload_param.buffer_count", 2.5),
     "zero_optimization.offload_param.buffer_count: 2.5 is not a whole number"),
    (with_("zero_optimization.offload_optimizer", "cpu"),
     'zero_optimization.offload_optimizer: "cpu" is not an object'),
    (with_("fp16.loss_scale", "NaN"), 'fp16.loss_scale: "NaN" is not a finite number'),
    (with_("tierflow.host_memory", "8X"), "tierflow.host_memory: '8X' has an unknown suffix"),
    # out of range
    (with_("zero_optimization.stage", 4), r"zero_optimization.stage: 4 is not a ZeRO stage \(0, 1, 2 or 3\)"),
    (with_("zero_optimization.stage", 2.5), r"zero_optimization.stage: 2.5 is not a ZeRO stage"),
    (with_("optimizer.params.lr", -1e-3), r"optimizer.params.lr: -0.001 is outside \[0, inf\]"),
    (with_("optimizer.params.betas", [0.9, 1.0]), r"optimizer.params.betas\[1\]: 1.0 is outside \[0, 1\)"),
    (with_("gradient_clipping", -1), r"gradient_clipping: -1 is outside \[0, inf\]"),
    (with_("fp16.loss_scale_window", 0), "fp16.loss_scale_window: 0 is not a whole number ≥ 1"),
    (with_("fp16.hysteresis", 0), "fp16.hysteresis: 0 is not a whole number ≥ 1"),
    (with_("zero_optimization.sub_group_size", 0), "zero_optimization.sub_group_size: 0 is not a whole number ≥ 1"),
    (with_("tierflow.threads", 0), "tierflow.threads: 0 is not a whole number ≥ 1"),
    # unknown choices
    (with_("zero_optimization.offload_param.device", "gpu"),
     'zero_optimization.offload_param.device: "gpu" is not "none", "cpu" or "nvme"'),
    (with_("optimizer.type", "Lamb"), 'optimizer.type: "Lamb" is not an optimizer tierflow runs'),
    (with_("scheduler", {"type": "OneCycle", "params": {}}), 'scheduler.type: "OneCycle" is not a schedule'),
    (with_("scheduler", {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
     'scheduler.params.warmup_type: "cosine" is not "log" or "linear"'),
    # combinations
    (with_("bf16", {"enabled": True}), "fp16.enabled and bf16.enabled: both true"),
    (with_("train_batch_size", 24), r"train_batch_size: 24 is not .* = 1 × 16 × 1"),
    (with_("zero_optimization.offload_optimizer.nvme_path", None, with_("tierflow.nvme_dir", None)),
     'zero_optimization.offload_optimizer.nvme_path: missing; device "nvme" needs a directory'),
    (with_("zero_optimization.prefetch_bucket_size", 1),
     "zero_optimization.stage3_prefetch_bucket_size and zero_optimization.prefetch_bucket_size: both given"),
    (with_("scheduler", {"type": "WarmupCosineLR", "params": {}}), "scheduler.params.total_num_steps: missing"),
    (with_("optimizer.params.max_grad_norm", 1.0),
     "optimizer.params.max_grad_norm: .* use the top-level gradient_clipping"),
    (with_("optimizer.params.bias_correction", False), "optimizer.params.bias_correction: false is not supported"),
    (with_("aio.block_size", "auto"), 'aio.block_size: "auto" is not resolved for this key'),
    (with_("tierflow.budget", 1), r"tierflow.budget: unknown key; the keys are device_memory, host_memory, nvme_dir, "
                                  r"threads, trace, overlap_step, strict_config"),
    ({"optimizer": {"type": "Adam"}}, "train_batch_size, train_micro_batch_size_per_gpu: neither is given"),
]


@pytest.mark.parametrize("config,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_bad_value_is_a_value_error_naming_the_key_and_the_value(config, message):
    with pytest.raises(ValueError, match=message):
        from_deepspeed(config)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model= expects a torch.nn.Module"):
        from_deepspeed(ZERO2_CPU, model=object())
    with pytest.raises(TypeError, match="optimizer= expects a torch.optim.Optimizer"):
        from_deepspeed(ZERO2_CPU, optimizer=object())
    with pytest.raises(TypeError, match="expected a path to a JSON file or a dict"):
        from_deepspeed(42)
    with pytest.raises(ValueError, match="world_size: 0"):
        from_deepspeed(ZERO2_CPU, world_size=0)


# ---- every key acts or is refused by name -----------------------------------------------------------

BASE = {"train_batch_size": 1}
STAGE3 = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}

# A value that changes what DeepSpeed trains and that tierflow does not do:
# refused whatever tierflow.strict_config says, naming the key and why.
CHANGES_THE_RESULT = [
    ({**BASE, "prescale_gradients": True}, "prescale_gradients: true is not supported: .*never pre-scales"),
    ({**BASE, "gradient_predivide_factor": 2}, "gradient_predivide_factor: 2 is not supported: .*a factor of 1"),
    ({**BASE, "gradient_allreduce_op": "sum"}, 'gradient_allreduce_op: "sum" is not supported: .*"mean"'),
    ({**BASE, "communication_data_type": "fp16"}, 'communication_data_type: "fp16" is not supported: .*in fp32'),
    ({**BASE, "sparse_gradients": True}, "sparse_gradients: true is not supported: .*dense gradients"),
    ({**BASE, "managed_gradient_accumulation": False}, "managed_gradient_accumulation: false is not supported"),
    ({**BASE, "dataloader_drop_last": True}, "dataloader_drop_last: true is not supported: .*drop_last=True"),
    ({**BASE, "amp": {"enabled": True}}, "amp.enabled: true is not supported: .*Apex AMP"),
    ({**BASE, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast.enabled: true is not"),
    ({**BASE, "curriculum_learning": {"enabled": True}}, "curriculum_learning.enabled: true is not supported"),
    ({**BASE, "data_efficiency": {"enabled": True}}, "data_efficiency.enabled: true is not supported"),
    ({**BASE, "progressive_layer_drop": {"enabled": True}}, "progressive_layer_drop.enabled: true is not supported"),
    ({**BASE, "elasticity": {"enabled": True}}, "elasticity.enabled: true is not supported"),
    ({**BASE, "data_types": {"grad_accum_dtype": "bf16"}},
     'data_types.grad_accum_dtype: "bf16" is not supported: .*in fp32'),
    ({**BASE, "data_types": {"param_dtype": "fp16"}}, 'data_types.param_dtype: "fp16" is not supported'),
    ({**BASE, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads: true is not supported: .*fp32 master weights"),
    ({**BASE, "fp16": {"enabled": True, "consecutive_hysteresis": True}},
     "fp16.consecutive_hysteresis: true is not supported: .*refills the hysteresis only when it raises"),
    ({**BASE, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     "bf16.bf16_master_weights_and_grads: true is not supported"),
    ({**BASE, "bf16": {"enabled": True, "bf16_optimizer_states": True}},
     "bf16.bf16_optimizer_states: true is not supported: .*in fp32"),
    (with_("zero_optimization.zero_quantized_weights", True, STAGE3),
     "zero_optimization.zero_quantized_weights: true is not supported"),
    (with_("zero_optimization.zero_quantized_gradients", True, STAGE3),
     "zero_optimization.zero_quantized_gradients: true is not supported"),
    (with_("zero_optimization.load_from_fp32_weights", False, STAGE3),
     "zero_optimization.load_from_fp32_weights: false is not supported"),
    (with_("optimizer.params.fp32_optimizer_states", False, STAGE3),
     "optimizer.params.fp32_optimizer_states: false is not supported: .*in fp32"),
    ({**BASE, "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 100}}},
     "scheduler.params.last_batch_iteration: 100 is not supported: .*load_checkpoint"),
]


@pytest.mark.parametrize("config,message", CHANGES_THE_RESULT, ids=[m.split(":")[0] for _, m in CHANGES_THE_RESULT])
def test_a_value_that_changes_what_deepspeed_trains_is_refused_naming_why(config, message):
    with pytest.raises(ValueError, match=message):
        from_deepspeed(config)
    with pytest.raises(ValueError, match=message):  # not an unknown key: the escape hatch keeps it refused
        from_deepspeed({**config, "tierflow": {"strict_config": False}})


def test_those_keys_at_deepspeeds_defaults_are_read_quietly():
    read({**STAGE3, "prescale_gradients": False, "gradient_predivide_factor": "1.0", "gradient_allreduce_op": "mean",
          "communication_data_type": None, "sparse_gradients": False, "managed_gradient_accumulation": True,
          "dataloader_drop_last": False, "amp": {"enabled": False}, "torch_autocast": {"enabled": False},
          "curriculum_learning": {"enabled": False}, "data_efficiency": {"enabled": False},
          "elasticity": {"enabled": False}, "data_types": {"grad_accum_dtype": "fp32", "param_dtype": None},
          "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "consecutive_hysteresis": False},
          "bf16": {"bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
          "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1}},
          "zero_optimization": {**STAGE3["zero_optimization"], "zero_quantized_weights": False,
                                "load_from_fp32_weights": True, "overlap_comm": True, "contiguous_gradients": True},
          "wall_clock_breakdown": False})


SAME_RESULT_OTHER_WAY = [
    (with_("zero_optimization.overlap_comm", False, STAGE3), "zero_optimization.overlap_comm",
     "reduces and moves each gradient during the backward"),
    (with_("zero_optimization.contiguous_gradients", False, STAGE3), "zero_optimization.contiguous_gradients",
     "copies each gradient into a contiguous host block"),
    (with_("zero_optimization.offload_param.pin_memory", False, STAGE3), "zero_optimization.offload_param.pin_memory",
     r"pins \(page-locks\) the host memory"),
    (with_("zero_optimization.offload_optimizer.pin_memory", False, STAGE3),
     "zero_optimization.offload_optimizer.pin_memory", r"pins \(page-locks\)"),
]


@pytest.mark.parametrize("config,key,what", SAME_RESULT_OTHER_WAY, ids=[k for _, k, _ in SAME_RESULT_OTHER_WAY])
def test_a_setting_tierflow_does_otherwise_is_refused_unless_strict_config_is_false(config, key, what):
    with pytest.raises(ValueError, match=f"^{key}: false is not what tierflow does: .*{what}.*strict_config: false"):
        from_deepspeed(config)
    with pytest.warns(TierflowConfigWarning, match=f"{key} \\(not used by tierflow: .*{what}"):
        c = from_deepspeed({**config, "tierflow": {"strict_config": False}})
    assert [u.key for u in c.not_used] == [key]


def test_the_gradient_keys_at_stages_below_3_and_reduce_bucket_size_are_reported_not_used():
    config = {**BASE, "zero_optimization": {"stage": 1, "overlap_comm": False, "contiguous_gradients": False,
                                            "reduce_bucket_size": "auto", "sub_group_size": 1e8}}
    c = read(config, {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                      "zero_optimization.reduce_bucket_size", "zero_optimization.sub_group_size"})
    reasons = {u.key: u.reason for u in c.not_used}
    assert reasons["zero_optimization.sub_group_size"] == "not used at stage 1 (a ZeRO-3 setting)"
    assert not any(hasattr(c.zero, name) for name in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size"))
    # The logs and timers DeepSpeed prints.
    c = read({**BASE, "steps_per_print": 10, "wall_clock_breakdown": True}, {"steps_per_print", "wall_clock_breakdown"})
    assert "monitoring" in c.not_used[0].reason or "monitoring" in c.not_used[1].reason


def test_offload_none_means_the_accelerator_and_is_refused_where_tierflow_offloads():
    for stage, key in ((1, "offload_optimizer"), (2, "offload_optimizer"), (3, "offload_optimizer"),
                       (3, "offload_param")):
        config = with_(f"zero_optimization.{key}", {"device": "none"}, with_("zero_optimization.stage", stage, STAGE3))
        if stage < 3:
            del config["zero_optimization"]["offload_param"]
        with pytest.raises(ValueError, match=f'^zero_optimization.{key}.device: "none" .* is not supported: '
                                             r'.*give "cpu" or "nvme"'):
            from_deepspeed(config)
    # Without the section, tierflow's own place, said where it came from.
    c = read({**BASE, "zero_optimization": {"stage": 3}})
    assert c.zero.offload_optimizer.device == c.zero.offload_param.device == "cpu"
    assert 'DeepSpeed\'s default, "none", keeps it on the accelerator' in c.source(
        "zero_optimization.offload_param.device")
    assert c.to_dict()["zero_optimization"]["offload_param"] == {"device": "cpu"}
    # At stage 0 nothing is offloaded and "none" says so.
    assert read({**BASE, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}}}
                ).zero.offload_optimizer.device == "none"
    # Refused before anything changes: the model is as it was.
    model = TinyLM(16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="offload_param.device"):
        tierflow.initialize(model=model, config=with_("zero_optimization.offload_param.device", "none", STAGE3))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_nvme_buffers_and_the_tierflow_budgets_are_named_where_nothing_reads_them():
    c = read(with_("zero_optimization.offload_param", {"device": "cpu", "buffer_count": 2, "buffer_size": 1e6},
                   STAGE3), {"zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size"})
    assert all(u.reason == 'not used: device is "cpu"' for u in c.not_used)
    c = read({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "tierflow": {"device_memory": "1G", "host_memory": "2G", "threads": 2, "nvme_dir": "/x"}},
             {"tierflow.device_memory", "tierflow.host_memory", "tierflow.nvme_dir"})
    assert c.tierflow.threads == 2  # the optimizer's threads, at any stage


def test_stage3_gather_16bit_weights_on_model_save_is_exposed_for_what_reads_it():
    for value in (True, False):
        c = read(with_("zero_optimization.stage3_gather_16bit_weights_on_model_save", value, STAGE3))
        assert c.zero.stage3_gather_16bit_weights_on_model_save is value
        assert c.to_dict()["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is value


def test_bf16_skips_an_overflowing_step_by_deepspeeds_default():
    assert read({**BASE, "bf16": {"enabled": True}}).bf16.check_grad_overflow is True
    c = read({**BASE, "bfloat16": {"enabled": True, "check_grad_overflow": False}})
    assert c.bf16.check_grad_overflow is False and "older name" in c.source("bf16.check_grad_overflow")


# ---- aio: the store's I/O engine ------------------------------------------------------------------

def nvme_config(nvme, **extra):
    config = with_("zero_optimization.offload_param", {"device": "nvme", "nvme_path": str(nvme)}, STAGE3)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme)}
    config.update(extra)
    return config


def io_engine_of(store):
    """The NVMe tier's own account of its I/O engine, from the store's telemetry."""
    tiers = store.telemetry()["tiers"]
    return next(t["details"]["io_engine"] for t in tiers if "io_engine" in t.get("details", {}))


def test_the_aio_section_configures_the_stores_io_engine(tmp_path):
    from tierflow.zero.partition import ParamStore
    from tierflow.zero.plan import make_plan

    aio = {"block_size": 262144, "queue_depth": 16, "thread_count": 2, "single_submit": True}
    config = read(nvme_config(tmp_path / "nvme", aio=aio))
    assert config.aio.engine_options() == {"block_size": 262144, "queue_depth": 16, "threads": 2, "submit_batch": 1}
    store = ParamStore(make_plan(TinyLM(16), config))
    try:
        assert store.store.io_config() == config.aio.engine_options()
        assert "block 262144" in io_engine_of(store.store)
    finally:
        store.close()
    # The same through zero.Init, whose store is made before the model.
    with tierflow.zero.Init(config=config):
        model = TinyLM(16)
    store = tierflow.zero.init.store_of(model)
    try:
        assert store.store.io_config()["queue_depth"] == 16
    finally:
        store.close()
    # No section: tierflow's own engine defaults, not DeepSpeed's (queue depth 8).
    config = read(nvme_config(tmp_path / "nvme2"))
    assert config.aio is None
    store = ParamStore(make_plan(TinyLM(16), config))
    try:
        assert store.store.io_config() == _core.Store(PAGE, nvme_dir=str(tmp_path), nvme_budget=1 << 20).io_config()
        assert store.store.io_config()["queue_depth"] != 8
    finally:
        store.close()


def test_a_bad_aio_value_is_refused_naming_it_before_anything_is_made(tmp_path):
    model = TinyLM(16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for aio, message in (({"queue_depth": 0}, r"aio.queue_depth: 0 is not in 1..4096"),
                         ({"block_size": 1000}, r"aio.block_size: 1000 is not a multiple of 4096"),
                         ({"intra_op_parallelism": 0}, r"aio.intra_op_parallelism: 0 is not in 1..256")):
        with pytest.raises(ValueError, match=message):
            tierflow.initialize(model=model, config=nvme_config(tmp_path / "nvme", aio=aio))
    assert not (tmp_path / "nvme").exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The store's own keyword, as the engine passes it.
    with pytest.raises(ValueError, match=r"aio.threads: 0 is not in 1..256"):
        _core.Store(PAGE, nvme_dir=str(tmp_path), nvme_budget=1 << 20, aio={"threads": 0})
    with pytest.raises(ValueError, match=r"aio.queue: unknown key"):
        _core.Store(PAGE, nvme_dir=str(tmp_path), nvme_budget=1 << 20, aio={"queue": 8})
    with pytest.raises(ValueError, match=r"aio.block_size: True is not a whole number"):
        _core.Store(PAGE, nvme_dir=str(tmp_path), nvme_budget=1 << 20, aio={"block_size": True})
    with pytest.raises(ValueError, match=r"aio: given without nvme_dir"):
        _core.Store(PAGE, aio={})
    assert _core.Store(PAGE).io_config() is None


def test_the_aio_section_reaches_the_optimizers_nvme_files(tmp_path):
    aio = {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2}
    expected = {"block_size": 262144, "queue_depth": 4, "threads": 2, "submit_batch": 8}
    config = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "aio": aio,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                     "nvme_path": str(tmp_path / "opt")}}}
    engine, optimizer, _, _ = tierflow.initialize(model=torch.nn.Linear(64, 64), config=config)
    try:
        assert optimizer._nvme.io_config() == expected
    finally:
        engine.close()
    # The optimizers take it themselves, and keep it through a copy.
    p = [torch.nn.Parameter(torch.randn(64, 64))]
    adamw = AdamW(p, offload="nvme", nvme_dir=tmp_path / "adamw", aio=expected)
    p[0].grad = torch.randn(64, 64)
    adamw.step()
    assert copy.deepcopy(adamw)._nvme.io_config() == adamw._nvme.io_config() == expected
    zen = tierflow.torch.optim.ZenFlow([torch.nn.Parameter(torch.randn(64, 64))], zenflow={"topk_ratio": 0.1},
                                       offload="nvme", nvme_dir=tmp_path / "zen", aio={"queue_depth": 4})
    for q in zen.param_groups[0]["params"]:
        q.grad = torch.randn_like(q)
    zen.step()
    assert zen._engine.io_config()["queue_depth"] == 4
    with pytest.raises(ValueError, match=r"aio is used only with offload='nvme'"):
        AdamW(p, aio=expected)
    with pytest.raises(ValueError, match=r"aio.queue_depth: 0 is not in 1..4096"):
        AdamW(p, offload="nvme", nvme_dir=tmp_path / "bad", aio={"queue_depth": 0})


# ---- DeepSpeed's defaults -----------------------------------------------------------------------

def test_the_defaults_are_deepspeeds():
    c = read({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"},
                                            "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, "aio": {}})
    z, p, o, f = c.zero, c.zero.offload_param, c.zero.offload_optimizer, c.fp16
    assert c.gradient_clipping == 1.0  # DeepSpeed's since 0.19.3 (0 before)
    assert (z.sub_group_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold,
            z.stage3_max_live_parameters, z.stage3_max_reuse_distance,
            z.stage3_gather_16bit_weights_on_model_save) == (10**9, 5 * 10**7, 10**5, 10**9, 10**9, False)
    assert (p.buffer_count, p.buffer_size, p.max_in_cpu, o.buffer_count) == (5, 10**8, 10**9, 4)
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (
        0, 16, 1000, 2, 1)
    assert c.bf16.check_grad_overflow is True
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.intra_op_parallelism, c.aio.single_submit) == (
        1 << 20, 8, 1, False)


def test_the_defaults_match_the_deepspeed_installed():
    zero = pytest.importorskip("deepspeed.runtime.zero.config", reason="DeepSpeed is not installed "
                                                                      "(scripts/setup.sh --bench installs it)")
    from deepspeed.runtime import constants
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.swap_tensor import constants as aio
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    c = read({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"},
                                            "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, "aio": {}})
    z, ds = c.zero, zero.DeepSpeedZeroConfig()
    assert c.gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT
    assert (z.sub_group_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold,
            z.stage3_max_live_parameters, z.stage3_max_reuse_distance, z.stage3_gather_16bit_weights_on_model_save) == (
        ds.sub_group_size, ds.prefetch_bucket_size, ds.param_persistence_threshold, ds.max_live_parameters,
        ds.max_reuse_distance, ds.gather_16bit_weights_on_model_save)
    dp, do = DeepSpeedZeroOffloadParamConfig(), DeepSpeedZeroOffloadOptimizerConfig()
    p, o = z.offload_param, z.offload_optimizer
    assert (p.buffer_count, p.buffer_size, p.max_in_cpu, o.buffer_count) == (
        dp.buffer_count, dp.buffer_size, dp.max_in_cpu, do.buffer_count)
    assert dp.pin_memory is do.pin_memory is True  # what tierflow does: its host memory is pinned
    f, df = c.fp16, DeepSpeedFP16Config()
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (
        df.loss_scale, df.initial_scale_power, df.loss_scale_window, df.hysteresis, df.min_loss_scale)
    assert c.bf16.check_grad_overflow is DeepSpeedBF16Config().check_grad_overflow
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.intra_op_parallelism, c.aio.single_submit) == (
        aio.AIO_BLOCK_SIZE_DEFAULT, aio.AIO_QUEUE_DEPTH_DEFAULT, aio.AIO_INTRA_OP_PARALLELISM_DEFAULT,
        aio.AIO_SINGLE_SUBMIT_DEFAULT)


def test_every_key_of_deepspeeds_sections_is_known_to_tierflow():
    """Each field of DeepSpeed's pydantic sections, at its default, reads
    without an unknown-key refusal: acted on, or named as not used."""
    import enum

    zero = pytest.importorskip("deepspeed.runtime.zero.config", reason="DeepSpeed is not installed "
                                                                      "(scripts/setup.sh --bench installs it)")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    def defaults(model):
        for name, f in model.model_fields.items():
            value = f.get_default(call_default_factory=True)
            value = value.value if isinstance(value, enum.Enum) else value
            try:
                json.dumps(value)
            except TypeError:
                value = None
            yield from ((key, value) for key in {name, f.alias or name})

    sections = [("zero_optimization", zero.DeepSpeedZeroConfig), ("zero_optimization.offload_param",
                DeepSpeedZeroOffloadParamConfig), ("zero_optimization.offload_optimizer",
                DeepSpeedZeroOffloadOptimizerConfig), ("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config),
                ("zero_optimization.zenflow", ZenFlowConfig)]
    checked = 0
    for path, model in sections:
        for key, value in defaults(model):
            if key == "device" or (path == "zero_optimization" and key in ("stage", "offload_param",
                                                                              "offload_optimizer")):
                continue  # "none" is refused on purpose; the stage and sections are the test's own
            config = with_(f"{path}.{key}", value, STAGE3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TierflowConfigWarning)
                from_deepspeed(config)
            checked += 1
    assert checked > 60


# ---- DeepSpeed's rules ----------------------------------------------------------------------------

@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2, (24, 3, 4)),
])
def test_deepspeeds_batch_rule_derives_the_missing_size(given, world, expected):
    c = read(given, world_size=world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_deepspeeds_floor_divisions_then_the_consistency_check():
    with pytest.raises(ValueError, match=r"train_batch_size: 10 is not .* = 3 × 3 × 1"):
        from_deepspeed({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3})


def test_deepspeeds_older_spellings_are_read_as_deepspeed_reads_them():
    c = read({"train_batch_size": 2, "bfloat16": {"enabled": True},
              "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                    "prefetch_bucket_size": 1e6, "max_live_parameters": "3e8",
                                    "stage3_gather_fp16_weights_on_model_save": True}})
    assert c.precision == "bf16" and "older name" in c.source("bf16.enabled")
    z = c.zero
    assert z.offload_optimizer.device == "cpu" and z.offload_param.device == "cpu"
    assert z.stage3_prefetch_bucket_size == 1_000_000 and z.stage3_max_live_parameters == 300_000_000
    assert c.source("zero_optimization.stage3_prefetch_bucket_size") == "zero_optimization.prefetch_bucket_size"
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert read({"train_batch_size": 2, "zero_optimization": True}).zero.stage == 1
    with pytest.raises(ValueError,
                       match="zero_optimization.cpu_offload and zero_optimization.offload_optimizer: both"):
        from_deepspeed({"train_batch_size": 2, "zero_optimization": {
            "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    with pytest.warns(TierflowConfigWarning, match=r"bfloat16 \(not used: bf16 is given"):
        from_deepspeed({"train_batch_size": 2, "bf16": {"enabled": True}, "bfloat16": {"enabled": False}})


def test_adam_follows_deepspeeds_adam_w_mode_and_torch_adam():
    def optimizer_of(type_, **params):
        return read({"train_batch_size": 1, "optimizer": {"type": type_, "params": params}}).optimizer

    p = [torch.nn.Parameter(torch.zeros(4))]
    for spelling in ("Adam", "adam", "ADAM"):
        adamw = optimizer_of(spelling)
        assert adamw.decoupled_weight_decay and type(adamw.build(p)) is AdamW and adamw.weight_decay == 0.0
    plain = optimizer_of("Adam", adam_w_mode=False, weight_decay=0.01)
    assert type(plain.build(p)) is Adam and plain.build(p).param_groups[0]["weight_decay"] == 0.01
    # torch_adam: torch.optim.AdamW's default decay, 0.01; Adam's stays 0.
    torch_adamw = optimizer_of("AdamW", torch_adam=True)
    assert torch_adamw.weight_decay == 0.01 and "torch.optim.AdamW" in read(
        {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    ).source("optimizer.params.weight_decay")
    assert optimizer_of("Adam", torch_adam=True).weight_decay == 0.01  # DeepSpeed runs torch.optim.AdamW
    assert optimizer_of("Adam", torch_adam=True, adam_w_mode=False).weight_decay == 0.0
    with pytest.warns(TierflowConfigWarning, match=r'optimizer.params.adam_w_mode \(not used: type "AdamW" always'):
        c = from_deepspeed({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert c.optimizer.decoupled_weight_decay
    built = optimizer_of("AdamW", lr=2e-3, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.2, amsgrad=True).build(p)
    assert {k: built.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")} == {
        "lr": 2e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.2, "amsgrad": True}


def test_muon_with_deepspeeds_defaults_and_lr_overrides():
    def muon_of(params):
        return read({"train_batch_size": 1, "optimizer": {"type": "Muon", "params": params}}).optimizer

    d = muon_of({})
    assert (d.muon_group_lr, d.adam_group_lr, d.momentum, d.weight_decay, d.betas, d.eps) == (
        0.02, 3e-4, 0.95, 0.0, (0.9, 0.95), 1e-10)
    assert (muon_of({"lr": 1e-3}).muon_group_lr, muon_of({"lr": 1e-3}).adam_group_lr) == (1e-3, 1e-3)
    both = muon_of({"lr": 1e-3, "muon_lr": 0.05, "adam_lr": 1e-4, "momentum": 0.9, "weight_decay": 0.1})
    assert (both.muon_group_lr, both.adam_group_lr) == (0.05, 1e-4)
    muon, adamw = both.build(TinyLM(hidden=16))
    assert type(muon) is Muon and type(adamw) is AdamW
    assert muon.defaults["lr"] == 0.05 and muon.defaults["momentum"] == 0.9 and muon.defaults["weight_decay"] == 0.1
    assert adamw.defaults["lr"] == 1e-4 and adamw.defaults["betas"] == (0.9, 0.95)
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    with pytest.warns(TierflowConfigWarning, match=r"optimizer.params.ns_method \(not used by tierflow"):
        from_deepspeed({"train_batch_size": 1, "optimizer": {"type": "muon", "params": {"ns_method": "gram"}}})


# ---- the schedulers' learning rates against DeepSpeed's formulas ------------------------------------------
# DeepSpeed's deepspeed/runtime/lr_schedules.py, written out: iteration -1 is
# before the first step(); each step() adds one.

def ds_warmup_gamma(i, warmup, kind):
    w = max(2, warmup)
    return (1.0 / math.log(w)) * math.log(i + 1) if kind == "log" else i / w


def ds_warmup_lr(i, min_lr, max_lr, warmup, kind):
    if i < 0:
        return min_lr
    gamma = ds_warmup_gamma(i, warmup, kind) if i < max(2, warmup) else 1.0
    return min_lr + (max_lr - min_lr) * gamma


def ds_warmup_decay_lr(i, min_lr, max_lr, warmup, kind, total):
    if i < 0:
        return min_lr
    w = max(2, warmup)
    if i < w:
        gamma = ds_warmup_gamma(i, warmup, kind)
    else:
        gamma = max(0.0, float(total - i) / float(max(1.0, total - w)))
    return min_lr + (max_lr - min_lr) * gamma


def ds_warmup_cosine_lr(i, base_lr, warmup, kind, total, warmup_min_ratio, cos_min_ratio):
    if i < 0:
        return 0.0
    w = max(2, warmup)
    if i < w:
        ratio = warmup_min_ratio + ds_warmup_gamma(i, warmup, kind) * (1.0 - warmup_min_ratio)
    else:
        progress = min(1.0, (i - w + 1) / max(1, total - w))
        ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)
    return base_lr * ratio


def lrs_of(scheduler_config, steps, lr=0.1, groups=1):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    optimizer = torch.optim.SGD([{"params": [p]} for p in params], lr=lr)
    c = read({"train_batch_size": 1, "scheduler": scheduler_config})
    scheduler = c.scheduler.build(optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    seen = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        seen.append([g["lr"] for g in optimizer.param_groups])
    return seen


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_sets_deepspeeds_rates(kind):
    seen = lrs_of({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3,
                                                  "warmup_num_steps": 20, "warmup_type": kind}}, 40)
    expected = [ds_warmup_lr(i, 1e-5, 1e-3, 20, kind) for i in range(-1, 40)]
    assert [s[0] for s in seen] == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert seen[-1][0] == pytest.approx(1e-3) and seen[0][0] == pytest.approx(1e-5)


def test_warmup_lr_without_max_takes_each_groups_lr():
    seen = lrs_of({"type": "WarmupLR", "params": {"warmup_num_steps": 1}}, 5, lr=0.3)
    # warmup_num_steps 1 is DeepSpeed's max(2, 1) = 2 steps of warm-up.
    assert [s[0] for s in seen] == pytest.approx([ds_warmup_lr(i, 0.0, 0.3, 1, "log") for i in range(-1, 5)])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_sets_deepspeeds_rates_past_the_last_step(kind):
    params = {"warmup_min_lr": 0, "warmup_max_lr": [2e-4, 1e-3], "warmup_num_steps": 10,
              "warmup_type": kind, "total_num_steps": 50}
    seen = lrs_of({"type": "WarmupDecayLR", "params": params}, 60, groups=2)
    for g, high in enumerate((2e-4, 1e-3)):
        expected = [ds_warmup_decay_lr(i, 0.0, high, 10, kind, 50) for i in range(-1, 60)]
        assert [s[g] for s in seen] == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert seen[-1] == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_sets_deepspeeds_rates(kind):
    params = {"warmup_min_ratio": 0.1, "warmup_num_steps": 8, "cos_min_ratio": 0.01, "warmup_type": kind,
              "total_num_steps": 40}
    seen = lrs_of({"type": "WarmupCosineLR", "params": params}, 50, lr=0.5)
    expected = [ds_warmup_cosine_lr(i, 0.5, 8, kind, 40, 0.1, 0.01) for i in range(-1, 50)]
    assert [s[0] for s in seen] == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert seen[-1][0] == pytest.approx(0.5 * 0.01)


def test_a_schedule_with_unresolved_steps_or_the_wrong_group_count_is_refused():
    two_rates = [1e-3, 1e-4]
    c = read({"train_batch_size": 1, "scheduler": {"type": "WarmupDecayLR",
                                                   "params": {"total_num_steps": "auto", "warmup_max_lr": two_rates}}})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r'scheduler.params.total_num_steps: "auto" is unresolved'):
        c.scheduler.build(opt)
    c = read({"train_batch_size": 1, "scheduler": {"type": "WarmupDecayLR",
                                                   "params": {"total_num_steps": 10, "warmup_max_lr": [1e-3, 1e-4]}}})
    with pytest.raises(ValueError, match="scheduler.params.warmup_max_lr: 2 values for 1 param groups"):
        c.scheduler.build(opt)


# ---- files, the printout, the round trip ------------------------------------------------------------

def test_a_json_file_path_is_read_as_deepspeed_reads_it(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3_NVME, indent=2))
    assert read(path) == read(str(path)) == read(ZERO3_NVME)
    with pytest.raises(ValueError, match=r"no such DeepSpeed config file"):
        from_deepspeed(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,}')
    with pytest.raises(ValueError, match=r"bad.json: not JSON \(.* line 1"):
        from_deepspeed(tmp_path / "bad.json")
    (tmp_path / "twice.json").write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ValueError, match=r'twice.json: key "stage" appears twice'):
        from_deepspeed(tmp_path / "twice.json")


def test_the_printout_shows_every_section_its_values_and_their_sources():
    text = read(ZERO3_NVME).describe()
    for line in ("tierflow config", "zero_optimization.offload_param.nvme_path", "/scratch/tierflow",
                 "[tierflow.nvme_dir]", "aio.intra_op_parallelism", "[aio.thread_count]",
                 "fp16: training precision fp16", "optimizer: Adam with L2 weight decay (adam_w_mode false)",
                 "tierflow.host_memory", str(64 << 30), "unresolved: none", "not acted on: none",
                 "zero_optimization.stage3_max_reuse_distance", "1000000000", "[default]"):
        assert line in text, line
    zenflow = read(ZENFLOW).describe()
    assert "schedule: 10 full warm-up steps, selection refreshed every 300 steps" in zenflow
    assert "zero_optimization: stage 2 (offload_param and the stage-3 settings are ZeRO-3's)" in zenflow
    assert str(read(ZENFLOW)) == zenflow


@pytest.mark.parametrize("config,unused", [(ZERO2_CPU, ZERO2_UNUSED), (ZERO3_NVME, ()), (ZENFLOW, ()),
                                           (HF_AUTO, HF_UNUSED)], ids=["zero2", "zero3", "zenflow", "hf"])
def test_to_dict_is_deepspeeds_shape_and_reads_back_equal(config, unused):
    c = read(config, unused)
    back = c.to_dict()
    json.dumps(back)  # plain JSON
    again = read(back)  # every key written acts: none is reported
    assert again == c and again.unresolved == c.unresolved
    assert back["zero_optimization"]["stage"] == c.zero.stage
    if c.zero.stage < 3:
        assert "offload_param" not in back["zero_optimization"]
        assert "stage3_prefetch_bucket_size" not in back["zero_optimization"]


def test_the_resolved_config_reads_back_without_the_model():
    model = TinyLM()
    c = read(HF_AUTO, HF_UNUSED, model=model, optimizer=hf_style_optimizer(model))
    again = read(c.to_dict())
    assert again == c and again.zero.stage3_prefetch_bucket_size == 2073


def test_a_config_with_unresolved_values_pickles():
    c = read(HF_AUTO, HF_UNUSED)
    back = pickle.loads(pickle.dumps(c))
    assert back == c and back.optimizer.lr is AUTO and back.unresolved == c.unresolved
    assert back.sources == c.sources and str(back) == str(c)


def test_the_config_is_frozen_and_the_package_exports_it():
    c = read(ZERO2_CPU, ZERO2_UNUSED)
    with pytest.raises(AttributeError):
        c.zero.stage = 3
    assert tierflow.config.from_deepspeed is from_deepspeed and isinstance(c, Config)
    assert isinstance(c.optimizer, AdamConfig) and not isinstance(c.optimizer, MuonConfig)
    assert hash(c) == hash(read(copy.deepcopy(ZERO2_CPU), ZERO2_UNUSED))
