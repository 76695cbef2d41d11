"""The ``autopar`` console command's entry point (``autopar_entry``), in a subprocess: the
command's output and exit handlers as Python's own exit gives them, less its teardown."""

from __future__ import annotations

import json
import subprocess
import sys

# an exit handler registered before the command, and an object whose finalizer runs only
# when the interpreter tears ``__main__`` down
CONSOLE = (
    "import atexit, os, sys\n"
    "atexit.register(lambda: sys.stderr.write('exit handler ran\\n'))\n"
    "class Late:\n"
    "    def __del__(self):\n"
    "        os.write(2, b'torn down\\n')  # sys.stderr may be gone by then\n"
    "late = Late()\n"
    "from autopar_entry import main\n"
    "main()\n"
)


def console(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CONSOLE, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_command_that_returns_flushes_its_output_runs_the_exit_handlers_and_skips_teardown():
    result = console("plan", "mlp-tiny", "--mesh", "2", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["estimate"]["step_time_s"] > 0  # all of it, though piped
    assert "exit handler ran" in result.stderr
    assert "torn down" not in result.stderr


def test_a_command_that_fails_exits_with_its_code_and_says_why():
    result = console("plan", "no-such-model", "--mesh", "2")
    assert result.returncode == 2
    assert "MODEL 'no-such-model' is neither" in result.stderr
    assert "exit handler ran" in result.stderr
    assert "torn down" not in result.stderr


def test_a_thread_still_running_is_waited_for_as_python_does():
    code = (
        "import threading, time\n"
        "from autopar_entry import end_now\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "end_now(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout) == (3, "thread done\n")
