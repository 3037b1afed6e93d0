"""The RL step's rollout side in this process, on a real embedded engine over a tiny model in a world of one:
the order of the HybridEngine transition around every awake window (training memory released before the engine
wakes, back after it sleeps), and the sampling stage's rounds (ReMax's greedy responses in the samples' window),
validation, and the sampler's checkpoint keys. The engine is wrapped only to note its calls."""
import contextlib

import pytest

from verl_mega.config import load_config
from verl_mega.data.prompts import PromptDataset
from verl_mega.data.synthetic import make_task_rows
from verl_mega.data.tables import write_rows
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.parallel.layout import ParallelLayout
from verl_mega.roles.reward import RuleReward
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import HFModelConfig
from verl_mega.trainer.progress import Progress
from verl_mega.trainer.rl.generation import Generation, eos_token_ids
from verl_mega.trainer.rl.sampling import Sampling
from verl_mega.trainer.rl.scoring import Scoring
from verl_mega.trainer.rl.step import Step
from verl_mega.trainer.rl.validation import Validation

# The parameters leave only once the engine holds its copy, before the KV cache is allocated.
TRANSITION = ["release", "wake_up:weights", "load_weights", "release_params", "wake_up:kv_cache"]
BACK = ["sleep", "restore"]


class RecordingEngine:
    """The real engine; its transitions and generation noted in `calls`."""

    def __init__(self, engine, calls: list):
        self._engine, self.calls = engine, calls

    def __getattr__(self, name):
        attribute = getattr(self._engine, name)
        if name not in ("wake_up", "load_weights", "generate", "sleep"):
            return attribute

        def recorded(*args, **kwargs):
            self.calls.append(f"wake_up:{','.join(args[0])}" if name == "wake_up" else name)
            return attribute(*args, **kwargs)

        return recorded


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("rl generation #1")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    train = write_rows(make_task_rows("copy", 16, seed=0, max_digits=2), root / "train.jsonl")
    val = write_rows(make_task_rows("copy", 3, seed=1, max_digits=2), root / "val.jsonl")
    return hf, train, val


def parts(inputs, *overrides):
    """(generation, sampling, validation, calls) over a recording engine on the tiny model, whose weights the
    transition streams from its HF folder (the actor's HybridEngine stream in a job)."""
    hf, train, val = inputs
    config = load_config(None, [f"model.hf_path={hf}", f"data.train_files=['{train}']", "data.batch_size=2",
                                "rollout.n=2", "data.max_response_length=4", "critic.enable=false",
                                "reward.function=exact_match", "algorithm.adv_estimator=grpo", *overrides])
    layout = ParallelLayout(rank=0, tp_rank=0, dp_rank=0, pp_rank=0, ep_rank=0, tp=1, pp=1, dp=1, ep=1,
                            world_size=1)
    tokenizer = load_tokenizer(hf)
    calls: list = []
    raw = HFModelConfig.read_raw(hf)
    engine = RecordingEngine(EmbeddedEngine(raw), calls)
    reader = SafetensorsReader(hf)

    @contextlib.contextmanager
    def training_memory():
        calls.append("release")
        yield lambda: calls.append("release_params")
        calls.append("restore")

    weights = lambda: ((name, reader.read(name)) for name in reader.names())  # noqa: E731
    generation = Generation(config, layout, engine, None, weights, training_memory, None, eos_token_ids(raw, tokenizer))
    notes = []
    scoring = Scoring(config, RuleReward(tokenizer, "exact_match"), None, 1, lambda *note: notes.append(note))
    dataset = PromptDataset([str(train)], tokenizer, config.data.max_prompt_length)
    sampling = Sampling(config, dataset, generation, scoring, tokenizer.pad_token_id, lambda *note: notes.append(note),
                        raw["vocab_size"])
    validation = Validation(config, PromptDataset([str(val)], tokenizer, config.data.max_prompt_length), generation,
                            scoring, tokenizer.pad_token_id)
    return generation, sampling, validation, calls


def test_memory_is_released_before_the_engine_wakes_at_every_step_and_validation(inputs, one_rank_world):
    generation, sampling, validation, calls = parts(inputs)
    passes = []
    for index in range(2):
        calls.clear()
        validation.run(index, Progress(enabled=False))
        passes.append(list(calls))
        calls.clear()
        sampling.run(Step(index))
        sampling.settle()
        passes.append(list(calls))
    for order in passes:
        generations = len(order) - len(TRANSITION) - len(BACK)
        assert order == TRANSITION + ["generate"] * generations + BACK and generations >= 1, order


def test_remax_rounds_generate_the_greedy_baselines_in_the_samples_window(inputs, one_rank_world):
    generation, sampling, _, calls = parts(inputs, "algorithm.adv_estimator=remax")
    step = Step(0)
    sampling.run(step)
    assert calls == TRANSITION + ["generate", "generate"] + BACK
    baselines = step.rows["reward_baseline"]
    assert len(baselines) == 4 and baselines[0] == baselines[1] and baselines[2] == baselines[3]
    assert step.timer.seconds["remax_baseline"] > 0
    assert step.batch["responses"].shape[0] == 4 and step.rows["uid"] == [0, 0, 1, 1]


def test_the_sampler_resumes_under_its_key_and_draws_what_the_straight_run_drew(inputs, one_rank_world):
    _, straight, _, _ = parts(inputs)
    straight.run(Step(0))
    state = straight.state_dict()
    assert set(state) == {"sampler", "rollout_schedule"}  # the keys checkpoints have always held
    _, resumed, _, _ = parts(inputs)
    resumed.load_state_dict({**state, "step": 1})  # the job state holds the checkpoint's step beside them
    steps = [Step(1), Step(1)]
    straight.run(steps[0])
    resumed.run(steps[1])
    assert steps[0].rows["index"] == steps[1].rows["index"]
    assert steps[0].batch["responses"].equal(steps[1].batch["responses"])
