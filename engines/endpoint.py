"""The OpenAI side of --agent (engines/agents.py): `Endpoint`, the chat-completions server of one rank
(starlette on uvicorn, a daemon thread, 127.0.0.1 only), and the request's and the answer's shapes:
what is served (`check_request`), the model's turn as an assistant message with its tool calls
(`assistant_message`), the reply (`completion`), and whether an agent echoed its answer back as it
was given (`same_turn`).
"""
import asyncio
import json
import socket
import threading
import time
from concurrent.futures import Future

from tasks.env import parse_tool_calls
from utils.errors import UserError

SERVED = {"model", "messages", "tools", "tool_choice", "temperature", "max_tokens", "max_completion_tokens",
          "n", "stream", "logprobs", "top_logprobs", "user", "metadata", "store", "parallel_tool_calls"}


def check_request(body: dict, model: str, temperature: float) -> str | None:
    """What this endpoint does not serve, as one message for the agent (None: served)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        return "a request needs `messages`, a non-empty list"
    unknown = sorted(set(body) - SERVED)
    if unknown:
        return f"parameters not served here: {', '.join(unknown)} (the policy samples as the run's flags say)"
    if body.get("model") != model:
        return f"model {body.get('model')!r} is not served here; this endpoint serves {model!r}"
    if body.get("stream"):
        return "streaming is not served: send stream=false"
    if body.get("n", 1) != 1:
        return "n must be 1: each episode is one sample"
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))):
        return "temperature must be a number"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return f"{key} must be a positive integer"
    if t is not None and abs(float(t) - temperature) > 1e-9:
        return (f"temperature {t} is not the run's --temperature {temperature}: the trainer's log-probs are "
                "at the run's temperature; leave it out")
    if body.get("tool_choice") not in (None, "auto"):
        return "tool_choice other than auto is not served"
    for m in body["messages"]:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            return "each message is an object with a role: system, user, assistant or tool"
    return None


def assistant_message(text: str) -> tuple[dict, list]:
    """The model's turn as OpenAI's assistant message: its tool calls (the Qwen / Hermes
    `<tool_call>{"name", "arguments"}</tool_call>` format, tasks.env.parse_tool_calls) as
    `tool_calls`, the rest as `content`. -> (message, the well-formed calls)."""
    calls = [(name, args) for name, args, wrong in parse_tool_calls(text) if wrong is None]
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(args)}}
                                 for i, (name, args) in enumerate(calls)]
    return message, calls


def same_turn(echoed: list, answered: dict | None) -> bool:
    """Whether the agent's echo of the assistant message is the one it was answered with: the same
    content, or (an agent that keeps only the calls) the same tool calls by name and arguments."""
    if not echoed or answered is None or echoed[0].get("role") != "assistant":
        return False
    m = echoed[0]
    if m.get("content") == answered["content"]:
        return True
    calls = lambda msg: [(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))  # noqa: E731
                         for c in msg.get("tool_calls") or []]
    try:
        return bool(answered.get("tool_calls")) and calls(m) == calls(answered)
    except (KeyError, TypeError, ValueError):
        return False


def answer_error(future: Future, status: int, message: str):
    if not future.done():
        future.set_result((status, {"error": {"message": message, "type": "invalid_request_error"}}))


def completion(key: str, model: str, message: dict, reason: str, context: int, made: int) -> dict:
    """An answer in OpenAI's chat.completion format: one choice, its finish_reason, the usage (context:
    the episode's tokens the engine read; made: the turn's)."""
    return {"id": f"chatcmpl-{key}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": {"prompt_tokens": context, "completion_tokens": made, "total_tokens": context + made}}


class Endpoint:
    """The OpenAI-compatible server of one rank: starlette on uvicorn in a daemon thread, on
    127.0.0.1 only; each request goes to `agents.inbox` (the batcher's) with a Future, and waits for
    its answer. The routes name the episode: /episodes/{key}/v1/chat/completions."""

    def __init__(self, agents, port: int):
        # deferred: only an --agent run serves (starlette and uvicorn are requirements.txt's, not light)
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def completions(request):
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse({"error": {"message": "the body is not JSON"}}, status_code=400)
            future = Future()
            agents.inbox.put((request.path_params["key"], body, future))
            status, reply = await asyncio.wrap_future(future)
            return JSONResponse(reply, status_code=status)

        async def models(request):
            served = [{"id": agents.cfg.agent_model, "object": "model"}]
            return JSONResponse({"object": "list", "data": served})

        app = Starlette(routes=[Route("/episodes/{key}/v1/chat/completions", completions, methods=["POST"]),
                                Route("/episodes/{key}/v1/models", models)])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(("127.0.0.1", port))
        except OSError as e:
            self.sock.close()
            raise UserError(f"--agent-port {port}: {e.strerror} on 127.0.0.1; pick another port, or 0 (any "
                            "free port)") from None
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="agent-endpoint")
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise UserError(f"--agent: the endpoint on {self.url} did not start within 10 s")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
