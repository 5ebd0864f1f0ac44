"""Decoder language models as they are deployed: a small Llama-architecture model trained here (benchmarks/
decoders.py), built by the ONNX Runtime GenAI model builder in FP32, INT4 and FP16, fed lines of Python
source it never saw. The generation (prefill, then decode steps with each side carrying its own KV cache)
is held to an oracle written apart from accudiff (oracle.generation: two plain ONNX Runtime sessions and
numpy), the model folder and the builder's ops load as ONNX Runtime loads them, and the figures carry
intervals whose coverage is checked on a seeded simulation. They skip without torch, transformers and
onnxruntime-genai (.ci/run installs them)."""

from __future__ import annotations

import contextlib
import json
import shutil
import re
import subprocess
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import accudiff
import oracle
from conftest import ROOT, run_printed

sys.path.insert(0, str(ROOT))
from benchmarks import decoders  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """The trained checkpoint and its GenAI builds, made once for every test worker (a shared folder, locked),
    and eight prompts of source text as .jsonl. The folder is named as a user names one, relative to where
    they are: the training and the builder run in a process of their own, elsewhere (they once made the
    models there, and the build then found no checkpoint)."""
    shared = tmp_path_factory.getbasetemp().parent / "decoders"
    with contextlib.chdir(shared.parent):
        checkpoint = decoders.trained_llama(Path(shared.name)).resolve()
        builds = {precision: decoders.genai_model(Path(shared.name) / checkpoint.name, Path(shared.name), precision).resolve()
                  for precision in ("fp32", "int4")}
    prompts = decoders.write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", decoders.source_prompts(8))
    return SimpleNamespace(checkpoint=checkpoint, shared=shared, prompts=prompts, **builds)


def _prompt_ids(llama) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(llama.fp32 / "tokenizer.json"))
    return [np.asarray(tokenizer.encode(json.loads(line)).ids, np.int64) for line in llama.prompts.read_text().splitlines()]


def _phases_match(result, expected: dict, absolute: float) -> None:
    """Every figure of both phases as the oracle's generation loop gives it, to 1e-6 of itself or `absolute`."""
    for phase, figures in expected["phases"].items():
        ours = result.phases["logits"][phase]["figures"]
        assert ours["score_vectors"] == figures["positions"]
        for name in ("top1", "kl", "kl_max", "delta_p", "delta_nll"):
            assert ours[name] == pytest.approx(figures[name], rel=1e-6, abs=absolute), (phase, name)


def test_a_genai_folder_compares_with_generation_and_matches_two_plain_sessions(llama, tmp_path):
    """The folders load (SimplifiedLayerNormalization in the default domain, GroupQueryAttention, MatMulNBits),
    the candidate is named in its formats and what it computes, and every figure of both phases matches the
    oracle's generation loop to 1e-6: each side carries its own cache. The candidate's own continuation from
    where it parts (its steps run beside the reference's next ones) is the oracle's, token for token."""
    result = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, report_dir=tmp_path / "r")
    assert result.precision == "int8-dynamic+int4-weight"
    assert "integer arithmetic" in result.candidate
    expected = oracle.generation(llama.fp32 / "model.onnx", llama.int4 / "model.onnx", _prompt_ids(llama), NEW_TOKENS)
    _phases_match(result, expected, absolute=1e-9)
    assert [g["diverged_at"] for g in result.generations] == expected["first_different"]
    assert [g["candidate"] for g in result.generations] == expected["candidate_continuations"]  # its own steps beside the reference's
    assert any(g["candidate"] != g["reference"] for g in result.generations)
    assert result.output_kinds["present.0.key"].kind == "state"
    assert all(f.tensor == "logits" for f in result.output_failures)
    assert len(result.steps) == sum(1 for _ in result.steps["sample"].unique())


@pytest.fixture(scope="session")
def windowed(llama):
    """A trained Gemma2-architecture decoder whose first layer attends over a window of 16 positions, built by
    the GenAI builder in FP32 and INT4: that layer's KV cache is a buffer of the window's size
    (GroupQueryAttention's sliding_window_cache), made once beside the Llama's."""
    with contextlib.chdir(llama.shared.parent):
        checkpoint = decoders.trained_windowed(Path(llama.shared.name)).resolve()
        return SimpleNamespace(**{precision: decoders.genai_model(Path(llama.shared.name) / checkpoint.name, Path(llama.shared.name), precision).resolve()
                                  for precision in ("fp32", "int4")})


def test_a_windowed_kv_cache_generates_as_deployed_and_matches_two_plain_sessions(windowed, llama):
    """A layer whose cache is a window (Gemma2 and its kind, as the GenAI builder writes them) stopped at the
    first prefill: "KV cache capacity (0) must be at least local_window_size". Its past is now a buffer of the
    window's capacity, and every figure matches the oracle's generation loop (which sizes that buffer from
    genai_config.json) to 1e-6, on prompts that run past the window (the op evicts) and on prompts shorter
    than it, where the rows after those it holds are left unspecified by the op: its present outputs are
    compared on the rows it holds alone."""
    from tokenizers import Tokenizer

    prompts = [*decoders.source_prompts(4), "def f(", "x = 1"]
    tokenizer = Tokenizer.from_file(str(windowed.fp32 / "tokenizer.json"))
    ids = [np.asarray(tokenizer.encode(p).ids, np.int64) for p in prompts]
    assert all(len(i) + NEW_TOKENS < 16 for i in ids[4:]) and all(len(i) > 16 for i in ids[:4])
    result = accudiff.compare(windowed.fp32, candidate_model=windowed.int4, prompts=prompts, new_tokens=NEW_TOKENS, verify=False)
    expected = oracle.generation(windowed.fp32 / "model.onnx", windowed.int4 / "model.onnx", ids, NEW_TOKENS)
    # A plain FP32 session fuses this model's tanh GELU (its logits move by 1.4e-6 with ONNX Runtime's graph
    # optimizations on or off): Δp and ΔNLL, means of differences near 0, agree to 1e-7, not to 1e-6 of themselves.
    _phases_match(result, expected, absolute=1e-7)
    assert [g["candidate"] for g in result.generations] == expected["candidate_continuations"]
    # The window's cache is compared on the rows the op holds: as many positions as were fed, up to the window.
    held = sum(min(len(i) + step, 16) for i in ids for step in range(NEW_TOKENS + 1))
    row = result.table.set_index("tensor").loc["present.0.key"]
    assert row["elements"] == held * 2 * 16 and np.isfinite(row["max_abs_err"]), row


def test_a_kv_cache_the_genai_runtime_slides_itself_is_one_sentence(windowed, tmp_path, run_cli):
    """Where the GenAI config has the runtime slide the cache (slide_key_value_cache: static shapes, as for an NPU),
    generating from prompts would not be the model as deployed: refused in one sentence, naming what to give."""
    folder = shutil.copytree(windowed.fp32, tmp_path / "sliding")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["sliding_window"]["slide_key_value_cache"] = True
    (folder / "genai_config.json").write_text(json.dumps(config))
    code, _, err = run_cli("compare", folder, "--bf16", "--prompts", decoders.write_prompts(tmp_path / "p.jsonl", ["def f("]), "-o", tmp_path / "r")
    assert code == 2 and "slide its KV cache or its inputs itself" in err and "--load-inputs" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_candidate_whose_kv_cache_is_quantized_is_one_sentence_that_says_so(llama, run_cli, tmp_path):
    """The GenAI builder's kv_cache_quant_scheme stores the cache as INT8 codes that its attention scales: refused
    as "not a version of" the model, as if it were another model; now said for what it is, and what to give."""
    scales = llama.shared / "kv-scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.05] * 4, "v_scales": [0.03] * 4}}))
    with contextlib.chdir(llama.shared.parent):
        quantized = decoders.genai_model(llama.checkpoint, llama.shared, "fp32", ("kv_cache_quant_scheme=int8_per_tensor", f"kv_cache_scale_file={scales}"))
    code, _, err = run_cli("compare", llama.fp32, "--candidate-model", quantized, "--prompts", llama.prompts, "-o", tmp_path / "r")
    assert code == 2 and "stores its KV cache in int8 ('present.0.key'" in err and "kv_cache_quant_scheme" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_decoders_kv_cache_outputs_are_its_state_not_failing_outputs(llama, tmp_path):
    """At a tolerance every output leaves, only the logits are diagnosed: the present outputs are compared,
    shown as the model's state, and judged through the logits of later steps."""
    result = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=2, atol=1e-6, rtol=1e-6, stol=0, verify=False)
    failing = {f.tensor for f in result.output_failures}
    assert failing == {"logits"}
    state = result.table[result.table["tensor"].str.startswith("present.")]
    assert len(state) == 8 and (state["status"] == "fail").all()


