"""An agent on another host reaches the agent endpoint (`rollout.agent_endpoint_host: node`), and
with the default (`loopback`) it cannot: two network-namespace hosts, the endpoint on host 1 bound
as the rollout binds it, the official `openai` client on host 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slimrl.errors import ConfigError
from slimrl.preflight import load_config
from tests.conftest import REPO
from tests.netns_hosts import network_hosts

pytestmark = pytest.mark.slow

SERVE = """
import asyncio, json, sys
from transformers import AutoTokenizer
from slimrl.rollout.agent.endpoint import AgentEndpoint
from slimrl.rollout.client import FleetClient

async def main():
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    urls = {}
    for host in sys.argv[2:]:
        endpoint = await AgentEndpoint(tokenizer, FleetClient([]), host=host).start()
        urls[host] = [endpoint.base_url(endpoint.open_session({})), endpoint.api_key]
    print(json.dumps(urls), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test is done

asyncio.run(main())
"""

AGENT = """
import json, sys, openai
try:
    models = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=10).models.list()
    print(json.dumps([m.id for m in models.data]))
except openai.APIConnectionError as exc:
    print(json.dumps({"unreachable": str(exc.__cause__ or exc)}))
"""


def test_an_agent_on_another_host_reaches_the_endpoint_bound_to_the_node_address(tiny_model):
    model = tiny_model("qwen3_moe")
    with network_hosts(2) as hosts:
        env = {**os.environ, **hosts.env, "PYTHONPATH": str(REPO)}
        node = hosts.address(1)  # what `node` binds under Ray there: the node's own address
        serve = subprocess.Popen(
            hosts.command(1, sys.executable, "-c", SERVE, str(model), node, "127.0.0.1"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )  # fmt: skip
        try:
            urls = json.loads(serve.stdout.readline())

            def agent(base_url: str, key: str) -> object:
                argv = hosts.command(2, sys.executable, "-c", AGENT, base_url, key)
                done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
                assert done.returncode == 0, done.stderr[-2000:]
                return json.loads(done.stdout)

            base_url, key = urls[node]
            assert base_url.startswith(f"http://{node}:")
            assert agent(base_url, key) == ["slimrl-policy"]  # across the network, with the run's key
            # the default binds 127.0.0.1 only: host 2 cannot reach that port on host 1's address
            loopback_url, key = urls["127.0.0.1"]
            elsewhere = loopback_url.replace("127.0.0.1", node)
            assert "unreachable" in agent(elsewhere, key)  # type: ignore[operator]
        finally:
            serve.stdin.close()  # type: ignore[union-attr]
            serve.wait(timeout=30)


def test_the_endpoint_host_is_loopback_or_node(tiny_model):
    base = [f"model.hf_checkpoint={tiny_model('qwen3_moe')}"]
    assert load_config(None, base).rollout.agent_endpoint_host == "loopback"
    node = load_config(None, [*base, "rollout.agent_endpoint_host=node"])
    assert node.rollout.agent_endpoint_host == "node"
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, "rollout.agent_endpoint_host=0.0.0.0"])
    assert str(info.value) == "rollout.agent_endpoint_host=0.0.0.0: not one of loopback, node"
