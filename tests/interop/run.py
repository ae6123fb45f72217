"""`make interop`: the clients users bring, run unchanged against `dcut serve` on the bundled model.

Each client lives in its own virtual environment under .interop/ (lm-eval and guidellm depend on
torch: they get the CPU wheel first, as .venv does), pinned in tests/interop/requirements/. One
server is started for the whole run, the way `make serve` starts it; every client is checked
against something it could disagree with:

- lm-eval (local-completions, batch sizes 1 and 4): every loglikelihood, multiple-choice and
  rolling, against a direct forward of the target on the same tokens; every generate_until
  answer against the target's own greedy continuation.
- guidellm: its default run (no request overrides; it asks for continuous usage statistics),
  every request successful.
- aiperf, streaming: every request successful, and its output token count against the tokens
  the server says it sent (`dcut_generated_tokens_total`).
- schemathesis: the served /openapi.json as is, every check; no server error, no request left
  without an answer.

Writes runs/interop/results.json and results.md (the table docs/interop.md quotes) and exits 1
when any check fails. Usage: `.venv/bin/python -m tests.interop.run [--only lmeval,aiperf]`.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).parent
ENVS = ROOT / ".interop"
MODEL = "dcut-demo"
TOKENIZER = str(ROOT / "models" / "demo")  # tokenizer.json + tokenizer_config.json: what every client loads
TORCH = "torch==2.13.0"  # the CPU wheel on disk (Makefile's TORCH)
NEEDS_TORCH = {"lmeval", "guidellm"}
# No client may reach a model hub (the tokenizer and the tasks are local paths): the hub's address
# is a closed loopback port, and the libraries' offline switches are on. aiperf 0.13 alone runs
# without them: in offline mode it looks a local tokenizer folder up in the hub's cache and fails.
NO_HUB = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
          "TOKENIZERS_PARALLELISM": "false"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclasses.dataclass
class Check:
    """One row of the table: a client, what was checked, whether it held, and the numbers."""

    client: str
    what: str
    ok: bool
    detail: str


# --- environments -----------------------------------------------------------------------------

def ensure_env(tool: str) -> pathlib.Path:
    """.interop/<tool>, created and installed from its pins unless already installed from them."""
    pins = HERE / "requirements" / f"{tool}.txt"
    env = ENVS / tool
    stamp = env / ".installed"
    digest = hashlib.sha256(pins.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return env
    print(f"[interop] installing {tool} into {env} (log: {env}/install.log)", flush=True)
    if not (env / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--progress-bar", "off"]
    with open(env / "install.log", "w") as log:
        if tool in NEEDS_TORCH:  # first, so the resolver never reaches for a CUDA build
            subprocess.run([*pip, TORCH], check=True, stdout=log, stderr=log)
        subprocess.run([*pip, "-r", str(pins)], check=True, stdout=log, stderr=log)
    stamp.write_text(digest)
    return env


def run_tool(env: pathlib.Path, argv: list[str], log: pathlib.Path, timeout_s: float, cwd: pathlib.Path = ROOT,
             offline: bool = True) -> int:
    """A client's command from its environment's bin/, output to `log`; its exit status (124 on
    timeout, as timeout(1) says it)."""
    exe = env / "bin" / argv[0]
    environ = os.environ | NO_HUB | (OFFLINE if offline else {}) | {"PATH": f"{env / 'bin'}:{os.environ['PATH']}"}
    print(f"[interop] {' '.join(argv)}", flush=True)
    with open(log, "w") as out:
        try:
            return subprocess.run([str(exe), *argv[1:]], cwd=cwd, env=environ, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return 124


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


# --- the server -------------------------------------------------------------------------------

@contextlib.contextmanager
def served(port: int, log: pathlib.Path) -> Iterator[str]:
    """`dcut serve` on the bundled model (as `make serve` runs it) until the block ends; SIGTERM
    then, which drains."""
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "dcut"), "serve", "--port", str(port)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"dcut serve exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            time.sleep(2)
        else:
            raise RuntimeError(f"dcut serve not healthy after 600 s; see {log}")
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def generated_tokens(base: str) -> float:
    """The server's count of completion tokens sent, from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(r"^dcut_generated_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def still_serving(base: str) -> bool:
    r = httpx.post(f"{base}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "def add(a, b):\n", "max_tokens": 4, "temperature": 0})
    return r.status_code == 200 and httpx.get(f"{base}/health", timeout=10).json().get("status") == "ok"


# --- the reference: the target alone ----------------------------------------------------------

class Reference:
    """A direct forward of the bundled target, tokenized as lm-eval tokenizes (its
    TemplateAPI with the Hugging Face tokenizer: no special tokens added)."""

    def __init__(self) -> None:
        import torch
        from tokenizers import Tokenizer

        from actors.target.checkpoint import load_model
        from deployments.bundle import BUNDLED

        torch.set_num_threads(1)
        self.torch = torch
        self.model = load_model(f"{BUNDLED}/target")
        self.tok = Tokenizer.from_file(str(ROOT / TOKENIZER / "tokenizer.json"))
        self.eos = self.tok.token_to_id("<|endoftext|>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def log_probs(self, tokens: list[int]):
        from actors.target.model import ForwardBatch

        with self.torch.no_grad():
            batch = ForwardBatch.from_lists([0], [tokens], "all")
            logits, _ = self.model(batch, self.model.new_cache(len(tokens) + 64))
        return self.torch.log_softmax(logits.double(), -1).numpy()

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        """lm-eval's _encode_pair (trailing spaces of the context move to the continuation), then
        the continuation's summed log-probability and whether greedy decoding would produce it."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        cont = whole[len(ctx):]
        ctx = whole[: len(ctx)] or [self.eos]
        rows = self.log_probs(ctx + cont)[len(ctx) - 1: len(ctx) - 1 + len(cont)]
        pairs = list(zip(rows, cont, strict=True))
        return float(sum(r[t] for r, t in pairs)), all(r.argmax() == t for r, t in pairs)

    def rolling(self, text: str) -> float:
        """A document's log-likelihood as lm-eval's rolling windows compute it (one window here:
        the documents are far shorter than the context): every token given the ones before, the
        first given the end-of-text token."""
        ids = self.encode(text)
        rows = self.log_probs([self.eos, *ids])
        return float(sum(rows[i][t] for i, t in enumerate(ids)))

    def greedy(self, prompt: str, max_tokens: int, until: list[str]) -> str:
        from actors.target.decode import greedy_decode
        from actors.target.local import LocalTarget

        ids = greedy_decode(LocalTarget(self.model), [0], [self.encode(prompt)], max_tokens, eos_token_id=self.eos)[0]
        text = self.tok.decode([t for t in ids if t != self.eos])
        for stop in until:
            text = text.split(stop)[0]
        return text


# --- the clients --------------------------------------------------------------------------------

def lm_eval(base: str, out: pathlib.Path, ref: Reference) -> list[Check]:
    env = ensure_env("lmeval")
    checks = []
    for batch in (1, 4):
        dest = out / f"lmeval-bs{batch}"
        args = (f"model={MODEL},base_url={base}/v1/completions,tokenizer={TOKENIZER},tokenizer_backend=huggingface,"
                "num_concurrent=1,max_retries=2,timeout=120")
        rc = run_tool(env, ["lm_eval", "--model", "local-completions", "--model_args", args,
                            "--batch_size", str(batch), "--tasks", "dcut_code", "--include_path", "tests/interop/tasks",
                            "--log_samples", "--output_path", str(dest), "--seed", "0"],
                      out / f"lmeval-bs{batch}.log", timeout_s=1800)
        samples = {re.search(r"::(\w+?)_\d{4}-", p).group(1): jsonl(p)
                   for p in glob.glob(f"{dest}/**/samples_*.jsonl", recursive=True)}
        if rc != 0 or not samples:
            checks.append(Check(f"lm-eval (batch {batch})", "ran", False, f"exit {rc}, see lmeval-bs{batch}.log"))
            continue
        checks += lm_eval_checks(batch, samples, ref)
    return checks


def lm_eval_checks(batch: int, samples: dict[str, list[dict]], ref: Reference) -> list[Check]:
    """Each logged sample's answer against the reference."""
    name = f"lm-eval (batch {batch})"
    by_task = {task: [_parsed(s) for s in rows] for task, rows in samples.items()}
    worst, greedy_wrong, n = 0.0, 0, 0
    for s in by_task.get("dcut_code_mc", []):
        for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            got_ll, got_greedy = float(resp[0][0]), str(resp[0][1]) == "True"
            want_ll, want_greedy = ref.loglikelihood(args["arg_0"], args["arg_1"])
            worst = max(worst, abs(got_ll - want_ll))
            greedy_wrong += got_greedy != want_greedy
            n += 1
    checks = [Check(name, "loglikelihood (multiple choice) = a direct forward",
                    n > 0 and worst < 1e-4 and not greedy_wrong,
                    f"{n} requests, max abs diff {worst:.1e}, is_greedy differs in {greedy_wrong}")]
    worst, n = 0.0, 0
    for s in by_task.get("dcut_code_rolling", []):
        worst = max(worst, abs(float(s["resps"][0][0]) - ref.rolling(s["doc"]["text"])))
        n += 1
    checks.append(Check(name, "loglikelihood_rolling = a direct forward", n > 0 and worst < 1e-4,
                        f"{n} documents, max abs diff {worst:.1e}"))
    wrong, n = [], 0
    for s in by_task.get("dcut_code_gen", []):
        args = s["arguments"]["gen_args_0"]
        want = ref.greedy(args["arg_0"], args["arg_1"]["max_gen_toks"], args["arg_1"]["until"])
        wrong += [] if s["resps"][0][0] == want else [s["doc_id"]]
        n += 1
    checks.append(Check(name, "generate_until = the target's greedy output", n > 0 and not wrong,
                        f"{n} prompts, {len(wrong)} differ" + (f" (docs {wrong[:5]})" if wrong else "")))
    return checks


def _parsed(sample: dict) -> dict:
    """A logged sample with its fields as values: lm-eval 0.4 writes `doc`, `arguments` and
    `resps` as the repr of Python objects (literals only, read with ast.literal_eval)."""
    return {k: ast.literal_eval(v) if k in ("doc", "arguments", "resps") and isinstance(v, str) else v
            for k, v in sample.items()}


def guidellm(base: str, out: pathlib.Path) -> list[Check]:
    """Its default request shape (chat completions, streamed, with continuous usage statistics),
    one request at a time, 30 requests of synthetic text made with the server's tokenizer."""
    env = ensure_env("guidellm")
    dest = out / "guidellm"
    dest.mkdir(exist_ok=True)
    before = generated_tokens(base)
    rc = run_tool(env, ["guidellm", "run", "--backend", f"kind=openai_http,target={base}",
                        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=30",
                        "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
                        "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER}", "--disable-console-interactive"],
                  out / "guidellm.log", timeout_s=900, cwd=dest)
    sent = generated_tokens(base) - before
    report = dest / "benchmarks.json"
    if rc != 0 or not report.exists():
        return [Check("guidellm", "default run", False, f"exit {rc}, see guidellm.log")]
    bench = json.loads(report.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    counted = bench["metrics"]["output_token_count"]["successful"]["total_sum"]
    return [Check("guidellm", "default request shape (streamed, continuous usage stats), 30 requests",
                  totals["successful"] == 30 and not totals["errored"] and not totals["incomplete"],
                  f"{totals['successful']} successful, {totals['errored']} errored, {totals['incomplete']} incomplete"),
            Check("guidellm", "its output token count = the server's", counted == sent,
                  f"guidellm {counted:.0f}, server {sent:.0f}")]


def aiperf(base: str, out: pathlib.Path, ref: Reference) -> list[Check]:
    """Streamed completions, 4 at a time, twice. As aiperf sends them (sampled): every request
    answered, and the usage it read equal to the tokens the server counts. Greedy (its
    `--extra-inputs temperature:0`), with the raw responses kept: every streamed text equal to
    the target's own greedy continuation, and aiperf's own count of that text (the server's
    tokenizer) equal to the server's. Under sampling its own count is off by up to about 1 %
    either way, as it must be: re-tokenizing a sampled text merges pieces the model produced
    apart, and splits what a lone byte of a multi-byte character decodes to (U+FFFD)."""
    env = ensure_env("aiperf")
    checks = []
    for mode, extra in (("sampled", []), ("greedy", ["--extra-inputs", "temperature:0", "--export-level", "raw"])):
        dest = out / f"aiperf-{mode}"
        before = generated_tokens(base)
        rc = run_tool(env, ["aiperf", "profile", "--model", MODEL, "--url", base, "--endpoint-type", "completions",
                            "--streaming", "--tokenizer", TOKENIZER, "--request-count", "30", "--concurrency", "4",
                            "--synthetic-input-tokens-mean", "64", "--output-tokens-mean", "32", "--ui-type", "none",
                            *extra, "--artifact-dir", str(dest)], out / f"aiperf-{mode}.log", timeout_s=900,
                      offline=False)
        sent = generated_tokens(base) - before
        records = jsonl(dest / "profile_export.jsonl") if (dest / "profile_export.jsonl").exists() else []
        if rc != 0 or not records:
            checks.append(Check(f"aiperf ({mode})", "ran", False, f"exit {rc}, see aiperf-{mode}.log"))
            continue
        failed = sum(1 for r in records if r.get("error"))
        usage = sum(r["metrics"].get("usage_completion_tokens", {}).get("value", 0) for r in records)
        counted = sum(r["metrics"].get("output_sequence_length", {}).get("value", 0) for r in records)
        checks.append(Check(f"aiperf ({mode})", "streamed completions, 30 requests, 4 at a time",
                            len(records) == 30 and not failed, f"{len(records) - failed} successful, {failed} failed"))
        checks.append(Check(f"aiperf ({mode})", "the usage it read = the tokens the server sent", usage == sent,
                            f"aiperf {usage:.0f}, server {sent:.0f}; its own count of the text {counted:.0f}"))
        if mode == "greedy":
            wrong = sum(text != ref.greedy(prompt, max_tokens, []) for prompt, max_tokens, text in _streamed(dest))
            checks.append(Check("aiperf (greedy)", "every streamed text = the target's greedy output", not wrong,
                                f"{len(records) - wrong} of {len(records)} equal"))
            checks.append(Check("aiperf (greedy)", "its own count of the text = the server's", counted == sent,
                                f"aiperf {counted:.0f}, server {sent:.0f}"))
    return checks


def _streamed(dest: pathlib.Path) -> list[tuple[str, int, str]]:
    """(prompt, max_tokens, the text its stream carried) of each request of aiperf's raw export."""
    out = []
    for record in jsonl(dest / "profile_export_raw.jsonl"):
        payload = record["payload"]
        payload = ast.literal_eval(payload) if isinstance(payload, str) else payload
        text = ""
        for response in record["responses"]:
            for packet in response["packets"]:
                if packet["name"] == "data" and packet["value"].strip() != "[DONE]":
                    text += "".join(c.get("text") or "" for c in json.loads(packet["value"]).get("choices", []))
        out.append((payload["prompt"], payload["max_tokens"], text))
    return out


# Rules a request's schema cannot state (JSON Schema compares no two fields and compiles no
# pattern): a schema-valid body that breaks one is rightly a 400 with a message naming the rule.
BEYOND_SCHEMA = {
    "best_of: must be at least n": "best_of >= n (two fields compared)",
    "structured output:": "a regex, grammar or JSON schema that does not compile",
    "prompt:": "the prompt's length in tokens",
    "min_tokens: must not exceed max_tokens": "min_tokens <= max_tokens (two fields compared)",
    "n: ": "prompts × choices within the limit (two fields multiplied)",
}


def schemathesis(base: str, out: pathlib.Path) -> list[Check]:
    env = ensure_env("schemathesis")
    events = out / "schemathesis.ndjson"
    rc = run_tool(env, ["schemathesis", "run", f"{base}/openapi.json", "--checks", "all", "--max-examples", "40",
                        "--request-timeout", "120", "--workers", "1", "--seed", "0", "--no-color",
                        "--generation-database", "none",
                        "--report", "ndjson", "--report-ndjson-path", str(events)], out / "schemathesis.log",
                  timeout_s=1800)
    if not events.exists():
        return [Check("schemathesis", "ran", False, f"exit {rc}, see schemathesis.log")]
    s = summarise_schemathesis(events)
    beyond = ", ".join(f"{n} × {why}" for why, n in s["beyond_schema"].items())
    return [Check("schemathesis", "the served spec: no server error, no request without an answer",
                  s["server_errors"] == 0 and s["no_answer"] == 0,
                  f"{s['requests']} requests: {s['server_errors']} 5xx, {s['no_answer']} unanswered; "
                  f"statuses {s['statuses']}"),
            Check("schemathesis", "every other check (conformance, acceptance, rejection)", not s["failed_checks"],
                  (", ".join(f"{k}: {v}" for k, v in s["failed_checks"].items()) or "all passed")
                  + (f"; schema-valid but refused by a rule no schema states: {beyond}" if beyond else ""))]


def summarise_schemathesis(events: pathlib.Path) -> dict:
    """Statuses, 5xx, requests without an answer and failed checks of a run, from schemathesis's
    NDJSON events (each finished scenario records its cases' checks and interactions). A
    rejected schema-valid body whose error names a rule of BEYOND_SCHEMA is counted apart."""
    statuses: dict[int, int] = {}
    failed: dict[str, int] = {}
    beyond: dict[str, int] = {}
    requests = no_answer = 0
    for event in jsonl(events):
        recorder = event.get("ScenarioFinished", {}).get("recorder", {})
        interactions = recorder.get("interactions", {})
        for interaction in interactions.values():
            requests += 1
            response = interaction.get("response")
            if response is None:
                no_answer += 1
                continue
            statuses[response["status_code"]] = statuses.get(response["status_code"], 0) + 1
        for case, checks in recorder.get("checks", {}).items():
            for check in checks:
                if check["status"] != "failure":
                    continue
                rule = _rule_beyond_schema(interactions.get(case, {}).get("response"))
                if check["name"] == "positive_data_acceptance" and rule:
                    beyond[rule] = beyond.get(rule, 0) + 1
                else:
                    failed[check["name"]] = failed.get(check["name"], 0) + 1
    return {"requests": requests, "statuses": dict(sorted(statuses.items())), "no_answer": no_answer,
            "server_errors": sum(n for code, n in statuses.items() if code >= 500), "failed_checks": failed,
            "beyond_schema": beyond}


def _rule_beyond_schema(response: dict | None) -> str | None:
    if not response or response["status_code"] != 400 or "$base64" not in response.get("content", {}):
        return None
    try:
        message = json.loads(base64.b64decode(response["content"]["$base64"]))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return next((why for prefix, why in BEYOND_SCHEMA.items() if message.startswith(prefix)), None)


# --- the run ------------------------------------------------------------------------------------

CLIENTS = ("lmeval", "guidellm", "aiperf", "schemathesis")


def table(checks: list[Check]) -> str:
    rows = ["| client | check | result | measured |", "|---|---|---|---|"]
    rows += [f"| {c.client} | {c.what} | {'pass' if c.ok else '**FAIL**'} | {c.detail} |" for c in checks]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(CLIENTS), help=f"some of {','.join(CLIENTS)}")
    p.add_argument("--port", type=int, default=8149)  # no test module listens there
    p.add_argument("--out", default="runs/interop")
    args = p.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for tool in only:  # before the server starts: installing takes minutes the first time
        ensure_env(tool)
    ref = Reference() if {"lmeval", "aiperf"} & set(only) else None
    checks: list[Check] = []
    t0 = time.time()
    with served(args.port, out / "server.log") as base:
        for tool in only:
            t = time.time()
            try:
                got = {"lmeval": lambda: lm_eval(base, out, ref), "aiperf": lambda: aiperf(base, out, ref),
                       "guidellm": lambda: guidellm(base, out), "schemathesis": lambda: schemathesis(base, out)}[tool]()
            except Exception as exc:  # one client's crash is its row, not the end of the run
                got = [Check(tool, "ran", False, f"{type(exc).__name__}: {exc}")]
            checks += got
            checks.append(Check(tool, "the server serves after it", still_serving(base), f"{time.time() - t:.0f} s"))
    (out / "results.json").write_text(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    (out / "results.md").write_text(table(checks))
    print(table(checks))
    print(f"[interop] {sum(c.ok for c in checks)} of {len(checks)} checks passed in {time.time() - t0:.0f} s")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