def test_the_plugin_judges_a_decoder_by_what_its_verdict_is_judged_by(llama, pytester):
    """`assert_within(kl=0.02)` failed the INT4 build on 'present.3.value' outside its elementwise tolerance,
    where `compare --require kl=0.02` passed it: the KV cache is the model's state, judged through the logits
    of later steps, by the plugin as by the command line; asked for by name, a present output is judged."""
    pytester.makepyfile(test_model=f"""
def test_by_the_logits(accudiff):
    result = accudiff.compare(r"{llama.fp32}", candidate_model=r"{llama.int4}", prompts=r"{llama.prompts}", new_tokens=2, verify=False)
    assert result.assert_within(atol=1e-6, rtol=1e-6, stol=0, kl=1.0).passed

def test_a_present_output_asked_for(accudiff):
    accudiff.compare(r"{llama.fp32}", candidate_model=r"{llama.int4}", prompts=r"{llama.prompts}", new_tokens=2, verify=False).assert_within(
        atol=1e-6, rtol=1e-6, stol=0, kl=1.0, tensors=["logits", "present.0.key"])
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    assert "tensor 'present.0.key':" in result.stdout.str()


@pytest.mark.parametrize("model", ["decoder", "classifier"])
def test_an_output_named_state_that_nothing_reads_back_is_refused(model, request, tmp_path, run_cli):
    """`--output-kind logits=state` read "verdict: INCONCLUSIVE (... only 68 of the 68 tensors ... (100%) were
    compared)" and counted the logits among the KV cache 'fed back as its past': no output was left to judge."""
    llama = request.getfixturevalue("llama") if model == "decoder" else None  # the classifier's case runs without torch
    given = (llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts) if model == "decoder" else (ROOT / "fixtures" / "clean.onnx", "--fp16")
    code, out, err = run_cli("compare", *given, "--output-kind", "logits=state", "-o", tmp_path / "r")
    said = "this model's are present.0.key" if model == "decoder" else "this model carries no KV cache"
    assert code == 2 and not out and err.startswith("accudiff: error: --output-kind names 'logits' state, but state is a KV-cache output") and said in err, err
    assert not (tmp_path / "r").exists()


def test_prompts_given_from_python_as_a_list_compare_as_the_same_prompts_in_a_file(llama, tmp_path):
    """`accudiff.compare(..., prompts=["def main():", ...])` raised a bare TypeError (a path was expected): from
    Python the prompts are a list of what a .jsonl line holds, and give the file's figures; a replay reads them
    saved as token ids."""
    lines = [json.loads(line) for line in llama.prompts.read_text().splitlines()[:3]]
    given = [lines[0], _prompt_ids(llama)[1], {"prompt": lines[2]}]
    from_file = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=2, verify=False)
    from_list = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=given, new_tokens=2, verify=False, report_dir=tmp_path / "r")
    assert from_list.generations == from_file.generations[:3]
    assert "--prompts " + str(tmp_path / "r" / "prompts.npz") in " ".join(from_list.replay)
    assert accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=given, new_tokens=2, verify=False).replay == []  # saved nowhere
    for bad, said in ((42, "prompts= takes a file, or a list of prompts"), ([], "the prompts list holds no prompt"),
                      ([{"text": "x"}], "prompt 0 of the prompts list is neither text nor a list of token ids")):
        with pytest.raises(accudiff.AccudiffError, match=re.escape(said)):
            accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=bad, new_tokens=2, verify=False)


def test_a_decoders_int8_candidate_is_calibrated_on_prompts(llama, tmp_path):
    """`--int8` on a decoder said its scales "were calibrated on random data", when a prefill has nothing to draw
    (the prompt's tokens, an empty past): they were the first prompt's, eight times over. That is now said, and
    --calib-data takes prompts as --prompts does (a calibration file of prefill tensors no one writes by hand)."""
    import onnx

    def scales(result) -> dict[str, float]:
        model = onnx.load(str(result.report_dir / "candidate-int8.onnx"))
        return {node.input[1]: float(numpy_helper.to_array(init)) for node in model.graph.node if node.op_type == "QuantizeLinear"
                for init in model.graph.initializer if init.name == node.input[1] and not init.dims}

    alone = accudiff.compare(llama.fp32, "int8", prompts=llama.prompts, new_tokens=1, verify=False, report_dir=tmp_path / "a")
    assert any(n.startswith("INT8 scales were calibrated on the first sample alone") for n in alone.notices), alone.notices
    calib = decoders.write_prompts(tmp_path / "calib.jsonl", decoders.source_prompts(12)[8:])
    calibrated = accudiff.compare(llama.fp32, "int8", prompts=llama.prompts, new_tokens=1, verify=False, calib_data=calib, report_dir=tmp_path / "c")
    assert not any("INT8 scales were calibrated" in n for n in calibrated.notices)
    assert scales(alone).keys() == scales(calibrated).keys() and scales(alone) != scales(calibrated)


def test_the_kv_cache_line_names_the_worst_step_output_by_what_it_counts(llama, tmp_path, run_cli):
    """The KV-cache line counted step outputs outside tolerance, each judged by its share of elements outside,
    then named a worst by the 99.9th percentile over every step: "9 of 576 step outputs outside tolerance; the
    worst, 'present.3.value', at 0.805x its tolerance". The worst is now the worst step output, as counted."""
    code, out, err = run_cli("compare", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, "--new-tokens", NEW_TOKENS,
                             "--atol", "0.01", "--rtol", "0.01", "--no-verify")
    said = re.search(r"KV cache: .*: (\d+) of \d+ step outputs outside tolerance; the worst, 'present\.\d+\.(?:key|value)' at prompt \d+'s "
                     r"(?:prefill|decode step \d+): \S+ of elements outside, ([0-9.]+)x its tolerance", out)
    assert code == 1 and said is not None, out + err
    outside, ratio = int(said.group(1)), float(said.group(2))
    assert (ratio > 1) == (outside > 0), said.group(0)


def test_a_requirement_the_prompts_cannot_resolve_is_inconclusive_not_repaired(llama, tmp_path):
    """One prompt's positions cannot tell the candidate's top-1 agreement from a target just above it: the
    verdict is inconclusive, nothing is diagnosed, and the run says how many prompts would tell."""
    one = tmp_path / "one.jsonl"
    one.write_text(llama.prompts.read_text().splitlines()[0] + "\n")
    result = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=one, new_tokens=NEW_TOKENS)
    top1 = result.decisions["logits"]["top1"]
    target = min(0.999, round(top1 + 0.01, 3))
    judged = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=one, new_tokens=NEW_TOKENS, require=[f"top1={target}"])
    assert judged.verdict == "inconclusive" and judged.output_failures == []
    [unresolved] = judged.unresolved["logits"]
    assert unresolved.outcome == "unresolved" and unresolved.interval.low < target <= unresolved.interval.high
    assert unresolved.needed is not None and unresolved.needed > 1


def test_a_folder_that_is_not_a_genai_model_is_refused_in_one_sentence(tmp_path, run_cli):
    code, out, err = run_cli("compare", tmp_path, "--fp16")
    assert code == 2 and err.count("\n") == 1
    assert "is a folder, not a model file" in err and "genai_config.json" in err


def test_prompts_for_a_model_without_a_kv_cache_are_refused(tmp_path, run_cli):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    code, _, err = run_cli("compare", ROOT / "fixtures" / "clean.onnx", "--fp16", "--prompts", prompts)
    assert code == 2 and "carries no KV cache" in err


@pytest.mark.parametrize("flag", ["--load-inputs", "--load-candidate", "--load-reference", "--save-reference", "--save-candidate", "--engine"])
def test_prompts_with_an_option_that_gives_other_inputs_or_tensors_is_refused_by_name(flag, tmp_path, run_cli):
    """`--prompts p.txt --load-candidate x.json` said "--load-candidate needs ... --load-inputs", which
    --prompts refuses in turn: the conflict with the prompts is what is said, whatever the option."""
    code, _, err = run_cli("compare", ROOT / "fixtures" / "clean.onnx", "--prompts", tmp_path / "p.txt", flag, tmp_path / "x.json")
    assert code == 2 and f"--prompts generates from each prompt, each side carrying its own KV cache: {flag} cannot go with it" in err, err


def test_a_prefill_only_generation_says_no_decode_step_was_fed():
    """With --new-tokens 0 the line read "both sides fed the reference's greedy choices; the candidate choosing
    greedily on its own chooses the same in all 6 prompt(s)": no token was fed, one was chosen."""
    from accudiff.report.decision_text import generation_lines

    def result(*chosen: tuple[list[int], list[int]]) -> SimpleNamespace:
        return SimpleNamespace(model=Path("nowhere") / "model.onnx", generations=[
            {"sequence": k, "given": False, "reference": ref, "candidate": cand, "diverged_at": None if ref == cand else 0} for k, (ref, cand) in enumerate(chosen)])

    assert generation_lines(result(([5], [5]), ([7], [7]))) == ["  generation: the prefill only; the candidate's greedy next token is the reference's in all 2 prompt(s)"]
    assert generation_lines(result(([5], [6]), ([7], [7])))[0] == "  generation: the prefill only; the candidate's greedy next token differs from the reference's in 1 of 2 prompt(s)"
    assert generation_lines(result(([5, 1], [5, 1])))[0].startswith("  generation: both sides fed the reference's greedy choices")


def test_new_tokens_without_prompts_is_refused(run_cli):
    code, _, err = run_cli("compare", ROOT / "fixtures" / "clean.onnx", "--new-tokens", "4")
    assert code == 2 and "--new-tokens" in err and "--prompts" in err


