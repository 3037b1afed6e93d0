"""Rollout: the engine interface, the embedded (transformers) and vLLM engines, and the HybridEngine
that regroups the actor's training shards into the rollout layout."""
