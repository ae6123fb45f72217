"""Held-out benchmark prompts: code and prose from files neither demo model trained on.

`heldout_prompts`: half code, half docstrings. `mixed_prompts`: a workload of four labelled
domains, for comparing drafter kinds — code (a function's opening), docstring prose, comment
prose (blocks of `#` lines) and documentation text (the README paragraphs of the installed
packages' metadata: English written for people, the least code-like text this machine has
offline, and text the demo model never saw).

The project's own distribution is not one of those packages: its metadata holds README.md as
it was when the checkout was last installed, and a checkout on `sys.path` shows a second copy
(`dcut.egg-info`), so its paragraphs would move every "docs" prompt (the pool's length sets the
draw) with each README edit and with how a script was started.
"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import importlib.util
import pathlib
import re
import sysconfig
from collections.abc import Iterator

import numpy as np

from deployments.corpus import texts


def heldout_prompts(n: int, seed: int = 0, max_chars: int = 400) -> list[str]:
    """n prompts, half code (the opening of a function) and half prose (a docstring's opening),
    from the corpus's validation split, in a fixed shuffled order."""
    code, prose = _functions(max_chars)
    rng = np.random.default_rng(seed)
    code = [code[i] for i in rng.permutation(len(code))]
    prose = [prose[i] for i in rng.permutation(len(prose))]
    half = n // 2
    out = code[: n - half] + prose[:half]
    return [out[i] for i in rng.permutation(len(out))]


def functions(split: str = "validation") -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, list[str]]]:
    """(node, its file's lines) of every function of five lines or more in a split, file by file
    in the corpus's order (also read by tests/interop/make_tasks.py)."""
    for text in texts(split):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno > 4:
                yield node, lines


def _functions(max_chars: int) -> tuple[list[str], list[str]]:
    """(code, docstrings): the first lines of every function of five lines or more in the
    validation split, and the openings of their docstrings of more than 80 characters."""
    code, prose = [], []
    for node, lines in functions():
        head = "\n".join(lines[node.lineno - 1: node.lineno + 2])
        code.append(head[:max_chars] + "\n")
        doc = ast.get_docstring(node)
        if doc and len(doc) > 80:
            prose.append(doc[: max_chars // 2].rsplit(" ", 1)[0])
    return code, prose


DOMAINS = ("code", "docstring", "comment", "docs")


def _comment_blocks(max_chars: int) -> list[str]:
    """Openings of blocks of two or more `#` comment lines in the validation split (licence
    headers, shebangs and separator lines left out)."""
    out = []
    for text in texts("validation"):
        block: list[str] = []
        for line in [*text.splitlines(), ""]:
            stripped = line.strip()
            if stripped.startswith("#") and not stripped.startswith(("#!", "# -*-")):
                block.append(stripped)
                continue
            body = " ".join(b.lstrip("# ") for b in block)
            if len(block) >= 2 and len(body) > 80 and sum(c.isalpha() for c in body) > 0.7 * len(body) \
                    and "copyright" not in body.lower() and "license" not in body.lower():
                out.append("\n".join(block)[: max_chars // 2].rsplit(" ", 1)[0])
            block = []
    return out


PROJECT = "dcut"  # our own distribution: not a source of prompts (module docstring)


def package_folders() -> list[str]:
    """Where the docs prompts' packages are read: the environment's own package folders
    (sysconfig's purelib and platlib) and ray's `thirdparty_files` (psutil, colorama). Not
    `sys.path`, which imports lengthen: importing ray puts its thirdparty_files there, so the pool
    — and with it every mixed-workload prompt, training and held-out alike — depended on whether
    ray had been imported first (found in session 36). The CLI and the benchmarks always had: this
    is the pool they drew, now whatever was imported."""
    paths = sysconfig.get_paths()
    folders = [paths["purelib"], paths["platlib"]]
    ray = importlib.util.find_spec("ray")  # found, not imported
    if ray is not None and ray.submodule_search_locations:
        folders.append(str(pathlib.Path(ray.submodule_search_locations[0]) / "thirdparty_files"))
    return list(dict.fromkeys(folders))


def _doc_paragraphs(max_chars: int) -> list[str]:
    """Prose paragraphs of the installed packages' long descriptions (README text), by package
    name, the project's own left out: headings, lists, tables, code and link-heavy lines left out."""
    out = []
    dists = sorted(importlib.metadata.distributions(path=package_folders()),
                   key=lambda d: (d.metadata["Name"] or "").lower())
    seen = {PROJECT}
    for d in dists:
        name = (d.metadata["Name"] or "").lower()
        if name in seen:
            continue
        seen.add(name)
        body = d.metadata.get_payload() if isinstance(d.metadata, email.message.Message) else ""
        for para in re.split(r"\n\s*\n", body or ""):
            para = " ".join(para.split())
            if len(para) < 160 or para[0] in "#|`<[!*-=.:>0123456789" or "http" in para or "```" in para:
                continue
            if sum(c.isalpha() or c == " " for c in para) > 0.9 * len(para):
                out.append(para[: max_chars // 2].rsplit(" ", 1)[0])
    return out


def mixed_prompts(n: int, seed: int = 0, max_chars: int = 400) -> list[tuple[str, str]]:
    """n (domain, prompt) pairs, as even a share of each of `DOMAINS` as n allows, in a fixed
    shuffled order. Every domain is held out from the demo models' training (validation split,
    or text outside the corpus)."""
    rng = np.random.default_rng(seed)
    code, doc = _functions(max_chars)
    pools = {"code": code, "docstring": doc, "comment": _comment_blocks(max_chars), "docs": _doc_paragraphs(max_chars)}
    out = []
    for i, domain in enumerate(DOMAINS):
        pool = pools[domain]
        take = n // len(DOMAINS) + (1 if i < n % len(DOMAINS) else 0)
        if len(pool) < take:
            raise ValueError(f"only {len(pool)} {domain} prompts available, {take} asked for")
        out += [(domain, pool[j]) for j in rng.permutation(len(pool))[:take]]
    return [out[i] for i in rng.permutation(len(out))]
