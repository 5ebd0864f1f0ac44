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
the same in every job: a decoder of large weights has them replayed from a store (verification/trial.py). Their
tokens all known, a trial's prompts of one length step together as rows of one batch: a decode step reads the
weights once for all of them, and each row is computed as that prompt alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable, Collection, Sequence

import numpy as np

from accudiff.execution.engine import Engine
from accudiff.errors import AccudiffError
from accudiff.model.decoder import Decoder
from accudiff.model.samples import Samples

PREFILL, DECODE = "prefill", "decode"
PASSES_AT_ONCE = 8  # carrying passes generated together: each holds its KV cache while a prompt generates
BATCH_TOKENS = 512  # prompt tokens a batch of a trial's prompts holds at most (`batches`)


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
    them): the caches held at once stay bounded, whatever the keep-lists. A trial's prompts of one length
    fed as many tokens generate together, as rows of one batch (`batches`)."""
    decoder = Decoder.from_json(spec["decoder"])
    cache_types = {name: np.dtype(kind) for name, kind in spec["cache_types"].items()}
    found: dict[str, list] = {"steps": [], "generations": []}
    rounds = [list(carrying[k : k + PASSES_AT_ONCE]) for k in range(0, len(carrying), PASSES_AT_ONCE)] or [[]]
    others = [p.name for p in engine.passes if p.name not in carrying]  # fed the reference's values: run in the first round
    trial = spec.get("trial", False)
    groups = [[k] for k in range(len(prompts))]
    if trial and spec.get("batch"):
        grouped = batches(list(prompts), spec["new_tokens"], decoder.eos_token_id)
        widest = max(grouped, key=len)  # each session's rows measured apart at a decode step's shape: one token a row
        if len(widest) > 1 and engine.rows_apart(decoder.first_feed(np.stack([prompts[k]["input_ids"][:1] for k in widest]), cache_types)):
            groups = grouped
    together = len(groups) < len(prompts)
    for number, group in enumerate(rounds):
        only = None if len(rounds) == 1 else {*group, *(others if number == 0 else [])}
        done = 0
        for rows in groups:
            chosen = [prompts[k] for k in rows]
            steps, generations = generate(engine, decoder, np.stack([p["input_ids"] for p in chosen]), [_tokens_fed(p) for p in chosen], [indices[k] for k in rows],
                                          spec["new_tokens"], cache_types, group, scored=[p.get("replayed") is None for p in chosen], alone=not trial, only=only)
            if number == 0:
                found["steps"] += [asdict(step) for step in steps]
                found["generations"] += [generation.as_json() for generation in generations]
            done += len(rows)
            on_prompt(number * len(prompts) + done, len(rounds) * len(prompts))
    if together:  # each prompt's steps and outcomes in the prompts' order, as one at a time gives them (figures add up in that order)
        order = {sequence: k for k, sequence in enumerate(indices)}
        per_prompt = samples_per_prompt(spec["new_tokens"])
        found["steps"].sort(key=lambda step: (order[step["sequence"]], step["step"]))
        found["generations"].sort(key=lambda generation: order[generation["sequence"]])
        for result in engine.results.values():
            result.outcomes.sort(key=lambda outcome: (order[outcome.sample // per_prompt], outcome.sample))
    return found


def batches(prompts: Sequence[dict], new_tokens: int, eos: Collection[int]) -> list[list[int]]:
    """Which of a trial's prompts (each fed the tokens its comparison fed after it) generate together, by their
    positions: those of one length that step in step to the same end. Each row is computed as it would be alone
    (where every session is measured to compute a batch's rows apart, Engine.rows_apart). A batch
    holds at most BATCH_TOKENS prompt tokens: its prefill's logits and caches are no larger than those of one
    prompt of that length."""
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for k, prompt in enumerate(prompts):
        length, steps = len(prompt["input_ids"]), _steps_fed(prompt, new_tokens, eos)
        rows = groups.setdefault((length, steps) if steps is not None else (-1 - k, 0), [[]])
        if rows[-1] and (len(rows[-1]) + 1) * length > BATCH_TOKENS:
            rows.append([])
        rows[-1].append(k)
    return sorted((rows for group in groups.values() for rows in group), key=lambda rows: rows[0])


def _steps_fed(prompt: dict, new_tokens: int, eos: Collection[int]) -> int | None:
    """How many steps a prompt generates when the tokens fed after it are all known (given, or replayed up to an
    end-of-sequence token); None when some are not (it chooses them as it goes)."""
    fed = _tokens_fed(prompt)
    if fed is None:
        return None
    ends = [step for step, token in enumerate(fed[:new_tokens]) if int(token) in eos]
    return ends[0] + 1 if ends else new_tokens + 1 if len(fed) >= new_tokens else None


def _tokens_fed(prompt: dict) -> np.ndarray | None:
    """The tokens fed after a prompt: the continuation given, or the comparison's own choices replayed (None: chosen as it goes)."""
    return prompt["continuation"] if prompt.get("continuation") is not None else prompt.get("replayed")


def generate(engine: Engine, decoder: Decoder, prompts: np.ndarray, continuations: Sequence[np.ndarray | None], sequences: Sequence[int], new_tokens: int,
             cache_types: dict, carrying: Sequence[str], scored: Sequence[bool], alone: bool, only: Collection[str] | None) -> tuple[list[Step], list[Generation]]:
    """The generation of one prompt, or of prompts of one length as rows of a batch ([rows, tokens], each
    with its `continuation` and `sequence`), through the engine (see the module's docstring). `carrying`: the
    passes that carry their own cache (the candidate, a second backend); the others read the reference's.
    `scored`: per row, whether a step's last position is scored on the `continuation`'s next token (not so when
    it replays the reference's own choices: the comparison chose it after the step). `alone`: where the
    candidate parts, it goes on alone (one row). `only`: the passes that run (Engine.run_sample)."""
    prompts = np.atleast_2d(prompts)
    rows = range(prompts.shape[0])
    firsts = [sequence * samples_per_prompt(new_tokens) for sequence in sequences]
    keep = {decoder.logits, *decoder.present_outputs}
    feed = decoder.first_feed(prompts, cache_types)
    own: dict[str, dict[str, np.ndarray]] = {}  # each carrying pass's cache, from its own present outputs
    fed = [[int(t) for t in prompt] for prompt in prompts]
    steps: list[Step] = []
    generations = [Generation(sequence, list(prompt), given=continuation is not None) for sequence, prompt, continuation in zip(sequences, fed, continuations)]
    own_way: list[_OnItsOwn | None] = [None for _ in rows]  # the candidate generating on its own, from where it parted
    position = 0
    for step in range(samples_per_prompt(new_tokens)):
        given = [int(c[step]) if c is not None and step < len(c) else -1 for c in continuations]
        # each position scored on the token after it
        targets = {decoder.logits: np.stack([np.asarray([*fed[r][1:], given[r] if scored[r] else -1], np.int64) for r in rows])}
        samples = [first + step for first in firsts]
        one = len(rows) == 1  # one prompt: its sample as the engine takes one (every tensor as it is, not as rows of a batch)
        going = [way for way in own_way if way is not None]  # a step each, beside this one's (as many as the reference makes)
        try:
            kept = engine.run_sample(samples[0] if one else samples, feed, {name: own[name] for name in carrying if name in own},
                                     {name: value[0] for name, value in targets.items()} if one else targets, keep, only,
                                     also=partial(_each_a_step, going) if going else None, held=decoder.resident(position + len(fed[0])))
        except AccudiffError as exc:  # which step of which prompt: a decode step can fail where the prefill ran
            said = f"prompt {sequences[0]}" if one else f"prompts {', '.join(map(str, sequences))}"
            raise AccudiffError(f"{exc} ({said}, {'its prefill' if step == 0 else f'decode step {step}'})") from None
        chosen = []
        for r in rows:
            reference_next = given[r] if given[r] >= 0 else _greedy(kept["reference"][decoder.logits][r])
            candidate_next = _greedy(kept[carrying[0]][decoder.logits][r]) if carrying else reference_next
            steps.append(Step(samples[r], sequences[r], step, PREFILL if step == 0 else DECODE, position, len(fed[r]), reference_next, candidate_next))
            generations[r].reference.append(reference_next)
            if generations[r].diverged_at is None and candidate_next != reference_next:
                generations[r].diverged_at = step
                if alone:
                    past = {name: value[r : r + 1] for name, value in decoder.next_past(kept[carrying[0]]).items()}
                    own_way[r] = _OnItsOwn(engine, decoder, carrying[0], [*generations[r].reference[:step], candidate_next], past, position + len(fed[0]))
            chosen.append(reference_next)
        position += len(fed[0])
        ended = [step == new_tokens or token in decoder.eos_token_id for token in chosen]
        assert all(ended) or not any(ended), "rows step together only where their tokens end together (batches)"
        if all(ended):
            break
        # The reference's cache feeds its next step; a reference replayed from a store has none (nor needs one), and
        # a carrying pass's cache spans the same positions.
        replayed = decoder.present_outputs[0] not in kept["reference"]
        feed = decoder.step_feed(np.asarray(chosen)[:, None], decoder.next_past(kept[carrying[0] if replayed else "reference"]), position)
        own = {name: decoder.next_past(kept[name]) for name in carrying}
        fed = [[token] for token in chosen]
    for generation, way in zip(generations, own_way):
        generation.candidate = list(generation.reference) if way is None else way.chosen
    return steps, generations


@dataclass
class _OnItsOwn:
    """The candidate's continuation when it generates alone: the reference's tokens up to where it parted, then
    its own greedy choices, a step each time the reference makes one (up to an end-of-sequence token). Its steps
    run beside the reference's next ones (Engine.run_sample's `also`): they read only the candidate's own cache."""

    engine: Engine
    decoder: Decoder
    name: str
    chosen: list[int]
    past: dict[str, np.ndarray]
    done: int  # the positions its cache holds

    def step(self) -> None:
        token = self.chosen[-1]
        if token in self.decoder.eos_token_id:
            return
        outputs = self.engine.run_alone(self.name, self.decoder.step_feed(np.asarray([token]), self.past, self.done),
                                        {self.decoder.logits, *self.decoder.present_outputs})
        self.chosen.append(_greedy(outputs[self.decoder.logits]))
        self.past, self.done = self.decoder.next_past(outputs), self.done + 1


def _each_a_step(ways: Sequence[_OnItsOwn]) -> None:
    for way in ways:
        way.step()


def _greedy(logits: np.ndarray) -> int:
    """The token a greedy decoder picks at the last position (a NaN position picks nothing: -1)."""
    last = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])[-1]
    return int(last.argmax()) if np.isfinite(last).all() else -1
