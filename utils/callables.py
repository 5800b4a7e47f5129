"""User-supplied callables checked once before the run against how the trainer will call them.

A mistake in a user's function used to surface late or never: a tool `def add_all(*numbers: int)`
was offered with a JSON schema no call could fill, and the run went on. Each kind the flags load
('module:name') is checked here against the trainer's own call, and refused in one line that names
it and says what to change:

    check_tool    a --tools function (or an --env class's `tools`): the worker calls fn(**arguments),
                  the model's JSON object, and its schema (tasks.env.schema) describes it
    check_env     an --env class: cls() per episode, then reset(row) and step(text)
    check_reward  a --rewards module:function: fn(prompts, completions, **columns) -> scores
"""
import inspect
import re
import types
import typing

from utils.errors import UserError


def check_plain(fn, where: str, caller: str, result: str):
    """A function that `caller` calls plainly and whose return value it reads: not async (the call
    would give a coroutine) and not a generator (it would give an iterator). One error naming it."""
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise UserError(f"{where} is async: {caller} calls it plainly and would get a coroutine, not "
                        f"{result}: make it a plain def")
    if inspect.isgeneratorfunction(fn):
        raise UserError(f"{where} is a generator (it yields): {caller} reads what it returns: return "
                        f"{result} instead")


def check_tool(fn, where: str):
    """A tool as the trainer uses it, checked once before the run: `schema` describes it to the
    model and the worker calls it as fn(**arguments), the model's JSON object. So its name is a
    name, each parameter has a JSON type and can be passed by keyword (keyword-only is fine; *args,
    **kwargs and positional-only are not), and its docstring says what it does. where: "--tools
    module:fn", or the environment's tool; one error naming it and what to change."""
    if not inspect.isfunction(fn):
        kind = "class" if inspect.isclass(fn) else type(fn).__name__
        raise UserError(f"{where} is a {kind}, not a function: a tool is a plain def with typed parameters "
                        "and a docstring (as tasks.env:multiply)")
    if not fn.__name__.isidentifier():
        raise UserError(f"{where} is a lambda, whose name ({fn.__name__}) the model cannot call: define it "
                        "with def")
    check_plain(fn, where, "the tool worker", "its result")
    doc = inspect.getdoc(fn) or ""
    if not doc.strip():
        raise UserError(f"{where} has no docstring: its first paragraph is the tool's description in the "
                        "chat template, and `name: text` lines under Args: describe the parameters; add one")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation that names nothing importable
        raise UserError(f"{where}: its annotations do not resolve ({type(e).__name__}: {e}); annotate with "
                        "int, float, str, bool, list or dict") from None
    params = inspect.signature(fn).parameters
    for name, p in params.items():
        check_tool_parameter(where, name, p, hints)
    stray = [name for name in described(doc) if name not in params]
    if stray:
        raise UserError(f"{where}: its docstring describes {stray[0]!r} under Args:, which is no "
                        f"parameter of it (its parameters: {', '.join(params) or 'none'}): describe the "
                        f"parameters it has")


def check_tool_parameter(where: str, name: str, p: inspect.Parameter, hints: dict):
    """One parameter of a tool (`check_tool`): passed by keyword from JSON, typed for the schema."""
    P = inspect.Parameter
    if p.kind == P.VAR_POSITIONAL:
        item = typing_name(hints[name]) if name in hints else "int"
        raise UserError(f"{where}: *{name} takes any number of positional arguments, which a tool call (a "
                        f"JSON object of named arguments) cannot pass: take one list instead ({name}: "
                        f"list[{item}])")
    if p.kind == P.VAR_KEYWORD:
        raise UserError(f"{where}: **{name} takes any keyword, which its JSON schema cannot describe to the "
                        "model: name each argument as a typed parameter")
    if p.kind == P.POSITIONAL_ONLY:
        raise UserError(f"{where}: its parameter {name} is positional-only (before /), and the tool worker "
                        "passes every argument by name: drop the /")
    if name not in hints:
        raise UserError(f"{where}: its parameter {name} has no type annotation, which its JSON schema needs: "
                        f"annotate it ({name}: int, float, str, bool, list or dict)")
    if json_type(hints[name]) is None:
        raise UserError(f"{where}: its parameter {name}: {typing_name(hints[name])} has no JSON schema type: "
                        f"use int, float, str, bool, list or dict (or one of them | None, with a default)")


def typing_name(hint) -> str:
    """An annotation as it was written: int, list[int], typing.Any, MyClass."""
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint)


