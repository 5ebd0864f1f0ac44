"""How a repair is said: each step of the keep-list verification found for an output, on which samples it
held, and the commands that apply it (accudiff's --keep-fp32, and the producing tool's own options).
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Collection
from pathlib import Path

from accudiff.findings import NEARLY_AS_MUCH
from accudiff.judging.objective import Objective, describe
from accudiff.model.formats import QUANTIZED_FORMATS
from accudiff.model.quantized_ops import TOOL_OPTIONS, modelopt_pattern, op_types_option
from accudiff.report.next_steps import bisect_command, decision_search, decision_search_lines, keep_option, unsaved_inputs_text


def tried_subset_lines(failure, result) -> list[str]:
    """Where verification tried some of the run's samples: that the figures of its keeps are theirs (chosen for
    the error and the decision they lose, they read worse than the whole run's)."""
    tried = failure.repair.samples if failure.repair is not None else []
    unit, total = ("prompt", len(result.generations)) if result.generations else ("sample", result.iterations)
    if not tried or len(tried) >= total:
        return []
    again = failure.repair.whole_run is not None or any(f.kind == "every_sample" for f in failure.cause.findings)
    return [f"  (every keep here was tried on {len(tried)} of the {total} {unit}s, those the repair names, chosen for the error and the decision "
            f"they lose: its figures are those {unit}s', not the whole run's{f', except in the lines that say on all {total} {unit}s' if again else ''})"]


def repair_lines(failure, result, python: bool = False) -> list[str]:
    """The verified repair, one line per step; without one, how to look for it."""
    repair = failure.repair
    if repair is None or len(repair.steps) < 2:
        bisect = f"    {bisect_command(result) or f'accudiff bisect precision ({unsaved_inputs_text()})'}"
        aimed = decision_search(failure.tensor, result)
        if aimed is None:
            return ["  to find the nodes to keep in higher precision:", bisect]
        return [*decision_search_lines({failure.tensor: aimed}, result, "  ", named=False), "  or, for the tolerance:", bisect]
    unit = "prompt" if result.generations else "sample"  # a decoder's trials generate from each prompt
    samples = (f"on {unit} {repair.samples[0]}" if len(repair.samples) == 1 else f"on {unit}s {', '.join(map(str, repair.samples))}") if repair.samples else ""
    if failure.cause is not None and failure.cause.stand_in:
        samples += f" of {failure.cause.stand_in}"
    # Unverified, the worst of the samples tried is what still fails, not each of them; or, by a requirement, its
    # figure reached the target where its interval over them does not lie within it.
    reached = Objective(require=result.require).miss(repair.steps[-1].figures)
    still = (f"; its figures reach its requirement, their 95% intervals over those {unit}s do not: not shown met" if reached is not None and reached <= 1.0
             else ", the output still fails")
    how = f"verified {samples}" if repair.verified else f"NOT verified: tried {samples}{still}"
    whole = repair.whole_run
    if whole is not None:
        total = len(result.generations) if result.generations else result.iterations
        others = f", with the other outputs' repairs kept too ({len(whole.keep)} node(s))" if set(whole.keep) != set(repair.keep) else ""
        on_all = f"on all {total} {unit}s{others}: output at {describe(whole.tol_ratio, whole.figures, result.require)}"
        how = f"verified {samples}, then {on_all}" if repair.verified else f"NOT verified: it holds {samples}, not {on_all}"
    if repair.op_types:  # every quantized node but the matrix ops kept: said by op type, not a screen of names
        op_type = dict(zip(result.table["node"], result.table["op_type"]))
        counts = Counter(op_type.get(n, "?") for n in repair.keep)
        lines = [f"  repair ({how}): quantize only its {' and '.join(repair.op_types)} nodes: keep the other {len(repair.keep)} quantized node(s) "
                 f"in higher precision ({', '.join(f'{t} x{k}' for t, k in counts.most_common())}); the smallest such list: "
                 f"{bisect_command(result) or 'accudiff bisect precision'}"]
    else:
        lines = [f"  repair ({how}): keep {len(repair.keep)} node(s) in higher precision: " + ", ".join(f"'{n}'" for n in repair.keep)]
    pruned_step = len(repair.steps) - 1 if repair.pruning_runs else None
    for number, step in enumerate(repair.steps):
        kept = "nothing kept" if not step.keep else f"keep {len(step.keep)} node(s)"
        if repair.left_out_while_met is not None and 1 < number != pruned_step:  # suspects kept together in step 1, left out again
            kept += ", a suspect left out: the rest " + ("still meets the target" if repair.left_out_while_met else
                                                         f"within {NEARLY_AS_MUCH:g}x of all of them (step 1)")
        lines.append(f"    step {number}: {kept} -> output at {describe(step.tol_ratio, step.figures, result.require)}")
    if repair.pruning_runs:
        grown = len(repair.steps[-2 if len(repair.steps[-1].keep) < len(repair.steps[-2].keep) else -1].keep)
        dropped = grown - len(repair.keep)
        lines.append(f"    pruned in {repair.pruning_runs} run(s): each node tried for dropping while the output still met its target; "
                     + (f"{dropped} of {grown} dropped (the last step)" if dropped else "none could be"))
    if repair.verified:
        keep = (whole or repair).keep  # what held on every sample, where that was tried
        lines += ["    apply it:", f"      {keep_option(result, keep, python)}"]
        if result.candidate_model is not None:
            repaired = result.report_dir / result.repaired_candidate if result.repaired_candidate and result.report_dir is not None else None
            lines += [f"    {line}" for line in remake_lines(keep, result.precision, result.quantized_by, result.reads_constant_weights, repaired,
                                                            op_types=repair.op_types)]
    return lines