def _simplified_layernorm_model(path: Path) -> Path:
    """A model ONNX Runtime runs and ONNX's checker refuses: SimplifiedLayerNormalization (ONNX Runtime's op,
    registered in the default domain, as the GenAI builder writes it), its weights in a data file."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(1, 0.1, 64).astype(np.float32), "gamma"),
               numpy_helper.from_array(rng.normal(0, 0.3, (64, 32)).astype(np.float32), "W")]
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["normed"], name="norm", epsilon=1e-6, axis=-1, stash_type=1),
             helper.make_node("MatMul", ["normed", "W"], ["y"], name="proj")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 64])], [helper.make_tensor_value_info("y", 1, [2, 32])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)
    onnx.save(model, str(path), save_as_external_data=True, size_threshold=0)
    return path


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_a_model_holding_onnxruntimes_default_domain_ops_loads_and_converts(precision, tmp_path):
    """ONNX's checker says "No Op registered for SimplifiedLayerNormalization": ONNX Runtime loads and runs it,
    so accudiff does, converting it where ONNX Runtime has the kernel in that format."""
    model = _simplified_layernorm_model(tmp_path / "m.onnx")
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(str(model))
    result = accudiff.compare(model, precision)
    assert result.verdict == "pass" and result.coverage == (2, 2)
    if precision != "fp32":
        assert "norm" in result.converted


def test_an_op_neither_onnx_nor_onnxruntime_knows_is_still_refused(tmp_path, run_cli):
    model = _simplified_layernorm_model(tmp_path / "m.onnx")
    proto = onnx.load(str(model))
    proto.graph.node[0].op_type = "NoSuchNormalization"
    onnx.save(proto, str(tmp_path / "bad.onnx"))
    code, _, err = run_cli("compare", tmp_path / "bad.onnx")
    assert code == 2 and "fails the ONNX checker" in err and "NoSuchNormalization" in err


@pytest.mark.parametrize("units, positions, share, concentration", [(1, 64, 0.97, None), (8, 64, 0.95, 20.0), (20, 64, 0.95, 20.0), (50, 32, 0.97, 10.0)])
def test_intervals_cover_the_true_share_on_a_seeded_simulation(units, positions, share, concentration):
    """Shares measured on positions of sequences whose own shares vary (a Beta around the truth): the 95%
    intervals hold the true share in at least 92% of 400 simulated runs."""
    from accudiff.judging.intervals import interval_of

    rng = np.random.default_rng(7)
    held = 0
    for trial in range(400):
        per_unit = np.full(units, share) if concentration is None else rng.beta(share * concentration, (1 - share) * concentration, units)
        agreed = rng.binomial(positions, per_unit).astype(np.float64)
        span = interval_of(agreed, np.full(units, float(positions)), None, "share", seed=trial)
        held += span.low <= share <= span.high
    assert held / 400 >= 0.92


@pytest.mark.parametrize("units, concentration", [(1, None), (8, None), (20, 5.0)])
def test_intervals_cover_the_true_mean_on_a_seeded_simulation(units, concentration):
    """Means of skewed per-position values (exponential, as KL divergences are) whose scale varies by sequence."""
    from accudiff.judging.intervals import interval_of

    rng = np.random.default_rng(11)
    held = 0
    for trial in range(400):
        scales = rng.gamma(concentration, 1e-3 / concentration, units) if concentration else np.full(units, 1e-3)
        values = [rng.exponential(scale, 64) for scale in scales]
        span = interval_of(np.array([v.sum() for v in values]), np.full(units, 64.0), np.array([(v * v).sum() for v in values]), "mean", seed=trial)
        held += span.low <= 1e-3 <= span.high
    assert held / 400 >= 0.92


def test_the_data_said_to_resolve_a_requirement_is_more_than_the_data_at_hand():
    """YOLOv8n's detections on 16 photographs, 16 of 20 matched (the reference's extra detections in three images):
    80% [56.4%, 100%] cannot be told from 95%, and the run said "about 16 samples like these would", the 16 it
    had. The estimate read a narrower interval than the one printed (no t quantile, no clip). It is now at
    least one unit more, and the same data repeated that many times gives an interval without the target."""
    from accudiff.judging.intervals import interval_of, needed_units

    matched, union = np.ones(16), np.array([1.0] * 13 + [2.0, 3.0, 2.0])
    span = interval_of(matched, union, None, "share")
    assert span.low < 0.95 < span.high
    needed = needed_units(0.8, 0.95, span)
    assert needed > 16
    repeats = -(-needed // 16)
    more = interval_of(np.tile(matched, repeats), np.tile(union, repeats), None, "share")
    assert not more.low <= 0.95 <= more.high


def test_a_trials_intervals_are_those_of_the_per_sample_table():
    """Verification's trials add each output's counts per sample without a table (a DataFrame and a groupby
    cost 5 ms a keep-list): the intervals are the ones the comparison's per-sample table gives, NaN counted
    as none as a table's sum does."""
    from dataclasses import asdict

    import pandas as pd

    from accudiff.judging.decisions import SampleOutcome
    from accudiff.judging.intervals import intervals
    from accudiff.verification.trial import _outcome

    rng = np.random.default_rng(3)

    def counts() -> dict:
        shares = {name: int(rng.integers(0, 9)) for name in ("top1", "top5", "neighbor_same", "flipped", "intersection")}
        means = {name: float(rng.uniform(0, 8)) for name in ("kl_sum", "dp_sum", "nll_sum", "cosine_sum")}
        squares = {name.replace("_sum", "_sq_sum"): value * value / 8 + float(rng.uniform(0, 1)) for name, value in means.items()}
        rows = dict.fromkeys(("rows", "top5_rows", "nll_rows", "vectors", "neighbor_rows", "map_elements", "union"), 8)
        return {**shares, **means, **squares, **rows}

    outcomes = [SampleOutcome(sample=int(sample), tensor=tensor, max_abs_err=0.1, tol_ratio=2.0, outside_share=0.1, sqnr_db=20.0, **counts())
                for sample in rng.integers(0, 7, 40) for tensor in ("logits", "embedding")]
    outcomes[3] = SampleOutcome(**{**asdict(outcomes[3]), "kl_sum": float("nan")})
    found = _outcome([], outcomes)
    rows = pd.DataFrame([asdict(one) for one in outcomes])
    for name, part in rows.groupby("tensor"):
        expected = intervals(part, part["sample"], found.figures[name])
        assert expected and found.spans[name].keys() == expected.keys()
        for figure, span in expected.items():
            assert found.spans[name][figure].as_json() == pytest.approx(span.as_json()), figure


def test_a_model_cut_into_segments_gives_the_table_of_the_whole_model(llama, monkeypatch):
    """The INT4 candidate's nodes are renamed by its quantizer (`X_Q4`): placed in segments by the float
    model's node names, its MatMulNBits outputs were 'not observed' in a segmented run (20 of 68 here) and
    the isolated run missed them silently. Placed by the values they make, a run cut into many segments gives
    the one-shot table, value for value, and the same generation figures."""
    import pandas as pd
    import accudiff.stages.group as group

    options = dict(candidate_model=llama.int4, prompts=llama.prompts, new_tokens=4, verify=False)
    whole = accudiff.compare(llama.fp32, max_memory="4G", **options)
    monkeypatch.setattr(group, "SEGMENTS_PER_BUDGET", 4000)  # a few kilobytes of tensors a segment: a cut every node or two
    cut = accudiff.compare(llama.fp32, max_memory="16M", **options)
    assert cut.coverage == whole.coverage == (68, 68)
    assert (cut.table["status"] == whole.table["status"]).all()
    pd.testing.assert_frame_equal(cut.table, whole.table)
    assert cut.phases["logits"]["decode"]["figures"] == whole.phases["logits"]["decode"]["figures"]
    assert not [n for n in cut.notices if "did not observe" in n]


