"""Wall time and peak resident memory of a command's whole process tree (accudiff's workers count), sampled; and
the largest single process's peak, as the kernel counts it (for tests: no sampling)."""

from __future__ import annotations

import compileall
import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def measure(command: list[str]) -> dict:
    """Run `command`; its wall time, exit code and peak resident memory of its process tree. The data the
    commands before it wrote is flushed to disk first, untimed: polygraphy's flow leaves its reference
    tensors written (269 MB of JSON for the recognizer), whose writeback slowed the next command's own
    writes (a recognizer compare right after it: load and transform 0.14 and 0.15 s, against 0.11 and
    0.09 s after a flush)."""
    os.sync()
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(process.pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, stderr = process.communicate()
    done.set()
    sampler.join()
    return {"seconds": time.perf_counter() - start, "peak_mb": peak[0] / 2**20, "exit": process.returncode, "stderr_tail": stderr.strip().splitlines()[-1:] }


_LARGEST = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)")


def largest_process_peak(command: list[str]) -> tuple[float, int]:
    """The peak resident MB of the largest single process `command` starts (itself or a worker), and its exit
    code: the kernel's own high-water mark (ru_maxrss of the waited-for descendants, through a fresh
    wrapper so nothing else this process ran counts), so no sampling and nothing that depends on timing."""
    done = subprocess.run([sys.executable, "-c", _LARGEST, *command], capture_output=True, text=True)
    kilobytes, code = done.stdout.split()[-2:]
    return int(kilobytes) / 1024, int(code)


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants. Only the tree is read (each thread's `children`
    file): scanning all of /proc every 10 ms took ~20% of a core, which the measured command lost."""
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            for task in os.listdir(f"/proc/{pid}/task"):
                stack.extend(int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except OSError:  # gone meanwhile
            continue
        rss = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), "0")
        total += int(rss) * 1024
    return total


def accudiff_command(*args: str) -> list[str]:
    """The command that runs `accudiff *args` in a fresh process (from the repository root, this checkout's
    accudiff), its modules byte-compiled first, as pip compiles a package it installs. Where
    PYTHONDONTWRITEBYTECODE is set, a source checkout is otherwise compiled again by
    every process it starts: 0.3 s of a recognizer compare on a busy hour, which polygraphy, installed by
    pip with its bytecode, does not pay."""
    _byte_compile_accudiff()
    return [sys.executable, "-m", "accudiff.cli", *args]


PACKAGES = ("numpy", "ml_dtypes", "onnx", "onnxruntime", "polygraphy")


def environment() -> dict:
    """What makes the same flows' figures differ between machines, beside the CPU: the versions of the
    packages both tools import, and what a fresh process pays to import onnx (every polygraphy command and
    accudiff's caller pay it). ml_dtypes 0.7.0, which onnx imports, registers its ufunc loops in numpy 2.4 in
    0.55 s where 0.6.0 takes 0.01 s: polygraphy's two-command MiniLM flow read 3.82 s against 3.04 s."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "absent"

    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import onnx"], check=True)
    return {"versions": {package: installed(package) for package in PACKAGES}, "import_onnx_s": round(time.perf_counter() - start, 2)}


def environment_line(found: dict) -> str:
    """`environment()` as one line of a benchmark's output."""
    return ", ".join(f"{k} {v}" for k, v in found["versions"].items()) + f"; a fresh process's `import onnx`: {found['import_onnx_s']:.2f} s"


def polygraphy_command(*args: str) -> list[str]:
    """The command that runs `polygraphy *args` at its best: with torch kept from being imported. polygraphy's
    JSON module imports torch, when it is installed, to register a codec for torch tensors, whatever the
    job: on MiniLM's run that is 1.3 s and 190 MB (452 MB against 262 MB), so its figures differed between
    a machine with torch (this project's CI) and one without."""
    blocked = "import sys; sys.modules['torch'] = None; sys.argv[0] = 'polygraphy'; from polygraphy.tools import main; sys.exit(main())"
    return [sys.executable, "-c", blocked, *args]


@functools.cache
def _byte_compile_accudiff() -> None:
    import accudiff

    compileall.compile_dir(str(Path(accudiff.__file__).parent), quiet=1)
