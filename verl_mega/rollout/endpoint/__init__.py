"""The rollout endpoint (`rollout.multi_turn.agent`): in the rollout engine's awake window, an OpenAI-compatible
server (`/v1/chat/completions`, `/v1/completions`) on a local port, one session per sample, driven by the user's
agent; the server records each session's trajectory token for token as the in-process agent loop does."""
from .openai_format import EndpointError
from .rollout import EndpointResult, EndpointRollout, load_agent

__all__ = ["EndpointError", "EndpointResult", "EndpointRollout", "load_agent"]
