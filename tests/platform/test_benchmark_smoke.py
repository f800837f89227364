"""The benchmarks' smoke run (`benchmarks/smoke.py`, run by `.ci/run`): it knows every benchmark,
so a new one cannot be left out of it, and it fails a benchmark that breaks the convention of
one JSON line of figures last, exits non-zero or runs past its timeout."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_smoke():
    spec = importlib.util.spec_from_file_location("benchmark_smoke", BENCHMARKS_DIR / "smoke.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


smoke = _load_smoke()


def test_every_benchmark_file_is_in_the_smoke_run():
    files = {path.stem for path in BENCHMARKS_DIR.glob("*.py")}
    listed = [bench.name for bench in smoke.BENCHMARKS]
    assert len(listed) == len(set(listed)), "a benchmark is listed twice"
    assert not set(listed) & smoke.HELPERS
    forgotten = files - set(listed) - smoke.HELPERS
    assert not forgotten, f"add these to BENCHMARKS in benchmarks/smoke.py (or HELPERS if no benchmark): {forgotten}"
    assert not (set(listed) | smoke.HELPERS) - files, "smoke.py lists files that are gone"


@pytest.mark.parametrize("bench", smoke.BENCHMARKS, ids=lambda bench: bench.name)
def test_every_listed_benchmark_has_a_quick_run(bench):
    assert '"--quick"' in (BENCHMARKS_DIR / f"{bench.name}.py").read_text()


@pytest.mark.parametrize(
    ("stdout", "figures"),
    [
        ('progress\n{"rate": 1.5}\n', {"rate": 1.5}),
        ('{"rate": 1.5}\n\n', {"rate": 1.5}),
        ('{"rate": 1.5}\ndone\n', None),
        ("[1, 2]\n", None),
        ("", None),
    ],
)
def test_only_a_json_object_on_the_last_line_counts_as_figures(stdout, figures):
    assert smoke.last_json_object(stdout) == figures


@pytest.mark.parametrize(
    ("body", "timeout_s", "ok", "note"),
    [
        ('print("warming up"); print(\'{"figure": 1}\')', 30, True, ""),
        ('print(\'{"figure": 1}\'); print("done")', 30, False, "not a JSON object"),
        ("print('{\"figure\": 1}'); sys.exit(3)", 30, False, "exit status 3"),
        ("time.sleep(60)", 1, False, "timed out after 1 s"),
        # One that does not stop on SIGINT is killed after its grace.
        ("signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)", 1, False, "timed out after 1 s"),
    ],
    ids=["figures", "text-last", "exit-status", "timeout", "deaf-to-sigint"],
)
def test_a_benchmark_passes_only_with_exit_0_and_its_figures_last(tmp_path, body, timeout_s, ok, note):
    script = tmp_path / "fake.py"
    script.write_text(
        textwrap.dedent(f"""\
            import signal, sys, time
            assert sys.argv[1:] == ["--quick", "--flag"], sys.argv
            {body}
        """)
    )
    bench = smoke.Benchmark("fake", timeout_s, stop_grace_s=3)
    outcome = smoke.run_one(bench, ["--flag"], tmp_path, scripts=tmp_path)
    assert outcome.ok is ok, (tmp_path / "fake.err").read_text()
    assert note in outcome.note
    assert outcome.seconds < 30


def test_a_failed_benchmark_runs_once_more_and_passes_only_if_the_second_try_does(tmp_path):
    """A busy machine may fail one try; a rotted benchmark fails both, and fails the run."""
    flaky = tmp_path / "flaky.py"
    flaky.write_text(
        textwrap.dedent("""\
            import pathlib, sys
            marker = pathlib.Path(__file__).with_suffix(".tried")
            if not marker.exists():
                marker.touch()
                sys.exit("busy")
            print('{"figure": 1}')
        """)
    )
    (tmp_path / "broken.py").write_text('print("no figures")\n')

    outcome = smoke.run_twice_if_failed(smoke.Benchmark("flaky", 30), None, tmp_path, scripts=tmp_path)
    assert outcome.ok, outcome.note
    assert outcome.note == "exit status 1; passed on the second try"
    assert "busy" in (tmp_path / "flaky.1.err").read_text()

    outcome = smoke.run_twice_if_failed(smoke.Benchmark("broken", 30), None, tmp_path, scripts=tmp_path)
    assert not outcome.ok
    assert outcome.note.endswith("again: the last line of stdout is not a JSON object")


def test_every_name_a_benchmark_imports_from_gpucloud_exists() -> None:
    """A move in the package that forgets a benchmark fails here, in the tests, not only in the
    smoke run after them."""
    missing = []
    for path in sorted(BENCHMARKS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpucloud"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if (
                        not hasattr(module, alias.name)
                        and importlib.util.find_spec(f"{node.module}.{alias.name}") is None
                    ):
                        missing.append(f"{path.name}: {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("gpucloud") and importlib.util.find_spec(alias.name) is None:
                        missing.append(f"{path.name}: {alias.name}")
    assert missing == []
