"""The memory planner (planning.memory): its published sources reproduced under their own assumptions, its
answers moving the right way, `verl-mega plan --memory` and the pre-flight refusal. In process, no GPU."""
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.config.schema import RecomputeConfig
from verl_mega.models import load_hf_model_config
from verl_mega.models.expected_shapes import expected_hf_shapes
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.planning.memory import (
    Model, Roles, korthikanti_shape, layer_activation_bytes, layer_input_bytes, layout_of,
    optimizer_bytes_per_parameter, plan_memory, stage_activation_bytes, suggest_layouts,
)
from verl_mega.trainer.preflight import preflight_check

S, B, H, A = 2048, 1, 6144, 48  # any sizes: the table's rows are identities in them


@pytest.mark.parametrize("tp, sp, selective, per_sbh", [
    (1, False, False, 34 + 5 * A * S / H),  # no parallelism
    (8, False, False, 10 + 24 / 8 + 5 * A * S / (H * 8)),  # tensor parallel
    (8, True, False, (34 + 5 * A * S / H) / 8),  # + sequence parallel
    (8, False, True, 10 + 24 / 8),  # tensor parallel + selective recompute
    (8, True, True, 34 / 8),  # + sequence parallel
])
def test_korthikanti_table_2_rows(tp, sp, selective, per_sbh):
    got = layer_activation_bytes(korthikanti_shape(H, A), S, B, tp, sp, selective, act_bytes=2)
    assert got == pytest.approx(S * B * H * per_sbh)


def test_korthikanti_full_recompute_keeps_2sbh():
    assert layer_input_bytes(korthikanti_shape(H, A), S, B, 1, False, act_bytes=2) == 2 * S * B * H


@pytest.mark.parametrize("param_bytes, grad_bytes, whole, fixed, sharded", [
    (2, 2, 20, 4, 16),  # fp16 params, fp16 grads
    (2, 4, 18, 6, 12),  # bf16 params, fp32 grads: what verl_mega's bf16 runs take
    (4, 4, 16, 8, 8),  # fp32 params, fp32 grads
])
def test_megatron_distributed_optimizer_bytes_per_parameter(param_bytes, grad_bytes, whole, fixed, sharded):
    for dp in (1, 8, 64):
        assert sum(optimizer_bytes_per_parameter(param_bytes, grad_bytes, False, dp).values()) == whole
        assert sum(optimizer_bytes_per_parameter(param_bytes, grad_bytes, True, dp).values()) == pytest.approx(
            fixed + sharded / dp)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("planner")
    hf = make_tiny_hf_model(folder / "qwen2", "qwen2", tokenizer=False)
    config = folder / "run.yaml"
    config.write_text(f"model:\n  hf_path: {hf}\n  dtype: bf16\ndata:\n  max_prompt_length: 512\n"
                      "  max_response_length: 512\n")
    return config


def test_more_recompute_and_more_tp_keep_less(tiny):
    model = Model(load_config(tiny))
    shape = dataclasses.replace(korthikanti_shape(64, 4), gated=True, dropout=False, flash=False)
    by_granularity = [stage_activation_bytes(shape, 4, 1024, 2, 1, False, RecomputeConfig(granularity), 2)
                      for granularity in ("none", "selective", "full")]
    assert by_granularity == sorted(by_granularity, reverse=True) and len(set(by_granularity)) == 3
    roles = Roles(critic=True, reference=True)
    base = layout_of(model.config, 2)
    peaks = [plan_memory(model, dataclasses.replace(base, tp=tp, sequence_parallel=tp > 1), roles)
             for tp in (1, 2)]
    assert peaks[1].max_memory_allocated_gb < peaks[0].max_memory_allocated_gb
    assert peaks[1].roles["actor"]["params"] < peaks[0].roles["actor"]["params"]


