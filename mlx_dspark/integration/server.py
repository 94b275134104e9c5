"""``mlx_lm.server`` with speculative drafting: rollback-correct prompt caches
that the server's LRU reuses within their reach, and the speculative
statistics of each request in its response's ``usage`` and in the log."""

import copy
import logging
import threading

from mlx_lm.models.cache import LRUPromptCache

from .cli import server_options
from .dispatch import StatsSlot, is_drafter, local, rollback_caches

# Rollback depth of the caches the server makes, so that a cached context
# serves later requests with up to this many drafts minus one.
SERVER_ROLLBACK = 32

_handler = threading.local()


def reach(cache) -> int:
    """How many of the newest tokens every cache in ``cache`` can drop."""
    limits = []
    for c in cache:
        if hasattr(c, "rollback_limit"):
            limits.append(c.rollback_limit())
        elif c.is_trimmable():
            limits.append(c.offset)
        else:
            limits.append(0)
    return min(limits, default=0)


class RollbackAwarePromptCache(LRUPromptCache):
    """mlx-lm's LRU of prompt caches, for caches that can roll back only so
    far (a sliding-window cache keeps only ``max_rollback`` tokens beyond its
    window): a longer cached context is trimmed to the shared prefix only if
    every layer can do it, else a shorter one (or none) is used.

    A hit always leaves at least one prompt token to process, as mlx-lm
    does for longer contexts.
    """

    def fetch_nearest_cache(self, model, tokens):
        result = self._trie.search(model, tokens)
        short_length = len(result.shorter) if result.shorter is not None else 0
        candidates = []
        if result.exact is not None:
            candidates.append((result.exact, len(tokens) - 1))
        if result.longer is not None and result.common_prefix > short_length:
            candidates.append(
                (result.longer, min(len(tokens) - 1, result.common_prefix))
            )
        for key, prefix in candidates:
            entry = self._trie.get(result.model, key)
            drop = len(key) - prefix
            if reach(entry.prompt_cache) >= drop:
                cache = copy.deepcopy(entry.prompt_cache)
                for c in cache:
                    c.trim(drop)
                return cache, tokens[prefix:]
        if short_length > 0:
            entry = self._trie.get(result.model, result.shorter)
            return copy.deepcopy(entry.prompt_cache), tokens[short_length:]
        return None, tokens


def make_prompt_cache(original):
    """Rollback-correct target caches while the server serves a request with
    a draft model; mlx-lm's own otherwise (they batch)."""

    def make_prompt_cache(model, max_kv_size=None):
        if getattr(local, "max_rollback", None) and not is_drafter(model):
            caches = rollback_caches(model, local.max_rollback)
            if caches is not None:
                return caches
        return original(model, max_kv_size)

    return make_prompt_cache


class _ReportingQueue:
    """A request's response queue that hands the request's statistics slot
    to the handler thread along with the generation context, and to the
    batch generator that the request is inserted into next."""

    def __init__(self, queue, slot, context_type):
        self._queue = queue
        self.slot = slot
        self._context_type = context_type

    def put(self, item, *args, **kwargs):
        if isinstance(item, self._context_type):
            item.speculative = self.slot
            local.inserting = self.slot
        self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


def next_request(original, context_type):
    """``ResponseGenerator._next_request``, giving each request that names a
    draft model a statistics slot that travels with its response queue."""

    def _next_request(self, timeout=None):
        request = original(self, timeout)
        if request is None or self._is_distributed:
            return request
        queue, completion, args = request
        if args.model.draft is None or isinstance(queue, _ReportingQueue):
            return request
        slot = StatsSlot(num_draft_tokens=args.num_draft_tokens)
        return _ReportingQueue(queue, slot, context_type), completion, args

    return _next_request


def serve_single(original):
    """``ResponseGenerator._serve_single`` that records the request's
    speculative statistics and logs them."""

    def _serve_single(self, request, stream):
        queue, completion, args = request
        slot = getattr(queue, "slot", None)
        if self.model_provider.draft_model is None or slot is None:
            return original(self, request, stream)
        local.slot = slot
        local.max_rollback = max(SERVER_ROLLBACK, (args.num_draft_tokens or 0) + 1)
        try:
            original(self, request, stream)
        finally:
            local.slot = None
            local.max_rollback = None
        if slot.stats is not None and slot.stats.rounds:
            logging.info("Speculative decoding: %s", slot.stats.summary())

    return _serve_single


def batchable_load(original):
    """``ModelProvider.load``: a drafter that drafts for a batch makes the
    server batch its requests, through ``ServerBatchGenerator``."""

    def load(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        drafter = self.draft_model
        policy = server_options.get("batch_policy", "cost")
        if is_drafter(drafter) and hasattr(drafter, "propose_batch") and policy != "off":
            self.is_batchable = True
            local.batch_pair = (self.model, drafter, policy)
        return result

    return load


def batch_generator(original):
    """``mlx_lm.server.BatchGenerator``: the speculative one for the target
    that ``batchable_load`` paired with a drafter, mlx-lm's otherwise."""

    def make(model, **kwargs):
        target, drafter, policy = getattr(local, "batch_pair", (None, None, None))
        if target is not model:
            return original(model, **kwargs)
        from ..batching.policy import POLICIES
        from .batch import ServerBatchGenerator

        return ServerBatchGenerator(model, drafter, policy=POLICIES[policy](), **kwargs)

    return make


def remember_context(original):
    """``ResponseGenerator.generate``, remembering the request's context in
    the handler thread that called it."""

    def generate(self, *args, **kwargs):
        ctx, responses = original(self, *args, **kwargs)
        _handler.ctx = ctx
        return ctx, responses

    return generate


def with_speculative_usage(original):
    """``APIHandler`` response builders that add ``usage.speculative``."""

    def build(self, *args, **kwargs):
        response = original(self, *args, **kwargs)
        slot = getattr(getattr(_handler, "ctx", None), "speculative", None)
        if "usage" in response and slot is not None and slot.stats is not None:
            response["usage"]["speculative"] = slot.stats.as_dict()
        return response

    return build
