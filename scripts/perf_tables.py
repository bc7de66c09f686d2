"""scripts/perf-gpu's tables beside the float rows: the same decode rows with the weights
quantized (`--quantize`), and with speculative decoding's measuring drafters (`--speculative`)."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from devtools.shapes import fp8_block_checkpoint, int4_checkpoint
from perf_serve import bench, serve, stop, words_for


@contextmanager
def warm_server(args, served: Path, slots: int, tp: int, name: str, **settings):
    """A server of ``served`` without the prefix cache (the rows repeat one prompt), warmed up:
    its URL and model id."""
    proc, url, ready = serve(served, tp, slots, args.long_prompt + 512, args.device,
                             args.work / f"server-{name}-tp{tp}.log", caching=False, **settings)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        print(f"[perf] {name} tp={tp}: serve -> healthy in {ready:.1f} s", flush=True)
        bench(url, model, args.work / "warm.jsonl", "--concurrency", "1", "--requests", "2", "--max-tokens", "8")
        yield url, model
    finally:
        stop(proc)


def quantized_rows(args, model_dir: Path, levels: list[int], rows: list[dict], info: dict) -> None:
    """The decode rows again with the weights quantized in situ at load, at each TP size against
    this run's float rows at the same TP size."""
    for tp in info:
        quantized_table(args, model_dir, levels, rows, info, tp)