def test_suggest_lists_fitting_layouts_cheapest_first(tiny):
    model = Model(load_config(tiny))
    plans = suggest_layouts(model, Roles(critic=False, reference=False), gpus=2, gpu_memory_gb=80, limit=4)
    assert [plan.fits for plan in plans] == [True] * 4
    first = plans[0].layout
    assert (first.tp, first.pp, first.recompute.granularity, first.distributed_optimizer) == (1, 1, "none", False)
    assert suggest_layouts(model, Roles(critic=False, reference=False), gpus=2, gpu_memory_gb=1e-3) == []


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "verl_mega.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_memory_json_and_the_old_plan(tiny, tmp_path):
    done = run_cli("--memory", str(tiny), "parallel.tp=2", "--json", "--gpus", "4", "--gpu-memory", "80")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["layout"]["tp"] == 2 and found["layout"]["dp"] == 2 and found["fits"] is True
    assert {"actor.update", "actor.log_prob", "critic.update", "rollout", "transition"} <= set(found["phases"])
    assert found["max_memory_allocated_gb"] == max(phase["gb"] for phase in found["phases"].values())
    assert found["roles"]["actor"]["optimizer"] > 0 and found["tflops"]["total"] > 0
    hf = load_config(tiny).model.hf_path
    old = run_cli("--hf", hf, "--train-tp", "2", "--train-pp", "1", "--dp", "1", "--rollout-tp", "1")
    assert old.returncode == 0 and "micro-DP" in old.stdout, old.stderr


def test_preflight_refuses_a_config_predicted_not_to_fit(tiny):
    config = load_config(tiny, ["trainer.gpu_memory_gb=0.001"])
    with pytest.raises(ConfigError, match=r"trainer.gpu_memory_gb=0.001: predicted peak .* GiB per rank"):
        preflight_check(config, world_size=1, check_files=False)
    preflight_check(load_config(tiny, ["trainer.gpu_memory_gb=0.001", "trainer.skip_memory_check=true"]),
                    world_size=1, check_files=False)


FIXTURES = Path(__file__).parent / "fixtures" / "model_configs"


@pytest.mark.parametrize("name, billions", [
    ("qwen2.5-7b", 7.62), ("qwen2.5-32b", 32.76), ("qwen2.5-72b", 72.71), ("qwen3-30b-a3b", 30.53),
    ("deepseek-v3", 671.03),  # the main model; the published 685B adds the 14B multi-token-prediction module
])
def test_the_docs_model_configs_have_the_published_parameter_counts(name, billions):
    hf_config, family = load_hf_model_config(FIXTURES / name)
    total = sum(math.prod(shape) for shape in expected_hf_shapes(hf_config, family).values())
    assert round(total / 1e9, 2) == billions


def test_the_rollout_window_holds_the_actor_without_its_gradients_and_adam_moments(tiny):
    """rollout/training_memory drops the actor's gradient buffers and moves Adam's moments to the host while the
    engine is awake; the critic keeps all of it."""
    model = Model(load_config(tiny))
    layout = layout_of(model.config, 1)
    plan = plan_memory(model, layout, Roles(critic=True, reference=False))
    actor_params = plan.roles["actor"]["params"] / 2  # bf16
    released = actor_params * (4 + 2 * 4)  # the fp32 gradient buffer and two fp32 moments per parameter
    assert plan.phases["rollout"].resident_bytes == pytest.approx(plan.phases["actor.update"].resident_bytes - released)
    assert plan.phases["transition"].resident_bytes == plan.phases["rollout"].resident_bytes


@pytest.mark.parametrize("pp, vpp, micro_batches", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 3, 16)])
def test_interleaved_schedule_holds_1_plus_p_minus_1_over_pv_more(pp, vpp, micro_batches):
    """Narayanan et al. 2021 / Korthikanti et al. 2022 (section 4.2.3): interleaving multiplies the first stage's
    in-flight activations, p micro-batches' worth of its layers under 1F1B, by 1 + (p - 1) / (p v)."""
    from verl_mega.planning.memory import in_flight_micro_batches

    assert in_flight_micro_batches(0, pp, micro_batches) == pp
    assert in_flight_micro_batches(0, pp, micro_batches, vpp) == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))
    # With as many micro-batches as stages, every forward runs first.
    assert in_flight_micro_batches(pp - 1, pp, pp, vpp) == pp


