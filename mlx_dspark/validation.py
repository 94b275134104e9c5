"""Checks of user input shared by the Python API, the commands, the server and
the checkpoint loaders. Each raises one ``ValueError`` that names the argument
(or config field) and says what is allowed."""

import math
from typing import Optional

import mlx.core as mx

KINDS = {
    "integer": "an integer",
    "number": "a number",
    "positive": "a number > 0",
    "boolean": "true or false",
    "string": "a string",
    "list": "a list",
    "object": "an object",
}


def _is_kind(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in ("number", "positive"):
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (kind == "number" or value > 0)
        )
    types = {"boolean": bool, "string": str, "list": list, "object": dict}
    return isinstance(value, types[kind])


def describe(kind: str, low=None, high=None) -> str:
    """``"an integer in [1, 4]"`` and the like."""
    text = KINDS[kind]
    if low is not None and high is not None:
        return f"{text} in [{low}, {high}]"
    if low is not None:
        return f"{text} >= {low}"
    if high is not None:
        return f"{text} <= {high}"
    return text


def problem(value, kind: str, low=None, high=None) -> Optional[str]:
    """What ``value`` must be, if it is not a ``kind`` in ``[low, high]``."""
    if not _is_kind(value, kind):
        return describe(kind, low, high)
    if (low is not None and value < low) or (high is not None and value > high):
        return describe(kind, low, high)
    return None


def check(value, name: str, kind: str, low=None, high=None):
    """``value`` if it is a ``kind`` in ``[low, high]``, else a ValueError
    naming ``name``."""
    wanted = problem(value, kind, low, high)
    if wanted is not None:
        raise ValueError(f"{name} must be {wanted}, got {value!r}.")
    return value


def check_callable(value, name: str) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or None, got {value!r}.")


def check_processors(processors, name: str = "logits_processors") -> None:
    if processors is None:
        return
    if not isinstance(processors, (list, tuple)) or not all(
        callable(p) for p in processors
    ):
        raise ValueError(
            f"{name} must be a list of callables (mlx-lm logits processors), "
            f"got {processors!r}."
        )


def is_drafter(obj) -> bool:
    """A hidden-state drafter (``mlx_dspark.drafters.base.Drafter``), as
    opposed to an ordinary draft language model."""
    return callable(getattr(obj, "propose", None)) and callable(
        getattr(obj, "commit", None)
    )


def check_drafter(drafter, name: str = "drafter") -> None:
    if not is_drafter(drafter):
        raise ValueError(
            f"{name} must be a hidden-state drafter from mlx_dspark.load_drafter, "
            f"got {type(drafter).__name__}."
        )


def check_num_draft_tokens(value, drafter, name: str = "num_draft_tokens") -> int:
    if problem(value, "integer", 1, drafter.max_draft_tokens) is not None:
        raise ValueError(
            f"{name} must be an integer between 1 and {drafter.max_draft_tokens} "
            f"for this drafter (its trained block size is {drafter.block_size}), "
            f"got {value!r}."
        )
    return value


def check_max_tokens(value, name: str = "max_tokens") -> int:
    if problem(value, "integer", -1) is not None:
        raise ValueError(f"{name} must be an integer >= 0 or -1 (no limit), got {value!r}.")
    return value


def check_token_ids(ids, vocab_size: int, name: str) -> None:
    """``ids`` (ints) are token ids of a ``vocab_size`` vocabulary."""
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        shown = ", ".join(map(str, sorted(set(outside))[:5]))
        raise ValueError(
            f"{name} has token ids outside the model's vocabulary [0, {vocab_size}): "
            f"{shown}."
        )


def parse_logit_bias(bias, name: str) -> dict:
    """``{token id: bias}`` from JSON's ``{"42": -5}``. The ids must then pass
    ``check_token_ids``: mlx-lm's logit bias processor indexes the logits with
    them unchecked, and an id past the end crashes the process."""
    if not isinstance(bias, dict):
        raise ValueError(
            f"{name} must be a JSON object of token ids to biases, e.g. "
            f"'{{\"42\": -5}}', got {bias!r}."
        )
    try:
        bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must map token ids (integers) to biases (numbers), got {bias!r}."
        ) from None
    return bias


def check_prompt(prompt, vocab_size: int) -> mx.array:
    """The prompt as a non-empty 1-D ``uint32`` array of token ids."""
    if not isinstance(prompt, mx.array):
        raise ValueError(
            f"prompt must be an mx.array of token ids, got {type(prompt).__name__}."
        )
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise ValueError(
            f"prompt must hold integer token ids, got dtype {prompt.dtype}."
        )
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(
            "prompt must be a non-empty 1-D array of token ids, got shape "
            f"{tuple(prompt.shape)}."
        )
    low, high = mx.min(prompt).item(), mx.max(prompt).item()
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"prompt has token ids outside the target's vocabulary [0, {vocab_size}): "
            f"min {low}, max {high}."
        )
    return prompt.astype(mx.uint32)


def vocab_size(model) -> int:
    """The width of ``model``'s logits. MLX infers shapes when it builds the
    graph, so this computes nothing."""
    return model(mx.zeros((1, 1), mx.uint32)).shape[-1]