def check_env(cls, spec: str):
    """An --env class as the trainer uses it, checked once before the run: one instance per
    episode made with cls(), then reset(row) and step(text) on it; its `tools` (optional) are
    described to the model (`check_tool`). One error naming it and what to change."""
    where = f"--env {spec}"
    if not inspect.isclass(cls):
        raise UserError(f"{where} is a {type(cls).__name__}, not a class: pass a class with reset(row) and "
                        "step(text), of which the trainer makes one instance per episode (docs/tools.md)")
    for method, arg in (("reset", "row"), ("step", "text")):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise UserError(f"{where}: {cls.__name__} has no {method}({arg}) method: an environment class "
                            "has reset(row) -> messages and step(text) -> (messages, reward, done); add it "
                            "(docs/tools.md)")
        check_plain(fn, f"{where}: {cls.__name__}.{method}", "the trainer", "its result")
        sig = method_signature(cls, method)
        if not fits(sig, 1):
            raise UserError(f"{where}: {cls.__name__}.{method}{sig} cannot be called as {method}({arg}), "
                            f"with one argument: take {arg} alone (others need defaults)")
    if not fits(init_signature(cls), 0):
        raise UserError(f"{where}: {cls.__name__}{init_signature(cls)} cannot be made with no arguments, as "
                        "the trainer makes each episode's instance: give its parameters defaults")
    tools = getattr(cls, "tools", [])
    if not isinstance(tools, (list, tuple)):
        raise UserError(f"{where}: {cls.__name__}.tools is a {type(tools).__name__}: make it a list of the "
                        "tool functions (tools = [multiply])")
    for fn in tools:
        if not callable(fn):
            raise UserError(f"{where}: {cls.__name__}.tools holds {fn!r:.60}, not a function: it lists the "
                            "tool functions themselves (tools = [multiply]), not their names")
        check_tool(fn, f"{where}: its tool {getattr(fn, '__name__', fn)}")  # a partial has no name


def method_signature(cls, name: str) -> inspect.Signature:
    """A method's signature as an instance calls it: self left out (a staticmethod has none)."""
    sig = inspect.signature(getattr(cls, name))
    if isinstance(inspect.getattr_static(cls, name), (staticmethod, classmethod)):
        return sig
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def init_signature(cls) -> inspect.Signature | None:
    """cls()'s signature, the trainer's call (None where Python cannot describe it: not checked)."""
    try:
        return inspect.signature(cls)
    except (TypeError, ValueError):
        return None


def fits(sig: inspect.Signature | None, positional: int) -> bool:
    """Whether a call with this many positional arguments binds to `sig` (None: not known, fits)."""
    if sig is None:
        return True
    try:
        sig.bind(*[None] * positional)
    except TypeError:
        return False
    return True


def check_reward(fn, name: str, columns: list[str], outputs: str = "completions"):
    """A 'module:function' term as `_call` calls it, checked once before the run: fn(prompts,
    completions, **columns) with every column (the dataset's and finish_reason) by keyword, whose
    result it reads as scores; `outputs` names the second argument (train_flow_grpo.py: images).
    One error naming it and what to change."""
    call = f"fn(prompts, {outputs}, **columns)" if columns else f"fn(prompts, {outputs})"
    if inspect.isclass(fn) or not callable(fn):
        kind = "class" if inspect.isclass(fn) else type(fn).__name__
        raise UserError(f"--rewards {name} is a {kind}, not a function: the trainer calls {call} and reads "
                        "the list of scores it returns; pass a function")
    check_plain(fn, f"--rewards {name}", "the trainer", "the list of scores")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable Python cannot describe (some built-ins): not checked
        return
    check_reward_parameters(sig, name, columns, outputs, call)


def check_reward_parameters(sig: inspect.Signature, name: str, columns: list[str], outputs: str, call: str):
    """`check_reward`'s second half: the two positional arguments, then each column by keyword."""
    given = ", ".join(columns) or "none"
    P = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)][:2]
    if len(positional) < 2 and not any(p.kind == P.VAR_POSITIONAL for p in params):
        raise UserError(f"--rewards {name}{sig} cannot take prompts and {outputs} as its first two "
                        f"arguments: the trainer calls {call}; make its parameters (prompts, {outputs}, "
                        f"**columns)")
    named = [p for p in params if p not in positional and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    for p in named:
        if p.default is P.empty and not columns:
            raise UserError(f"--rewards {name}: its parameter {p.name!r} would get no value, as the trainer "
                            f"calls {call}: give it a default, or drop it")
        if p.default is P.empty and p.name not in columns:
            raise UserError(f"--rewards {name}: its parameter {p.name!r} is no column of the dataset (the "
                            f"trainer passes each column by keyword: {given}); give it a default, or add the "
                            f"column")
    extra = [c for c in columns if c not in {p.name for p in named}]
    if extra and not any(p.kind == P.VAR_KEYWORD for p in params):
        raise UserError(f"--rewards {name} takes no {extra[0]!r}, and the trainer passes every column by "
                        f"keyword ({given}): add **columns to its parameters")
    try:
        sig.bind([], [], **{c: [] for c in columns})
    except TypeError as e:
        raise UserError(f"--rewards {name}{sig} cannot be called as {call} with the columns {given} ({e}): "
                        f"take (prompts, {outputs}, **columns)") from None


def json_type(hint) -> str | None:
    """A parameter's JSON schema type from its annotation (int -> "integer", list[int] -> "array",
    `X | None` -> X's), or None where JSON schema has no type for it."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        hint = args[0] if args[1] is type(None) else args[1]
    return JSON_TYPES.get(typing.get_origin(hint) or hint)


def described(doc: str) -> dict:
    """{parameter: its description} from the `name: text` lines under a docstring's Args:."""
    return dict(ARGS_LINE.findall(doc.split("Args:", 1)[1])) if "Args:" in doc else {}


JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


ARGS_LINE = re.compile(r"^\s+(\w+)(?: \([^)]*\))?: (.+)$", re.M)  # `name: text` under a docstring's Args:
