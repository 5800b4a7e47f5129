"""Agents written against OpenAI's chat-completions API, as people write them, for --agent
(engines/agents.py, docs/agents.md).

`multiply_agent` is builtin:multiply's tool use written a second time as an ordinary `openai`-client
agent: it offers the model a `multiply` tool, runs the calls the model makes itself and sends their
results back, until the model answers without a call (or --agent-max-turns ends it). Its episodes
are the in-process tool environment's (`--tools tasks.env:multiply`) token for token.

    torchrun --standalone --nproc-per-node 2 train_grpo.py --model assets/tool-tiny \\
        --dataset builtin:multiply --agent tasks.agents:multiply_agent
"""
import functools
import json

from tasks.env import as_text, multiply, schema

TOOLS = [schema(multiply)]


@functools.cache
def shared_client():
    """One `openai` client for every episode of this process, each episode's copy made by
    `with_options(base_url=...)` (0.06 ms): a new `openai.OpenAI` builds an HTTP client and its SSL
    context, 21 ms of the GIL on this machine, which 256 concurrent episodes would queue behind."""
    import openai  # (the agent's own dependency, as in any agent code)

    return openai.OpenAI(base_url="http://127.0.0.1", api_key="none", max_retries=0, timeout=60)


def multiply_agent(base_url: str, row: dict, max_turns: int = 4):
    """One episode of builtin:multiply against the endpoint at base_url. Returns None: the reward is
    --rewards' (accuracy of the last answer)."""
    client = shared_client().with_options(base_url=base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            result = multiply(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": as_text(result)[0]})
    return None
