"""Benchmark 1: the codec's ratio, error and speed against a plain buffer copy.

Inputs: real outer gradients (the difference of two checkpoints of a short training run
of the built-in GPT) and a larger synthetic set with the same value distribution
(resampled from the real values with random signs).  For every codec and zstandard
level: compression ratio against raw fp32, relative L2 error, and encode/decode rates in
fp32 input bytes on one thread, each measured side by side with ``dst.copy_(src)`` of the
same buffer (the physical reference); medians of repeats.

    python -m bench.codec            # the full run (>= 100 MB synthetic)
    python -m bench.codec --quick    # about a minute
"""

from __future__ import annotations

import argparse

import torch

from bench._common import benchmark_parser, copy_seconds, median, print_table, seconds, write_and_report
from diloco_cli.codec import Codec, CodecSpec, RunSecret, decode_payload, encode_payload
from diloco_cli.data.corpora import builtin_corpus
from diloco_cli.data.text import TextSplit, random_batch
from diloco_cli.models.gpt import byte_gpt
from diloco_cli.training.inner import inner_step, make_inner_optimizer

TARGETS = {
    "int4_zstd_ratio_real": 7.5,
    "int8_zstd_ratio_real": 3.8,
    "int4_encode_vs_copy": 0.15,
    "int4_decode_vs_copy": 0.25,
}