# A Q/DQ quantizer gives a value one pair for all its readers: a node it leaves out still reads the value rounded
# where another reader is quantized (ModelOpt and quantize_static) or, in quantize_static, its writer (the
# trained Magika by quantize_static, bisect's 26 nodes left out: 12 still read a pair; top-1 on 24 files 79%
# where the repaired candidate, those nodes reading their inputs unrounded, gives 100%).
QDQ_REBUILD_CAVEAT = ("(a rebuild is not what was verified: these quantizers give a value one Q/DQ pair for all its readers, so a node left out "
                      "still reads it rounded where another of its readers, or in quantize_static its writer, is quantized, where the candidate "
                      "with them kept reads it unrounded; compare a rebuilt model with accudiff compare before shipping it)")


def remake_lines(nodes: list[str], precision: str, quantized_by: dict[str, str], reads_constant_weights: Collection[str],
                 repaired: Path | None = None, listed: tuple[Path, Path] | None = None, op_types: Collection[str] = ()) -> list[str]:
    """For a candidate made by another tool (of `precision`): the options that make it again without `nodes`
    quantized or converted, in the tools' own terms (the tool that wrote a quantized op, `quantized_by`,
    else the Q/DQ quantizers'; not onnxconverter-common's where a node reads a weight a Constant holds,
    `reads_constant_weights`: it would round that weight all the same), and where the repaired candidate is.
    `listed`: files holding the nodes as ModelOpt's patterns and as names, one a line; the options read them
    there, where one tool made every node and none has a space (a long list is otherwise a screen of names).
    `op_types`: `nodes` are every quantized node but these op types', said as the quantizers' op_types_to_quantize."""
    formats = set(precision.split("+"))
    by_tool: dict[str, list[str]] = {}
    for node in nodes:
        by_tool.setdefault(quantized_by.get(node, "Q/DQ"), []).append(node)
    from_files = listed is not None and len(by_tool) == 1 and not any(re.search(r"\s", n) for n in nodes)

    def spelled(names: list[str]) -> tuple[str, str, str]:
        """The names as ModelOpt's patterns (shell words), a Python list and one comma-separated shell word."""
        if from_files:
            patterns, names_file = (shlex.quote(str(path)) for path in listed)
            return f"$(cat {patterns})", f"open({str(listed[1])!r}).read().splitlines()", f"$(paste -sd, {names_file})"
        return " ".join(shlex.quote(modelopt_pattern(n)) for n in names), f"[{', '.join(map(repr, names))}]", shlex.quote(",".join(names))

    lines = []
    if formats & QUANTIZED_FORMATS:
        by_type = op_types_option(nodes, quantized_by, op_types) if op_types else None
        options = [TOOL_OPTIONS[tool](*spelled(names)[1:]) for tool, names in by_tool.items() if tool in TOOL_OPTIONS]
        # DequantizeLinear on weights alone (ModelOpt's int4, MatMulNBitsQuantizer's QDQ form): no value is shared by a pair
        weights_only = all(f.endswith("-weight") for f in formats & QUANTIZED_FORMATS)
        if "Q/DQ" in by_tool:
            patterns, python_list, _ = spelled(by_tool["Q/DQ"])
            options.append(f"ModelOpt --quantize_mode int4 --nodes_to_exclude {patterns}; ONNX Runtime MatMulNBitsQuantizer(..., "
                           f"quant_format=QuantFormat.QDQ, nodes_to_exclude={python_list})" if weights_only and "int4-weight" in formats else
                           f"ModelOpt --nodes_to_exclude {patterns}; ONNX Runtime quantize_static(..., nodes_to_exclude={python_list})")
        if by_type is not None:
            lines.append(f"or quantize again only its {' and '.join(op_types)} nodes: {by_type}")
        elif options:
            lines.append("or quantize again without them: " + "; ".join(options)
                         + (" (excluded from quantization, they still run in the tool's FP16/BF16: ModelOpt --high_precision_dtype fp32 keeps FP32)"
                            if formats & {"fp16", "bf16"} else ""))
        if "Q/DQ" in by_tool and not weights_only:
            lines.append(QDQ_REBUILD_CAVEAT)
    elif formats & {"fp16", "bf16"}:
        patterns, python_list, _ = spelled(nodes)
        held = [n for n in nodes if n in reads_constant_weights]
        lines.append(f"or convert again keeping them in FP32: ModelOpt AutoCast --nodes_to_exclude {patterns}"
                     + (f"; onnxconverter-common convert_float_to_float16(..., node_block_list={python_list})" if not held else
                        f" (not onnxconverter-common's node_block_list: it rounds the weights Constant nodes hold for {', '.join(map(repr, held[:3]))}"
                        f"{' ...' if len(held) > 3 else ''} to FP16 all the same)"))
    if repaired is not None:
        lines.append(f"the candidate with them kept: {repaired}")
    return lines
