"""``stream_generate`` and ``generate`` with a hidden-state drafter, shaped like
mlx-lm's own."""

import time
from dataclasses import dataclass
from typing import Generator, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.generate import GenerationResponse, generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .speculative.engine import speculative_generate_step
from .speculative.stats import SpeculativeStats
from .validation import check_drafter, check_max_tokens, problem


@dataclass
class SpeculativeResponse(GenerationResponse):
    """mlx-lm's ``GenerationResponse`` plus the speculative statistics so far."""

    stats: Optional[SpeculativeStats] = None


def _encode(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        add_special_tokens = tokenizer.bos_token is None or not prompt.startswith(
            tokenizer.bos_token
        )
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if not isinstance(prompt, (list, tuple)) or any(
        problem(t, "integer") for t in prompt
    ):
        raise ValueError(
            "prompt must be a string, a list of token ids (integers) or an "
            f"mx.array of them, got {prompt!r:.80}."
        )
    return mx.array(prompt) if prompt else mx.array([], mx.uint32)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    draft=None,
    max_tokens: int = 256,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Like ``mlx_lm.stream_generate``, drafting with ``draft`` (from
    ``load_drafter``). Each response carries ``.stats``.

    ``kwargs`` are mlx-lm's generation options (``prompt_cache``,
    ``prefill_step_size``, ...) plus ``num_draft_tokens`` (default: the
    drafter's trained block size). Without ``draft`` this is plain
    ``mlx_lm.stream_generate``.
    """
    if draft is None:
        yield from mlx_lm_stream_generate(
            model, tokenizer, prompt, max_tokens, **kwargs
        )
        return
    check_drafter(draft, "draft")
    if check_max_tokens(max_tokens) == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode(tokenizer, prompt)
    detokenizer = tokenizer.detokenizer
    stats = SpeculativeStats(draft.name, draft.block_size)
    steps = speculative_generate_step(
        prompt,
        model,
        draft,
        max_tokens=max_tokens,
        stop_tokens=tokenizer.eos_token_ids,
        stats=stats,
        **kwargs,
    )

    def response(token, logprobs, from_draft, n, finish_reason=None):
        return SpeculativeResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
            stats=stats,
        )

    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        for n, (token, logprobs, from_draft) in enumerate(steps):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if (n + 1) == max_tokens:
                break
            yield response(token, logprobs, from_draft, n)

        steps.close()
        detokenizer.finalize()
        finish = "stop" if token in tokenizer.eos_token_ids else "length"
        yield response(token, logprobs, from_draft, n, finish)


def generate(
    model: nn.Module, tokenizer, prompt, draft=None, verbose: bool = False, **kwargs
) -> str:
    """Like ``mlx_lm.generate``: the whole completion as a string; with
    ``verbose`` it streams the text and prints timings and the speculative
    statistics."""
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, draft=draft, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if response is None or not text:
            print("No text generated for this prompt")
            return text
        print(
            f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        if getattr(response, "stats", None) is not None:
            print(f"Speculative: {response.stats.summary()}")
    return text
