"""The engine over a zero-cost target (`ReplayEngine`): every stage real — scheduling, the gate,
drafting with the real n-gram drafter, pruning, acceptance, commit, the step log — and the
target's forward a lookup of known greedy outputs (`actors/target/replay.py`), taking the time
the caller gives it. It measures the coordinator's own time per step at batch sizes this
machine cannot run a model at (benchmarks/coordinator.py, issue #26), losslessly: its outputs
are the recorded ones."""

from __future__ import annotations

from collections.abc import Callable

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.drafters import hosted_drafter
from actors.target.replay import ReplayGroup
from dcut_core.cost_model import StepShape
from dcut_core.counterfactual import Trace


class ReplayEngine(Engine):
    """`Engine` at EP 1 in process, its target a `ReplayGroup` answering from `continuations`
    (prompt tokens -> greedy output); a forward sleeps `forward_s(shape)` seconds when given."""

    # Its forwards take what the caller says (or nothing): the real target's cached profile, copied
    # in, is what its gate and pruning decide by, not a profile of the lookup.
    checks_profile = False

    def __init__(self, cfg: EngineConfig, continuations: dict[tuple[int, ...], list[int]],
                 forward_s: Callable[[StepShape], float] | None = None) -> None:
        if cfg.ep != 1 or not cfg.in_process:
            raise ValueError("the replay target is one in-process rank (EP 1, in_process)")
        self._replay = (continuations, cfg.eos_token_id, forward_s)
        super().__init__(cfg)

    def _new_target(self) -> ReplayGroup:
        return ReplayGroup(self.cfg.ep_config(guests=hosted_drafter(self.cfg)), *self._replay)

    def save_learned(self) -> None:
        """Never: what it learns of a replayed target's costs must not warm a real engine of the
        same deployment (it shares the real one's cost-model cache and key)."""


def continuations(prompts: list[list[int]], trace: Trace) -> dict[tuple[int, ...], list[int]]:
    """Prompt -> greedy output, from a trace recorded on these prompts (in its order)."""
    if len(prompts) != len(trace.requests):
        raise ValueError(f"{len(prompts)} prompts for a trace of {len(trace.requests)} requests")
    out = {}
    for p, r in zip(prompts, trace.requests, strict=True):
        if len(p) != r.prompt_len:
            raise ValueError("the prompts are not the trace's (a prompt's length differs)")
        out[tuple(p)] = r.output.tolist()
    return out
