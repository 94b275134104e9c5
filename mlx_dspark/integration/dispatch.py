"""Routing mlx-lm's speculative decoding: hidden-state drafters go to the
mlx-dspark engine; ordinary draft models go to mlx-lm's own loop, given caches
that roll back correctly past a sliding window."""

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache

from ..cache import rollback_depth
from ..checkpoints import load_drafter, read_config
from ..plugins import drafter_kinds, find_target_adapter
from ..speculative import engine
from ..speculative.stats import SpeculativeStats
from ..validation import is_drafter

from .hooks import generation_options, local

# Per process: the drafter options the command-line flags set, and drafters
# the CLI checked before mlx-lm loads them (the server loads in its
# generation thread).
drafter_options = {}
preloaded = {}


@dataclass
class StatsSlot:
    """Where one request's speculative statistics go; ``num_draft_tokens``
    is the request's own setting."""

    stats: Optional[SpeculativeStats] = None
    num_draft_tokens: Optional[int] = None


def checkpoint_config(path_or_hub_id: str) -> dict:
    """The ``config.json`` of a local checkpoint or a Hub repository."""
    path = Path(path_or_hub_id).expanduser()
    if not path.exists():
        try:
            path = Path(hf_hub_download(str(path_or_hub_id), "config.json")).parent
        except (OSError, ValueError, HfHubHTTPError) as e:
            raise ValueError(
                f"No model at {path_or_hub_id}: it is not a local directory, and "
                f"the Hugging Face Hub could not provide it ({e})."
            ) from None
    return read_config(path)


def drafter_config(path_or_hub_id: str) -> Optional[dict]:
    """The config of ``path_or_hub_id`` if an installed drafter kind claims
    it, else ``None``."""
    try:
        config = checkpoint_config(path_or_hub_id)
    except ValueError:
        return None
    if any(kind.detect(config) for kind in drafter_kinds()):
        return config
    return None


def load_if_drafter(path_or_hf_repo):
    """The drafter at ``path_or_hf_repo``, or ``None`` if no installed drafter
    kind claims it (``hooks.load`` calls this for mlx-lm's draft model)."""
    if drafter_config(path_or_hf_repo) is None:
        return None
    # MLX arrays belong to the thread that made them: the server loads in its
    # generation thread, not where the CLI checked the drafter.
    thread, drafter = preloaded.pop(path_or_hf_repo, (None, None))
    if thread != threading.get_ident():
        drafter = load_drafter(path_or_hf_repo, **drafter_options)
    network = getattr(drafter, "model", None)  # optional in the protocol
    if network is not None:
        mx.eval(network.parameters())
    return drafter


def rollback_caches(model, max_rollback: int):
    """``model``'s caches from its target adapter, or ``None`` without one."""
    try:
        adapter = find_target_adapter(model)
    except ValueError:
        return None
    return adapter.adapt(model).make_cache(max_rollback)


def _settle(model, cache, tokens, start):
    """Trim or extend ``cache`` so that it holds exactly ``tokens`` after
    position ``start``."""
    want = start + len(tokens)
    offset = cache[0].offset
    if offset > want:
        for c in cache:
            c.trim(offset - want)
    elif offset < want:
        model(mx.array(tokens[offset - start :], mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])


def two_model_step(
    original: Callable,
    prompt,
    model,
    draft_model,
    stream=generation_stream,
    *,
    prompt_cache=None,
    num_draft_tokens: int = 3,
    **kwargs,
):
    """mlx-lm's own speculative loop with an ordinary draft model, made
    lossless past a sliding window by caches that roll back at any length.

    With a prompt cache, afterwards it holds the prompt and every yielded
    token (mlx-lm's own loop leaves the last one out, which desynchronises a
    reused cache from the tokens it is keyed by).
    """
    target_cache = rollback_caches(model, num_draft_tokens + 1)
    if target_cache is None:
        yield from original(
            prompt,
            model,
            draft_model,
            stream,
            prompt_cache=prompt_cache,
            num_draft_tokens=num_draft_tokens,
            **kwargs,
        )
        return
    if prompt_cache is None:
        draft_cache = rollback_caches(
            draft_model, num_draft_tokens + 1
        ) or mlx_lm_make_prompt_cache(draft_model)
        yield from original(
            prompt,
            model,
            draft_model,
            stream,
            prompt_cache=target_cache + draft_cache,
            num_draft_tokens=num_draft_tokens,
            **kwargs,
        )
        return

    split = len(model.layers)
    target_cache, draft_cache = prompt_cache[:split], prompt_cache[split:]
    shallow = [
        d
        for d in map(rollback_depth, target_cache + draft_cache)
        if d < num_draft_tokens + 1
    ]
    if shallow:
        raise ValueError(
            f"This prompt cache can roll back {min(shallow)} tokens; verifying "
            f"{num_draft_tokens} drafts needs {num_draft_tokens + 1}."
        )
    start = target_cache[0].offset
    history = prompt.tolist()
    try:
        for token, logprobs, from_draft in original(
            prompt,
            model,
            draft_model,
            stream,
            prompt_cache=prompt_cache,
            num_draft_tokens=num_draft_tokens,
            **kwargs,
        ):
            history.append(token)
            yield token, logprobs, from_draft
    finally:
        _settle(model, target_cache, history, start)
        _settle(draft_model, draft_cache, history, start)


def speculative_generate_step(
    original: Callable, prompt, model, draft_model, *args, **kwargs
):
    """``mlx_lm.generate.speculative_generate_step``: a hidden-state drafter
    goes to mlx-dspark's engine, an ordinary draft model to ``two_model_step``."""
    if not is_drafter(draft_model):
        return two_model_step(original, prompt, model, draft_model, *args, **kwargs)
    stats = SpeculativeStats(draft_model.name, draft_model.block_size)
    slot = getattr(local, "slot", None)
    if slot is not None:
        slot.stats = stats
    # The command line's (``cli.prepare``), or the server request's (``server.serve_single``).
    scheduler = getattr(local, "scheduler", None) or generation_options.get("scheduler")
    if scheduler is not None:
        kwargs.setdefault("scheduler", scheduler)
    return engine.speculative_generate_step(
        prompt, model, draft_model, *args, stats=stats, **kwargs
    )
