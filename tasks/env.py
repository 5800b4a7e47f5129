"""Environments for multi-turn episodes (engines/episodes.py runs them, token in, token out).

An environment is a class with two methods; one instance, made with Guess(), plays one episode:

    class Guess:                                   # --env mymodule:Guess
        tools = []                                 # functions offered to the chat template (optional)
        calls = 0                                  # tool calls it ran this episode (optional): an int
                                                   #   or a list of them; episode/tool_calls reads it
        def reset(self, row) -> list[dict]:        # the dataset row -> the opening chat messages
            return [{"role": "user", "content": row["prompt"]}]
        def step(self, text: str):                 # the model's turn (its text) ->
            return [], 0.0, True                   #   (new messages, a reward, whether it is over)

An environment that runs tools itself counts them in `calls` (and, optionally, its failures in
`errors`, {kind: count} over ERRORS); without them its episodes count 0 tool calls. The class and
every tool are checked once before the run against how the trainer calls them (`check_env`,
`check_tool`): a tool needs a docstring and typed parameters that a JSON object of named arguments
can fill (no *args, **kwargs or positional-only ones).

`--tools module:fn ...` needs no class: `ToolEnv` offers the plain Python functions as tools (their
JSON schema read from the signature and docstring, as transformers' get_json_schema does),
parses each turn's tool calls in the Qwen / Hermes format, `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, runs them in a separate process (`ToolWorker`: a time limit per call, a memory
limit, its prints thrown away) and answers with `tool` messages; a turn without a tool call ends
the episode (its text is the answer the rewards score). A bad call (invalid JSON, an unknown name,
wrong arguments) or a tool that raises, hangs, dies, returns no text or too much gets an error
message back and is counted by kind (`ERRORS`); it never ends the run.

The built-in task that needs a tool: `builtin:multiply` (tasks/data.py) with `--tools
tasks.env:multiply`.
"""
import importlib
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import typing
from collections import Counter

from utils.callables import described, json_type
from utils.errors import UserError

ERRORS = ("bad_json", "unknown_tool", "bad_arguments", "raised", "timeout", "crashed", "non_text", "too_long")
TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
MAX_CHARS = 100_000  # a tool's text is cut here in the worker, before --max-tool-tokens cuts it again


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Retry:
    """The example of docs/tools.md: the model answers; a wrong answer is told so and may try
    again (--max-turns), and the right one earns 1 / the turn it came on, besides --rewards."""
    tools = []  # none: a plain multi-turn chat

    def reset(self, row) -> list[dict]:
        self.answer, self.turn = row["answer"], 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text: str):
        self.turn += 1
        numbers = re.findall(r"-?\d+", text)
        if numbers and numbers[-1] == self.answer:
            return [], 1.0 / self.turn, True
        return [{"role": "user", "content": "wrong, try again"}], 0.0, False


def load(spec: str, flag: str):
    """'module:name' -> the object, or one error naming the flag."""
    if ":" not in spec:
        raise UserError(f"{flag} {spec!r}: use 'module:name' (e.g. tasks.env:multiply)")
    module, name = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # not found, or the module fails on import
        raise UserError(f"{flag} {spec!r} could not be loaded: {type(e).__name__}: {e}") from None


