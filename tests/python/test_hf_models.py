"""Hugging Face models under the ZeRO-3 engine: tiny GPT-2 (tied
embeddings), Llama and Mixtral (top-2 of 4 experts) built by
``transformers``' own ``AutoModelForCausalLM.from_config`` under
``tierflow.zero.Init``, their parameters and AdamW state on NVMe in the
test's directory, fp32, trained beside the same model under plain
``torch.optim.AdamW`` in memory; a resume in a new process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tierflow
from tierflow.zero.init import store_of

transformers = pytest.importorskip("transformers")

from test_zero import ds_config  # noqa: E402

VOCAB = 256
# Adam's settings in ds_config, for the reference.
ADAMW = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def hf_config(kind):
    """A tiny config of ``kind``: a few layers, hidden 32, a vocabulary of 256."""
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if kind == "gpt2":
        return transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, **common)
    llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **common)
    if kind == "llama":
        return transformers.LlamaConfig(**llama_like)
    if kind == "mixtral":
        # The router's load-balancing loss is part of the loss (output_router_logits).
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                          router_aux_loss_coef=0.02, **llama_like)
    raise ValueError(kind)


def engine_config(nvme):
    """ZeRO-3, parameters and AdamW state on NVMe, fp32, one micro-batch a step, clipping at 1.0."""
    return ds_config(nvme, gas=1, host_memory=2 << 20, device_memory=1 << 20)


def build(kind, config=None, seed=0):
    """The model, built from ``seed`` by transformers (under Init when ``config`` is given)."""
    torch.manual_seed(seed)
    if config is None:
        return transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    with tierflow.zero.Init(config=config):
        return transformers.AutoModelForCausalLM.from_config(hf_config(kind))


def batches(n, seed=1, batch=2, seq=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def train(engine, data):
    """One engine step a batch; the losses and, per step, each MoE layer's experts chosen by no token."""
    losses, idle = [], []
    for x in data:
        out = engine(input_ids=x, labels=x)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        idle.append(_idle_experts(out))
    return losses, idle


def _idle_experts(out):
    logits = getattr(out, "router_logits", None)
    if not logits:
        return []
    k = 2
    return [4 - len(torch.unique(layer.topk(k, dim=-1).indices)) for layer in logits]


def train_reference(model, data):
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_a_transformers_model_trains_as_torch_adamw_and_generates_its_tokens(tmp_path, kind):
    config = engine_config(tmp_path / "nvme")
    reference = build(kind)
    model = build(kind, config)
    # Partitioned from Init on: every parameter is in the store and holds nothing.
    assert store_of(model) is not None
    for name, p in model.named_parameters():
        assert p.numel() == 0 and tuple(p.ds_shape) == tuple(reference.get_parameter(name).shape), name
    engine, *_ = tierflow.initialize(model=model, config=config)
    try:
        distinct = dict(reference.named_parameters())
        every = list(reference.named_parameters(remove_duplicate=False))
        if kind == "gpt2":  # the LM head is the embedding, stored once
            assert len(every) == len(distinct) + 1 and reference.lm_head.weight is reference.transformer.wte.weight
        assert len(engine.runtime.params.parts) == len(distinct)
        assert sum(p.ds_numel for p in engine.module.parameters()) == sum(p.numel() for p in distinct.values())

        # Init built what transformers builds from the same seed.
        built, want = engine.module.state_dict(), reference.state_dict()
        assert built.keys() == want.keys()
        for key in want:
            assert torch.equal(built[key], want[key]), key

        # Mixtral: 3 tokens a step, top-2 of 4 experts, so that some expert goes without.
        data = batches(4, batch=1, seq=3) if kind == "mixtral" else batches(4)
        losses, idle = train(engine, data)
        expected = train_reference(reference, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        if kind == "mixtral":  # some expert of some layer had no token, so no gradient, in some step
            assert any(n > 0 for step in idle for n in step), idle
        trained = engine.module.state_dict()
        for key, value in reference.state_dict().items():
            # atol 1e-5: GPT-2's key bias has a gradient of rounding noise only (softmax ignores a
            # shift of every key), which Adam scales up to steps of up to lr; the rest agree to 1e-7.
            torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-5, msg=key)

        prompt = batches(1, seed=5, batch=1, seq=5)[0]
        engine.module.eval()
        reference.eval()
        got = engine.module.generate(prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, reference.generate(prompt, max_new_tokens=6, do_sample=False))
    finally:
        engine.close()