def test_a_decoders_repair_is_the_builders_own_exclusion_and_holds(llama, tmp_path, run_cli):
    """bisect precision on the INT4 decoder, judged by its next-token KL, prints the GenAI builder's own
    option; the builder run with it makes the model accudiff repaired (the same logits), and that model,
    compared generating as deployed, meets the requirement or cannot be told from it, never fails it."""
    import onnxruntime as ort

    kl = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, verify=False).decisions["logits"]["kl"]
    target = f"kl={0.6 * kl:.3g}"
    code, out, err = run_cli("bisect", "precision", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, "--new-tokens", NEW_TOKENS,
                             "--require", target, "-o", tmp_path / "fix")
    assert code == 1, out + err
    # where it says the candidate's figures (a long list: "that is most of the model"), they are per prompt, not "of 72 sequence(s)"
    assert "sequence(s)" not in out and "samples]" not in out, out
    [line] = [line for line in out.splitlines() if "onnxruntime_genai.models.builder" in line]
    option = re.search(r"--extra_options (nodes_to_exclude=(?:\$\([^)]*\)|\S+))", line).group(1)  # its names, or a command that reads them
    excluded = subprocess.run(["bash", "-c", f"printf %s {option}"], capture_output=True, text=True, check=True).stdout  # as a shell pastes it
    assert all(name in excluded for name in (tmp_path / "fix" / "nodes.txt").read_text().splitlines())
    rebuilt = decoders.genai_model(llama.checkpoint, tmp_path, "int4", (excluded,))
    feed = {"input_ids": np.asarray([_prompt_ids(llama)[0]]), "attention_mask": np.ones((1, len(_prompt_ids(llama)[0])), np.int64)}
    feed.update({f"past_key_values.{layer}.{part}": np.zeros((1, 2, 0, 16), np.float32) for layer in range(4) for part in ("key", "value")})
    logits = [ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feed)[0]
              for path in (rebuilt / "model.onnx", tmp_path / "fix" / "repaired-candidate.onnx")]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    after = accudiff.compare(llama.fp32, candidate_model=rebuilt, prompts=llama.prompts, new_tokens=NEW_TOKENS, require=[target], verify=False)
    assert after.verdict in ("pass", "inconclusive"), shlex.join(map(str, after.replay))
    # Minimal: without any one of its nodes the repair no longer meets the target. A passing prefix of the ranking longer
    # than 8 nodes was given unpruned. Its keep-lists were tried each prompt's whole sequence as one prefill, where a
    # compare generates step by step: on an AVX2 EPYC, MatMulNBits' INT8 kernels put this model's logits 0.011 apart
    # that way, and one of ten lists without a node passed step by step. bisect now generates as compare does.
    kept = (tmp_path / "fix" / "nodes.txt").read_text().splitlines()
    assert "each of them is needed: without any one of them (each tried)" in out and "one prefill" not in out, out
    for node in kept:
        rest = [re.escape(other) for other in kept if other != node]
        fewer = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, require=[target], keep_fp32=rest, verify=False)
        assert fewer.verdict != "pass", (node, kept)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_a_decoders_bisect_is_judged_by_its_logits_not_its_kv_cache(llama, large, tmp_path, monkeypatch, run_cli):
    """bisect precision judged every graph output, the eight present.* outputs too, where compare judges the logits
    alone (the KV cache is state, judged through the logits of later steps). Held to atol=rtol=0.01, its keep-list
    was 7 MatMuls "each of them needed", and compare without one of them passed. Each node it keeps is now needed
    by what compare judges, and its figures are said per prompt (they read "of 72 sequence(s)", "the 8 samples").
    So too for a decoder of 1 GB of weights or more (its trial sessions made one at a time), whose keeps were
    tried on each prompt's whole sequence as one prefill."""
    if large:
        monkeypatch.setattr("accudiff.verification.trial.LARGE_MODEL_BYTES", 0)  # this small model, tried as a large one
    tolerance = ["--new-tokens", NEW_TOKENS, "--atol", "0.01", "--rtol", "0.01"]
    code, out, err = run_cli("bisect", "precision", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, *tolerance, "-o", tmp_path / "fix")
    assert code == 1 and "sequence(s)" not in out and "samples]" not in out, out + err
    kept = (tmp_path / "fix" / "nodes.txt").read_text().splitlines()
    assert "each of them is needed: without any one of them (each tried)" in out, out
    for node in kept:
        rest = [re.escape(other) for other in kept if other != node]
        fewer = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, atol=0.01, rtol=0.01, keep_fp32=rest,
                                 verify=False)
        assert fewer.verdict != "pass", (node, kept)
    every = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, atol=0.01, rtol=0.01,
                             keep_fp32=[re.escape(node) for node in kept], verify=False)
    assert every.verdict == "pass", kept  # and with all of them kept, it passes


def test_a_repair_not_shown_met_is_never_pruned_past_its_requirement(llama, run_cli):
    """No single MatMul left unquantized brings the INT4 decoder's KL under 0.008; its suspects left unquantized
    together reached 0.00796, the interval over the 8 prompts straddling the target (not shown met). Pruning
    then dropped each member whose drop left the output within 1.25x of that, down to a KL of 0.00818, and the
    repair printed was the failing list, said to "still fail". Pruning now never crosses back over a target
    the list reached, and the line says what the intervals could not show."""
    code, out, err = run_cli("compare", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, "--require", "kl=0.008", "-o", "r")
    assert code in (0, 1), err
    for block in re.findall(r"repair \((NOT verified[^\n]*)\n((?:        step [^\n]*\n)+)", out):
        misses = [float(m) for m in re.findall(r"-> output at ([0-9.e+-]+)x its requirement", block[1])][1:]
        if any(m <= 1.0 for m in misses):
            assert misses[-1] <= 1.0, block  # a list that reached the target is not pruned into one that misses it
        if misses and misses[-1] <= 1.0:
            assert "its figures reach its requirement, their 95% intervals over those prompts do not: not shown met" in block[0] and "still fails" not in block[0], block


def test_a_repairs_steps_that_leave_suspects_out_say_so(llama, run_cli):
    """At 0.4x the INT4 decoder's KL no MatMul left unquantized helps alone: its suspects are kept together, then
    left out one by one while the rest stays within 1.25x of all of them. The steps read "keep 5 node(s) -> 1.75x,
    keep 4 node(s) -> 1.76x, keep 3 node(s) -> 1.86x" and the repair named the 3, with nothing saying why a list
    that did better was cut."""
    kl = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=4, verify=False).decisions["logits"]["kl"]
    code, out, err = run_cli("compare", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, "--new-tokens", "4",
                             "--require", f"kl={0.4 * kl:.3g}", "-o", "r")
    blocks = re.findall(r"\n      repair \([^\n]*\n((?:        step [^\n]*\n)+)(        pruned in)?", out)
    assert code == 1 and blocks, out + err
    for block, pruned in blocks:
        steps = block.splitlines()
        counts = [int(m.group(1)) if (m := re.search(r"keep (\d+) node", line)) else 0 for line in steps]
        for number in range(2, len(steps) - bool(pruned)):  # pruning's step, the last, says so on a line of its own
            assert (counts[number] < counts[number - 1]) == ("a suspect left out: the rest" in steps[number]), block


def test_a_decoders_keeps_and_loss_split_are_said_by_its_kl_requirement(llama, tmp_path, run_cli):
    """Judged by a KL target, what each keep and each part of the loss split does is said as a multiple of that
    target, with its KL: they read "0.651x its tolerance" (the logits' elementwise ratio, which passes) beside a
    failing KL, and "0.729x of 0.651x" for a keep that brought the KL down. The target lies below the KL's
    interval, so the requirement fails whatever the trained model's spread over its prompts (at 0.8x the KL,
    a model trained on another machine was inconclusive, and said no cause)."""
    measured = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, verify=False)
    kl = measured.decisions["logits"]["kl"]
    target = float(f"{0.9 * measured.intervals['logits']['kl'].low:.3g}")
    code, out, err = run_cli("compare", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, "--new-tokens", NEW_TOKENS,
                             "--require", f"kl={target}", "-o", tmp_path / "r")
    assert code == 1, out + err
    # a ΔNLL below zero read "costs the candidate -0.000195 nats more": its sign is said
    assert re.search(r"ΔNLL, what the reference's next token costs the candidate more than the reference, in nats \(negative: less\): mean [+-]", out), out
    cause = out[out.index("    cause:") : out.index("apply it:") if "apply it:" in out else out.index("  steps:")]
    assert "x its tolerance" not in cause, cause
    # its trials generate as the comparison did, step by step on the tokens it fed (they once ran each prompt's whole sequence as one prefill)
    assert re.search(r"repair \((NOT )?verified[^)]* on prompts? [0-9, ]+", cause) and "one prefill" not in cause, cause
    split = re.search(r"loss split over the whole candidate: .* both at ([0-9.]+)x its requirement \(KL divergence \(mean\) ([0-9.e-]+)\)", cause)
    step = re.search(r"step 0: nothing kept -> output at ([0-9.]+)x its requirement \(top-1 agreement [0-9.]+%, KL divergence ([0-9.e-]+)\)", cause)
    for found in (split, step):
        assert found is not None, cause
        ratio, measured = map(float, found.groups())
        # a trial generates as the comparison did: its KL with nothing kept is the comparison's, to the digits printed
        assert ratio == pytest.approx(measured / target, rel=1e-2) and measured == pytest.approx(kl, rel=5e-3), (found.group(0), kl)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_a_decoders_trials_generate_as_the_comparison_did(llama, large, monkeypatch):
    """Verification tries each keep generating again as the comparison did (step by step on the tokens it fed,
    each side its own KV cache, the reference's steps recorded once and replayed): with nothing kept it reads the
    comparison's own figures. It ran each prompt's whole sequence as one prefill, which MatMulNBits' kernels
    round otherwise (KL 5% apart on this model). A decoder of 1 GB of weights or more, whose trial sessions are
    made one at a time, did so until its reference was replayed from what the comparison recorded: it generates too."""
    if large:
        monkeypatch.setattr("accudiff.verification.trial.LARGE_MODEL_BYTES", 0)  # this small model, tried as a large one
    measured = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, verify=False)
    target = float(f"{0.9 * measured.intervals['logits']['kl'].low:.3g}")
    result = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=llama.prompts, new_tokens=NEW_TOKENS, require=[f"kl={target}"])
    [failure] = result.output_failures
    control = failure.repair.steps[0]
    assert not control.keep and len(failure.repair.samples) == len(result.generations), failure.repair
    for figure in ("kl", "top1", "delta_nll"):
        assert control.figures[figure] == pytest.approx(result.decisions["logits"][figure], rel=1e-6, abs=1e-9), figure
    if large:  # its reference's steps are the ones the comparison recorded: not run again (one session of its weights at a time)
        assert "runs: reference" not in result.worker_timings["verification"], result.worker_timings


