"""Generation as a decoder is deployed, inside the comparison worker: for each prompt, the prefill (the whole
prompt, an empty cache), then decode steps of one token each, every side carrying its own KV cache (its
present outputs fed back as its past), so the candidate's cache error accumulates as it does in service.
Both sides are fed the same tokens: the prompt's, then the continuation the user gave, or else the
reference's greedy choice. Each step is one sample of the engine (every tensor compared, reduced as it is
produced); its logits are scored position by position on the token that follows (ΔNLL).

A pass fed the reference's values (the isolated run) reads the reference's cache, as it reads every other
reference value. The first step at which the candidate's own greedy choice differs from the reference's is
where free-running generation would part (up to it both saw the same tokens); from there the candidate
continues alone on its own choices, its tokens returned beside the reference's.

Verification's and bisect's trials generate again (`Job.generation` with "trial" set): each prompt is fed the
tokens the comparison fed (a continuation given stays one; the reference's own choices are `replayed`, scored
as when it chose them), and nobody generates alone: only the steps are measured. The reference's steps are then
the same in every job: a decoder of large weights has them replayed from a store (verification/trial.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Collection, Sequence

import numpy as np

from accudiff.execution.engine import Engine
from accudiff.errors import AccudiffError
from accudiff.model.decoder import Decoder
from accudiff.model.samples import Samples

PREFILL, DECODE = "prefill", "decode"
PASSES_AT_ONCE = 8  # carrying passes generated together: each holds its KV cache while a prompt generates


@dataclass(frozen=True)
class Step:
    """One step of one prompt's generation, as the engine's sample `sample`: its phase, the position of its
    first token and how many it feeds, and each side's greedy choice at its last position."""

    sample: int
    sequence: int
    step: int
    phase: str
    position: int
    tokens: int
    reference_next: int
    candidate_next: int


@dataclass
class Generation:
    """One prompt's generation: the prompt, the tokens fed after it (the reference's, or the continuation
    given) and the candidate's own continuation, which differs from the first step it chose otherwise
    (`diverged_at`: that step, None when it never did)."""

    sequence: int
    prompt: list[int]
    reference: list[int] = field(default_factory=list)
    candidate: list[int] = field(default_factory=list)
    diverged_at: int | None = None
    given: bool = False  # the tokens after the prompt are a continuation the user gave, not the reference's choice

    def as_json(self) -> dict:
        return asdict(self)


def samples_per_prompt(new_tokens: int) -> int:
    """The engine samples a prompt's generation takes: its prefill and `new_tokens` decode steps."""
    return new_tokens + 1


def generate_prompts(engine: Engine, spec: dict, prompts: Samples, indices: Sequence[int], carrying: Sequence[str],
                     on_prompt: Callable[[int, int], None]) -> dict[str, list]:
    """Each prompt generated through the engine, as a worker's job (`Job.generation`, `spec`) asks: every
    step and generation, as JSON. `on_prompt(done, total)` follows. Many carrying passes (a trial job's
    keep-lists) generate PASSES_AT_ONCE at a time, every prompt again for each round (the reference with
    them): the caches held at once stay bounded, whatever the keep-lists."""
    decoder = Decoder.from_json(spec["decoder"])
    cache_types = {name: np.dtype(kind) for name, kind in spec["cache_types"].items()}
    found: dict[str, list] = {"steps": [], "generations": []}
    rounds = [list(carrying[k : k + PASSES_AT_ONCE]) for k in range(0, len(carrying), PASSES_AT_ONCE)] or [[]]
    others = [p.name for p in engine.passes if p.name not in carrying]  # fed the reference's values: run in the first round
    for number, group in enumerate(rounds):
        only = None if len(rounds) == 1 else {*group, *(others if number == 0 else [])}
        for done, (prompt, index) in enumerate(zip(prompts, indices), 1):
            given, replayed = prompt.get("continuation"), prompt.get("replayed")
            steps, generation = generate(engine, decoder, prompt["input_ids"], given if given is not None else replayed, index, spec["new_tokens"], cache_types,
                                         group, scored=replayed is None, alone=not spec.get("trial", False), only=only)
            if number == 0:
                found["steps"] += [asdict(step) for step in steps]
                found["generations"].append(generation.as_json())
            on_prompt(number * len(prompts) + done, len(rounds) * len(prompts))
    return found