_RESUME = textwrap.dedent("""
    import sys, json, torch
    sys.path.insert(0, {tests!r})
    import tierflow
    from test_hf_models import batches, build, engine_config, train
    config = engine_config({nvme!r})
    engine, *_ = tierflow.initialize(model=build({kind!r}, config, seed=7), config=config)
    path, client = engine.load_checkpoint({ckpt!r})
    assert client == {{"step": 3}}, client
    losses, _ = train(engine, batches(6)[3:])
    print(json.dumps(losses))
""")


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_a_checkpoint_resumes_in_a_new_process_as_the_uninterrupted_run(tmp_path, kind):
    config = engine_config(tmp_path / "nvme")
    data = batches(6)
    engine, *_ = tierflow.initialize(model=build(kind, config), config=config)
    try:
        first, _ = train(engine, data[:3])
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"step": 3})
        rest, _ = train(engine, data[3:])
    finally:
        engine.close()
    # The new process builds its model from another seed: all it trains on comes from the checkpoint.
    script = _RESUME.format(tests=os.path.dirname(__file__), nvme=str(tmp_path / "nvme2"), kind=kind,
                            ckpt=str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed == rest  # bit for bit
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(train_reference(build(kind), data)),
                               rtol=1e-5, atol=1e-6)


def _trained_checkpoint(tmp_path, kind, steps=2):
    """An engine trained ``steps`` steps, its checkpoint in tmp_path/ckpt; the engine is open."""
    config = engine_config(tmp_path / "nvme")
    engine, *_ = tierflow.initialize(model=build(kind, config), config=config)
    train(engine, batches(steps))
    engine.save_checkpoint(tmp_path / "ckpt")
    return engine


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_the_consolidated_checkpoint_loads_with_from_pretrained_and_gives_the_engines_logits(tmp_path, kind):
    engine = _trained_checkpoint(tmp_path, kind)
    try:
        x = batches(1, seed=9)[0]
        engine.module.eval()
        with torch.no_grad():
            want = engine.module(input_ids=x).logits
    finally:
        engine.close()
    out = subprocess.run([sys.executable, "-m", "tierflow.zero.consolidate", str(tmp_path / "ckpt"),
                          str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "from fp32 masters" in out.stdout and "config.json from" in out.stdout, out.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == type(build(kind)).__name__
    if kind == "gpt2":  # the file holds the embedding once; from_pretrained ties the head to it
        from safetensors import safe_open

        with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
            assert "lm_head.weight" not in f.keys() and "transformer.wte.weight" in f.keys()
        assert model.lm_head.weight is model.transformer.wte.weight
    model.eval()
    with torch.no_grad():
        got = model(input_ids=x).logits
    assert torch.equal(got, want)


def test_consolidate_names_a_missing_directory_tag_or_corrupt_file_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file

    from tierflow.zero.consolidate import consolidate, main

    _trained_checkpoint(tmp_path, "llama", steps=1).close()
    ckpt = tmp_path / "ckpt"
    fp32 = load_file(consolidate(ckpt, tmp_path / "fp32")["path"])
    bf16 = load_file(consolidate(ckpt, tmp_path / "bf16", dtype="bf16", tag="global_step1")["path"])
    assert fp32.keys() == bf16.keys() and all(torch.equal(bf16[k], fp32[k].bfloat16()) for k in fp32)
    config = tmp_path / "given.json"
    config.write_text((ckpt / "global_step1" / "config.json").read_text())
    assert consolidate(ckpt, tmp_path / "given", config=config)["config"] == str(config)

    def error(*argv):
        assert main([str(a) for a in argv]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("python -m tierflow.zero.consolidate: error: "), err
        return err

    assert "no such checkpoint directory" in error(tmp_path / "nowhere", tmp_path / "o")
    assert "no checkpoint 'step9'" in error(ckpt, tmp_path / "o", "--tag", "step9")
    assert "no such config file" in error(ckpt, tmp_path / "o", "--config", tmp_path / "none.json")
    (ckpt / "latest").unlink()
    assert "no 'latest' file; give the tag" in error(ckpt, tmp_path / "o")
    tag = ckpt / "global_step1"
    optim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = optim.read_bytes()
    optim.write_bytes(data[: len(data) // 2])
    assert f"{optim} (rank 0's fp32 masters) is not a readable torch file" in error(ckpt, tmp_path / "o",
                                                                                     "--tag", "global_step1")
    optim.write_bytes(data)
    model = tag / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-8])
    assert "is truncated" in error(ckpt, tmp_path / "o", "--tag", "global_step1")
    model.write_bytes(b"\x04")
    assert "not a safetensors file" in error(ckpt, tmp_path / "o", "--tag", "global_step1")
    model.unlink()
    assert f"{model} is missing" in error(ckpt, tmp_path / "o", "--tag", "global_step1")
    assert not (tmp_path / "o" / "model.safetensors").exists()


_UNCLOSED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import tierflow
    from test_hf_models import batches, build, engine_config, train
    config = engine_config({nvme!r})
    engine, *_ = tierflow.initialize(model=build("gpt2", config), config=config)
    train(engine, batches(2))
    print("trained")
""")


def test_a_transformers_training_script_that_never_closes_its_engine_exits_silently(tmp_path):
    """No 'nanobind: leaked' lines and no warning from tierflow on stderr (transformers' own quieted)."""
    script = _UNCLOSED.format(tests=os.path.dirname(__file__), nvme=str(tmp_path / "nvme"))
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "trained", out.stderr
    assert out.stderr == "", out.stderr
    left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "nvme") for f in files]
    assert left == [], left