def real_outer_gradients(steps_per_round: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Theta after one round of AdamW minus Theta after the next: an outer gradient."""
    torch.manual_seed(seed)
    model = byte_gpt()
    optimizer = make_inner_optimizer(model, 3e-3, 0.1, (0.9, 0.95))
    shard = TextSplit.of(builtin_corpus("shakespeare"), 0.05, 128).share(0, 4, seed=0)
    generator = torch.Generator().manual_seed(seed)

    def train(steps: int) -> None:
        for _ in range(steps):
            inner_step(model, optimizer, *random_batch(shard, 16, 128, generator), 3e-3)

    train(steps_per_round)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train(steps_per_round)
    return {name: before[name] - p.detach() for name, p in model.named_parameters()}


def synthetic_like(real: dict[str, torch.Tensor], megabytes: int, seed: int = 1) -> torch.Tensor:
    """A large buffer with the real gradients' statistics, tensor by tensor: each real
    tensor is scaled up to its share of the size by resampling its own values with
    random signs, so block-local magnitudes look like the real ones."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(t.numel() for t in real.values())
    count = megabytes * (1 << 20) // 4
    shares = [count * t.numel() // total for t in real.values()]
    shares[shares.index(max(shares))] += count - sum(shares)
    parts = []
    for tensor, share in zip(real.values(), shares):
        values = tensor.reshape(-1)
        picks = values[torch.randint(0, len(values), (share,), generator=generator)]
        signs = torch.randint(0, 2, (share,), generator=generator).float().mul_(2).sub_(1)
        parts.append(picks.mul_(signs))
    return torch.cat(parts)


def naive_int4(values: torch.Tensor, block: int) -> torch.Tensor:
    """The straightforward torch quantizer over the whole buffer (a baseline)."""
    blocks = values.view(-1, block)
    scale = blocks.abs().amax(1, keepdim=True) / 7
    levels = torch.round(blocks / scale).clamp(-7, 7).to(torch.int8) + 8
    pairs = levels.view(-1, 2).to(torch.uint8)
    return pairs[:, 0] | (pairs[:, 1] << 4)


TOPK_3_PERCENT = {"block_size": 256, "keep_per_block": 8}
"""top-k as SparseLoCo sends it: 3% of the values (8 of each block of 256)."""


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    secret = RunSecret.generate()
    real = real_outer_gradients(args.train_steps)
    real_bytes = sum(t.numel() * 4 for t in real.values())
    synthetic = synthetic_like(real, args.synthetic_mb)
    destination = torch.empty_like(synthetic)
    decoded = torch.empty_like(synthetic)
    rows = []
    for codec in Codec:
        for level in (0, 1, 3):
            spec = CodecSpec(codec=codec, zstd_level=level, **(TOPK_3_PERCENT if codec is Codec.TOPK else {}))
            real_payload = encode_payload(real.items(), spec, secret)
            real_decoded = decode_payload(real_payload, secret).tensors
            real_error = float(
                torch.cat([(real_decoded[n] - t).reshape(-1) for n, t in real.items()]).norm()
                / torch.cat([t.reshape(-1) for t in real.values()]).norm()
            )
            encode_ratios, decode_ratios, encode_rates, decode_rates, copy_rates = [], [], [], [], []
            payload = b""
            for _ in range(args.repeats):
                copy = copy_seconds(synthetic, destination)
                holder = {}
                encode = seconds(
                    lambda holder=holder, spec=spec: holder.setdefault(
                        "p", encode_payload([("x", synthetic)], spec, secret)
                    )
                )
                payload = holder["p"]
                decode = seconds(lambda payload=payload: decode_payload(payload, secret, into={"x": decoded}))
                encode_ratios.append(copy / encode)
                decode_ratios.append(copy / decode)
                encode_rates.append(synthetic.numel() * 4 / encode / 1e6)
                decode_rates.append(synthetic.numel() * 4 / decode / 1e6)
                copy_rates.append(synthetic.numel() * 4 / copy / 1e6)
            rows.append(
                {
                    "codec": codec.value,
                    "zstd": level,
                    "ratio_real": real_bytes / len(real_payload),
                    "error_real": real_error,
                    "ratio_synthetic": synthetic.numel() * 4 / len(payload),
                    "error_synthetic": float((decoded - synthetic).norm() / synthetic.norm()),
                    "encode_MBps": median(encode_rates),
                    "decode_MBps": median(decode_rates),
                    "copy_MBps": median(copy_rates),
                    "encode_vs_copy": median(encode_ratios),
                    "decode_vs_copy": median(decode_ratios),
                }
            )
            print(f"  {codec.value:5} zstd {level}: done", flush=True)
    naive_ratios = []
    for _ in range(args.repeats):
        copy = copy_seconds(synthetic, destination)
        naive_ratios.append(copy / seconds(lambda: naive_int4(synthetic, 64)))
    return {"rows": rows, "naive_int4_encode_vs_copy": median(naive_ratios), "real_fp32_bytes": real_bytes}


def verdicts(results: dict) -> dict[str, dict]:
    by = {(r["codec"], r["zstd"]): r for r in results["rows"]}
    found = {
        "int4_zstd_ratio_real": by[("int4", 1)]["ratio_real"],
        "int8_zstd_ratio_real": by[("int8", 1)]["ratio_real"],
        "int4_encode_vs_copy": by[("int4", 1)]["encode_vs_copy"],
        "int4_decode_vs_copy": by[("int4", 1)]["decode_vs_copy"],
    }
    return {
        name: {"target": TARGETS[name], "measured": found[name], "met": found[name] >= TARGETS[name]}
        for name in TARGETS
    }


def main(argv: list[str] | None = None) -> dict:
    args = benchmark_parser(__doc__, "a small run for the test suite (~1 minute)").parse_args(argv)
    args.train_steps = 10 if args.quick else 50
    args.synthetic_mb = 16 if args.quick else 128
    args.repeats = 3 if args.quick else 7
    results = measure(args)
    results["targets"] = verdicts(results)
    settings = {
        "train_steps_per_round": args.train_steps,
        "synthetic_mb": args.synthetic_mb,
        "repeats": args.repeats,
        "block_size": 64,
        "threads": 1,
    }
    print_table(
        results["rows"],
        [
            "codec",
            "zstd",
            "ratio_real",
            "error_real",
            "ratio_synthetic",
            "encode_MBps",
            "decode_MBps",
            "encode_vs_copy",
            "decode_vs_copy",
        ],
    )
    print(f"naive torch int4 encode: {results['naive_int4_encode_vs_copy']:.3f}x copy")
    for name, verdict in results["targets"].items():
        print(
            f"{name}: {verdict['measured']:.3f} (target >= {verdict['target']}) {'met' if verdict['met'] else 'MISSED'}"
        )
    write_and_report("codec", args, settings, results)
    return results


if __name__ == "__main__":
    main()