def test_a_decoders_keep_said_on_all_its_prompts_reads_as_its_command_does(llama, tmp_path):
    """Verification tries its keeps on the 8 prompts that lose most, then once more on all of them, generating as
    the comparison did: what it says of a keep on all 12 prompts is what that keep's command measures."""
    prompts = decoders.write_prompts(tmp_path / "twelve.jsonl", decoders.source_prompts(12))
    result = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=prompts, new_tokens=4, atol=0.02, rtol=0.02)
    tried = [f.repair for f in result.output_failures if f.repair is not None and f.repair.whole_run is not None]
    assert all(len(repair.samples) == 8 for repair in tried) and len(result.generations) == 12
    for repair in tried:
        pasted = accudiff.compare(llama.fp32, candidate_model=llama.int4, prompts=prompts, new_tokens=4, atol=0.02, rtol=0.02,
                                  keep_fp32=[re.escape(n) + "$" for n in repair.whole_run.keep], verify=False)
        worst = pasted.samples.loc[pasted.samples["tensor"] == "logits", "tol_ratio"].max()  # as a trial reads it: its worst step
        assert worst == pytest.approx(repair.whole_run.tol_ratio, rel=1e-6), repair.whole_run


def test_a_decoder_out_of_tolerance_is_offered_the_kl_it_is_shown_to_meet(llama, tmp_path, run_cli):
    """Logits out of a tight elementwise tolerance, whose top-1 agreement is not shown to reach 90% (a small
    trained decoder in INT4 agrees at about 92%): the requirement offered is the KL divergence it is shown to
    meet, the field's measure of a quantized language model; none was offered, and the console said the
    decision "holds". The printed command passes. Where one node's keep repairs the tolerance (the lm_head, on
    a model trained on another machine), that repair comes first and the requirement beside it: it was not
    offered, though the repair keeps a layer the decision never needed."""
    code, out, err = run_cli("compare", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, "--new-tokens", NEW_TOKENS,
                             "--atol", "0.01", "--rtol", "0.01", "-o", tmp_path / "r")
    assert code == 1, out + err
    offered = re.search(r"judged by its decision, it passes: --require (top1|kl)=(\S+) is met \((?:top-1 agreement|KL divergence \(mean\)) \S+ \[(\S+), (\S+)\]\)", out)
    assert offered is not None, out
    name, target, low, high = offered.groups()
    if name == "top1":  # only where its top-1 agreement is shown to reach 90% (its interval's low end)
        assert float(low.rstrip("%")) >= 90, offered.group(0)
    else:
        assert float(high) <= float(target), offered.group(0)
    assert (f"next: out of tolerance, but what it decides meets {name}={target}; if the decision is what you judge the model by:" in out
            or f"  or, as what it decides meets {name}={target}, if the decision is what you judge the model by:" in out), out
    [command] = [line.strip() for line in out.splitlines() if line.strip().startswith("accudiff compare") and f"--require {name}={target}" in line]
    assert run_printed(command, tmp_path).returncode == 0, command
    # A repair offered first holds when its command is pasted. Verification once ran each prompt's whole sequence as one
    # prefill, where the command generates step by step: the lm_head kept read 0.908x its tolerance there and 1.07x pasted
    # (this machine's INT4 kernels round otherwise for one row and many). Its trials now generate as the comparison does.
    lines = out.splitlines()
    offered = [lines[k + 1].strip() for k, line in enumerate(lines) if line.startswith("  next: keep")]
    assert all(run_printed(command, tmp_path).returncode == 0 for command in offered), offered


def test_bisect_subgraph_cuts_a_decoder_compared_from_prompts(llama, tmp_path, run_cli):
    """bisect subgraph on a GenAI folder with prompts stopped with "internal error: TypeError" (its feeds are
    known only after the first comparison), then cut its INT4 candidate without the MatMulNBits standing for
    the reference's MatMuls, and through Casts the reference has too. Judged by a tolerance the logits fail,
    it now saves a reproducer that fails when its printed command is pasted; judged only by a requirement
    its elements meet, it says in one sentence that a cut is checked elementwise."""
    common = ["bisect", "subgraph", llama.fp32, "--candidate-model", llama.int4, "--prompts", llama.prompts, "--new-tokens", "2"]
    code, out, err = run_cli(*common, "--atol", "0.01", "--rtol", "0.01", "--stol", "0", "-o", tmp_path / "cut")
    assert code == 1 and "reproducer confirmed to fail" in out, out + err
    runs, bound = map(int, re.search(r"(\d+) candidate runs \(at most (\d+) on any path", out).groups())
    assert runs <= bound, out  # the whole model fed as its cuts are is one run more, counted
    [command] = [line.strip() for line in out.splitlines() if line.strip().startswith("cd ")]
    assert run_printed(command, tmp_path).returncode == 1
    code, out, err = run_cli(*common, "--require", "kl=1e-6", "-o", tmp_path / "req")
    said = [line for line in err.splitlines() if line.startswith("accudiff: error:")]  # below the first step's progress line
    assert code == 2 and len(said) == 1 and "a subgraph is checked elementwise" in said[0], err
    assert not (tmp_path / "req").exists()
    # At the default stol, the single-node cause's tensor is checked as one prefill before the logits: each named (both read alike).
    code, out, err = run_cli(*common, "--atol", "0.01", "--rtol", "0.01", "-o", tmp_path / "two")
    progress = [line for line in err.splitlines() if "as one prefill" in line]
    assert code == 1 and progress and len(set(progress)) == len(progress), err


def _kv_cache_in_int8(model: Path, target: Path, layers: range = range(4), scale: float = 0.1) -> Path:
    """The decoder storing the KV cache of `layers` in INT8 (a Q/DQ pair, one scale, on each present output), as
    a deployment quantizing its cache does: the prefill's logits are the model's own, the decode steps read
    the cache rounded."""

    def quantize_cache(proto: onnx.ModelProto) -> None:
        proto.graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), "kv_scale"),
                                        numpy_helper.from_array(np.array(0, np.int8), "kv_zero")])
        for name in [f"present.{layer}.{part}" for layer in layers for part in ("key", "value")]:
            writer = next(node for node in proto.graph.node if name in node.output)
            writer.output[list(writer.output).index(name)] = f"{name}/float"
            proto.graph.node.extend([helper.make_node("QuantizeLinear", [f"{name}/float", "kv_scale", "kv_zero"], [f"{name}/int8"], name=f"{name}/Q"),
                                     helper.make_node("DequantizeLinear", [f"{name}/int8", "kv_scale", "kv_zero"], [name], name=f"{name}/DQ")])

    return decoders.edited(model, target, quantize_cache)


