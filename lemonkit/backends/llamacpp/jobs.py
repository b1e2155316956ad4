"""What one generation asks of the decode thread: a :class:`Job` (prompt tokens and all that shapes sampling), and
the :data:`Logprob` it may hand back with each token. Its own module because the batcher, the generator and the
answer builders all read it, and none of them should import the others for a type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lemonkit.backends.llamacpp.sampler import ReasoningBudget

__all__ = ["Job", "Logprob"]

#: A generated token's logprob: (token, its bytes, logprob, [(alternative token, logprob)...]).
Logprob = tuple[int, bytes, float, list[tuple[int, float]]]


@dataclass
class Job:
    """One generation: the prompt and everything that shapes sampling."""

    tokens: list[int]
    sampling: dict[str, Any]
    seed: int
    max_tokens: int  # -1: until the context is full
    stops: list[str] = field(default_factory=list)
    grammar: str | None = None
    n_probs: int | None = None  # None: no logprobs; else top alternatives per token
    prompt: str = ""
    images: list[bytes] = field(default_factory=list)  # decoded image files (vision)
    cache_prompt: bool = True  # reuse a slot's cached prefix (llama-server's field); False: evaluate it all
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    budget: ReasoningBudget | None = None  # caps the reasoning's tokens
    priority: int = 0  # vLLM's field: lower goes first (a batch's rows are 1, behind interactive requests' 0)
