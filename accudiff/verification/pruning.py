"""Pruning a keep-list that holds: its nodes dropped while the rest still holds, so a repair keeps no node it
does not need (verification's repairs, and bisect precision's passing prefix of its ranking)."""

from __future__ import annotations

from typing import Callable, Collection, Sequence

PRUNE_RUNS = 16  # runs pruning a repair may take: its nodes tried for dropping, the last added first
HALVING_START = 8  # pruning in groups starts with groups of this share of the list (see prune)


def prune(keep: Sequence[str], holds: Callable[[list[str]], bool], protected: Collection[str] = (), limit: int = PRUNE_RUNS,
          halving: bool = False) -> tuple[list[str], int, int]:
    """`keep`, each node dropped (the last added first) while the rest still `holds` (a run of the rest as
    it is, not closed over boundaries); how many runs that took; and how many of the nodes left were not tried
    alone (0: none can be left out, so long as keeping more never hurts). A repair grown by adding what helps, or
    kept as a unit (a cancellation with what computes its operands), carries nodes it needs no more once the
    others are in; so may its closure: a reader kept because its input would overflow it, where the overflow
    does no harm (-Inf into a Softmax is exactly right). `protected` nodes (the cause) are not tried.
    `halving`: a list more than twice as long as the runs allowed (one node at a time would leave most of it
    untried) drops its nodes in groups first (an eighth of the list, the last added first, then halves of that,
    down to one node): the PP-OCRv4 detector quantized per tensor, on 2 pages at --require flipped_share=0.01,
    230 nodes to 82 in 64 runs (one at a time, to 183). A shorter list does better one at a time (on 4 pages,
    72 nodes to 27, in groups 35; magika's 50 to 15 each needed, in groups 19)."""
    chosen, runs, alone = list(keep), 0, set()
    size = max(1, len(chosen) // HALVING_START) if halving and len(chosen) > 2 * limit else 1
    while runs < limit:
        end = len(chosen)
        while end > 0 and runs < limit:
            group = [n for n in chosen[max(0, end - size) : end] if n not in protected]
            end -= size
            rest = [n for n in chosen if n not in group]
            if not group or not rest:
                continue
            runs += 1
            if size == 1:
                alone.update(group)
            if holds(rest):
                chosen = rest
        if size == 1:
            break
        size = max(1, size // 2)
    return chosen, runs, sum(1 for n in chosen if n not in alone and n not in protected)
