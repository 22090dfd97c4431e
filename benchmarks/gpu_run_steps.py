"""The steps of ``benchmarks/gpu_run.sh``, within one time budget.

Standard library only, so that the preflight can say what is missing
(MAX, this package, PyTorch, a GPU) instead of failing on an import.
``bash benchmarks/gpu_run.sh OUT_DIR`` runs ``python
benchmarks/gpu_run_steps.py OUT_DIR``:

1. **preflight** (seconds): MAX, ``mla_kpool`` and PyTorch import and a
   GPU is visible (``max.driver.accelerator_count() > 0``); otherwise the
   run stops with the reasons and exit status 2;
2. **tests** (``pytest -m gpu``) while **compile** fills MAX's compile
   cache with the timing graphs (two processes:
   ``mla_kpool.bench.kernel_times --compile``);
3. **timing** (``mla_kpool.bench.kernel_times --json``: the ops' and
   MAX's peers' kernel times, and the cost model's constants).

The whole run has :data:`BUDGET_S` seconds (``GPU_RUN_BUDGET_S``), under a
lent machine's 10-minute command limit: each step's timeout is taken from
what is left, steps 2 keeping :func:`timing_share` of it for step 3. The
record ``OUT_DIR/<gpu>-<short commit>.json`` is written after the
preflight, after the tests and (by ``kernel_times``) after every timing
item, so a kill keeps what was measured; its ``steps`` say what each step
took, its status and timeout. The commit is the checkout's, or
``MLA_KPOOL_COMMIT`` where the copy has no ``.git``.

Everything the run writes goes to ``OUT_DIR``: the record, the logs, the
profiler's passing trace files; Python writes no bytecode. Only MAX's own
caches (``~/.cache/modular``, its Mojo package builds under ``$TMPDIR``)
and the GPU tests' temporary directories (pytest's) live elsewhere.

``GPU_RUN_FAKE=1`` swaps the GPU parts for fast fakes (the preflight's
PyTorch and GPU checks, the tests, the compile, and the timings for
``kernel_times --fake``): the CPU test of this flow
(``tests/cli/test_gpu_run.py``). ``GPU_RUN_FAKE_TESTS_S`` is the fake tests'
seconds.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Seconds for every step together (a lent machine's command limit is
#: 600 s; the rest is the machine's start and the install).
BUDGET_S = 540.0
#: The most each step may take, whatever the budget leaves.
STEP_MAX_S = {"preflight": 90.0, "tests": 360.0, "compile": 420.0}
#: Seconds kept back at the end (the last record, the summary).
MARGIN_S = 3.0
#: Exit status when the preflight stops the run.
PREFLIGHT_FAILED = 2

PREFLIGHT = r"""
import json, os, sys
fake = os.environ.get("GPU_RUN_FAKE") == "1"
checks, device = {}, None
def check(name, fn):
    try:
        checks[name] = fn() or "ok"
    except BaseException as e:
        checks[name] = "FAILED: " + (f"{type(e).__name__}: {e}".strip())
def gpu():
    from max import driver
    n = driver.accelerator_count()
    if n <= 0:
        raise RuntimeError(
            f"no GPU visible (max.driver.accelerator_count() == {n})"
        )
    global device
    device = driver.Accelerator().model_name
def imports(*names):
    for name in names:
        __import__(name)
check("max", lambda: imports("max.driver", "max.graph"))
check("mla_kpool", lambda: imports("mla_kpool"))
if fake:
    checks["torch"] = checks["gpu"] = "skipped (GPU_RUN_FAKE=1)"
    device = "FAKE GPU"
else:
    check("torch", lambda: imports("torch.profiler"))
    check("gpu", gpu)
