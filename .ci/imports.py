"""The house's import rules, read from the code's own import statements (nothing is imported or run).

Layers, lowest first; a file imports only from its own folder or from a lower layer:

    utils/    0  plumbing any trainer needs: dist, errors, checkpoint, logger, plot, sandbox, callables
    models/   1  the model code: config, decoder, Qwen2-VL, the flow DiT, LoRA, tokenizer, FSDP2 sharding
    rl/       2  the RL math: advantages, losses, KL, Flow-GRPO's sampler, the mismatch corrections
    tasks/    2  datasets, batches and the built-in tasks, their rewards and tool environments
    engines/  3  generation: the native engine and its decode, vLLM, tensor-parallel, episodes
    roles/    4  actor, critic, reference, teacher, reward, judge, rollout
    (top)     5  flags, run, rollouts, placement, rebalance, memory: what the scripts share
    assets/   6  the builders of the tiny checkpoints (they train with everything below)
    scripts   7  train_*.py, teach_grpo.py

So the model never imports the RL math (models is below rl), a utility never imports a role, a
role never imports run or a script. Within a layer, files import each other without a circle.

An import inside a function defers a heavy optional package (vllm, matplotlib, wandb, PIL,
datasets, ...). Of the project's own modules, only one that imports such a package at its top may
be imported inside a function (engines/vllm_transfer.py imports vllm), and the line says so with a
comment holding "defers": everything else of ours sits in the file's header.

Usage: python .ci/imports.py [ROOT]. Prints one line per finding and a last line
'imports: F findings (C circles, U upward, I inside functions)'; exits 1 when F > 0.
"""
import ast
import os
import sys

FOLDERS = {"utils": 0, "models": 1, "rl": 2, "tasks": 2, "engines": 3, "roles": 4, "assets": 6}
SKIP = {"tests", "bench", "docs", "build", "dist", "runs"}


def layer(module: str) -> int:
    """A module's layer: its folder's, 7 for a script (train_*, teach_*), else 5 (the top's shared files)."""
    top = module.split(".")[0]
    if top in FOLDERS:
        return FOLDERS[top]
    return 7 if top.startswith(("train_", "teach_")) else 5


def project_modules(root: str) -> dict[str, str]:
    """{module name: file path} of every project .py file outside tests/bench/docs."""
    found = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith((".", "__")))
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root)
                module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
                found[module] = os.path.join(folder, name)
    return found


def imports_of(path: str, modules: dict) -> list[tuple[str, int, bool]]:
    """(project module imported, line, inside a function and not marked `defers`?) for each import
    statement of the file."""
    source = open(path, encoding="utf-8").read()
    lines, tree = source.splitlines(), ast.parse(source, path)
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]  # a module, or a name in one
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                deferred = "defers" in lines[node.lineno - 1].partition("#")[2]
                out.add((name, node.lineno, id(node) in inside and not deferred))
    return sorted(out, key=lambda found: (found[1], found[0]))


def circles(edges: dict[str, set]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def findings(root: str) -> tuple[list[str], dict]:
    modules = project_modules(root)
    edges = {m: set() for m in modules}
    out, counts = [], {"circles": 0, "upward": 0, "inside": 0}
    for module, path in sorted(modules.items()):
        rel = os.path.relpath(path, root)
        for target, line, inside in imports_of(path, modules):
            if target == module or module.startswith(target + "."):  # a package's own __init__
                continue
            edges[module].add(target)
            beside = target.rpartition(".")[0] == module.rpartition(".")[0] and layer(target) == layer(module)
            if inside:
                counts["inside"] += 1
                out.append(f"{rel}:{line}: imports {target} inside a function (move it to the header)")
            if not beside and layer(target) >= layer(module):
                counts["upward"] += 1
                out.append(f"{rel}:{line}: {module} (layer {layer(module)}) imports {target} "
                           f"(layer {layer(target)}): imports go down")
    for component in circles(edges):
        counts["circles"] += 1
        out.append(f"circle of {len(component)}: {', '.join(component)}")
    return out, counts


def main():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else here)
    out, counts = findings(root)
    for line in out:
        print(line)
    print(f"imports: {len(out)} findings ({counts['circles']} circles, {counts['upward']} upward, "
          f"{counts['inside']} inside functions)")
    sys.exit(1 if out else 0)


if __name__ == "__main__":
    main()