def test_a_kv_cache_stored_in_int8_is_found_where_it_enters_and_no_subgraph_is_claimed(llama, tmp_path, run_cli):
    """The trained Llama storing its KV cache in INT8 on its way out. Its attentions were not counted as
    quantized (a Q/DQ pair writing a graph output, read by no node), so compare found no quantized node
    upstream of the logits and bisect precision nothing to keep; bisect subgraph stopped on a cut of the
    candidate whose outputs no node wrote ("fails the ONNX checker", naming a file of its own). And a cut,
    fed each prompt's whole sequence as one prefill (it carries no cache), cannot fail here: bisection ended
    on a "reproducer" of the whole model that "needs more context"; where the cause was a single node (an Intel
    Xeon's rounding), its cuts were written and reported as a reproducer that did not reproduce, before the
    whole model fed as one prefill was run. Now bisect subgraph says that no subgraph reproduces it, and
    bisect precision, pasted as printed, keeps the four attentions, each needed as the
    oracle (two plain sessions generating) finds; with all four kept, no error is said to enter anywhere."""
    tolerance = ["--atol", "0.01", "--rtol", "0.01", "--stol", "0"]
    common = ["--candidate-model", _kv_cache_in_int8(llama.fp32 / "model.onnx", tmp_path / "kv.onnx"), "--prompts", llama.prompts, "--new-tokens", "4", *tolerance]
    code, out, err = run_cli("bisect", "subgraph", llama.fp32, *common, "-o", tmp_path / "cut")
    # checked at the logits, or where the cause is one node (an Intel Xeon's rounding: the kind of cause is borderline
    # here) at the first tensor it makes fail: the comparison and its isolated run, then the whole model fed as a cut is
    checked = r"'(logits|/model/layers\.0/attn/GroupQueryAttention/output_0)'"
    assert code == 1 and "no subgraph reproduces it" in out and re.search(rf"the whole model leaves {checked} at 0x its tolerance", out), out + err
    assert re.search(r"accudiff bisect subgraph: 3 candidate runs \(at most \d+ on any path", out), out
    page = (tmp_path / "cut" / "report.html").read_text()
    assert not (tmp_path / "cut" / "subgraph.onnx").exists() and "NO SUBGRAPH FOUND" in page and "no subgraph reproduces it" in page
    [command] = [line.strip() for line in out.splitlines() if line.strip().startswith("accudiff bisect precision")]
    pasted = run_printed(command, tmp_path)
    attentions = [f"/model/layers.{layer}/attn/GroupQueryAttention" for layer in range(4)]
    assert pasted.returncode == 1 and "keeping 4 of the 4 converted node(s)" in pasted.stdout, pasted.stdout + pasted.stderr
    assert all(name in pasted.stdout for name in attentions) and "each of them is needed" in pasted.stdout, pasted.stdout
    for layer in range(4):  # the oracle: the cache of this layer alone in INT8 still fails the tolerance
        alone = _kv_cache_in_int8(llama.fp32 / "model.onnx", tmp_path / f"kv{layer}.onnx", range(layer, layer + 1))
        assert oracle.generation(llama.fp32 / "model.onnx", alone, _prompt_ids(llama), 4, tolerance=(0.01, 0.01, 0.0))["tol_ratio"] > 1, layer
    code, out, err = run_cli("compare", llama.fp32, *common, "--no-verify")
    assert code == 1 and "the error arises only in the decode steps: the decode steps' KL" in out, out + err
    code, out, err = run_cli("compare", llama.fp32, *common, "--keep-fp32", r"/model/layers\..*/attn/GroupQueryAttention", "--no-verify")
    assert code == 0 and "the candidate's next-token distributions are the reference's in both phases (KL 0)" in out, out + err
    # a cache stored on a grid too coarse for it is the rules' finding on the attention writing it
    coarse = _kv_cache_in_int8(llama.fp32 / "model.onnx", tmp_path / "coarse.onnx", scale=1.0)
    code, out, err = run_cli("compare", llama.fp32, "--candidate-model", coarse, "--prompts", llama.prompts, "--new-tokens", "4", "--no-verify")
    said = re.search(r"int8_resolution: ([0-9.]+)% of the values of its output 'present\.0\.value' are smaller than half an INT8 step \(scale 1,", out)
    assert code == 1 and said is not None, out + err
    import onnxruntime as ort

    prompt = _prompt_ids(llama)[0][None, :]
    feed = {"input_ids": prompt, "attention_mask": np.ones_like(prompt),
            **{f"past_key_values.{layer}.{part}": np.zeros((1, 2, 0, 16), np.float32) for layer in range(4) for part in ("key", "value")}}
    [value] = ort.InferenceSession(str(llama.fp32 / "model.onnx"), providers=["CPUExecutionProvider"]).run(["present.0.value"], feed)
    assert (np.abs(value) < 0.5).mean() > 0.5  # the oracle: on one prompt's prefill, most of them do


def test_a_decoder_quantized_by_modelopt_int4_compares_and_is_made_again_by_modelopts_own_option(llama, tmp_path, run_cli):
    """The trained Llama quantized by ModelOpt's ONNX PTQ in INT4 (blocked DequantizeLinear on each MatMul's weight;
    its SimplifiedLayerNormalization written as RMSNormalization first, as ModelOpt needs): compare generates and
    matches the oracle, every tensor aligned. Its repairs offered ModelOpt's --nodes_to_exclude beside
    quantize_static's, which does not make this model, with the caveat that a Q/DQ pair is shared by its readers,
    which a weight's is not; and a cause 'the best of 10 of the 9 single keeps tried' (the best flipped a top-1,
    so it was no contributor). Now ModelOpt's int4 option, run as printed, makes the repaired candidate."""
    from benchmarks import models

    float_form = decoders.with_rms_normalization(llama.fp32 / "model.onnx", tmp_path / "rms.onnx")
    ids = _prompt_ids(llama)[0][None, :48]
    calibration = {"input_ids": ids, "attention_mask": np.ones_like(ids),
                   **{f"past_key_values.{layer}.{part}": np.zeros((1, 2, 0, 16), np.float32) for layer in range(4) for part in ("key", "value")}}
    candidate = models.modelopt_quantized(float_form, calibration, tmp_path / "int4.onnx", "int4")
    code, out, err = run_cli("compare", llama.fp32, "--candidate-model", candidate, "--prompts", llama.prompts, "--new-tokens", NEW_TOKENS, "-o", tmp_path / "c")
    assert code in (0, 1) and "[int4-weight]" in out and "tensors compared: 68 of 68" in out, out + err
    phases = json.loads((tmp_path / "c" / "summary.json").read_text())["generation"]["phases"]["logits"]
    # its DequantizeLinear and MatMul computed as written, as TensorRT runs them (docs/candidate-models.md), not as ONNX Runtime's MatMulNBits
    for phase, figures in oracle.generation(llama.fp32 / "model.onnx", candidate, _prompt_ids(llama), NEW_TOKENS, qdq_as_written=True)["phases"].items():
        for name in ("top1", "kl", "delta_nll"):
            assert phases[phase]["figures"][name] == pytest.approx(figures[name], rel=1e-6, abs=1e-9), (phase, name)
    best_of = re.search(r"the best of the (\d+) single keeps that each do", out)
    assert "single keeps tried" not in out and (best_of is None or int(best_of.group(1)) == out.count("also repairs it alone:") + 1), out
    code, out, err = run_cli("bisect", "precision", llama.fp32, "--candidate-model", candidate, "--prompts", llama.prompts, "--new-tokens", NEW_TOKENS,
                             "--atol", "0.02", "--rtol", "0.05", "-o", tmp_path / "fix")
    assert code == 1 and "or quantize again without them: ModelOpt --quantize_mode int4 --nodes_to_exclude" in out, out + err
    assert "quantize_static" not in out and "a rebuild is not what was verified" not in out, out
    patterns = tuple((tmp_path / "fix" / "keep_fp32.txt").read_text().split())
    rebuilt = models.modelopt_quantized(float_form, calibration, tmp_path / "rebuilt.onnx", "int4", exclude=patterns)
    import onnxruntime as ort

    feed = {**calibration, "input_ids": _prompt_ids(llama)[1][None, :], "attention_mask": np.ones((1, len(_prompt_ids(llama)[1])), np.int64)}
    logits = [ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feed)[0]
              for path in (rebuilt, tmp_path / "fix" / "repaired-candidate.onnx")]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_partition_gives_each_attention_of_a_decoder_its_own_part(llama, tmp_path):
    """TensorRT's capability query names only a decoder's first GroupQueryAttention: the range after it was
    reported NOT convertible as a whole, the MatMuls of three layers with it. Each range is asked again on its
    own: each layer's attention is a part of its own, and every other part converts."""
    from accudiff.bisect.partition import partition
    from accudiff.runners.trt_env import import_tensorrt

    try:
        import_tensorrt()
    except accudiff.AccudiffError as exc:
        pytest.skip(str(exc))
    parts = partition(llama.fp32, tmp_path / "parts")
    assert [p.op_types for p in parts if not p.supported] == ["GroupQueryAttention"] * 4, [(p.op_types, p.reason) for p in parts]
    assert sum(p.supported for p in parts) == 5


def test_every_cpu_build_of_the_genai_builder_loads_and_compares(llama, tmp_path):
    """int4 at accuracy_level 0 (FP32 arithmetic on dequantized blocks, said so), exclude_embeds (embeddings
    in) and exclude_lm_head (hidden states out): each compares on its inputs; --prompts, which needs token ids in
    and logits out, is refused for the last two in one sentence naming the folder."""
    level0 = decoders.genai_model(llama.checkpoint, llama.shared, "int4", ("accuracy_level=0",))
    result = accudiff.compare(llama.fp32, candidate_model=level0, prompts=llama.prompts, new_tokens=2, verify=False)
    assert result.precision == "int4-weight" and "its arithmetic is FP32" in result.candidate
    rng = np.random.default_rng(0)
    empty = {f"past_key_values.{layer}.{part}": np.zeros((1, 2, 0, 16), np.float32) for layer in range(4) for part in ("key", "value")}
    for option, feed in (("exclude_embeds=true", {"inputs_embeds": rng.normal(size=(1, 12, 128)).astype(np.float32)}),
                         ("exclude_lm_head=true", {"input_ids": np.arange(100, 112)[None]})):
        folder = decoders.genai_model(llama.checkpoint, llama.shared, "fp32", (option,))
        np.savez(tmp_path / "inputs.npz", **feed, attention_mask=np.ones((1, 12), np.int64), **empty)
        assert accudiff.compare(folder, "fp16", inputs=tmp_path / "inputs.npz", verify=False).verdict == "pass"
        with pytest.raises(accudiff.AccudiffError, match=rf"^'{folder.name}/model.onnx' (reads embeddings|returns hidden states)"):
            accudiff.compare(folder, "fp16", prompts=llama.prompts)


TINY = ROOT / "fixtures" / "tiny_decoder"  # a GenAI folder of a one-layer decoder (fixtures/make_fixtures.py): no package beyond accudiff's own


