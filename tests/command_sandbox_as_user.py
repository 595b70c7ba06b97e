"""Run by tests/integration/test_gateway_agent_command.py as an unprivileged user (nobody, when the
suite is root): one agent command through `run_command`, as a trainer that is not root runs it.
Prints what the command reached as JSON. Usage: python command_sandbox_as_user.py REPO"""

import json
import socket
import sys
import threading

sys.path.insert(0, sys.argv[1])
from megatron_stepwise.envs.sandbox_command import CommandLimits, command_environment, command_isolation, run_command  # noqa: E402

COMMAND = """
import json, socket
with socket.create_connection(("127.0.0.1", 8000)) as s:
    got = s.recv(64).decode()
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    host = "connected"
except OSError as e:
    host = type(e).__name__
print(json.dumps({{"reward": 1, "got": got, "host": host}}))
"""


def main() -> None:
    host = socket.create_server(("127.0.0.1", 0))  # the host's listener the command must not reach

    def serve(listener):
        def answer():
            conn, _ = listener.accept()
            conn.sendall(b"endpoint")
            conn.close()

        threading.Thread(target=answer, daemon=True).start()
        return listener.close

    if command_isolation().namespaces == "none":
        print(json.dumps({"namespaces": "none"}))  # nothing bridges here: the degraded test covers it
        return
    code = COMMAND.format(port=host.getsockname()[1])
    # the system's python: the suite's may live where this user cannot read (a pyenv under /root)
    result = run_command(["/usr/bin/python3", "-c", code], command_environment({}), "/", {}, CommandLimits(60.0), serve)
    iso = command_isolation()
    print(
        json.dumps(
            {"namespaces": iso.namespaces, "rc": result.returncode, "out": result.stdout, "err": result.stderr[-500:]}
        )
    )


if __name__ == "__main__":
    main()