print(json.dumps({"checks": checks, "device": device}))
"""


def _sysinfo() -> Any:
    """``mla_kpool._sysinfo`` loaded alone (standard library only).

    So the commit can be read without importing MAX.
    """
    path = ROOT / "python" / "mla_kpool" / "_sysinfo.py"
    spec = importlib.util.spec_from_file_location("_gpu_run_sysinfo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timing_share(budget: float) -> float:
    """Seconds of the budget kept for the timing step.

    240 of 540, and the same share of a smaller budget.
    """
    return min(240.0, budget * 4 / 9)


def result_name(device: str, commit: str | None) -> str:
    """``<gpu>-<short commit>.json``, as ``kernel_times.result_name``."""
    gpu = "-".join(device.lower().replace("_", " ").split())
    return f"{gpu}-{(commit or 'nocommit')[:7]}.json"


class Record:
    """The run's JSON record, written whole after every change."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data
        self.write()

    def write(self) -> None:
        """Writes the record (a sibling file renamed over it)."""
        tmp = self.path.with_name(self.path.name + ".part")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def reload(self) -> None:
        """Reads back what another process (``kernel_times``) wrote."""
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            pass

    def step(self, name: str, **facts: Any) -> None:
        """Adds step ``name``'s facts and writes the record."""
        self.data.setdefault("steps", {})[name] = facts
        self.write()


