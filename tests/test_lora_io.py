"""LoRA weights out of megatron: the PEFT adapter folder and the merged HF folder, for Llama and Qwen2 (q/k/v
biases, tied embedding; LoRA leaves the biases alone).

The adapters are hand-made in megatron's layout (A [rank, in], B [out, rank] with linear_qkv's rows interleaved
per query group and linear_fc1's gate|up), so the policy they define is the base's megatron tensors with
W + scale * B @ A, split to HF by the converter's own path. PEFT's loader on the base and transformers on the
merged folder must both give that policy's logits within the parity rule.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from verl_mega.converters.lora_export import PEFT_CONFIG, PEFT_WEIGHTS, Adapters, hf_adapters, merged_hf_tensors, write_peft_folder
from verl_mega.converters.parity import logit_parity

FAMILIES = ("llama", "qwen2")
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
RANK, ALPHA = 4, 16.0
TOKENS = torch.tensor([[5, 17, 42, 9, 77, 3, 120, 64]])


def hand_made_adapters(hf_dir, targets=TARGETS, seed: int = 0) -> Adapters:
    """Random A and B (B not zero: the adapters change the model) on every targeted linear, megatron's layout."""
    from verl_mega.models import load_hf_model_config
    from verl_mega.models.expected_shapes import mcore_shape
    from verl_mega.models.sharding import rank_slots

    hf_config, family = load_hf_model_config(hf_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for slot in rank_slots(hf_config, family):
        if not slot.global_name.endswith(tuple(f".{target}.weight" for target in targets)):
            continue
        out_features, in_features = mcore_shape(slot.rule, hf_config)
        module = slot.global_name.removesuffix("weight")
        tensors[module + "lora_a"] = torch.randn(RANK, in_features, generator=generator) / in_features ** 0.5
        tensors[module + "lora_b"] = torch.randn(out_features, RANK, generator=generator) / RANK
    return Adapters(RANK, ALPHA, 0.0, tensors)


def policy_state_dict(hf_dir, adapters: Adapters) -> dict[str, torch.Tensor]:
    """The trained policy in HF names: each megatron tensor of the base merged with its adapters, then split."""
    from verl_mega.checkpoint.safetensors_io import SafetensorsReader
    from verl_mega.models import load_hf_model_config
    from verl_mega.models.sharding import merge_hf_to_mcore, rank_slots, split_mcore_to_hf

    hf_config, family = load_hf_model_config(hf_dir)
    reader = SafetensorsReader(hf_dir)
    state = {}
    for slot in rank_slots(hf_config, family):
        tensor = merge_hf_to_mcore(slot, hf_config, reader, 0, 1, hf_config.vocab_size)
        module = slot.global_name.removesuffix("weight")
        if module + "lora_a" in adapters.tensors:
            tensor = tensor + adapters.scale * adapters.tensors[module + "lora_b"] @ adapters.tensors[module + "lora_a"]
        state.update(split_mcore_to_hf(slot, hf_config, [tensor]))
    return state


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def assert_parity(logits, reference, hf_config, what: str) -> None:
    parity = logit_parity(logits, reference, "fp32", num_layers=hf_config.num_layers,
                          reduction_length=max(hf_config.hidden_size, hf_config.ffn_hidden_size), moe=False)
    assert parity.passed, f"{what}: {parity.describe()}"


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory):
    """family -> its tiny model converted (the manifest the exporter reads)."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("lora_io")
    for family in FAMILIES:
        convert_hf_to_mcore(tiny_models[family], root / family)
    return {family: root / family for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_folder_loads_in_peft_with_the_policys_logits(tiny_models, converted, family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
    from verl_mega.models import load_hf_model_config

    hf_dir = tiny_models[family]
    hf_config, _ = load_hf_model_config(hf_dir)
    adapters = hand_made_adapters(hf_dir)
    out = write_peft_folder(adapters, Manifest.read(converted[family]), converted[family] / HF_ASSETS_DIR,
                            tmp_path / "peft", base_model=str(hf_dir), sources=(converted[family],))
    config = json.loads((out / PEFT_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", RANK, ALPHA, "none")
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(hf_dir)
    from safetensors import safe_open

    with safe_open(str(out / PEFT_WEIGHTS), framework="pt") as file:
        names = set(file.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight" in names
    assert not any("bias" in name for name in names)

    policy = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    policy.load_state_dict(policy_state_dict(hf_dir, adapters), strict=False)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    assert_parity(logits_of(loaded), logits_of(policy), hf_config, f"{family}: PEFT on the base vs the policy")


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_folder_loads_in_transformers_with_the_policys_logits(tiny_models, converted, family, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
    from verl_mega.converters.mcore_to_hf import iter_checkpoint_hf_tensors, write_hf_model
    from verl_mega.models import load_hf_model_config

    hf_dir = tiny_models[family]
    hf_config, spec = load_hf_model_config(hf_dir)
    adapters = hand_made_adapters(hf_dir)
    manifest = Manifest.read(converted[family])
    deltas = {name: (a, b) for name, a, b in hf_adapters(adapters, hf_config, spec)}
    base = iter_checkpoint_hf_tensors(converted[family], manifest)
    out = write_hf_model(merged_hf_tensors(base, deltas, adapters.scale), manifest, converted[family] / HF_ASSETS_DIR,
                         tmp_path / "merged", sources=(converted[family],))
    policy = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    policy.load_state_dict(policy_state_dict(hf_dir, adapters), strict=False)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_parity(logits_of(merged), logits_of(policy), hf_config, f"{family}: merged folder vs the policy")
    assert not torch.equal(logits_of(merged), logits_of(AutoModelForCausalLM.from_pretrained(hf_dir).eval()))


def test_adapters_that_fit_no_linear_are_refused(tiny_models):
    from verl_mega.models import load_hf_model_config

    hf_config, spec = load_hf_model_config(tiny_models["llama"])
    adapters = hand_made_adapters(tiny_models["llama"], targets=("linear_proj",))
    stray = {**adapters.tensors, "decoder.layers.9.self_attention.linear_proj.lora_a": torch.zeros(RANK, 64)}
    with pytest.raises(ValueError, match="adapter 'decoder.layers.9.self_attention.linear_proj.lora_a' belongs to no"):
        list(hf_adapters(Adapters(RANK, ALPHA, 0.0, stray), hf_config, spec))
    wrong_rank = Adapters(RANK + 1, ALPHA, 0.0, adapters.tensors)
    with pytest.raises(ValueError, match=r"rank 5 on that linear needs a floating-point \[5, 64\]"):
        list(hf_adapters(wrong_rank, hf_config, spec))


# --- step checkpoints of a LoRA actor (one process; tests/test_training_state.py resumes them at other layouts) ---


@pytest.fixture(scope="module")
def one_rank():
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def lora_actor(ckpt, rank: int = RANK):
    from verl_mega.config import LoraConfig, OptimConfig
    from verl_mega.roles.actor import Actor

    # The distributed optimizer: megatron's plain one stores no Adam step before the first (`if step:`), and these
    # states are saved untrained.
    optim = OptimConfig(lr=1e-2, use_distributed_optimizer=True)
    return Actor(ckpt, optim, schedule_steps=2, lora=LoraConfig(rank=rank, alpha=ALPHA))


def save_step(run_dir, actor, base: str):
    from verl_mega.run.checkpoints import save_checkpoint

    state = {"step": 1, "model_fingerprint": "tiny", "world_size": 1}
    return save_checkpoint(run_dir, 1, trainables={"actor": actor.trainable}, trainer_state=state, config_yaml="",
                           rank=0, keep_last=2, base_checksums={"actor": base})


def test_lora_step_checkpoint_names_its_base_and_resumes_only_on_it(one_rank, converted, tmp_path):
    from verl_mega.config.errors import UserError
    from verl_mega.models.lora import lora_parameters
    from verl_mega.run.checkpoints import STATE_FILE, load_checkpoint

    actor = lora_actor(converted["llama"])
    with torch.no_grad():
        for _, param in lora_parameters(actor.model):
            param.add_(0.25)  # a trained adapter, not the initial one
    saved = save_step(tmp_path, actor, base="aa" * 32)
    assert json.loads((saved / STATE_FILE).read_text())["base_sha256"] == {"actor": "aa" * 32}
    fresh = lora_actor(converted["llama"])
    with pytest.raises(UserError, match="holds actor LoRA adapters trained on a base of sha256 a{64}, but this run's "
                                        "actor starts from one of sha256 b{64}"):
        load_checkpoint(saved, trainables={"actor": fresh.trainable}, fingerprint="tiny", rank=0, world_size=1,
                        base_checksums={"actor": "bb" * 32})
    load_checkpoint(saved, trainables={"actor": fresh.trainable}, fingerprint="tiny", rank=0, world_size=1,
                    base_checksums={"actor": "aa" * 32})
    for (name, want), (_, got) in zip(lora_parameters(actor.model), lora_parameters(fresh.model)):
        assert torch.equal(got, want), name


def test_lora_state_of_another_rank_is_refused(one_rank, converted, tmp_path):
    from verl_mega.run.training_state import load_training_state

    saved = save_step(tmp_path, lora_actor(converted["llama"]), base="aa" * 32)
    with pytest.raises(ValueError, match=r"holds LoRA adapters of rank 4 on linear_fc1,linear_fc2,linear_proj,"
                                         r"linear_qkv, this job has rank 2 .*: resume with actor.lora.rank=4"):
        load_training_state(lora_actor(converted["llama"], rank=2).trainable, saved / "actor")


def test_lora_state_that_holds_nan_is_refused_naming_the_tensor(one_rank, converted, tmp_path):
    """Not resumed to fail a step later as an overflow blamed on the learning rate."""
    from verl_mega.config.errors import UserError
    from verl_mega.models.lora import lora_parameters
    from verl_mega.run.checkpoints import load_checkpoint

    actor = lora_actor(converted["llama"])
    name, param = next(lora_parameters(actor.model))
    with torch.no_grad():
        param[0, 0] = float("nan")
    saved = save_step(tmp_path, actor, base="aa" * 32)
    with pytest.raises(UserError, match=rf"^checkpoint {saved}: {saved / 'actor'}: 'model\.{re.escape(name)}' holds "
                                        "NaN/inf; the run that saved it had diverged: resume from an earlier checkpoint$"):
        load_checkpoint(saved, trainables={"actor": lora_actor(converted["llama"]).trainable}, fingerprint="tiny",
                        rank=0, world_size=1, base_checksums={"actor": "aa" * 32})


def test_adapters_of_a_model_with_fewer_layers_are_refused_naming_the_tensor(one_rank, converted, tmp_path):
    """The manifest's model has more layers than the step's adapters: a ValueError naming the stored tensor, not
    an IndexError out of the stacked layers."""
    from dataclasses import replace

    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.checkpoint.torch_dist import read_adapter_tensors

    saved = save_step(tmp_path, lora_actor(converted["llama"]), base="aa" * 32)
    manifest = Manifest.read(converted["llama"])
    layers = manifest.hf_config["num_hidden_layers"]
    deeper = replace(manifest, hf_config={**manifest.hf_config, "num_hidden_layers": layers + 1})
    with pytest.raises(ValueError, match=rf"^tensor '\S+\.lora_a' in {saved / 'actor'} is \[{layers}, \d+, \d+\]: "
                                         rf"it has no entry \[{layers}\] for decoder\.layers\.{layers}\."):
        read_adapter_tensors(saved / "actor", deeper)


def test_a_lora_step_exports_as_peft_and_merged_with_the_actors_logits(one_rank, tiny_models, converted, tmp_path):
    """The real thing end to end on Qwen2: a LoRA actor's step checkpoint -> `export_role` -> PEFT on the base and
    transformers on the merged folder, against the megatron actor's own forward (adapters on)."""
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_mega.converters.export import export_role
    from verl_mega.models import load_hf_model_config
    from verl_mega.models.builder import unwrap_model
    from verl_mega.models.lora import lora_parameters
    from verl_mega.run.checkpoints import save_checkpoint

    hf_dir, ckpt = tiny_models["qwen2"], converted["qwen2"]
    hf_config, _ = load_hf_model_config(hf_dir)
    actor = lora_actor(ckpt)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in lora_parameters(actor.model):  # B off its zero start, as training moves it
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator) / RANK)
    config = {"model": {"hf_path": str(hf_dir), "actor_ckpt": str(ckpt)}, "parallel": {"tp": 1, "pp": 1, "ep": 1},
              "actor": {"lora": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}}}
    save_checkpoint(tmp_path / "run", 1, trainables={"actor": actor.trainable},
                    trainer_state={"step": 1, "model_fingerprint": "tiny", "world_size": 1},
                    config_yaml=yaml.safe_dump(config), rank=0, keep_last=1, base_checksums={"actor": "aa" * 32})
    model = unwrap_model(actor.model).eval()
    with torch.no_grad():
        policy = model(TOKENS, torch.arange(TOKENS.shape[1])[None], None)[..., :hf_config.vocab_size].float()

    export_role(tmp_path / "run", tmp_path / "peft", step=1)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert_parity(logits_of(loaded), policy, hf_config, "PEFT export")
    export_role(tmp_path / "run", tmp_path / "merged", step=1, merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert_parity(logits_of(merged), policy, hf_config, "merged export")


def test_the_planned_transition_peak_counts_the_merged_shard(tiny_models):
    """The HybridEngine test checks a measured peak against this figure; here: LoRA raises it by the merge's
    buffers (at TP 2 -> rollout TP 2 the largest adapted shard is fc1's, [128, 64]), and a bad rank is named."""
    from verl_mega.rollout.planner import plan

    plain = plan(tiny_models["llama"], 2, 1, 1, 2).ranks[0].transition_peak_bytes
    merged = plan(tiny_models["llama"], 2, 1, 1, 2, lora_rank=RANK, lora_targets=TARGETS).ranks[0].transition_peak_bytes
    assert merged > plain
    with pytest.raises(ValueError, match="--lora-rank must be a whole number >= 0, got -1"):
        plan(tiny_models["llama"], 2, 1, 1, 2, lora_rank=-1)