def test_context_parallelism_splits_activations_not_logits(tiny):
    """The layers' activations hold s/cp tokens per rank; the last stage gathers the sequence back before the
    output layer (every CP rank computes the whole loss), so the logits are whole."""
    model = Model(load_config(tiny, ["parallel.pp=1"]))
    roles = Roles(critic=False, reference=False)
    whole = plan_memory(model, layout_of(model.config, 2), roles)
    split = plan_memory(model, dataclasses.replace(layout_of(model.config, 2), cp=2), roles)
    assert split.layout.dp == 1 and whole.layout.dp == 2
    update, whole_update = split.phases["actor.update"].parts, whole.phases["actor.update"].parts
    assert update["activations"] == pytest.approx(whole_update["activations"] / 2)
    assert update["logits"] == pytest.approx(whole_update["logits"])
    # The CP ranks hold the replica's weights as DP ranks do.
    assert split.roles["actor"]["params"] == whole.roles["actor"]["params"]


def test_offload_empties_the_rollout_window_and_cpu_offload_the_optimizer(tiny):
    """bf16, no distributed optimizer: 2 B of parameters, 4 of fp32 gradients, 4 of fp32 main parameters and 8 of
    Adam's moments per parameter. Offloading all of it leaves the actor nothing on the device while the engine
    generates; the transition, which reads the parameters, still holds the 6 B of parameters and main parameters."""
    from verl_mega.config.schema import OffloadConfig

    model = Model(load_config(tiny))
    roles = Roles(critic=False, reference=False)
    base = layout_of(model.config, 1)
    everything = plan_memory(model, dataclasses.replace(base, offload=OffloadConfig(True, True, True)), roles)
    params = everything.roles["actor"]["params"] / 2
    assert everything.phases["actor.update"].resident_bytes == pytest.approx(params * 18)
    assert everything.phases["rollout"].resident_bytes == pytest.approx(0)
    assert everything.phases["transition"].resident_bytes == pytest.approx(params * 6)
    nothing = plan_memory(model, dataclasses.replace(base, offload=OffloadConfig(False, False, False)), roles)
    assert nothing.phases["rollout"].resident_bytes == nothing.phases["actor.update"].resident_bytes
    hosted = plan_memory(model, dataclasses.replace(base, cpu_offload=True), roles)
    assert hosted.roles["actor"]["optimizer"] == 0
    assert hosted.phases["actor.update"].resident_bytes == pytest.approx(params * 6)


def test_critic_offload_and_the_reference_leave_the_rollout_window(tiny):
    """bf16, no distributed optimizer: `critic.offload` releases the critic's 4 B of fp32 gradients and 8 of
    moments per parameter (its 6 B of parameters and main parameters too with params, once the engine has its copy:
    the transition still holds 6 B of the actor's and 6 of the critic's); with the actor's parameters offloaded the
    reference's 2 B are on the host but in its own pass."""
    from verl_mega.config.schema import OffloadConfig

    model = Model(load_config(tiny, ["critic.offload.grads=true", "critic.offload.optimizer=true"]))
    plain = Model(load_config(tiny))
    both = Roles(critic=True, reference=True)
    layout = layout_of(model.config, 1)
    offloaded, kept = plan_memory(model, layout, both), plan_memory(plain, layout, both)
    params = kept.roles["actor"]["params"] / 2
    assert kept.phases["rollout"].resident_bytes - offloaded.phases["rollout"].resident_bytes == pytest.approx(
        params * 12)
    everything = dataclasses.replace(layout, offload=OffloadConfig(True, True, True))
    critic_all = ["critic.offload.params=true", "critic.offload.grads=true", "critic.offload.optimizer=true"]
    with_params = plan_memory(Model(load_config(tiny, critic_all)), everything, both)
    assert with_params.phases["rollout"].resident_bytes == pytest.approx(0)
    assert with_params.phases["transition"].resident_bytes == pytest.approx(params * (6 + 6))
    phases = with_params.phases
    assert phases["reference.log_prob"].resident_bytes - phases["actor.log_prob"].resident_bytes == pytest.approx(
        params * 2)
    assert with_params.phases["actor.update"].resident_bytes == kept.phases["actor.update"].resident_bytes - params * 2


