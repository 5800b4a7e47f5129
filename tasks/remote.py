"""A reward behind HTTP: `--rewards http://host:port/path` (roles/reward.py resolves such a term to
`HttpReward`).

Each step's scoring call POSTs one JSON object, the same arguments a `module:function` term gets:

    {"prompts": [...], "completions": [...], "answer": [...], "finish_reason": [...], ...every column}

and reads one number per completion back: a JSON list, or an object with a "rewards" list; a null
(or NaN) scores that sample as failed. A connection refused or reset, a timeout, HTTP 429 or 5xx is
tried again, up to --reward-retries more times with a short pause (each try has 0.9 / (retries + 1)
of --reward-timeout-s, so that the call ends within it, reason known); any other answer (4xx, not JSON,
the wrong count, a value that is no number) is not. A call that still fails scores every sample of
it as failed: 0, counted in reward/failures and left out of its group and the loss, as a
`module:function` term that raises (the run goes on; `last_error` says why). Standard library only
(urllib): no client to install for it.
"""
import http.client
import json
import math
import time
import urllib.error
import urllib.request

RETRIED = (429, 500, 502, 503, 504)


def is_service(term: str) -> bool:
    """Whether a --rewards term names a reward service (its URL) rather than a function."""
    return term.startswith(("http://", "https://"))


class HttpReward:
    """A --rewards term that is a URL: called as fn(prompts, completions, **columns) -> scores."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 2, pause_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.pause_s = url, timeout_s, retries, pause_s
        self.last_error = None
        self.__name__ = url  # what the reward's messages call it

    def __call__(self, prompts, completions, **columns) -> list[float]:
        self.last_error = None
        body = json.dumps({"prompts": list(prompts), "completions": list(completions),
                           **{k: list(v) for k, v in columns.items()}}, default=str).encode()
        for attempt in range(self.retries + 1):
            got, retry = self._post(body)
            if not retry:
                break
            if attempt < self.retries:
                time.sleep(self.pause_s * (attempt + 1))
        if got is None:
            return [math.nan] * len(completions)
        scores = got.get("rewards") if isinstance(got, dict) else got
        if not isinstance(scores, list) or len(scores) != len(completions):
            self.last_error = (f"{self.url} answered {str(got)[:120]!r}: the reward service must answer one "
                               f"number per completion ({len(completions)}), a JSON list or "
                               '{"rewards": [...]}')
            return [math.nan] * len(completions)
        out = []
        for v in scores:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            out.append(float(v) if ok else math.nan)
        if any(math.isnan(v) for v in out):
            self.last_error = f"{self.url} scored some completions null or not a number"
        return out

    def _post(self, body: bytes):
        """-> (the decoded answer or None, whether to try again)."""
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            self.last_error = f"{self.url} answered HTTP {e.code} {e.reason}"
            return None, e.code in RETRIED
        except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            self.last_error = f"{self.url} could not be reached ({type(reason).__name__}: {reason})"
            return None, True
        try:
            return json.loads(raw), False
        except ValueError:
            self.last_error = f"{self.url} answered {raw[:120]!r}, not JSON"
            return None, False
