"""`serve` on a busy port or a foreign address: one line naming host, port and why, exit 2 (issue 42)."""

import socket

import pytest

from megatron_stepwise.cli.main import main as cli_main


def _serve(capsys, *args):
    code = cli_main(["serve", "--model-config", "tiny_word", *args])
    return code, capsys.readouterr().err


def test_a_busy_port_is_one_line_naming_it(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = _serve(capsys, "--host", "127.0.0.1", "--port", str(port))
    assert code == 2 and "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert f"127.0.0.1:{port}" in line and "another --port" in line


def test_a_foreign_address_is_one_line_naming_it(capsys):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine
    code, err = _serve(capsys, "--host", "192.0.2.1", "--port", "0", "--allow-unauthenticated")
    assert code == 2 and "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "192.0.2.1:0" in line and "--host" in line


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range_is_an_argument_error(capsys, port):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--model-config", "tiny_word", "--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err