def quantized_table(args, model_dir: Path, levels: list[int], rows: list[dict], info: dict, tp: int) -> None:
    base = {r["concurrency"]: r for r in rows if r["tp"] == tp and r["kind"] == "decode"}
    ttft = [r["ttft_p50"] for r in rows if r["tp"] == tp and r["kind"] == "ttft"]
    if ttft:
        base["ttft"] = sorted(ttft)[len(ttft) // 2]
    table = [("float", info[tp], base)]
    for scheme in args.quantize.split(","):
        served, insitu = model_dir, scheme
        if scheme in ("fp8-block", "awq", "gptq"):  # the publishers' forms, not quantized at load
            served, insitu = model_dir.with_name(f"{model_dir.name}-{scheme}"), ""
            if not (served / "config.json").exists():
                t0 = time.perf_counter()
                if scheme == "fp8-block":
                    fp8_block_checkpoint(model_dir, served, device=args.device)
                else:
                    int4_checkpoint(model_dir, served, scheme, device=args.device)
                print(f"[perf] wrote {served} in {time.perf_counter() - t0:.1f} s", flush=True)
        with warm_server(args, served, max(levels), tp, scheme, quantize=insitu) as (url, model):
            got = {}
            for c in levels:
                got[c] = bench(url, model, args.work / f"{scheme}-tp{tp}-c{c}.jsonl", "--concurrency", str(c),
                               "--max-tokens", str(args.max_tokens), "--workers", str(min(8, max(1, c // 8))))[0]
            if args.long_prompt:
                ttft = sorted(r["ttft_p50"] for r in bench(
                    url, model, args.work / f"{scheme}-tp{tp}-ttft.jsonl", "--concurrency", "1", "--requests", "3",
                    "--max-tokens", "2", "--prompt-words", str(words_for(model_dir, args.long_prompt))))
                got["ttft"] = ttft[len(ttft) // 2]
            table.append((scheme, httpx.get(f"{url}/models").json()["models"][0], got))
    one = levels[0]
    print(f"\nquantized in situ, TP={tp} ({args.shape}); x float: the same level's out tok/s against the float rows "
          f"at TP={tp}; c{one} decode: one stream's tokens a second between its first token and its last (stream "
          f"tok/s), and c{one} ttft its prompt's time to first token, each against float's")
    long = f"ttft {args.long_prompt}" if "ttft" in base else ""
    print(f"{'weights':>8} {'resident GB':>11} " + " ".join(f"{'c' + str(c):>16}" for c in levels)
          + f" {'c' + str(one) + ' decode':>16} {'c' + str(one) + ' ttft':>14} {long:>14}  packing")
    for name, m, got in table:
        cells = " ".join(f"{got[c]['output_tok_s']:>8.1f} {got[c]['output_tok_s'] / base[c]['output_tok_s']:>5.2f}x "
                         for c in levels)
        stream = got[one]["per_stream_decode_tok_s"]
        cells += f" {stream:>8.1f} {stream / base[one]['per_stream_decode_tok_s']:>5.2f}x "
        cells += f" {got[one]['ttft_p50'] * 1e3:>7.1f} ms {got[one]['ttft_p50'] / base[one]['ttft_p50']:>4.2f}x"
        if long:
            cells += f" {got['ttft'] * 1e3:>7.1f} ms {got['ttft'] / base['ttft']:>4.2f}x"
        print(f"{name:>8} {sum(m['shard_bytes']) / 1e9:>11.2f} {cells}  {m['packing']}")
    (args.work / f"perf-quant-tp{tp}.json").write_text(
        json.dumps({name: {"model": m, "rows": got} for name, m, got in table}))


def speculative_table(args, model_dir: Path, levels: list[int], rows: list[dict], tp: int) -> None:
    """The decode rows again with speculative decoding's measuring drafters (``replay``: the
    greedy answer recorded at one stream, then each level's own after a first pass at it, every
    draft right where the model repeats it;
    ``random``: every draft wrong), ``--spec-tokens`` drafts a decode, against this run's rows
    without drafts at the same TP size."""
    base = {r["concurrency"]: r for r in rows if r["tp"] == tp and r["kind"] == "decode"}
    out = {}
    for method in args.speculative.split(","):
        setting = f"method={method},tokens={args.spec_tokens}"
        if method == "replay":
            setting += f",replay={args.work / f'replay-tp{tp}.jsonl'}"
        with warm_server(args, model_dir, max(levels), tp, f"spec-{method}", speculative=setting) as (url, model):
            got = {}
            for c in levels:
                # a first pass: replay's answers as this server computes them with drafts, recorded;
                # and for every method, the kernels of its drafting steps' shapes compiled
                bench(url, model, args.work / "settle.jsonl", "--concurrency", str(c), "--max-tokens",
                      str(args.max_tokens), "--requests", str(max(4, 2 * c)))
                before = httpx.get(f"{url}/models").json()["models"][0]["speculative"]
                row = bench(url, model, args.work / f"spec-{method}-tp{tp}-c{c}.jsonl", "--concurrency", str(c),
                            "--max-tokens", str(args.max_tokens), "--workers", str(min(8, max(1, c // 8))))[0]
                after = httpx.get(f"{url}/models").json()["models"][0]["speculative"]
                row["spec"] = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
                got[c] = row
            out[method] = got
    print(f"\nspeculative decoding, TP={tp} ({args.shape}), {args.spec_tokens} drafts a decode at most; x: against "
          f"the rows without drafts; stream: one stream's tok/s between its first token and its last")
    print(f"{'drafter':>8} {'conc':>5} {'out tok/s':>10} {'x':>6} {'stream tok/s':>12} {'x':>6} {'itl p99':>8} "
          f"{'drafts':>7} {'accepted':>9}")
    for method, got in out.items():
        for c in levels:
            r, b, sp = got[c], base[c], got[c]["spec"]
            acc = f"{100 * sp['accepted_tokens'] / sp['draft_tokens']:.0f}%" if sp["draft_tokens"] else "-"
            print(f"{method:>8} {c:>5} {r['output_tok_s']:>10.1f} {r['output_tok_s'] / b['output_tok_s']:>5.2f}x "
                  f"{r['per_stream_decode_tok_s']:>12.1f} "
                  f"{r['per_stream_decode_tok_s'] / b['per_stream_decode_tok_s']:>5.2f}x "
                  f"{r['itl_p99'] * 1e3:>6.2f}ms {sp['draft_tokens']:>7} {acc:>9}")
    (args.work / f"perf-spec-tp{tp}.json").write_text(json.dumps(out))
