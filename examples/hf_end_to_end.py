"""End-to-end step time of a Hugging Face Llama with and without rope_ops.

A real-size configuration (Llama-3-8B shapes, llama3 frequency scaling, 2 decoder layers,
random weights, bf16) on CUDA, or a small one on the CPU. For each mode -- ``hf`` (transformers'
own rotary code), ``rope_ops`` (``patch(model)``: rope_ops rotates with the model's cos/sin) and
``rope_ops_exact`` (``patch(model, exact=True)``: angles from positions and float64
frequencies) -- it times:

- a training step: forward with labels, backward (gradients of every parameter);
- inference: a prefill of the prompt with a KV cache, then single-token decode steps.

and reports the median times, peak memory of the training step, and how far each mode's logits
are from ``hf``'s on the same weights. All modes run on the same model (patched, then undone).

    python examples/hf_end_to_end.py                       # CUDA when available, else --size small
    python examples/hf_end_to_end.py --size small --device cpu --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time

import torch

SIZES = {
    # Llama-3-8B: 32 q / 8 kv heads of 128, hidden 4096, MLP 14336, vocab 128256, theta 500000.
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192},
           "batch": 1, "seq": 4096, "prompt": 2048, "decode": 16},
    "small": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "batch": 2, "seq": 256, "prompt": 128, "decode": 8},
}
MODES = ("hf", "rope_ops", "rope_ops_exact")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), help="default: 8b on CUDA, small elsewhere")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, help="training and prefill batch")
    parser.add_argument("--seq", type=int, help="training sequence length")
    parser.add_argument("--prompt", type=int, help="prefill length")
    parser.add_argument("--decode", type=int, help="decode steps after the prefill")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (after one warm-up)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--backend", help="rope_ops backend request (default: ROPE_OPS_BACKEND or auto)")
    parser.add_argument("--attn", default="sdpa", help="transformers attn_implementation")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: unknown {unknown}; expected a comma list of {MODES}")
    args.modes = modes
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.size is None:
        args.size = "8b" if args.device.startswith("cuda") else "small"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for name in ("layers", "repeats", "batch", "seq", "prompt", "decode"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "decode" else 1):
            parser.error(f"--{name}: expected a positive int, got {value}")
    return args


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: v for k, v in SIZES[args.size].items() if k not in ("batch", "seq", "prompt", "decode")}
    config = LlamaConfig(**shape, num_hidden_layers=args.layers, attn_implementation=args.attn)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> list[float]:
    fn()  # warm-up: first-call costs (selection, table builds, allocator) are not the step's
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run_mode(model, args, sizes, tokens, prompt) -> dict:
    from transformers import DynamicCache

    device = args.device
    params = [p for p in model.parameters() if p.requires_grad]
    result = {}

    def train_step():
        for p in params:
            p.grad = None
        loss = model(tokens, labels=tokens).loss
        loss.backward()

    model.train()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    train = timed(train_step, device, args.repeats)
    result["train_step_ms"] = statistics.median(train)
    if device.startswith("cuda"):
        result["train_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for p in params:
        p.grad = None

    model.eval()
    with torch.inference_mode():
        result["logits"] = model(tokens[:, : min(tokens.shape[1], 512)]).logits.float()

        # transformers renamed the cache argument (past_key_values -> cache)
        cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

        def prefill():
            cache = DynamicCache(config=model.config)
            out = model(prompt, use_cache=True, **{cache_name: cache})
            return cache, out.logits[:, -1:].argmax(-1)

        def decode() -> float:
            """ms for the decode steps after a prefill (the prefill is not counted)."""
            cache, next_token = prefill()
            sync(device)
            start = time.perf_counter()
            for _ in range(sizes["decode"]):
                out = model(next_token, use_cache=True, **{cache_name: cache})
                next_token = out.logits[:, -1:].argmax(-1)
            sync(device)
            return (time.perf_counter() - start) * 1e3

        prefill_times = timed(prefill, device, args.repeats)
        decode_times = [decode() for _ in range(args.repeats + 1)][1:]  # the first is a warm-up
    result["prefill_ms"] = statistics.median(prefill_times)
    result["decode_step_ms"] = statistics.median(decode_times) / max(sizes["decode"], 1)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    import rope_ops
    from rope_ops.integrations.transformers import patch

    sizes = {k: SIZES[args.size][k] for k in ("batch", "seq", "prompt", "decode")}
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    model = build_model(args)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (sizes["batch"], sizes["seq"]), generator=gen).to(args.device)
    prompt = torch.randint(0, vocab, (sizes["batch"], sizes["prompt"]), generator=gen).to(args.device)

    # The backends rope_ops picks for the two kinds of call the modes make, forward and backward.
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    probe = torch.zeros(1, 1, 1, head_dim, dtype=model.dtype, device=args.device, requires_grad=True)
    with rope_ops.use_backend(args.backend):
        tables_backend = rope_ops.select_backend(probe, probe, None, layout="bhsd",
                                                 cos_sin=(probe[0, 0].detach(), probe[0, 0].detach()))
        positions_backend = rope_ops.select_backend(probe, probe, torch.zeros(1, 1, dtype=torch.int64,
                                                                                device=args.device),
                                                    layout="bhsd", base=10000.0)
    info = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "backend_model_tables": tables_backend, "backend_exact": positions_backend,
            "size": args.size, "layers": args.layers, "dtype": args.dtype,
            "attn": args.attn, "repeats": args.repeats, **sizes,
            "params": sum(p.numel() for p in model.parameters())}
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)

    started = time.perf_counter()
    results = {}
    with rope_ops.use_backend(args.backend):
        for mode in args.modes:
            if mode == "hf":
                results[mode] = run_mode(model, args, sizes, tokens, prompt)
            else:
                with patch(model, exact=mode == "rope_ops_exact"):
                    results[mode] = run_mode(model, args, sizes, tokens, prompt)
            print(f"  {mode}: done", flush=True)

    reference = results.get("hf", {}).get("logits")
    for result in results.values():
        logits = result.pop("logits")
        if reference is not None:
            result["logits_max_abs_diff_vs_hf"] = float((logits - reference).abs().max())

    print(f"\n{'mode':<16}{'train step ms':>15}{'prefill ms':>12}{'decode ms/step':>16}{'peak GiB':>10}"
          f"{'vs hf train':>13}{'|logits - hf|':>15}")
    base = results.get("hf")
    for mode, r in results.items():
        ratio = f"{base['train_step_ms'] / r['train_step_ms']:.3f}x" if base else "-"
        peak = f"{r['train_peak_gib']:.2f}" if "train_peak_gib" in r else "-"
        diff = f"{r['logits_max_abs_diff_vs_hf']:.2e}" if "logits_max_abs_diff_vs_hf" in r else "-"
        print(f"{mode:<16}{r['train_step_ms']:>15.2f}{r['prefill_ms']:>12.2f}{r['decode_step_ms']:>16.3f}"
              f"{peak:>10}{ratio:>13}{diff:>15}")
    print(f"(measured in {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
