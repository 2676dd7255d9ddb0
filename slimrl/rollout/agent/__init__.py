"""Agentic RL through an OpenAI-compatible endpoint (issue 24; docs/agentic.md).

* `endpoint.py`: the server slimrl runs in front of the fleet, one session per agent run;
* `chat.py`: the chat template applied once, continued conversations built from sampled ids, tool
  calls parsed by SGLang's parsers;
* `openai_api.py`: OpenAI's request fields, replies and errors;
* `trajectory.py`: every call as the engine saw it, merged into training samples and checked;
* `runner.py`: one agent run per sample (`rollout.agent_function_path`);
* `environment.py`: the gym shape (reset / step) played by a built-in agent through the endpoint.
"""
