"""An exported HF folder uploaded to a Hub repo (`verl-mega export --push-to-hub`), through huggingface_hub with
the environment the downloads use (HF_ENDPOINT, HF_TOKEN): the repo is created when it does not exist (private
when asked; an existing repo keeps its visibility), a revision other than main is a branch made from main when
missing, and the folder goes up as one commit. Failures are one line naming the repo."""
from __future__ import annotations

from pathlib import Path

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from .refs import DEFAULT_REVISION
from .resolve import HubError, endpoint, first_line, offline


def push_folder(folder: str | Path, repo_id: str, *, private: bool = False, revision: str = DEFAULT_REVISION,
                message: str = "Upload a model trained with verl_mega") -> str:
    """Upload `folder` to `repo_id` at branch `revision`; returns the commit."""
    if offline():
        raise HubError(f"--push-to-hub {repo_id}: HF_HUB_OFFLINE is set; unset it to upload")
    api = HfApi(endpoint=endpoint())
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision != DEFAULT_REVISION:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, commit_message=message).oid
    except httpx2.TransportError:
        raise HubError(f"--push-to-hub {repo_id}: HF_ENDPOINT {endpoint()} cannot be reached") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        hint = ": set HF_TOKEN to a token with write access to it" if status in (401, 403) else ""
        raise HubError(f"--push-to-hub {repo_id}: {endpoint()} refused the upload ({first_line(err)}){hint}") from None
