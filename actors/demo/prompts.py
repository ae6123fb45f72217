"""Held-out benchmark prompts: code and prose from files neither demo model trained on."""

from __future__ import annotations

import ast

import numpy as np

from actors.demo.corpus import texts


def heldout_prompts(n: int, seed: int = 0, max_chars: int = 400) -> list[str]:
    """n prompts, half code (the opening of a function) and half prose (a docstring's opening),
    from the corpus's validation split, in a fixed shuffled order."""
    code, prose = [], []
    for text in texts("validation"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno > 4:
                head = "\n".join(lines[node.lineno - 1: node.lineno + 2])
                code.append(head[:max_chars] + "\n")
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    prose.append(doc[: max_chars // 2].rsplit(" ", 1)[0])
    rng = np.random.default_rng(seed)
    code = [code[i] for i in rng.permutation(len(code))]
    prose = [prose[i] for i in rng.permutation(len(prose))]
    half = n // 2
    out = code[: n - half] + prose[:half]
    return [out[i] for i in rng.permutation(len(out))]
