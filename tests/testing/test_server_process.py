"""ServerProcess reads a child's log back from its file: whole lines only, JSON ones parsed, and
what it read stays readable after the temporary log is removed."""

from __future__ import annotations

import sys

import pytest
from sloserve.testing.server_process import LogLines, ServerProcess

PRINTER = (sys.executable, "-c")


def test_log_lines_keep_a_partial_line_until_it_ends(tmp_path):
    path = tmp_path / "server.log"
    path.write_bytes(b'{"msg": "one", "level": "info"}\nplain text\n{"msg": "tw')
    lines = LogLines(path)
    raw, parsed = lines.read()
    assert raw == ['{"msg": "one", "level": "info"}', "plain text"]
    assert parsed == [{"msg": "one", "level": "info"}]
    with open(path, "ab") as f:
        f.write(b'o"}\n{not json\n')
    raw, parsed = lines.read()
    assert raw[2:] == ['{"msg": "two"}', "{not json"]
    assert [e["msg"] for e in parsed] == ["one", "two"]


def test_a_child_that_exits_before_listening_fails_with_its_output():
    code = "import sys; print('no model here', file=sys.stderr); sys.exit(3)"
    with pytest.raises(RuntimeError, match="exited with 3:\nno model here"):
        ServerProcess([code], command=PRINTER, startup_s=30)


def test_the_port_comes_from_the_listening_line_and_the_log_outlives_the_temporary_file():
    code = (
        "import json, sys, time; print(json.dumps({'msg': 'listening on 127.0.0.1:4321 (plaintext)'}), "
        "file=sys.stderr, flush=True); time.sleep(60)"
    )
    server = ServerProcess([code], command=PRINTER, startup_s=30)
    try:
        assert (server.port, server.target) == (4321, "127.0.0.1:4321")
        assert server.pids()[0] == server.proc.pid and server.rss_bytes() > 0
    finally:
        assert server.stop(10) == -15  # SIGTERM ends it
    assert server.log_path is not None and not server.log_path.exists()
    assert server.messages() == ["listening on 127.0.0.1:4321 (plaintext)"]
