"""Ctrl-C ends a command at once, with one line and exit code 130, never a traceback: while it
still looks for its bus, and while it is still starting."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
from fleetpilot.cli import main as cli

UNANSWERED_HOST = "nats.unanswered.invalid"

# A resolver that does not answer (a DNS server blackholed on the way), for this one name:
# the lookup says when it began, then hangs far longer than the test waits.
SLOW_RESOLVER = textwrap.dedent(f'''
    import os, socket, time
    _lookup = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == {UNANSWERED_HOST!r}:
            open(os.environ["LOOKUP_BEGAN"], "w").close()
            time.sleep(60)
        return _lookup(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo
''')


@pytest.mark.parametrize("command", [["watch"], ["submit", "--kind", "infer"], ["model"], ["dead-letters"],
                                     ["up", "--quiet", "--metrics-port-base", "0"], ["fleet"],
                                     ["fleet", "forget", "n1"]])
def test_ctrl_c_while_looking_up_the_bus_ends_the_command_at_once(command, tmp_path) -> None:
    # Before: each waited out the name lookup before it exited (asyncio looks names up on a
    # pool thread, which it joins when its loop closes, and Python joins again at exit).
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_RESOLVER)
    began = tmp_path / "lookup-began"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site"), "LOOKUP_BEGAN": str(began),
           "FLEETPILOT_NATS_URL": f"nats://{UNANSWERED_HOST}:4222", "FLEETPILOT_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([sys.executable, "-m", "fleetpilot.cli.main", *command], env=env, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not began.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert began.exists(), proc.communicate(timeout=60)
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and took < 10, (took, out, err)
    said = "interrupted while starting" if command[0] == "up" else "interrupted"
    assert err == f"fleetpilot {command[0]}: {said}\n", err


def test_ctrl_c_while_the_command_is_loaded_is_one_line(monkeypatch, capsys) -> None:
    # Before: a Ctrl-C in the first second, while the commands' modules load, was a traceback
    # through the import machinery, and the process died of the signal.
    def load(name: str):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", load)
    assert cli.main(["watch"]) == 130
    assert capsys.readouterr().err == "fleetpilot: interrupted\n"
