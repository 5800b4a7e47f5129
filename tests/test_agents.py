"""--agent (engines/agents.py): the `openai` client against the run's endpoint on localhost, episodes
token for token as the in-process environment's, what is refused and what fails; the reward behind
HTTP (tasks/remote.py) against a real server; GRPO through the endpoint, colocated and disaggregated."""
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from launch import torchrun

from engines.agents import AgentArgs, Agents
from engines.decode import SamplingParams
from engines.episodes import EnvArgs, Episodes
from engines.native import NativeEngine
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from roles.reward import Reward
from tasks.data import load_rows, tokenize_rows
from tasks.env import multiply, schema
from tasks.remote import HttpReward
from tests.helpers import agents as helpers
from utils.errors import UserError

TOOL_MODEL = "assets/tool-tiny"


@pytest.fixture(scope="module")
def tool():
    """(tokenizer, rows of builtin:multiply's held-out split (plain prompts), an engine factory)."""
    tok = Tokenizer(TOOL_MODEL)
    rows, _ = tokenize_rows(load_rows("builtin:multiply", "eval", "prompt", "answer")[:64], tok, 256)

    def engine():
        e = NativeEngine(read_config(TOOL_MODEL), tok)
        e.load_weights(iter_checkpoint(TOOL_MODEL))
        return e
    return tok, rows, engine


def play(tool, agent: str, n: int = 2, temperature: float = 0.0, prompts: int = 8, **flags):
    """The episodes of `agent` on the first rows, through a fresh endpoint -> Samples."""
    tok, rows, engine = tool
    agents = Agents(engine(), AgentArgs(agent=agent, **flags), tok, rows, 96, 256, temperature)
    try:
        params = SamplingParams(n, temperature, max_new_tokens=96)
        return agents.generate([r["ids"] for r in rows[:prompts]], params, list(range(prompts)))
    finally:
        agents.close()