def schema(fn) -> dict:
    """A function's tool schema, as chat templates take it ({"type": "function", "function":
    {name, description, parameters}}): the types from its annotations, the descriptions from its
    docstring (its first paragraph, and `name: text` lines under `Args:`)."""
    doc = inspect.getdoc(fn) or ""
    descriptions = described(doc)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        prop = {"type": json_type(hints.get(name)) or "string"}  # check_tool refused any other
        if name in descriptions:
            prop["description"] = descriptions[name]
        properties[name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.split("\n\n")[0].strip(),
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def parse_tool_calls(text: str) -> list[tuple[str | None, dict | None, str | None]]:
    """The turn's tool calls, in order: (name, arguments, None), or (None, None, what is wrong)
    for one that is not a JSON object with a "name" and "arguments" (an object, or a JSON string of one)."""
    calls = []
    for body, end in TOOL_CALL.findall(text):
        if not end:
            calls.append((None, None, "the tool call has no closing </tool_call>"))
            continue
        try:
            call = json.loads(body)
            args = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(args, str):
                args = json.loads(args)
        except json.JSONDecodeError as e:
            calls.append((None, None, f"the tool call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
            calls.append((None, None, 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        calls.append((call["name"], args, None))
    return calls


class ToolEnv:
    """The environment of --tools: the row's prompt opens; each turn's tool calls run (`worker`),
    their results come back as `tool` messages; a turn without one is the answer. `calls` and
    `errors` (by kind, ERRORS) count what this episode did."""

    def __init__(self, worker: "ToolWorker"):
        self.worker, self.tools = worker, worker.functions
        self.calls, self.errors = 0, Counter()

    def reset(self, row) -> list[dict]:
        prompt = row["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def step(self, text: str):
        calls = parse_tool_calls(text)
        if not calls:
            return [], 0.0, True
        messages = []
        for name, args, wrong in calls:
            self.calls += 1
            if wrong is not None:
                result, kind = f"error: {wrong}", "bad_json"
            elif name not in self.worker.names:
                tools = ", ".join(self.worker.names)
                result, kind = f"error: no tool is named {name!r}; the tools: {tools}", "unknown_tool"
            else:
                result, kind = self.worker.call(name, args)
            if kind:
                self.errors[kind] += 1
            messages.append({"role": "tool", "name": name or "", "content": result})
        return messages, 0.0, False


class ToolWorker:
    """The tools of --tools, run in a child process of this rank (started on first use, again
    after a kill): each call goes down a pipe as a JSON line and its result comes back as one.
    The child has a memory limit (RLIMIT_AS) and its own session; a call past `timeout_s` kills
    it, as does its death (the next call starts a fresh one); what the tools print is thrown
    away. Returns (text for the model, error kind or None) for each call."""

    def __init__(self, specs: tuple[str, ...], timeout_s: float = 5.0, memory_mb: int = 1024):
        self.specs, self.timeout_s, self.memory_mb = specs, timeout_s, memory_mb
        self.functions = [load(s, "--tools") for s in specs]
        self.names = [f.__name__ for f in self.functions]
        self.proc, self.pending = None, b""

    def _start(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join([root, os.getcwd(), os.environ.get("PYTHONPATH", "")])
        mb = self.memory_mb

        def limits():
            os.setsid()
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        self.proc = subprocess.Popen([sys.executable, "-m", "tasks.env", *self.specs], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=limits,
                                     env={**os.environ, "PYTHONPATH": path})
        self.pending = b""

    def call(self, name: str, args: dict) -> tuple[str, str | None]:
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps({"name": name, "arguments": args}) + "\n").encode())
            self.proc.stdin.flush()
            line = self._read_line()
        except (BrokenPipeError, EOFError):
            self.kill()
            return f"error: the tool {name} crashed", "crashed"
        except TimeoutError:
            self.kill()
            return f"error: the tool {name} ran past its {self.timeout_s:g} s limit", "timeout"
        reply = json.loads(line)
        if "error" in reply:
            return f"error: {reply['message']}", reply["error"]
        return reply["result"], reply.get("kind")

    def _read_line(self) -> bytes:
        fd, end = self.proc.stdout.fileno(), time.monotonic() + self.timeout_s
        while b"\n" not in self.pending:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def kill(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    close = kill


def as_text(value) -> tuple[str | None, str | None]:
    """A tool's return value as the text the model reads: a string as it is, numbers and
    JSON-able lists and dicts as JSON; else (None, why)."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, (bool, int, float, list, dict)):
        try:
            return json.dumps(value), None
        except (TypeError, ValueError):
            pass
    return None, f"returned {type(value).__name__}, not text"


def serve(specs: list[str]):
    """The worker's loop (`python -m tasks.env module:fn ...`, started by ToolWorker): one JSON
    line in, one out, per call."""
    out = os.fdopen(os.dup(1), "w")  # the answers' channel; the tools' own prints go nowhere
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    sys.stdout = open(os.devnull, "w")
    tools = {f.__name__: f for f in (load(s, "--tools") for s in specs)}
    for line in sys.stdin:
        req = json.loads(line)
        fn = tools[req["name"]]
        try:
            inspect.signature(fn).bind(**req["arguments"])
        except TypeError as e:
            reply = {"error": "bad_arguments", "message": f"{req['name']}: {e}"}
        else:
            try:
                text, why = as_text(fn(**req["arguments"]))
                reply = {"result": text} if why is None else {"error": "non_text",
                                                              "message": f"{req['name']} {why}"}
            except BaseException as e:  # MemoryError and SystemExit too: the call failed, not the worker
                reply = {"error": "raised", "message": f"{req['name']} raised {type(e).__name__}: {e}"[:500]}
            if "result" in reply and len(reply["result"]) > MAX_CHARS:
                reply = {"result": reply["result"][:MAX_CHARS], "kind": "too_long"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.argv[1:])
