"""Plain decoding through DeepSpeed-MII beside this engine's, on one Mixtral-layout checkpoint
(issue #26 item 7; tests/gpu/run.sh's `mii-peer` check).

DeepSpeed-MII (FastGen: a blocked KV cache, continuous batching, Dynamic SplitFuse, its own CUDA
kernels) is the design card's package for a GPU deployment and the plain-decoding peer a user of
such a deployment would run instead. It runs only on CUDA in fp16/bf16 (docs/dependencies.md), so
it is measured where a GPU is lent, as one more row beside the bare loop and transformers
(`benchmarks/peer.py`). MII serves Mixtral but not the bundled demo's Qwen3-MoE layout, so the
script writes a Mixtral-layout checkpoint (transformers' `MixtralForCausalLM`, random weights with
peaked logits so greedy is not decided by rounding, the bundle's tokenizer beside it: MII loads
its tokenizer from the checkpoint) and decodes the same prompts through both, each backend in a
process of its own (MII sets up torch.distributed; the engine its Ray):

- `mii`: `mii.pipeline(checkpoint)`, greedy, EOS ignored, in waves of C prompts;
- `engine`: this engine as `dcut serve --model CHECKPOINT` builds it (`ar`, and `dcut` with the
  n-gram kind), the same waves; `dcut`'s outputs must equal `ar`'s (exit 1 if not).

Reported per (system, C): tok/s, × MII's, and how many outputs' text equals MII's (bf16 kernels
part at near-ties: informative, not a failure). Exit status: 0 measured; 3 when deepspeed-mii or
CUDA is absent — nothing measured (the `gpu` extra is optional: run.sh records NOT RUN); 1 when an
output of `dcut` differs from `ar`'s or a backend fails.

    DCUT_GPUS_PER_RANK=1 .venv/bin/python benchmarks/mii_peer.py --out runs/mii-peer
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()  # before Ray is imported: a local Ray listens on 127.0.0.1 only

from deployments.bundle import BUNDLED  # noqa: E402

# (hidden, layers, heads, kv heads, expert width): GPU-sized for FastGen's kernels (head_dim 128), or a
# tiny one for the CPU test of the engine's half.
SHAPES = {"gpu": (1024, 4, 8, 8, 2048), "tiny": (64, 2, 4, 2, 64)}


def write_checkpoint(path: pathlib.Path, shape: str, dtype: str, seed: int = 0) -> str:
    """A Mixtral-layout checkpoint with the bundle's tokenizer beside it; returns its folder."""
    import torch
    import transformers

    hidden, layers, heads, kv, width = SHAPES[shape]
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(BUNDLED / "tokenizer.json")).get_vocab_size()
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=width,
                                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                                     rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None,
                                     pad_token_id=0, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: greedy is not decided by rounding
    model.to(getattr(torch, dtype)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, path / name)
    return str(path)


def prompts(n: int) -> list[str]:
    from deployments.trace_command import workload

    return list(workload("mixed", n, 23, 11))


def run_mii(ckpt: str, texts: list[str], levels: list[int], max_tokens: int) -> list[dict]:
    import mii

    pipe = mii.pipeline(ckpt)
    pipe(texts[:2], max_new_tokens=4, do_sample=False, ignore_eos=True)  # warm-up
    rows = []
    for c in levels:
        out, wall = [], 0.0
        for i in range(0, len(texts), c):
            t0 = time.perf_counter()
            got = pipe(texts[i:i + c], max_new_tokens=max_tokens, do_sample=False, ignore_eos=True)
            wall += time.perf_counter() - t0
            out += [(r.generated_text, r.generated_length) for r in got]
        rows.append({"system": "mii", "concurrency": c, "tokens": sum(n for _, n in out), "wall_s": wall,
                     "texts": [t for t, _ in out]})
    pipe.destroy()
    return rows


def run_engine(ckpt: str, texts: list[str], levels: list[int], max_tokens: int) -> list[dict]:
    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.sequence import SamplingParams
    from actors.ray_env import start_local_ray
    from deployments.settings import ServeSettings

    tok = Tokenizer.from_file(str(pathlib.Path(ckpt) / "tokenizer.json"))
    ids = [tok.encode(t).ids for t in texts]
    settings = ServeSettings(model_root=ckpt, drafter="ngram", block=8, max_running=max(levels))
    start_local_ray(num_cpus=settings.local_cpus())
    rows = []
    for policy in ("ar", "dcut"):
        eng = Engine(settings.model_copy(update={"policy": policy}).engine_config())
        try:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            eng.generate(ids[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)  # warm-up
            for c in levels:
                out, wall = [], 0.0
                for i in range(0, len(ids), c):
                    t0 = time.perf_counter()
                    out += [s.output for s in eng.generate(ids[i:i + c], [params] * len(ids[i:i + c]))]
                    wall += time.perf_counter() - t0
                rows.append({"system": f"engine {policy}", "concurrency": c, "tokens": sum(map(len, out)),
                             "wall_s": wall, "outputs": out, "texts": [tok.decode(o) for o in out]})
        finally:
            eng.shutdown()
    return rows


def table(rows: list[dict]) -> str:
    """Per (system, C): tok/s, × MII's and outputs whose text equals MII's (where MII ran)."""
    mii = {r["concurrency"]: r for r in rows if r["system"] == "mii"}
    lines = ["| system | C | tok/s | × MII | same text as MII |", "|---|---|---|---|---|"]
    for r in rows:
        rate = r["tokens"] / r["wall_s"]
        peer = mii.get(r["concurrency"])
        x = f"{rate / (peer['tokens'] / peer['wall_s']):.2f}" if peer else ""
        same = f"{sum(a == b for a, b in zip(r['texts'], peer['texts'], strict=True))} / {len(r['texts'])}" \
            if peer else ""
        lines.append(f"| {r['system']} | {r['concurrency']} | {rate:.0f} | {x} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="mii,engine", help="comma list: mii, engine")
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    p.add_argument("--dtype", default="bfloat16", help="the checkpoint's dtype (MII: bfloat16 or float16)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="runs/mii-peer")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one backend, in this process: writes OUT/BACKEND.json
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.child:
        run = {"mii": run_mii, "engine": run_engine}[args.child]
        rows = run(str(out / "checkpoint"), prompts(args.num_prompts), levels, args.max_tokens)
        (out / f"{args.child}.json").write_text(json.dumps(rows))
        return 0
    backends = args.backends.split(",")
    if "mii" in backends:
        import importlib.util

        import torch

        if importlib.util.find_spec("mii") is None or not torch.cuda.is_available():
            print("mii-peer: NOT RUN — deepspeed-mii needs CUDA and the `gpu` extra (pip install '.[gpu]')")
            return 3
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out / "checkpoint", args.shape, args.dtype)
    for b in backends:  # a process each: MII sets up torch.distributed, the engine its Ray
        proc = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", b],
                              capture_output=True, text=True)
        (out / f"{b}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"mii-peer: the {b} backend failed (exit {proc.returncode}); see {out / (b + '.log')}")
            return 1
    rows = [r for b in backends for r in json.loads((out / f"{b}.json").read_text())]
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(table(rows))
    print(table(rows))
    by = {(r["system"], r["concurrency"]): r for r in rows}
    differ = [c for c in levels if ("engine ar", c) in by
              and by["engine dcut", c]["outputs"] != by["engine ar", c]["outputs"]]
    if differ:
        print(f"mii-peer: dcut's outputs differ from ar's at C = {differ}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
