"""
The tuned constants of `lookahead_window="auto"` in one place: what each one controls and where it came from.

They were tuned on SmolLM2-135M-Instruct in fp32 on a 2-core CPU, on the tuning prompts (MT-Bench ids ending in 1-5,
HumanEval/0-81); `docs/source/en/results.md` has the measurements. None of them changes what is generated:
only which candidates a step verifies, so only the speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .configuration_lookahead import (
    AUTO_CONTEXT_DEPTH,
    AUTO_GUESS,
    AUTO_MAX_WINDOW,
    AUTO_NGRAM,
    MEMORY_DEPTH,
    MEMORY_NODES,
)


@dataclass(frozen=True)
class AutoTuning:
    """
    Args:
        ngram (`int`): N that `"auto"` uses (`lookahead_ngram="auto"`): candidates 4 tokens deep.
        guess (`int`): G that `"auto"` uses: n-grams kept per key in the pool; the policy prunes what does not pay.
        context_depth (`int`): the longest continuation copied from the context (prompt lookup) into a step's tree.
        max_window (`int`): the widest window `"auto"` considers.
        memory_depth (`int`): the deepest continuation the suffix memory proposes.
        memory_nodes (`int`): the most tree nodes the suffix memory adds to one step.
        window_cost_budget (`float`): the window `"auto"` runs is the widest whose step, with one candidate path,
            costs at most this many times that step without the window.
        compiled_step_cost (`float`): with a compiled forward pass, the longest step length it compiles costs at most
            this many one-token steps. 2.0 (16 tokens on the CPU) lost on open-ended prompts.
        compiled_buckets (`int`): the most multi-token step lengths a compiled forward pass compiles: every step is
            padded to the shortest of them that holds it.
        compiled_bucket_ratio (`float`): a shorter step length is compiled too only where the next longer one costs
            at least this many times as much (on a flat cost curve, one length holds every step).
        decay (`float`): weight the acceptance estimates keep at each step.
        match_prior (`float`): the first estimate of how often a pooled candidate matches once its parent did.
        context_prior (`float`): the same for the copied context continuation.
        memory_prior (`float`): the same for continuations from the suffix memory.
        window_credit_prior (`float`), window_steps_prior (`float`): the window's gain starts at their ratio, tokens
            per window step (optimistic, so that the window is tried).
        probe_every (`int`): steps without the window after which one window step is forced, at first.
        max_probe_every (`int`): the longest wait between forced window steps (each probe that did not pay doubles
            the wait).
        calibration_decay (`float`): weight kept by the calibration sums (predicted, accepted nodes) at each step.
        calibration_prior (`float`): predicted and accepted nodes the calibration starts from (a factor of 1).
        duration_smoothing (`float`): how fast measured step durations move the cost table's excess over one token.
        excess_scale_range (`tuple[float, float]`): the bounds of one duration's measured excess factor.
        underpricing_range (`tuple[float, float]`): the bounds of one duration's measured cost over what the excess
            factor explains (see `StepPricing.observe`).
        engine_steps_kept (`int`): the latest steps of a continuous-batching engine its cost is fitted to.
        engine_steps_needed (`int`): the steps an engine must have run before its own fit prices its steps (the
            cost table does until then).
    """

    ngram: int = AUTO_NGRAM
    guess: int = AUTO_GUESS
    context_depth: int = AUTO_CONTEXT_DEPTH
    max_window: int = AUTO_MAX_WINDOW
    memory_depth: int = MEMORY_DEPTH
    memory_nodes: int = MEMORY_NODES
    window_cost_budget: float = 1.25
    compiled_step_cost: float = 1.7
    compiled_buckets: int = 3
    compiled_bucket_ratio: float = 1.2
    decay: float = 0.9
    match_prior: float = 0.3
    context_prior: float = 0.5
    memory_prior: float = 0.5
    window_credit_prior: float = 0.5
    window_steps_prior: float = 1.0
    probe_every: int = 32
    max_probe_every: int = 256
    calibration_decay: float = 0.95
    calibration_prior: float = 1.0
    duration_smoothing: float = 0.2
    excess_scale_range: tuple[float, float] = (0.25, 4.0)
    underpricing_range: tuple[float, float] = (1.0, 4.0)
    engine_steps_kept: int = 64
    engine_steps_needed: int = 16


# Frozen: read, never written.
AUTO_TUNING = AutoTuning()
