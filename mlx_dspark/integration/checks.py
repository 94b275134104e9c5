"""``mlx_lm.server`` request checks that need the models: logit bias ids
against the target's vocabulary (mlx-lm indexes the logits with them
unchecked, and an id past the end crashes the server) and, with a
hidden-state drafter, ``num_draft_tokens``, the prompt and the pairing of
per-request ``model``/``draft_model`` overrides. They run in the handler
thread, where mlx-lm answers a ``ValueError`` with a 400 before the response
starts."""

from functools import lru_cache

from mlx_lm.utils import load

from ..checkpoints import load_drafter
from ..speculative.engine import checked_target
from ..validation import check_num_draft_tokens, check_token_ids, is_drafter, vocab_size
from .dispatch import drafter_config, drafter_options


def model_key(provider, model: str, adapter, draft: str) -> tuple:
    """The ``model_key`` ``ModelProvider.load`` gives these request fields."""
    aliases = [getattr(provider, f"_{name}_map", {}) for name in ("model", "adapter", "draft_model")]
    return (
        aliases[0].get(model, model),
        aliases[1].get(model, adapter),
        aliases[2].get(draft, draft),
    )


@lru_cache(maxsize=8)
def _unloaded(model_path, adapter_path, draft_path):
    """The target (its weights unread), tokenizer and hidden-state drafter
    of a key the server has not loaded; raises if the drafter does not fit
    the target."""
    try:
        model, tokenizer = load(model_path, adapter_path=adapter_path, lazy=True)
    except Exception:
        return None  # mlx-lm's own load reports it, as for any server
    drafter = None
    if draft_path is not None and drafter_config(draft_path) is not None:
        drafter = load_drafter(draft_path, lazy=True, **drafter_options)
        checked_target(model, drafter)
    return model, tokenizer, drafter


def serving_models(handler):
    """``(model, tokenizer, draft model)`` that will serve the handler's
    request, or ``None`` if the target cannot be loaded."""
    provider = handler.response_generator.model_provider
    key = model_key(
        provider, handler.requested_model, handler.adapter, handler.requested_draft_model
    )
    if key == provider.model_key:
        return provider.model, provider.tokenizer, provider.draft_model
    return _unloaded(*key)


def check_request(handler) -> None:
    models = serving_models(handler)
    if models is None:
        return
    model, tokenizer, draft = models
    if handler.logit_bias:
        check_token_ids(handler.logit_bias, vocab_size(model), "logit_bias")
    if not is_drafter(draft):
        return
    check_num_draft_tokens(handler.num_draft_tokens, draft)
    prompt = handler.body.get("prompt")
    if handler.path == "/v1/completions" and isinstance(prompt, str):
        if not tokenizer.encode(prompt):
            raise ValueError(
                "prompt is empty (it encodes to no tokens); speculative decoding "
                "needs at least one prompt token."
            )


def checking_requests(original):
    """``APIHandler.validate_model_parameters`` plus ``check_request``."""

    def validate_model_parameters(self):
        original(self)
        check_request(self)

    return validate_model_parameters