class Steps:
    """The run: its budget, output folder, interpreter and environment."""

    def __init__(self, out: Path, budget: float) -> None:
        self.out = out
        self.budget = budget
        self.start = time.monotonic()
        self.fake = os.environ.get("GPU_RUN_FAKE") == "1"
        self.py = os.environ.get("PYTHON") or sys.executable
        self.env = dict(os.environ)
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.env.setdefault("GPU_RUN_COMMAND", "bash benchmarks/gpu_run.sh")
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT / "python"), self.env.get("PYTHONPATH")) if p
        )

    def elapsed(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds of the budget left, less :data:`MARGIN_S`."""
        return self.budget - MARGIN_S - self.elapsed()

    def start_step(self, argv: list[str], log: str) -> subprocess.Popen:
        """Starts ``argv`` (in the repository) with its output to ``log``."""
        with open(self.out / log, "w") as f:
            return subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @staticmethod
    def finish(proc: subprocess.Popen, deadline: float) -> dict[str, Any]:
        """Waits for ``proc`` until ``deadline`` (monotonic).

        Past it, kills the process group. Returns the exit status and
        whether it timed out.
        """
        timed_out = False
        try:
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            rc = proc.wait()
        return {"rc": rc, "timed_out": timed_out}

    def command(self, name: str) -> list[str]:
        """Step ``name``'s command line, or its fake under ``GPU_RUN_FAKE``."""
        km = [self.py, "-m", "mla_kpool.bench.kernel_times"]
        if self.fake:
            pause = float(os.environ.get("GPU_RUN_FAKE_TESTS_S", "0.2"))
            fakes = {
                "tests": f"import time; time.sleep({pause});"
                " print('3 passed in 0.01s (fake)')",
                "compile-index": "print('compiled (fake)')",
                "compile-writers": "print('compiled (fake)')",
            }
            if name in fakes:
                return [self.py, "-c", fakes[name]]
        if name == "tests":
            return [
                self.py, "-m", "pytest", "-q", "-m", "gpu", "-n", "10",
                "-p", "no:cacheprovider", "tests",
            ]  # fmt: skip
        if name == "compile-index":
            return [*km, "--compile", "--items", "index"]
        if name == "compile-writers":
            return [*km, "--compile", "--items", "writers", "constants"]
        raise ValueError(name)

    def preflight(self) -> dict[str, Any]:
        """Runs the preflight's checks in a fresh interpreter."""
        limit = min(STEP_MAX_S["preflight"], max(self.left(), 1.0))
        begun = time.monotonic()
        try:
            done = subprocess.run(
                [self.py, "-c", PREFLIGHT],
                cwd=ROOT,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=limit,
            )
            found = json.loads(done.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            found = {"checks": {"preflight": f"FAILED: over {limit:.0f} s"}}
        except (ValueError, IndexError):
            found = {
                "checks": {
                    "python": "FAILED: the interpreter did not answer: "
                    + (done.stderr.strip().splitlines() or ["?"])[-1]
                }
            }
        found["seconds"] = round(time.monotonic() - begun, 2)
        found["timeout_s"] = round(limit, 1)
        return found


def _tail(path: Path) -> str:
    """The last non-empty line of a log."""
    try:
        lines = [x for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def run(out: Path, budget: float) -> int:
    """The whole run into ``out``; the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    steps = Steps(out, budget)
    print(f"gpu_run: budget {budget:.0f} s, results in {out}", flush=True)

    found = steps.preflight()
    failed = {k: v for k, v in found["checks"].items() if v.startswith("FAIL")}
    commit = _sysinfo().git_commit()
    device = found.get("device") or "no-gpu"
    path = out / result_name(device, commit[0] if commit else None)
    record = Record(
        path,
        {
            "device": found.get("device"),
            "commit": commit[0] if commit else None,
            "dirty": commit[1] if commit else None,
            "date": datetime.date.today().isoformat(),
            "command": steps.env["GPU_RUN_COMMAND"],
            "budget_s": budget,
            "fake": steps.fake,
            "tests": "",
            "us": {},
            "errors": {},
            "constants": {},
        },
    )
    record.step(
        "preflight",
        ok=not failed,
        checks=found["checks"],
        seconds=found["seconds"],
        timeout_s=found["timeout_s"],
    )
    if failed:
        for name, why in failed.items():
            print(f"gpu_run: preflight: {name}: {why}", file=sys.stderr)
        print(f"gpu_run: stopped; record in {path}", file=sys.stderr)
        return PREFLIGHT_FAILED

    # Tests while the timing graphs compile, leaving the timing its share.
    phase = steps.left() - timing_share(budget)
    now = time.monotonic()
    procs = {
        name: steps.start_step(steps.command(name), f"{name}.log")
        for name in ("compile-index", "compile-writers", "tests")
    }
    deadlines = {
        name: now + max(min(STEP_MAX_S[name.split("-")[0]], phase), 0.0)
        for name in procs
    }
    for name in ("tests", "compile-index", "compile-writers"):
        done = steps.finish(procs[name], deadlines[name])
        facts = {
            "rc": done["rc"],
            "timed_out": done["timed_out"],
            "seconds": round(time.monotonic() - now, 2),
            "timeout_s": round(deadlines[name] - now, 1),
        }
        if name == "tests":
            record.data["tests"] = _tail(out / "tests.log")
            facts["summary"] = record.data["tests"]
        record.step(name, **facts)
        print(f"gpu_run: {name}: {json.dumps(facts)}", flush=True)

    limit = max(steps.left(), 0.0)
    argv = [
        steps.py, "-m", "mla_kpool.bench.kernel_times",
        "--json", str(path), "--tests", record.data["tests"],
    ]  # fmt: skip
    if steps.fake:
        argv.append("--fake")
    now = time.monotonic()
    done = steps.finish(steps.start_step(argv, "times.log"), now + limit)
    record.reload()
    facts = {
        "rc": done["rc"],
        "timed_out": done["timed_out"],
        "seconds": round(time.monotonic() - now, 2),
        "timeout_s": round(limit, 1),
        "command": shlex.join(argv[1:]),
    }
    record.step("timing", **facts)
    record.data["total_s"] = round(steps.elapsed(), 2)
    record.write()
    print(f"gpu_run: timing: {json.dumps(facts)}")
    print(f"gpu_run: {record.data['total_s']} s of {budget:.0f}; {path}")
    bad = [
        name
        for name, f in record.data["steps"].items()
        if f.get("timed_out") or f.get("rc", 0) != 0
    ]
    if bad:
        print(f"gpu_run: failed or timed out: {', '.join(bad)}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """``gpu_run_steps.py [OUT_DIR]`` (default ``benchmarks/results``)."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else ROOT / "benchmarks" / "results"
    budget = float(os.environ.get("GPU_RUN_BUDGET_S", BUDGET_S))
    return run(out.resolve(), budget)


if __name__ == "__main__":
    raise SystemExit(main())