def test_the_openai_client_gets_answers_tool_calls_and_clear_refusals(tool):
    """A plain request answered in OpenAI's format (content, finish_reason, usage), the model's
    <tool_call> parsed into tool_calls; streaming, another model name, n > 1, another temperature and
    an unserved parameter refused with a message that says so (HTTP 400), the episode going on."""
    helpers.SEEN.clear()
    out = play(tool, "tests.helpers.agents:probe", prompts=64, n=1)
    seen = [helpers.SEEN[r["prompt"]] for r in tool[1][:64]]  # in the samples' order
    s = seen[0]
    assert "streaming is not served" in s["stream"] and "'gpt-4o' is not served" in s["model"]
    assert "n must be 1" in s["n"] and "not the run's --temperature" in s["temperature"]
    assert "parameters not served here: top_p" in s["top_p"]
    replies = [x["reply"] for x in seen]
    r = replies[0]
    assert r["model"] == "policy" and r["object"] == "chat.completion"
    assert r["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    assert r["usage"]["completion_tokens"] == int(out.lengths[0])
    assert r["usage"]["prompt_tokens"] == len(out.prompts[0])
    calls = [x for x in replies if x["choices"][0]["message"].get("tool_calls")]
    assert calls, "no sample called the tool (tool-tiny calls it on about 1 in 5 greedy prompts)"
    call = calls[0]["choices"][0]
    assert call["finish_reason"] == "tool_calls"
    assert call["message"]["tool_calls"][0]["function"]["name"] == "multiply"
    assert json.loads(call["message"]["tool_calls"][0]["function"]["arguments"]).keys() == {"a", "b"}
    assert (out.episode["failed"] == 0).all() and (out.episode["stop/answer"] == 1).all()
    assert torch.equal(out.episode["env_reward"], torch.ones(64))  # the function's own reward


def test_episodes_are_the_in_process_environments_token_for_token(tool):
    """At temperature 0 the openai-client agent (tasks/agents.py) and the in-process tool environment
    (--tools tasks.env:multiply) play the same episodes: the same prompt, the same tokens, the same
    mask (only the model's tokens trained), tool calls and turns."""
    tok, rows, engine = tool
    out = play(tool, "tasks.agents:multiply_agent", prompts=64)
    env = EnvArgs(tools=("tasks.env:multiply",))
    env.check()
    opening = [{**r, "prompt_messages": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    with_tools, _ = tokenize_rows(opening, tok, 256, [schema(multiply)])
    episodes = Episodes(engine(), env, tok, with_tools, 96)
    want = episodes.generate([r["ids"] for r in with_tools], SamplingParams(2, 0.0, max_new_tokens=96),
                             list(range(64)))
    episodes.close()
    assert out.prompts == [r["ids"] for r in with_tools for _ in range(2)]
    assert torch.equal(out.lengths, want.lengths) and torch.equal(out.tokens, want.tokens)
    assert torch.equal(out.model_mask, want.model_mask) and torch.equal(out.logprobs, want.logprobs)
    assert out.episode["tool_calls"].sum() > 0
    assert torch.equal(out.episode["tool_calls"], want.episode["tool_calls"])
    assert torch.equal(out.episode["turns"], want.episode["turns"]) and out.texts == want.texts
    assert (out.model_mask.sum(1) < out.lengths).any()  # a tool's reply is in the tokens, out of the loss


@pytest.mark.parametrize("agent,stop", [("rewriter", "rewrite"), ("raiser", "raised"), ("sleeper", "timeout"),
                                        ("wrong_type", "bad_return"), ("unrenderable", "refused")])
def test_a_failing_agent_fails_its_episode_not_the_run(tool, agent, stop):
    """A rewritten history (refused: a branch would be a second sample of the row), a function that
    raises, one that runs past --agent-timeout-s, one that returns no number: each episode fails by
    its cause, and the generate returns."""
    helpers.SEEN.clear()
    t = time.time()
    limit = 1.0 if agent == "sleeper" else 60.0  # (the others must not run into it on a loaded machine)
    out = play(tool, f"tests.helpers.agents:{agent}", prompts=2, agent_timeout_s=limit)
    assert time.time() - t < 30
    assert (out.episode[f"stop/{stop}"] == 1).all() and (out.episode["failed"] == 1).all()
    assert out.finish_reasons == [stop] * 4
    if agent == "rewriter":
        assert all("do not extend this episode" in s["rewrite"] for s in helpers.SEEN.values())
    if agent == "unrenderable":
        assert all("cannot be rendered" in s["parts"] for s in helpers.SEEN.values())


def test_two_requests_of_one_episode_at_once_one_is_refused(tool):
    """An episode is one chat: a second request while one waits for the model gets HTTP 409, and the
    same request after its answer (a client's retry) gets that answer again; the episode has one turn
    and is trained."""
    helpers.SEEN.clear()
    out = play(tool, "tests.helpers.agents:twice", prompts=2, n=1)
    assert all(set(s["twice"]) <= {"409", "stop", "length"} for s in helpers.SEEN.values())
    assert (out.episode["failed"] == 0).all() and (out.episode["turns"] == 1).all()


def test_budgets_end_an_episode_by_their_cause_and_it_is_trained(tool):
    """A request past --agent-max-turns is refused; the episode ends there (max_turns), not failed;
    an agent that asks nothing gives a sample without tokens."""
    out = play(tool, "tests.helpers.agents:chatty", prompts=2, agent_max_turns=2)
    assert (out.episode["stop/max_turns"] == 1).all() and (out.episode["failed"] == 0).all()
    assert (out.episode["turns"] == 2).all()
    out = play(tool, "tests.helpers.agents:silent", prompts=2)
    assert (out.lengths == 0).all() and (out.episode["stop/answer"] == 1).all()


def test_a_port_in_use_is_one_clear_error(tool):
    tok, rows, engine = tool
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"--agent-port {port}: .*pick another port"):
            flags = AgentArgs(agent="tasks.agents:multiply_agent", agent_port=port)
            Agents(engine(), flags, tok, rows, 96, 256, 0.0)


def test_agent_flags_are_checked():
    with pytest.raises(UserError, match="--agent with --env or --tools"):
        AgentArgs(agent="tasks.agents:multiply_agent").check(EnvArgs(tools=("tasks.env:multiply",)))
    with pytest.raises(UserError, match="fn\\(base_url, row\\)"):
        AgentArgs(agent="tasks.agents:shared_client").check(EnvArgs())  # takes no arguments


class Service(BaseHTTPRequestHandler):
    """A reward service: /len scores each completion by its length; /flaky fails twice (HTTP 503)
    then answers; /garbage answers text; /slow answers after 3 s; /null scores the first completion
    null."""
    calls = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Service.calls[self.path] = Service.calls.get(self.path, 0) + 1
        if self.path == "/flaky" and Service.calls[self.path] <= 2:
            return self.send_error(503)
        if self.path == "/slow":
            time.sleep(3)
        scores = [len(c) for c in body["completions"]]
        if self.path == "/null":
            scores[0] = None
        reply = b"hello" if self.path == "/garbage" else json.dumps({"rewards": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_reward_behind_http(service):
    """The columns go with the completions; retried through HTTP 503; garbage, a null, a slow or
    absent service fail their samples (counted, with the reason), never the run."""
    prompts, completions = ["p1", "p2"], ["ab", "abcd"]
    columns = {"answer": ["1", "2"], "finish_reason": ["stop"] * 2}
    reward = Reward([f"{service}/len"])
    total, _, failed = reward.score(prompts, completions, columns)
    assert total.tolist() == [2.0, 4.0] and not failed.any()
    flaky = HttpReward(f"{service}/flaky", timeout_s=5, retries=2, pause_s=0.01)
    assert flaky(prompts, completions, **columns) == [2.0, 4.0] and Service.calls["/flaky"] == 3
    failing = (("/garbage", "not JSON"), ("/null", "null or not a number"), ("/slow", "could not be reached"))
    for path, why in failing:
        reward = Reward([f"{service}{path}"], timeout_s=1.0, retries=0)
        total, _, failed = reward.score(prompts, completions, columns)
        assert failed.tolist() == ([True, False] if path == "/null" else [True, True])
        assert why in reward.last_failure()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}/len"  # nothing listens there
    fn = HttpReward(down, timeout_s=1, retries=1, pause_s=0.01)
    assert all(math.isnan(v) for v in fn(prompts, completions)) and "could not be reached" in fn.last_error


AGENT_RUN = ["--model", TOOL_MODEL, "--dataset", "builtin:multiply", "--agent", "tasks.agents:multiply_agent",
             "--max-prompt-tokens", "32", "--max-new-tokens", "96", "--prompts-per-step", "4",
             "--num-generations", "4", "--lr", "1e-3", "--warmup-steps", "1", "--eval-every", "0",
             "--steps", "3", "--save-every", "0", "--no-save-final"]
DISAGGREGATE = ["--placement", "disaggregate", "--rollout-ranks", "1"]


@pytest.mark.parametrize("ranks,placement", [(2, []), (3, DISAGGREGATE)])
def test_grpo_through_the_endpoint(tmp_path, ranks, placement):
    """Colocated, each trainer rank serves its endpoint; disaggregated, the rollout rank does: the
    agent's episodes train (no failures, its tool calls counted, the engine's log-probs the trainer's)."""
    from test_train_grpo import metrics

    torchrun(ranks, "train_grpo.py", *AGENT_RUN, *placement, "--run-dir", str(tmp_path), timeout=300)
    rows = [r for r in metrics(str(tmp_path)) if "episode/turns" in r]
    assert len(rows) == 3 and all(r["reward/failures"] == 0 and r["episode/failed"] == 0 for r in rows)
    assert all(r["episode/stop/answer"] == 1 and r["train/logprob_gap_max"] < 1e-4 for r in rows)


def test_a_failed_episode_has_no_reward_and_leaves_the_loss(tool):
    """The scorer reads an episode's `failed`: its sample scores 0 and is failed (left out of its group
    and of the loss by rollouts.py's keep), even where --rewards would have scored its text, and the
    function's reward of a good episode is added."""
    from roles.reward import RewardArgs, Scorer
    from utils.logger import Timer

    out = play(tool, "tests.helpers.agents:raiser", prompts=1, n=2)
    good = play(tool, "tasks.agents:multiply_agent", prompts=1, n=2)
    rows = tool[1][:1]
    scorer = Scorer(RewardArgs(), None, None, tool[0].pad_id, "cpu", 96)
    rewards, _, failed = scorer.score(rows, [0], out, None, 2, Timer(), {})
    assert failed.tolist() == [True, True] and rewards.tolist() == [0.0, 0.0]
    rewards, _, failed = scorer.score(rows, [0], good, None, 2, Timer(), {})
    assert not failed.any()
