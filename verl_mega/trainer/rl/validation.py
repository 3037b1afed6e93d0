"""Held-out validation of the RL job: greedy generations on data.val_files through the same transition and
engine as the step, scored by the same reward; the mean reward overall and per data_source, a dict reward's
fields, the mean response length, and the scoring service's requests (reward.remote)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from verl_mega.config import TrainConfig
from verl_mega.data.prompts import PromptDataset
from verl_mega.rewards.remote import RemoteStats
from verl_mega.rollout.engine import Response, SamplingParams

from ..metrics import StageTimer
from ..progress import Progress
from ..rollout_batch import response_tokens
from .generation import Generation
from .rows import PROMPT_FIELDS, responses_batch, with_episodes
from .scoring import Scoring


class Validation:
    def __init__(self, config: TrainConfig, dataset: PromptDataset, generation: Generation, scoring: Scoring,
                 pad_token_id: int):
        self.config, self.dataset, self.generation, self.scoring = config, dataset, generation, scoring
        self.pad_token_id = pad_token_id

    def run(self, version: int, progress: Progress) -> dict[str, float]:
        """Collective. Each rollout replica generates and scores its share (every replicas-th prompt, in batches
        of data.batch_size) with the weights after `version` optimizer steps; the sums are gathered from every
        replica's leader. With rollout ranks of their own, they generate every batch (split over their replicas)
        and the first training rank scores it. `progress` shows the start, rank 0's batches and the end."""
        what = f"validation after step {version}"
        with progress.phase(f"{what} ({len(self.dataset)} prompts)"):
            return self._run(version, progress, what)

    def _run(self, version: int, progress: Progress, what: str) -> dict[str, float]:
        config, generation, layout = self.config, self.generation, self.generation.layout
        if generation.remote is not None:
            mine, leads = [self.dataset[i] for i in range(len(self.dataset))], layout.rank == 0
        else:
            coordinates = generation.rollout_coordinates()
            mine = [self.dataset[i] for i in range(coordinates.replica, len(self.dataset), coordinates.replicas)]
            leads = coordinates.leads_replica
        batches = progress.batches(-(-len(mine) // config.data.batch_size), what)  # this replica's share
        greedy = SamplingParams(temperature=0.0, max_new_tokens=config.data.max_response_length,
                                seed=config.rollout.seed)
        # data_source -> [reward sum, rows, response tokens, timeouts, worker deaths]
        sums: dict[str | None, list[float]] = {}
        field_sums: dict[str, list[float]] = {}  # a dict reward's numeric field -> [sum, rows with it]
        with generation.awake(StageTimer(), version):
            for start in range(0, len(mine), config.data.batch_size):
                items = mine[start:start + config.data.batch_size]
                rows = {key: [item.get(key) for item in items] for key in ("input_ids", *PROMPT_FIELDS)}
                responses = self.responses(rows, greedy)
                batches.advance()
                if not leads:  # its replica's leader scores the same responses
                    continue
                rows = with_episodes(rows, responses)
                batch = responses_batch(rows, responses, config.data.max_response_length, self.pad_token_id,
                                        log_probs=False)
                reward = self.scoring.score(batch, rows, version + 1)
                lengths = response_tokens(batch).sum(dim=-1)
                for row, (source, score, length) in enumerate(zip(rows["data_source"], reward.scores.tolist(),
                                                                   lengths.tolist())):
                    entry = sums.setdefault(None if source is None else str(source), [0.0, 0, 0, 0, 0])
                    entry[0], entry[1], entry[2] = entry[0] + score, entry[1] + 1, entry[2] + length
                    entry[3] += row in reward.timeouts
                    entry[4] += row in reward.worker_deaths
                add_field_sums(field_sums, reward.extras)
        batches.close()
        metrics = self.metrics(sum_over_ranks(sums, layout.world_size), sum_over_ranks(field_sums, layout.world_size))
        if self.scoring.remote is not None:  # every replica leader asked the service for its share
            metrics.update(gathered_stats(self.scoring.remote_stats(), layout.world_size).metrics())
        return metrics

    def metrics(self, totals: dict, field_totals: dict) -> dict[str, float]:
        reward_sum, count, tokens, timeouts, deaths = (sum(values[i] for values in totals.values()) for i in range(5))
        metrics = {"reward_mean": reward_sum / count, "response_length_mean": tokens / count}
        for source in sorted(name for name in totals if name is not None):
            metrics[f"reward_mean/{source}"] = totals[source][0] / totals[source][1]
        for name, (total, rows_with_it) in sorted(field_totals.items()):
            metrics[f"reward/{name}"] = total / rows_with_it if rows_with_it else float("nan")
        if self.scoring.counts_timeouts:
            metrics["reward/timeouts"] = timeouts
            metrics["reward/worker_deaths"] = deaths
        return metrics

    def responses(self, rows: dict, greedy: SamplingParams) -> list[Response]:
        """This replica's greedy responses to a validation batch, or every one from the rollout ranks."""
        generation = self.generation
        if generation.remote is None:
            return generation.responses(rows["input_ids"], rows["raw_prompt"], greedy)
        responses, _ = generation.remote.request(rows["input_ids"], [greedy] * generation.remote.replicas).result()
        return responses


def add_field_sums(sums: dict[str, list[float]], extras: dict[str, torch.Tensor]) -> None:
    """Add each field's sum and count of rows that have it (not NaN) to `sums`."""
    for name, values in extras.items():
        present = ~torch.isnan(values)
        entry = sums.setdefault(name, [0.0, 0])
        entry[0], entry[1] = entry[0] + values[present].sum().item(), entry[1] + int(present.sum())


def gathered_stats(stats: RemoteStats, world_size: int) -> RemoteStats:
    """Collective: every rank's requests to the scoring service, together."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, stats)
    return RemoteStats.merged(gathered)


def sum_over_ranks(sums: dict, world_size: int) -> dict:
    """Collective: every rank's {key: [numbers]} added up key by key and position by position."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, sums)
    totals: dict = {}
    for rank_sums in gathered:
        for key, values in rank_sums.items():
            totals[key] = [a + b for a, b in zip(totals.get(key, [0] * len(values)), values)]
    return totals
