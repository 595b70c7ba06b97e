"""Agent commands for tests/integration/test_gateway_agent_command.py, one per `sample["mode"]`:
run as `python -m tests.command_agents` inside the sandbox, the sample on stdin."""

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request

from openai import OpenAI


def solve(sample: dict) -> None:
    """`n` user turns through the real openai SDK; reward 0.5, 0.25 per call."""
    client = OpenAI(max_retries=0)
    messages = []
    for turn in range(sample.get("n", 1)):
        messages.append({"role": "user", "content": f"say {turn}"})
        text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": text})
    print("some log line")
    print(json.dumps({"reward": 0.5, "turn_rewards": [0.25] * sample.get("n", 1), "info": {"n": sample.get("n")}}))


def probe(sample: dict) -> None:
    """What the command can reach: a host TCP listener, another trajectory, a file, its cwd."""
    found = {}
    try:
        socket.create_connection(("127.0.0.1", sample["host_port"]), timeout=5).close()
        found["host_port"] = "connected"
    except OSError as e:
        found["host_port"] = type(e).__name__
    root = os.environ["OPENAI_BASE_URL"].split("/trajectories/")[0]
    for name, key in (("other", os.environ["OPENAI_API_KEY"]), ("no_key", "")):
        request = urllib.request.Request(
            f"{root}{sample['other_path']}/models", headers={"Authorization": f"Bearer {key}"}
        )
        try:
            found[name] = urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as e:
            found[name] = e.code
    mine = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/models", headers={"x-api-key": os.environ["OPENAI_API_KEY"]}
    )
    found["mine"] = urllib.request.urlopen(mine, timeout=10).status
    for name, path in (("secret", sample["secret"]), ("root_home", "/root/.bashrc")):
        try:
            open(path).read()
            found[name] = "read"
        except OSError as e:
            found[name] = type(e).__name__
    try:
        open("written-by-the-agent", "w").close()
        found["cwd_write"] = "written"
    except OSError as e:
        found["cwd_write"] = type(e).__name__
    with open(os.path.join(os.environ["HOME"], "scratch"), "w") as f:
        found["home_write"] = f.write("ok")
    found["env"] = sorted(os.environ)
    print(json.dumps({"reward": 1.0, "info": found}))


def main() -> None:
    sample = json.load(sys.stdin)
    mode = sample.get("mode", "solve")
    if mode == "crash":
        print("about to fail", file=sys.stderr)
        raise SystemExit("boom: the agent crashed")
    if mode == "hang":
        OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        os.fork()  # a child too: the whole tree must go
        time.sleep(600)
    if mode == "silent":
        OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return
    (probe if mode == "probe" else solve)(sample)


if __name__ == "__main__":
    main()