def test_the_bundled_decoder_generates_from_text_prompts_on_workers_and_on_ray(tmp_path):
    """The fixture folder's text prompts, tokenized with its tokenizer.json, generated on two workers and as
    Ray tasks: the same steps and figures as on one worker."""
    pytest.importorskip("tokenizers", reason="text prompts are tokenized with the tokenizers package")
    runs = [accudiff.compare(TINY, "fp16", prompts=TINY / "prompts.txt", new_tokens=3, verify=False, **options)
            for options in ({}, {"workers": 2}, {"ray": "local", "workers": 2})]
    first = runs[0]
    assert len(first.steps) == 2 * 4 and set(first.steps["phase"]) == {"prefill", "decode"}
    for other in runs[1:]:
        assert other.phases["logits"]["decode"]["figures"] == pytest.approx(first.phases["logits"]["decode"]["figures"])
        assert [g["reference"] for g in other.generations] == [g["reference"] for g in first.generations]


def _perturbed_tiny(target: Path, seed: int) -> Path:
    """The bundled decoder with every float weight moved a little (by 1%, seeded): a candidate that differs."""
    perturbed = onnx.load(str(TINY / "model.onnx"))
    rng = np.random.default_rng(seed)
    for init in perturbed.graph.initializer:
        value = numpy_helper.to_array(init)
        if value.dtype == np.float32:
            init.CopyFrom(numpy_helper.from_array((value * (1 + 0.01 * rng.standard_normal(value.shape))).astype(np.float32), init.name))
    onnx.save(perturbed, target)
    return target


def test_many_keep_lists_generate_in_rounds_each_as_it_would_alone(tmp_path, monkeypatch):
    """A trial job's keep-lists each carry their own KV cache while a prompt generates: more than PASSES_AT_ONCE
    of them generate in rounds, every prompt again with the reference, so the caches held at once stay bounded
    whatever the keep-lists. Each pass reads what it reads in one round, and the inputs are counted once."""
    from accudiff.execution import generation, worker
    from accudiff.execution.messages import Job, PassSpec
    from accudiff.execution.pool import load_result
    from accudiff.judging.tolerances import Tolerances
    from accudiff.model.loading import load_model
    from accudiff.model.prompts import prepare_generation

    info = load_model(TINY / "model.onnx")
    _perturbed_tiny(tmp_path / "perturbed.onnx", seed=0)
    (tmp_path / "prompts.jsonl").write_text("[5, 17, 99, 3]\n[200, 1, 42]\n")
    plan = prepare_generation(info, tmp_path / "prompts.jsonl", 3, tmp_path / "prompts.npz", tmp_path)
    passes = [PassSpec(f"variant{k}", str(tmp_path / "perturbed.onnx" if k % 2 else info.path), "onnxrt") for k in range(5)]

    def run(name: str, at_once: int):
        monkeypatch.setattr(generation, "PASSES_AT_ONCE", at_once)
        job = Job(reference=str(info.path), passes=passes, precision="fp32", tensors=list(info.output_names), outputs=list(info.output_names),
                  segments=[[n.name for n in info.proto.graph.node]], tolerances=Tolerances.build("fp32").as_dict(), quant_ranges={},
                  samples=plan.prompts.as_json(), sample_indices=list(range(len(plan.prompts))), result=str(tmp_path / name / "result"), points=0,
                  generation=plan.as_json(trial=True))
        worker._work(job, lambda event: None)
        return load_result(tmp_path / name / "result")

    together, rounds = run("together", 8), run("rounds", 2)
    for name in together.passes:
        assert rounds.passes[name].outcomes == together.passes[name].outcomes, name
        np.testing.assert_array_equal(rounds.passes[name].stats.values, together.passes[name].stats.values)
    assert any(o.tol_ratio > 0 for o in together.passes["variant1"].outcomes)  # the perturbed passes differ from the reference
    np.testing.assert_array_equal(rounds.inputs.values, together.inputs.values)
    assert rounds.steps == together.steps


def _trial_job_alone_and_together(reference: Path, candidates: list[Path], prompts: list[list[int]], tmp_path: Path, monkeypatch):
    """A trial job (every keep's pass carrying its own cache, on the tokens a comparison fed) run twice: its prompts
    one at a time, then those of one length as rows of a batch where its sessions compute rows apart. Returns both
    results, and what the second run's engine steps were given (a sample, or a batch's samples)."""
    from accudiff.execution import generation, worker
    from accudiff.execution.engine import Engine
    from accudiff.execution.messages import Job, PassSpec
    from accudiff.execution.pool import load_result
    from accudiff.judging.tolerances import Tolerances
    from accudiff.model.loading import load_model
    from accudiff.model.prompts import prepare_generation, replayed_prompts

    info = load_model(reference)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    plan = prepare_generation(info, tmp_path / "prompts.jsonl", 4, tmp_path / "prompts.npz", tmp_path)
    assert plan.batch  # a GenAI folder's graph takes any number of rows
    rng = np.random.default_rng(0)
    replayed = replayed_prompts([{"prompt": p, "given": False, "reference": rng.integers(3, 200, 5).tolist()} for p in prompts], tmp_path / "replayed.npz")
    passes = [PassSpec(f"variant{k}", str(path), "onnxrt") for k, path in enumerate(candidates)]

    stepped: list = []  # what each engine step of the second run was given: a sample, or a batch's
    step = Engine.run_sample
    monkeypatch.setattr(Engine, "run_sample", lambda engine, sample, *rest, **named: (stepped.append(sample), step(engine, sample, *rest, **named))[1])

    def run(name: str, tokens: int):
        monkeypatch.setattr(generation, "BATCH_TOKENS", tokens)
        stepped.clear()
        job = Job(reference=str(info.path), passes=passes, precision="fp32", tensors=["logits"], outputs=["logits"],
                  segments=[[n.name for n in info.proto.graph.node]], tolerances=Tolerances.build("fp32").as_dict(), quant_ranges={},
                  samples=replayed.as_json(), sample_indices=list(range(len(replayed))), result=str(tmp_path / name / "result"), points=0,
                  generation=plan.as_json(trial=True))
        worker._work(job, lambda event: None)
        return load_result(tmp_path / name / "result")

    groups = generation.batches(list(replayed), 4, plan.decoder.eos_token_id)
    assert sorted(map(len, groups)) == [1, 3], groups  # the three prompts of one length together, the other apart
    tokens = generation.BATCH_TOKENS
    return run("alone", 0), run("together", tokens), stepped


def _same_trials(alone, together) -> None:
    for name in alone.passes:
        assert together.passes[name].outcomes == alone.passes[name].outcomes, name
        np.testing.assert_array_equal(together.passes[name].stats.values, alone.passes[name].stats.values)
    assert together.steps == alone.steps and together.generations == alone.generations


def test_a_trials_prompts_of_one_length_generate_together_each_as_it_would_alone(tmp_path, monkeypatch):
    """A trial's prompts of one length fed as many tokens generate as rows of one batch (a keep's generation costs
    a step for all of them, not one a prompt): every row reads as that prompt alone, bit for bit. The bundled
    decoder's graph (MatMul, Softmax, LayerNormalization), its reference run beside a perturbed candidate."""
    alone, together, stepped = _trial_job_alone_and_together(TINY / "model.onnx", [_perturbed_tiny(tmp_path / "perturbed.onnx", seed=1)],
                                                             [[5, 17, 99, 3], [200, 1, 42], [7, 7, 8, 9], [1, 2, 3, 4]], tmp_path, monkeypatch)
    _same_trials(alone, together)
    assert any(o.tol_ratio > 0 for o in together.passes["variant0"].outcomes)
    assert [0, 10, 15] in stepped and 5 in stepped  # (a prompt's steps are samples 5k..5k+4) the three together, the other alone


def test_a_trial_whose_sessions_compute_one_row_otherwise_steps_its_prompts_one_at_a_time(tmp_path, monkeypatch):
    """Unpacked, ONNX Runtime multiplies one row by another kernel than a batch's rows, which rounds otherwise (1e-5
    apart in the 1.1B Llama's logits): each session is measured before its prompts step together (Engine.rows_apart),
    and a trial whose sessions skip prepacking (large float weights, few prompts) steps them one at a time, as before."""
    monkeypatch.setattr("accudiff.runners.onnxrt.PREPACK_UP_TO_BYTES", 0)  # this small model's weights, taken as large
    alone, together, stepped = _trial_job_alone_and_together(TINY / "model.onnx", [TINY / "model.onnx"],
                                                             [[5, 17, 99, 3], [200, 1, 42], [7, 7, 8, 9], [1, 2, 3, 4]], tmp_path, monkeypatch)
    _same_trials(alone, together)
    assert stepped and all(isinstance(sample, int) for sample in stepped)