def generate(engine: Engine, decoder: Decoder, prompt: np.ndarray, continuation: np.ndarray | None, sequence: int, new_tokens: int,
             cache_types: dict, carrying: Sequence[str], scored: bool = True, alone: bool = True, only: Collection[str] | None = None) -> tuple[list[Step], Generation]:
    """One prompt's generation through the engine (see the module's docstring). `carrying`: the passes that
    carry their own cache (the candidate, a second backend); the others read the reference's. `scored`: a step's
    last position is scored on the `continuation`'s next token (not so when it replays the reference's own
    choices: the comparison chose it after the step). `alone`: where the candidate parts, it goes on alone.
    `only`: the passes that run (Engine.run_sample)."""
    first = sequence * samples_per_prompt(new_tokens)
    keep = {decoder.logits, *decoder.present_outputs}
    feed = decoder.first_feed(prompt, cache_types)
    own: dict[str, dict[str, np.ndarray]] = {}  # each carrying pass's cache, from its own present outputs
    fed = [int(t) for t in prompt]
    steps: list[Step] = []
    generation = Generation(sequence, [int(t) for t in prompt], given=continuation is not None)
    parted: tuple[int, dict[str, np.ndarray]] | None = None  # the candidate's own choice where it parted, and its cache then
    position = 0
    for step in range(samples_per_prompt(new_tokens)):
        given = int(continuation[step]) if continuation is not None and step < len(continuation) else -1
        targets = {decoder.logits: np.asarray([*fed[1:], given if scored else -1], np.int64)}  # each position scored on the token after it
        try:
            kept = engine.run_sample(first + step, feed, {name: own[name] for name in carrying if name in own}, targets, keep, only)
        except AccudiffError as exc:  # which step of which prompt: a decode step can fail where the prefill ran
            raise AccudiffError(f"{exc} (prompt {sequence}, {'its prefill' if step == 0 else f'decode step {step}'})") from None
        reference_next = given if given >= 0 else _greedy(kept["reference"][decoder.logits])
        candidate_next = _greedy(kept[carrying[0]][decoder.logits]) if carrying else reference_next
        steps.append(Step(first + step, sequence, step, PREFILL if step == 0 else DECODE, position, len(fed), reference_next, candidate_next))
        generation.reference.append(reference_next)
        if parted is None and candidate_next != reference_next:
            generation.diverged_at = step
            parted = candidate_next, decoder.next_past(kept[carrying[0]])
        position += len(fed)
        if step == new_tokens or reference_next in decoder.eos_token_id:
            break
        # The reference's cache feeds its next step; a reference replayed from a store has none (nor needs one), and
        # a carrying pass's cache spans the same positions.
        replayed = decoder.present_outputs[0] not in kept["reference"]
        feed = decoder.step_feed(np.asarray([reference_next]), decoder.next_past(kept[carrying[0] if replayed else "reference"]))
        own = {name: decoder.next_past(kept[name]) for name in carrying}
        fed = [reference_next]
    generation.candidate = list(generation.reference) if parted is None or not alone else _on_its_own(engine, decoder, carrying[0], generation, *parted)
    return steps, generation


def _on_its_own(engine: Engine, decoder: Decoder, name: str, generation: Generation, token: int, past: dict[str, np.ndarray]) -> list[int]:
    """The candidate's continuation when it generates alone: the reference's tokens up to where it parted,
    then its own greedy choices, as many as the reference made (or up to an end-of-sequence token)."""
    chosen = [*generation.reference[: generation.diverged_at], token]
    while len(chosen) < len(generation.reference) and token not in decoder.eos_token_id:
        outputs = engine.run_alone(name, decoder.step_feed(np.asarray([token]), past), {decoder.logits, *decoder.present_outputs})
        token, past = _greedy(outputs[decoder.logits]), decoder.next_past(outputs)
        chosen.append(token)
    return chosen


def _greedy(logits: np.ndarray) -> int:
    """The token a greedy decoder picks at the last position (a NaN position picks nothing: -1)."""
    last = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])[-1]
    return int(last.argmax()) if np.isfinite(last).all() else -1
