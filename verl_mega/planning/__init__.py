"""Planning a run before it starts: arithmetic on the config and the HF config.json, no weights, no process
group. `memory` predicts each rank's peak memory, the step's FLOPs and the bytes it moves."""
