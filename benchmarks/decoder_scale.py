"""A decoder at the field's scale: accudiff against its floor, and polygraphy on the same job.

    python benchmarks/decoder_scale.py [--folder /big/disk] [--repeat 3] [--out benchmarks/out]

The model is TinyLlama's shape (1.1B parameters, 22 layers, vocabulary 32000, 4.4 GB of FP32 weights),
randomly initialised and built by the ONNX Runtime GenAI model builder in fp32 and int4 (benchmarks/
decoders.py; made once in --folder, 10 GB of disk). Two jobs, each a fresh process, peak memory summed over
its process tree (measure.py):

* one 64-token prompt, prefill only, with diagnosis: `accudiff compare fp32/ --candidate-model int4/
  --prompts one.jsonl --new-tokens 0` (every tensor marked, the isolated run, verification of a failing
  output's cause, the report). Its floor: the two models' plain ONNX Runtime sessions (graph outputs only)
  built and run once on the prompt, one after the other (`python -m benchmarks.decoder_scale floor ...`).
  polygraphy's flow on the same prompt: `run --onnxrt --onnx-outputs mark all --save-outputs` on each model,
  the second with `--load-outputs` (its JSON inputs written from the same token ids).
* four prompts of 64 tokens, 32 decode steps each, every side carrying its own KV cache, `--no-verify`:
  accudiff's generation against its floor, the same generation by the two plain sessions;
* the same with verification (every keep the cause search tries generates the four prompts again).

Medians of --repeat runs (alternated), largest peaks; printed as a table and saved as JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import decoders
from benchmarks.measure import accudiff_command, measure, polygraphy_command

PROMPT_TOKENS, PROMPTS, DECODE_STEPS = 64, 4, 32


def prompts(folder: Path, count: int) -> Path:
    """`count` prompts of PROMPT_TOKENS bytes of standard library source (a byte is a token of this vocabulary)."""
    texts = [text[:PROMPT_TOKENS].ljust(PROMPT_TOKENS) for text in decoders.source_prompts(count, 2 * PROMPT_TOKENS)]
    return decoders.write_prompts(folder / f"prompts-{count}.jsonl", texts)


def floor(reference: Path, candidate: Path, prompt_file: Path, steps: int) -> None:
    """What the job cannot avoid: each model's plain session (graph outputs only) built, then each prompt
    generated with its own cache (the prefill, then `steps` decode steps fed the reference's greedy
    tokens), the two models one after the other. Prints the seconds it took."""
    import onnxruntime as ort

    ids = [np.frombuffer(json.loads(line).encode(), np.uint8).astype(np.int64) for line in prompt_file.read_text().splitlines()]
    config = json.loads((reference / "genai_config.json").read_text())["model"]["decoder"]
    start = time.perf_counter()
    tokens = None
    for model in (reference, candidate):
        session = ort.InferenceSession(str(model / "model.onnx"), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        chosen = []
        for k, prompt in enumerate(ids):
            past = {f"past_key_values.{layer}.{part}": np.zeros((1, config["num_key_value_heads"], 0, config["head_size"]), np.float32)
                    for layer in range(config["num_hidden_layers"]) for part in ("key", "value")}
            fed, picked = prompt, []
            for step in range(steps + 1):
                done = past["past_key_values.0.key"].shape[2]
                out = dict(zip(names, session.run(names, {"input_ids": fed[None], "attention_mask": np.ones((1, done + len(fed)), np.int64), **past})))
                past = {name.replace("present.", "past_key_values."): value for name, value in out.items() if name.startswith("present.")}
                picked.append(int(out["logits"][0, -1].argmax()))
                fed = np.asarray([tokens[k][step] if tokens is not None else picked[-1]], np.int64)
            chosen.append(picked)
        tokens = tokens or chosen  # the candidate is fed the reference's tokens
        del session
    print(json.dumps({"seconds": time.perf_counter() - start}))


def _floor(reference: Path, candidate: Path, prompt_file: Path, steps: int) -> dict:
    result = measure([sys.executable, "-m", "benchmarks.decoder_scale", "floor", str(reference), str(candidate), str(prompt_file), str(steps)])
    return result


def _polygraphy(reference: Path, candidate: Path, prompt_file: Path, work: Path) -> dict:
    from polygraphy.json import save_json

    config = json.loads((reference / "genai_config.json").read_text())["model"]["decoder"]
    ids = np.frombuffer(json.loads(prompt_file.read_text().splitlines()[0]).encode(), np.uint8).astype(np.int64)[None]
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), **{f"past_key_values.{layer}.{part}": np.zeros((1, config["num_key_value_heads"], 0, config["head_size"]), np.float32)
                                                                        for layer in range(config["num_hidden_layers"]) for part in ("key", "value")}}
    save_json([feed], str(work / "inputs.json"))
    polygraphy = polygraphy_command()
    steps = [[*polygraphy, "run", str(reference / "model.onnx"), "--onnxrt", "--onnx-outputs", "mark", "all", "--load-inputs", str(work / "inputs.json"),
              "--save-outputs", str(work / "ref.json")],
             [*polygraphy, "run", str(candidate / "model.onnx"), "--onnxrt", "--onnx-outputs", "mark", "all", "--load-inputs", str(work / "inputs.json"),
              "--load-outputs", str(work / "ref.json")]]
    results = []
    for step in steps:
        results.append(measure(step))
        if results[-1]["exit"] != 0:
            break
    return {"seconds": sum(r["seconds"] for r in results), "peak_mb": max(r["peak_mb"] for r in results), "exit_codes": [r["exit"] for r in results],
            "last_error": next((r["stderr_tail"] for r in results if r["exit"]), [])}


def _accudiff(reference: Path, candidate: Path, prompt_file: Path, steps: int, work: Path, verify: bool) -> dict:
    command = accudiff_command("compare", str(reference), "--candidate-model", str(candidate), "--prompts", str(prompt_file), "--new-tokens", str(steps),
                               "-o", str(work), *([] if verify else ["--no-verify"]))
    result = measure(command)
    summary = json.loads((work / "summary.json").read_text()) if (work / "summary.json").exists() else {}
    result.update(timings=summary.get("timings_s"), workers=summary.get("worker_timings_s"))
    return result


def _median(results: list[dict]) -> dict:
    chosen = dict(sorted(results, key=lambda r: r["seconds"])[len(results) // 2])
    chosen.update(peak_mb=max(r["peak_mb"] for r in results), all_seconds=[round(r["seconds"], 1) for r in results])
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("benchmarks/out/decoders"), help="where the models are made once (10 GB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--no-polygraphy", dest="polygraphy", action="store_false")
    args = parser.parse_args()
    checkpoint = decoders.random_llama(args.folder)
    reference, candidate = (decoders.genai_model(checkpoint, args.folder, precision) for precision in ("fp32", "int4"))
    one, four = prompts(args.folder, 1), prompts(args.folder, PROMPTS)
    rows: dict[str, dict] = {"prefill": {"accudiff": [], "floor": [], "polygraphy": []}, "generation": {"accudiff": [], "floor": []},
                             "verified": {"accudiff": [], "floor": []}}
    for repeat in range(args.repeat):
        work = args.folder / "runs" / str(repeat)
        shutil.rmtree(work, ignore_errors=True)  # report folders are never overwritten: each run writes afresh
        work.mkdir(parents=True)
        rows["prefill"]["floor"].append(_floor(reference, candidate, one, 0))
        rows["prefill"]["accudiff"].append(_accudiff(reference, candidate, one, 0, work / "prefill", verify=True))
        if args.polygraphy and repeat == 0:  # it fails the same way each time (below): once is enough
            rows["prefill"]["polygraphy"].append(_polygraphy(reference, candidate, one, work))
        rows["generation"]["floor"].append(_floor(reference, candidate, four, DECODE_STEPS))
        rows["generation"]["accudiff"].append(_accudiff(reference, candidate, four, DECODE_STEPS, work / "generation", verify=False))
        rows["verified"]["floor"].append(_floor(reference, candidate, four, DECODE_STEPS))
        rows["verified"]["accudiff"].append(_accudiff(reference, candidate, four, DECODE_STEPS, work / "verified", verify=True))
    summary = {job: {tool: _median(results) for tool, results in tools.items() if results} for job, tools in rows.items()}
    for job, tools in summary.items():
        ad, fl = tools["accudiff"], tools["floor"]
        print(f"{job:<11} accudiff {ad['seconds']:7.1f} s {ad['peak_mb']:7.0f} MB (exit {ad['exit']}) | floor {fl['seconds']:7.1f} s {fl['peak_mb']:7.0f} MB | "
              f"time {ad['seconds'] / fl['seconds']:.2f}x, memory {ad['peak_mb'] / fl['peak_mb']:.2f}x | runs {ad['all_seconds']} / {fl['all_seconds']}")
        print(f"{'':<11} where accudiff's time went: {ad.get('timings')}; workers: {ad.get('workers')}")
        if "polygraphy" in tools:
            pg = tools["polygraphy"]
            print(f"{'':<11} polygraphy {pg['seconds']:7.1f} s {pg['peak_mb']:7.0f} MB, exit {pg['exit_codes']}: {pg['last_error']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decoder_scale.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "floor":
        floor(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