def test_cli_models_what_training_refuses_yet(tiny):
    done = run_cli("--memory", str(tiny), "parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", "--json", "--gpus", "8")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert (found["layout"]["vpp"], found["layout"]["cp"], found["layout"]["dp"]) == (2, 2, 2)


def test_a_distillation_teacher_is_held_through_the_step_at_its_own_layout(tiny, tmp_path):
    """A teacher twice the actor's width, in bf16: its weights (2 B per parameter, vocabulary padded) sit on every
    rank in every phase, halved at teacher.tp=2; its pass adds its logits at its layout; its forward's FLOPs join
    the step's. A teacher.ckpt is planned from the config.json of its copied HF assets."""
    teacher = make_tiny_hf_model(tmp_path / "teacher", "qwen2", tokenizer=False, hidden_size=128,
                                 intermediate_size=256)
    distill = ["algorithm.distill.loss=reverse_kl", f"teacher.hf_path={teacher}"]
    from verl_mega.trainer.plan import roles_of

    student = load_config(tiny)
    plain = plan_memory(Model(student), layout_of(student, 2), roles_of(student))
    assert "teacher" not in plain.roles and "teacher.log_prob" not in plain.phases

    def planned(*overrides):
        config = load_config(tiny, [*distill, *overrides])
        assert roles_of(config).teachers == (str(teacher),)
        return plan_memory(Model(config), layout_of(config, 2), roles_of(config))

    whole, split = planned(), planned("teacher.tp=2")
    hf, family = load_hf_model_config(teacher)
    parameters = sum(math.prod(shape) for shape in expected_hf_shapes(hf, family).values())
    assert whole.roles["teacher"]["params"] == pytest.approx(parameters * 2, rel=0.02)
    # halved but for the norms, which every TP rank holds whole
    assert whole.roles["teacher"]["params"] / 2 < split.roles["teacher"]["params"] < whole.roles["teacher"]["params"] * 0.55
    for name in ("actor.update", "rollout", "transition"):
        assert whole.phases[name].total_bytes - plain.phases[name].total_bytes == pytest.approx(
            whole.roles["teacher"]["params"])
    from verl_mega.models.builder import padded_vocab_size

    tokens = 1024 * whole.layout.micro_batch  # the sequence's, in bf16: over the vocabulary, split over teacher TP
    assert whole.phases["teacher.log_prob"].parts["logits"] == 2 * tokens * padded_vocab_size(hf.vocab_size, 1)
    assert split.phases["teacher.log_prob"].parts["logits"] == 2 * tokens * padded_vocab_size(hf.vocab_size, 2) / 2
    assert whole.flops["teacher.log_prob"] > plain.flops["actor.log_prob"]
    assert whole.flops["total"] - plain.flops["total"] == pytest.approx(whole.flops["teacher.log_prob"])

    ckpt = tmp_path / "ckpt"
    (ckpt / "hf_assets").mkdir(parents=True)
    (ckpt / "hf_assets" / "config.json").write_bytes((teacher / "config.json").read_bytes())
    config = load_config(tiny, ["algorithm.distill.loss=reverse_kl", f"teacher.ckpt={ckpt}"])
    assert roles_of(config).teachers == (str(ckpt / "hf_assets"),)
    assert plan_memory(Model(config), layout_of(config, 2), roles_of(config)).roles["teacher"] == whole.roles[
        "teacher"]
    with pytest.raises(ValueError, match="teacher tp=4 x pp=1 does not divide the 2 ranks"):
        planned("teacher.tp=4")
