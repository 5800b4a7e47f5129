"""Agents for tests/test_agents.py, loaded as `tests.helpers.agents:NAME`: plain `openai`-client code
run against the endpoint of engines/agents.py. `SEEN` keeps what they observed, by the row's prompt."""
import time

import openai

from tasks.agents import TOOLS

SEEN = {}


def client(base_url: str):
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30)


def ask(base_url: str, row: dict):
    """One plain request with the row's prompt."""
    messages = [{"role": "user", "content": row["prompt"]}]
    return client(base_url).chat.completions.create(model="policy", messages=messages)


def refused(call) -> str:
    """The message of the HTTP 400 the endpoint answers `call` with ('' if it did not refuse)."""
    try:
        call()
    except openai.BadRequestError as e:
        return str(e)
    return ""


def probe(base_url: str, row: dict):
    """Asks for what the endpoint does not serve, then for a plain answer and a tool-call round trip."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    seen = SEEN.setdefault(row["prompt"], {})
    seen["stream"] = refused(lambda: c.chat.completions.create(model="policy", messages=messages,
                                                               stream=True))
    seen["model"] = refused(lambda: c.chat.completions.create(model="gpt-4o", messages=messages))
    seen["n"] = refused(lambda: c.chat.completions.create(model="policy", messages=messages, n=2))
    seen["temperature"] = refused(lambda: c.chat.completions.create(model="policy", messages=messages,
                                                                    temperature=0.5))
    seen["top_p"] = refused(lambda: c.chat.completions.create(model="policy", messages=messages, top_p=0.5))
    reply = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    seen["reply"] = reply.model_dump()
    return 1.0


def rewriter(base_url: str, row: dict):
    """A second request whose history is not the first one's: refused, and the episode fails."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = c.chat.completions.create(model="policy", messages=messages)
    rewritten = [{"role": "user", "content": row["prompt"] + " Think."},
                 reply.choices[0].message.model_dump(), {"role": "user", "content": "Again?"}]
    SEEN.setdefault(row["prompt"], {})["rewrite"] = refused(
        lambda: c.chat.completions.create(model="policy", messages=rewritten))
    return 1.0


def raiser(base_url: str, row: dict):
    ask(base_url, row)
    raise ValueError("the agent's own bug")


def sleeper(base_url: str, row: dict):
    ask(base_url, row)
    time.sleep(3)
    return 1.0


def wrong_type(base_url: str, row: dict):
    ask(base_url, row)
    return "1.0"


def silent(base_url: str, row: dict):
    """Asks nothing: its sample has no tokens, and scores by --rewards (none: reward 0)."""
    return None


def chatty(base_url: str, row: dict):
    """Asks more turns than --agent-max-turns allows, then returns: the episode ends at the budget."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(5):
        reply = c.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "More?"}]
    return 1.0


def unrenderable(base_url: str, row: dict):
    """Content as a list of parts, which this chat template cannot render: refused, the episode fails."""
    messages = [{"role": "user", "content": [{"type": "text", "text": row["prompt"]}]}]
    SEEN.setdefault(row["prompt"], {})["parts"] = refused(
        lambda: client(base_url).chat.completions.create(model="policy", messages=messages))
    return 1.0


def twice(base_url: str, row: dict):
    """Two requests of one episode at once: one is answered; the other is refused (409) while the first
    waits for the model, or gets the same answer after it (a retry); the episode goes on."""
    from concurrent.futures import ThreadPoolExecutor

    def one():
        try:
            return ask(base_url, row).choices[0].finish_reason
        except openai.APIStatusError as e:
            return e.status_code
    with ThreadPoolExecutor(2) as pool:
        SEEN.setdefault(row["prompt"], {})["twice"] = sorted(map(str, pool.map(lambda _: one(), range(2))))
    return 1.0
