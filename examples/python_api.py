"""GRPO from Python on the copy task, then chat with the trained actor (`python python_api.py HF_DIR [STEPS]`)."""
import sys

import verl_mega as vm
from verl_mega.data.synthetic import make_task_rows
from verl_mega.data.tables import write_rows


def copy_reward(data_source, response: str, ground_truth: str, extra_info=None) -> float:
    """The fraction of the digits repeated in their place; extra or missing ones count as wrong."""
    response = response.strip()
    return sum(a == b for a, b in zip(response, ground_truth)) / max(len(response), len(ground_truth), 1)


if __name__ == "__main__":  # under torchrun every rank runs this script
    model, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    write_rows(make_task_rows("copy", 512, max_digits=2), "copy.parquet")
    trainer = vm.Trainer(algorithm="grpo", actor=model, reward_fn=copy_reward, train_data="copy.parquet",
                         run_dir="runs/copy_grpo", config={
                             "trainer.total_steps": steps, "data.batch_size": 16, "rollout.n": 4,
                             "data.max_prompt_length": 16, "data.max_response_length": 4,
                             "actor.optim.lr": 5e-4, "actor.mini_batch_size": 64, "actor.micro_batch_size": 16})
    trainer.train()
    policy = vm.load_policy("runs/copy_grpo")
    print("copy: 42 ->", repr(policy.generate([{"role": "user", "content": "copy: 42"}], max_new_tokens=4)))
