"""``mlx_lm.server`` serving a request with a draft model: rollback-correct
prompt caches that the server's LRU reuses within their reach, and the
speculative statistics of the request in its response's ``usage`` and in the
log. Requests without a draft model never get here (see ``hooks``)."""

import copy
import logging
import weakref

from ..cache import rollback_limit
from ..validation import problem
from .dispatch import StatsSlot, drafter_options, is_drafter, local, rollback_caches
from .hooks import server_options

# Rollback depth of the caches the server makes, so that a cached context
# serves later requests with up to this many drafts minus one.
SERVER_ROLLBACK = 32


def reach(cache) -> int:
    """How many of the newest tokens every cache in ``cache`` can drop."""
    return min(map(rollback_limit, cache), default=0)


def fetch_nearest_cache(lru, model, tokens):
    """``lru.fetch_nearest_cache`` (mlx-lm's ``LRUPromptCache``) for caches
    that can roll back only so far (a sliding-window cache keeps only
    ``max_rollback`` tokens beyond its window): a longer cached context is
    trimmed to the shared prefix only if every layer can do it, else a
    shorter one (or none) is used.

    A hit always leaves at least one prompt token to process, as mlx-lm does
    for longer contexts: a drafter needs the target's hidden states of it.
    """
    result = lru._trie.search(model, tokens)
    short_length = len(result.shorter) if result.shorter is not None else 0
    candidates = []
    if result.exact is not None:
        candidates.append((result.exact, len(tokens) - 1))
    if result.longer is not None and result.common_prefix > short_length:
        candidates.append((result.longer, min(len(tokens) - 1, result.common_prefix)))
    for key, prefix in candidates:
        entry = lru._trie.get(result.model, key)
        drop = len(key) - prefix
        if reach(entry.prompt_cache) >= drop:
            cache = copy.deepcopy(entry.prompt_cache)
            for c in cache:
                c.trim(drop)
            return cache, tokens[prefix:]
    if short_length > 0:
        entry = lru._trie.get(result.model, result.shorter)
        return copy.deepcopy(entry.prompt_cache), tokens[short_length:]
    return None, tokens


def rollback_prompt_cache(model):
    """The target's rollback-correct caches, or ``None`` for the drafter or
    a target without an adapter (``hooks.make_prompt_cache``)."""
    if is_drafter(model):
        return None
    return rollback_caches(model, local.max_rollback)


class _ReportingQueue:
    """A request's response queue that hands the request's statistics slot
    to the handler thread along with the generation context, and to the
    batch generator that the request is inserted into next (the server
    inserts a request right after putting its context on its queue)."""

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


def prepare_request(generator, request, context_type):
    """A request with a draft model, as the generation thread takes it: its
    queue carries its statistics slot, and from now on the server's LRU
    looks up caches within their rollback reach while a draft model is
    loaded (mlx-lm's own lookup otherwise)."""
    queue, completion, args = request
    lru, provider = generator.prompt_cache, generator.model_provider
    if "fetch_nearest_cache" not in vars(lru):
        stock = lru.fetch_nearest_cache
        lru.fetch_nearest_cache = lambda key, tokens: (
            fetch_nearest_cache(lru, key, tokens)
            if provider.draft_model is not None
            else stock(key, tokens)
        )
    if isinstance(queue, _ReportingQueue):
        return request
    slot = StatsSlot(num_draft_tokens=args.num_draft_tokens)
    return _ReportingQueue(queue, slot, context_type), completion, args


def serve_single(original, generator, request, stream):
    """``ResponseGenerator._serve_single`` for a request with a draft model:
    the request's caches roll back, its statistics are recorded and logged."""
    queue, completion, args = request
    slot = getattr(queue, "slot", None) or StatsSlot()
    local.slot = slot
    local.max_rollback = max(SERVER_ROLLBACK, (args.num_draft_tokens or 0) + 1)
    # A request without a seed samples a new text each time anyway: paced
    # as greedy ones are (see ``cli.prepare``).
    chosen = drafter_options.get("scheduler") or drafter_options.get("confidence_threshold")
    local.scheduler = None if chosen or getattr(args, "seed", None) is not None else "cost"
    try:
        original(generator, request, stream)
    finally:
        local.slot = None
        local.max_rollback = None
        local.scheduler = None
    if slot.stats is not None and slot.stats.rounds:
        logging.info("Speculative decoding: %s", slot.stats.summary())


def make_batchable(provider) -> None:
    """A drafter that drafts for a batch makes the server batch requests
    (``--draft-batch-policy off``: one at a time), with the server's
    ``--num-draft-tokens`` (where it fits the drafter) as the drafts a round
    the batch's costs are measured for."""
    drafter = provider.draft_model
    policy = server_options.get("batch_policy", "cost")
    if is_drafter(drafter) and hasattr(drafter, "propose_batch") and policy != "off":
        provider.is_batchable = True
        drafts = getattr(getattr(provider, "cli_args", None), "num_draft_tokens", None)
        if problem(drafts, "integer", 1, drafter.max_draft_tokens) is not None:
            drafts = None
        local.batch_pair = (provider.model, drafter, policy, drafts)


def batch_generator(pair, model, **kwargs):
    """The speculative batch generator the server drives for ``pair``, with
    the batch policy the drafter's batches were paced by before: the server
    makes a new generator after each drain (a request with a seed, or for
    another model, waits for the batch to end), and what the policy learnt
    of the rounds' real costs would go with the old one. (A policy still
    held by a generator not closed is not shared: a fresh one paces.)"""
    from ..batching.policy import POLICIES
    from .batch import ServerBatchGenerator

    _, drafter, name, drafts = pair
    try:
        kept = _policies.setdefault(drafter, {})
    except TypeError:  # a drafter that cannot be weakly referenced
        kept = {}
    policy = kept.get((name, drafts))
    if policy is None or getattr(policy, "costs", None) is not None:
        policy = kept[name, drafts] = POLICIES[name]()
    return ServerBatchGenerator(
        model, drafter, policy=policy, num_draft_tokens=drafts, **kwargs
    )


_policies = weakref.WeakKeyDictionary()
