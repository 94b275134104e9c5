"""The replacements ``patch_module`` puts into ``mlx_lm.generate`` and
``mlx_lm.server``.

Each one calls mlx-lm's own function unchanged unless a draft model (or one
of mlx-dspark's flags) is involved, and only then imports the module that
does the work (``dispatch``, ``server`` or ``cli``). So this module uses the
standard library alone, and mlx-lm without a drafter runs its own code.
"""

import sys
import threading

# Per thread: the slot a speculative run reports its statistics to (set by
# the CLI, or by the server for the request it serves) and, in the server,
# the rollback depth of the caches it makes.
local = threading.local()

# The logits processors mlx_lm.generate's flags ask for (mlx-lm's own CLI
# has no such flags; the server takes them per request), and how the server
# batches requests with a drafter (``--draft-batch-policy``).
generation_options = {}
server_options = {}

# The flags that send a command line through ``cli`` (with -h and --help).
DRAFTER_FLAGS = (
    "--draft-model",
    "--draft-confidence-threshold",
    "--draft-kv-view",
    "--draft-scheduler",
    "--draft-calibration",
    "--draft-batch-policy",
)
PROCESSOR_FLAGS = (
    "--repetition-penalty",
    "--repetition-context-size",
    "--presence-penalty",
    "--frequency-penalty",
    "--logit-bias",
)

_handler = threading.local()


def names_a_flag(argv, flags) -> bool:
    """Whether ``argv`` asks for help or has one of ``flags``, or a prefix
    of one (argparse accepts unambiguous prefixes)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return True
        name = arg.split("=", 1)[0]
        if len(name) > 2 and name.startswith("--"):
            if any(flag.startswith(name) for flag in flags):
                return True
    return False


def main(original, prog, default_model=None, with_processors=False):
    flags = DRAFTER_FLAGS + (PROCESSOR_FLAGS if with_processors else ())

    def main():
        if not names_a_flag(sys.argv[1:], flags):
            return original()
        from . import cli

        return cli.main(original, prog, default_model, with_processors)

    return main


def load(original):
    """mlx-lm's ``load``, which also loads hidden-state drafter checkpoints.

    mlx-lm's CLI and server load the target with options, then the draft
    model with none; a drafter gets the target's tokenizer (drafter
    checkpoints ship none)."""
    last_tokenizer = {}

    def load(path_or_hf_repo, *args, **kwargs):
        if not args and not kwargs:
            from .dispatch import load_if_drafter

            drafter = load_if_drafter(path_or_hf_repo)
            if drafter is not None:
                return drafter, last_tokenizer.get("target")
        result = original(path_or_hf_repo, *args, **kwargs)
        last_tokenizer["target"] = result[1]
        return result

    return load


def speculative_generate_step(original):
    def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
        from . import dispatch

        return dispatch.speculative_generate_step(
            original, prompt, model, draft_model, *args, **kwargs
        )

    speculative_generate_step.__doc__ = original.__doc__
    return speculative_generate_step


def generate(original):
    """``mlx_lm.generate.generate`` with the logits processors the command
    line asked for and, with a draft model, the speculative statistics
    printed when verbose."""

    def generate(*args, **kwargs):
        if kwargs.get("draft_model") is None and not generation_options:
            return original(*args, **kwargs)
        from . import cli

        return cli.generate(original, *args, **kwargs)

    return generate


def make_prompt_cache(original):
    """``mlx_lm.server.make_prompt_cache``, which makes rollback-correct
    caches while the server serves a request with a draft model."""

    def make_prompt_cache(model, max_kv_size=None):
        if getattr(local, "max_rollback", None):
            from . import server

            caches = server.rollback_prompt_cache(model)
            if caches is not None:
                return caches
        return original(model, max_kv_size)

    return make_prompt_cache


def next_request(original, context_type):
    """``ResponseGenerator._next_request``; a request with a draft model gets
    a statistics slot that travels with its response queue
    (``server.prepare_request``)."""

    def _next_request(self, timeout=None):
        request = original(self, timeout)
        if request is None or self._is_distributed:
            return request
        draft = request[2].model.draft
        if draft == "default_model":  # what a request names unless it asks
            draft = self.model_provider.cli_args.draft_model
        if draft is None:
            return request
        from . import server

        return server.prepare_request(self, request, context_type)

    return _next_request


def serve_single(original):
    """``ResponseGenerator._serve_single``; a request with a draft model goes
    through ``server.serve_single``."""

    def _serve_single(self, request, stream):
        if self.model_provider.draft_model is None:
            return original(self, request, stream)
        from . import server

        return server.serve_single(original, self, request, stream)

    return _serve_single


def provider_load(original):
    """``ModelProvider.load``; with a draft model that drafts for a batch,
    the server batches its requests (``server.make_batchable``)."""

    def load(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self.draft_model is not None:
            from . import server

            server.make_batchable(self)
        return result

    return load


def batch_generator(original):
    """``mlx_lm.server.BatchGenerator``: the speculative one for a target that
    ``provider_load`` paired with a drafter, mlx-lm's otherwise."""

    def make(model, **kwargs):
        pair = getattr(local, "batch_pair", None)
        if pair is None or pair[0] is not model:
            return original(model, **kwargs)
        from . import server

        return server.batch_generator(pair, model, **kwargs)

    return make


def checking_requests(original):
    """``APIHandler.validate_model_parameters``, plus ``checks.check_request``
    for a request with a draft model or a logit bias."""

    def validate_model_parameters(self):
        original(self)
        default_draft = self.response_generator.model_provider.cli_args.draft_model
        if self.logit_bias or "draft_model" in self.body or default_draft is not None:
            from . import checks

            checks.check_request(self)

    return validate_model_parameters


def remember_statistics(original):
    """``ResponseGenerator.generate``, keeping in the calling handler thread
    the slot a speculative request reports its statistics to."""

    def generate(self, *args, **kwargs):
        ctx, responses = original(self, *args, **kwargs)
        _handler.slot = getattr(ctx, "speculative", None)
        return ctx, responses

    return generate


def with_speculative_usage(original):
    """``APIHandler`` response builders that add ``usage.speculative``."""

    def build(self, *args, **kwargs):
        response = original(self, *args, **kwargs)
        slot = getattr(_handler, "slot", None)
        if "usage" in response and slot is not None and slot.stats is not None:
            response["usage"]["speculative"] = slot.stats.as_dict()
        return response

    return build
