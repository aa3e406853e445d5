"""tests/sharded.py: the suite over several pytest processes reports every test's outcome,
the tests a stopped process did not finish by name, and fails unless all passed or skipped."""
import subprocess
import sys
import textwrap
from pathlib import Path

RUNNER = Path(__file__).resolve().parent / "sharded.py"

CASES = textwrap.dedent('''
    import time
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_passes():
        assert 1 + 1 == 2

    def test_fails():
        assert 2 + 2 == 5, "arithmetic moved"

    def test_skips():
        pytest.skip("not here")

    def test_setup_error(broken):
        pass

    @pytest.mark.parametrize("n", [1, 2, 3])
    def test_param(n):
        assert n > 0
''')

SLOW = textwrap.dedent('''
    import time

    def test_never_ends():
        time.sleep(120)
''')


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), "--root", str(tmp_path), "--out",
                           str(tmp_path / "out"), *args], capture_output=True, text=True,
                          timeout=120)


def test_every_outcome_and_the_unfinished_are_reported(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_zslow.py").write_text(SLOW)
    done = run(tmp_path, "-j", "3", "--limit", "6", "test_cases.py", "test_zslow.py")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "8 tests over 3 processes" in lines[0]
    assert "test_cases.py  error 1  failed 1  passed 4  skipped 1" in lines
    assert "test_zslow.py  unfinished 1" in lines
    assert any(line.startswith("FAILED test_cases.py::test_fails:") and "arithmetic moved" in line
               for line in lines)
    assert any(line.startswith("ERROR test_cases.py::test_setup_error:") and "fixture broke" in line
               for line in lines)
    assert "UNFINISHED test_zslow.py::test_never_ends" in lines
    assert lines[-1].startswith("1 error, 1 failed, 4 passed, 1 skipped, 1 unfinished in ")


def test_all_passing_exits_zero_and_selection_reaches_pytest(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    done = run(tmp_path, "-j", "2", "test_cases.py", "-k", "param or passes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("4 passed in ")


def test_bad_arguments_are_refused(tmp_path):
    done = run(tmp_path, "-j", "0")
    assert done.returncode == 2 and "--jobs must be at least 1, got 0" in done.stderr
    done = run(tmp_path, "no_such_file.py")
    assert done.returncode != 0 and "collection failed" in done.stderr


def test_durations_and_the_failing_process_output(tmp_path):
    """--durations lists the slowest tests' call phase, slowest first; --log-tail prints the
    output of each process where a test failed (pytest's traceback there), none of the
    others; the summary stays the last line."""
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_nap.py").write_text("import time\n\ndef test_nap():\n    time.sleep(1.2)\n")
    done = run(tmp_path, "-j", "2", "--durations", "2", "--log-tail", "400", "test_nap.py",
               "test_cases.py::test_fails", "test_cases.py::test_passes")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    at = lines.index("the 2 slowest tests (seconds, call phase):")
    first = lines[at + 1].split()
    assert first[1] == "test_nap.py::test_nap" and float(first[0]) >= 1.2, lines
    assert len([ln for ln in lines if ln.startswith("--- process ")]) == 1, lines
    assert any("AssertionError: arithmetic moved" in ln for ln in lines), lines
    assert lines[-1].startswith("1 failed, 2 passed in "), lines


def test_processes_share_the_tests_out_as_they_go(tmp_path):
    """Two processes claim the tests as they go: the one that takes a long first test runs it
    and at most the one test it claimed next, the other runs every other test meanwhile (dealt
    round-robin, each would have run half)."""
    (tmp_path / "test_share.py").write_text(
        "import time\n\ndef test_a_long():\n    time.sleep(5)\n\n"
        + "".join(f"def test_b{i}():\n    pass\n\n" for i in range(7)))
    done = run(tmp_path, "-j", "2", "test_share.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("8 passed in "), done.stdout
    ran = [[line.split("\t")[2] for line in (tmp_path / "out" / f"results{i}.tsv")
            .read_text().splitlines() if line.startswith("call")] for i in range(2)]
    assert sorted(n for r in ran for n in r) == sorted(
        ["test_share.py::test_a_long"] + [f"test_share.py::test_b{i}" for i in range(7)])
    long_one = next(r for r in ran if "test_share.py::test_a_long" in r)
    assert len(long_one) <= 2, ran