def test_a_genai_builds_trials_generate_together_each_as_it_would_alone(llama, tmp_path, monkeypatch):
    """The same on the GenAI builder's graphs (GroupQueryAttention, SkipSimplifiedLayerNormalization; MatMulNBits
    at accuracy_level 4, whose INT8 activations are quantized row by row): the FP32 build and the INT4 build as
    keeps' passes, each row of a batch bit for bit as its prompt alone. Whether they step together depends on
    the CPU's kernels: on an AMD EPYC with AVX2 and no VNNI, MatMulNBits multiplies three one-token rows otherwise
    than one (logits 2e-6 apart), so they step one at a time there, as plain sessions say they must."""
    ids = [p[:12].tolist() for p in _prompt_ids(llama)[:3]] + [_prompt_ids(llama)[3][:9].tolist()]
    models = [llama.int4 / "model.onnx", llama.fp32 / "model.onnx"]
    alone, together, stepped = _trial_job_alone_and_together(llama.fp32, models, ids, tmp_path, monkeypatch)
    _same_trials(alone, together)
    apart = all(oracle.rows_apart(model, [p[0] for p in ids[:3]]) for model in [llama.fp32 / "model.onnx", *models])
    assert any(isinstance(sample, list) and len(sample) == 3 for sample in stepped) == apart, stepped
    assert any(o.tol_ratio > 0 for o in together.passes["variant0"].outcomes)


@pytest.mark.parametrize("content, said", [
    ('[1, 2, 999]\n', "holds token id 999, outside the model's vocabulary of 258"),
    ('{"prompt": 5}\n', "prompt 0 of '.*' is neither text nor a list of token ids"),
    ('\n\n', "holds no prompt"),
    ('{"prompt": [1], "continuation": [300]}\n', "holds token id 300"),
    ('not json\n', "line 1 of '.*' is not JSON"),
])
def test_a_bad_prompts_file_is_one_sentence(content, said, tmp_path, run_cli):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    code, _, err = run_cli("compare", TINY, "--fp16", "--prompts", prompts)
    assert code == 2 and err.count("\n") == 1 and re.search(said, err), err


def test_every_command_takes_a_genai_folder_as_its_model(tmp_path):
    """`accudiff partition fp32/` said "model file 'fp32' does not exist" of a GenAI folder that compare and
    bisect take: the folder is read where a model is loaded, and a folder without its config is said to be one."""
    from accudiff.model.loading import load_model

    assert load_model(TINY).path == TINY / "model.onnx"
    with pytest.raises(accudiff.AccudiffError, match=r"is a folder, not a model file: give the model file in it \(model.onnx\)"):
        load_model(shutil.copytree(TINY, tmp_path / "no-config", ignore=shutil.ignore_patterns("genai_config.json")))


def test_a_decoder_given_no_prompts_is_asked_for_them(run_cli):
    """A GenAI folder compared without prompts was told to give 'input_ids' a shape with --input-shapes, as
    if random token ids and an empty cache were what it needed. It is asked for prompts, in one sentence."""
    code, _, err = run_cli("compare", TINY, "--fp16")
    assert code == 2 and err.count("\n") == 1 and "is a decoder carrying a KV cache: give it prompts with --prompts (text" in err, err
    with pytest.raises(accudiff.AccudiffError, match=r"give it prompts with prompts= \(text"):
        accudiff.compare(TINY, "fp16")


def test_prompts_as_token_ids_need_no_tokenizer_and_replay(tmp_path, run_cli):
    """Token ids in an .npz (`k/input_ids`, with a continuation fed instead of the reference's choice); the
    replay line reads the prompts the report saved."""
    np.savez(tmp_path / "ids.npz", **{"0/input_ids": np.arange(60, 70), "0/continuation": np.array([70, 71, 72]), "1/input_ids": np.arange(80, 90)})
    code, out, err = run_cli("compare", TINY, "--fp16", "--prompts", tmp_path / "ids.npz", "--new-tokens", "3", "-o", tmp_path / "r")
    assert code == 0, err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["generation"]["generations"][0]["reference"][:3] == [70, 71, 72] and summary["generation"]["generations"][0]["given"]
    assert "--prompts" in summary["replay"] and "prompts.npz" in summary["replay"]
    # The page says how its intervals were made as the console does: two prompts are too few to resample (it said it resampled them).
    page = (tmp_path / "r" / "report.html").read_text()
    [note] = re.findall(r"\[(95% intervals over \d+ positions taken as independent[^\]]*)\]", out)
    intro = page.split("both sides fed the same tokens. ")[1].split("</p>")[0]  # the Generation section's own words
    assert "with fewer than 5 prompts" in note and intro == f"{note}."  # the same words and count (the page once counted the prefill's alone)
    assert "resample whole prompts" not in page
    # A decoder is fed prompts, and the page and summary.md count them so, as the console does (they said "2 sample(s)").
    markdown = (tmp_path / "r" / "summary.md").read_text()
    assert "prompts: 2," in out and "2 prompt(s) from" in page and "compared over 2 prompt(s)." in markdown and "sample(s)" not in markdown
    # Each figure once: the phases, where the error enters and the greedy generation are the Generation section's, not repeated under Samples.
    samples = page.split("<h2>Samples</h2>")[1].split("</section>")[0]
    assert "each side carrying its own KV cache (" not in samples and "generation: both sides fed" not in samples, samples
    assert page.count("through the KV cache: the decode steps") == 1
    code, replayed, err = run_cli(*shlex.split(summary["replay"])[1:], "-o", tmp_path / "again")
    assert code == 0, err
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["generation"]["phases"] == summary["generation"]["phases"]


def test_where_a_decoders_error_enters_is_said_as_far_as_the_decode_steps_interval_shows():
    """BF16 of the trained Llama, 4 new tokens: decode KL 7.29e-05 [3.21e-05, 0.000114] against the prefill's 5.84e-05
    read 'does not grow through the KV cache', which 32 decode positions cannot show."""
    from accudiff.judging.intervals import Interval
    from accudiff.report.decision_text import entry_text

    def phases(decode_kl: float, low: float, high: float) -> dict:
        return {"prefill": {"figures": {"kl": 5.84e-05}, "intervals": {}},
                "decode": {"figures": {"kl": decode_kl}, "intervals": {"kl": Interval(low, high, 8, 32, True)}}}

    assert entry_text(phases(7.29e-05, 3.21e-05, 0.000114)) == ("the error enters in the prefill and is not shown to grow through the KV cache: "
                                                                "the decode steps' KL, 7.29e-05 [3.21e-05, 0.000114], whose interval holds the prefill's, 5.84e-05")
    assert entry_text(phases(2e-4, 1e-4, 3e-4)) == ("the error grows through the KV cache: the decode steps' KL, 0.0002 [0.0001, 0.0003], lies above the prefill's, "
                                                    "5.84e-05")
    assert entry_text(phases(2e-5, 1e-5, 3e-5)).startswith("the error enters in the prefill and does not grow through the KV cache: the decode steps' KL, 2e-05 [1e-05, 3e-05], lies below")


def test_prompts_longer_than_the_decoders_context_are_refused_before_any_run(tmp_path, run_cli):
    """A prompt of 5000 tokens to the trained Llama (context 2048) failed in ONNX Runtime's GroupQueryAttention,
    naming a segment file accudiff made; --new-tokens 100000 ran 2006 decode steps before failing so. The
    context the GenAI config gives (the bundled decoder's: 512) bounds the prompt and its new tokens, said at once."""
    np.savez(tmp_path / "ids.npz", **{"0/input_ids": np.arange(10, 20), "1/input_ids": np.arange(510) % 250})
    code, _, err = run_cli("compare", TINY, "--fp16", "--prompts", tmp_path / "ids.npz", "--new-tokens", "3", "-o", tmp_path / "r")
    assert code == 2 and err.count("\n") == 1, err
    assert ("prompt 1 of prompts file '" in err and "is 510 tokens long, and with 3 new tokens (--new-tokens) needs 513 positions: "
            "'tiny_decoder/model.onnx' holds 512 (context_length in its genai_config.json)" in err), err
    assert not (tmp_path / "r").exists()
    code, _, err = run_cli("compare", TINY, "--fp16", "--prompts", tmp_path / "ids.npz", "--new-tokens", "2", "--no-verify", "-o", tmp_path / "fits")
    assert code in (0, 1), err  # 510 + 2 fits exactly


def test_a_decoder_without_a_config_is_bounded_by_its_attentions_rotary_cache():
    """Without a GenAI config, the rotary cache GroupQueryAttention reads (input 7) is the context ONNX Runtime enforces."""
    from onnx import TensorProto, helper, numpy_helper

    from accudiff.model.decoder import Decoder
    from accudiff.model.prompts import context_limit

    cos = numpy_helper.from_array(np.zeros((64, 4), np.float32), "cos_cache")
    node = helper.make_node("GroupQueryAttention", ["q", "", "", "pk", "pv", "s", "t", "cos_cache", "sin_cache"], ["y", "k", "v"], domain="com.microsoft")
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [cos])
    decoder = Decoder("input_ids", "logits", (("pk", "k"),), 1, 8)
    assert context_limit(graph, decoder) == (64, "the rotary cache its GroupQueryAttention nodes read")
    assert context_limit(graph, replace(decoder, context_length=32)) == (32, "context_length in its genai_config.json")
    assert context_limit(helper.make_graph([], "empty", [], []), decoder) is None
