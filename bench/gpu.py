"""Benchmark: the GPU learner's building blocks on one CUDA device.

In under five minutes on one GPU:

* **training speed**: tokens/s and model FLOPs utilisation (MFU) of the inner step
  (``prepare_model`` + ``inner_step`` with AdamW, clipping and bf16 autocast) for the
  default recipe's model and for a ~134M-parameter Llama (``transformers``'
  ``LlamaForCausalLM`` built offline from a config: hidden 768, 12 layers, 12 heads,
  intermediate 2048, vocabulary 32000, context 1024), eager and compiled.  FLOPs per
  token are 6 N (N: the weights of every matrix multiply) plus the attention term
  12 L d T (PaLM, arXiv 2204.02311, appendix B), against the device's peak dense bf16
  FLOPs from :data:`PEAK_BF16_TFLOPS` (MFU unknown for a device not in the table);
* **exactness on the device**: ``install_parameters`` then ``full_parameters`` gives back
  the installed tensors bit for bit; a payload encoded from device tensors is the very
  payload encoded from their CPU copies, and decodes to the same values;
* **the codec on device tensors**: encode (the copy off the device included) and decode
  (the copy onto the device included) in MB/s of fp32 values, on the outer gradient the
  Llama's timed steps made.

A learner of several processes (DDP, FSDP2) is measured by ``bench.gpu_distributed``,
two learners on one host by ``bench.gpu_learners``; ``bench/gpu_check.sh`` runs all three.

    python -m bench.gpu                        # needs CUDA; without it says so and exits 0
    python -m bench.gpu --device cpu --quick   # the same code paths at tiny sizes (the tests)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from bench._common import benchmark_parser, median, print_table, seconds, write_and_report
from diloco_cli.codec import Codec, CodecSpec, RunSecret, decode_payload, encode_payload
from diloco_cli.config.recipe import ModelConfig, Recipe
from diloco_cli.runtime.distributed import ProcessGroup, full_parameters, install_parameters, prepare_model
from diloco_cli.training.inner import inner_step, make_inner_optimizer

PEAK_BF16_TFLOPS = [
    (r"H100 PCIe", 756.0),
    (r"H100", 989.0),
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"\bL4\b", 121.0),
    (r"A10G", 125.0),
    (r"RTX 4090", 165.0),
]
"""Dense bf16 tensor-core peaks (vendor datasheets, without sparsity), by a pattern of
``torch.cuda.get_device_name``; the first match wins (H100 PCIe before the SXM H100)."""

ONE_PROCESS = ProcessGroup()
LEARNING_RATE = 3e-4
GRADIENT_CLIP = 1.0


@dataclass(frozen=True)
class TrainingCase:
    """One model trained for timing: how to build it and the shape of its work."""

    name: str
    build: Callable[[], torch.nn.Module]
    vocabulary: int
    num_layers: int
    width: int
    sequence_length: int
    batch_size: int
    steps: int
    warmup_steps: int
    micro_batch_size: int | None = None
    compile: bool = False
    precision: str = "bf16"


LLAMA_134M = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 2048,
    "max_position_embeddings": 1024,
}
TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 32,
}
TINY_GPT = ModelConfig(kwargs={"num_layers": 1, "width": 32, "num_heads": 2, "context": 32})


def llama(shape: dict[str, int]) -> torch.nn.Module:
    """A Llama causal LM from a config alone (random weights, nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape, num_key_value_heads=shape["num_attention_heads"], tie_word_embeddings=False, use_cache=False
    )
    return LlamaForCausalLM(config)


def training_cases(quick: bool, steps: int = 200) -> list[TrainingCase]:
    """The default recipe's model at the recipe's batch, and the Llama at 16 sequences of
    1024 tokens in micro-batches of 8, eager and compiled; ``steps`` timed steps each.
    ``quick``: tiny models, 3 steps, nothing compiled (inductor is slow on a CPU)."""
    if quick:
        gpt, gpt_batch, gpt_sequence, shape, llama_batch, micro_batch, steps, warmup = (
            TINY_GPT,
            4,
            32,
            TINY_LLAMA,
            4,
            2,
            3,
            1,
        )
    else:
        recipe = Recipe()
        gpt, gpt_batch, gpt_sequence = recipe.model, recipe.training.batch_size, recipe.data.sequence_length
        shape, llama_batch, micro_batch, warmup = LLAMA_134M, 16, 8, 10
    layers, width = gpt.kwargs["num_layers"], gpt.kwargs["width"]
    default = TrainingCase(
        f"default gpt {layers}x{width}", gpt.build, 256, layers, width, gpt_sequence, gpt_batch, steps, warmup
    )
    eager = TrainingCase(
        f"llama {shape['hidden_size']}x{shape['num_hidden_layers']}",
        lambda: llama(shape),
        shape["vocab_size"],
        shape["num_hidden_layers"],
        shape["hidden_size"],
        shape["max_position_embeddings"],
        llama_batch,
        steps,
        warmup,
        micro_batch_size=micro_batch,
    )
    return [default, eager] if quick else [default, eager, replace(eager, name=f"{eager.name} compiled", compile=True)]


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s from :data:`PEAK_BF16_TFLOPS`; None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops * 1e12
    return None


def matmul_parameters(model: torch.nn.Module) -> int:
    """Weights that enter a matrix multiply (every ``nn.Linear``, the output head
    included); embedding lookups cost no FLOPs."""
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def flops_per_token(model: torch.nn.Module, case: TrainingCase) -> float:
    """Forward and backward: 6 N, plus attention's 12 L d T (PaLM, appendix B)."""
    return 6 * matmul_parameters(model) + 12 * case.num_layers * case.width * case.sequence_length


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock around it measures the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_and_time(case: TrainingCase, device: torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Time ``case.steps`` inner steps after ``case.warmup_steps`` untimed ones (which
    compile, when asked); returns the row and the outer gradient of the timed steps
    (parameters before them minus after, on the device)."""
    torch.manual_seed(0)
    model = case.build()
    prepared = prepare_model(model, device, ONE_PROCESS, "ddp", case.compile)
    optimizer = make_inner_optimizer(model, LEARNING_RATE, 0.1, (0.9, 0.95))
    generator = torch.Generator(device=device).manual_seed(0)
    rows = torch.randint(
        0, case.vocabulary, (8, case.batch_size, case.sequence_length + 1), device=device, generator=generator
    )

    def step(index: int) -> float:
        batch = rows[index % len(rows)]
        return inner_step(
            prepared,
            optimizer,
            batch[:, :-1],
            batch[:, 1:],
            LEARNING_RATE,
            GRADIENT_CLIP,
            micro_batch_size=case.micro_batch_size,
            precision=case.precision,
        )

    started = time.perf_counter()
    for index in range(case.warmup_steps):
        step(index)
    synchronize(device)
    warmup_seconds = time.perf_counter() - started
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    started = time.perf_counter()
    losses = [step(index) for index in range(case.steps)]
    synchronize(device)
    elapsed = time.perf_counter() - started
    tokens_per_second = case.steps * case.batch_size * case.sequence_length / elapsed
    peak = peak_bf16_flops(device)
    achieved = flops_per_token(model, case) * tokens_per_second
    row = {
        "model": case.name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "precision": case.precision,
        "compiled": case.compile,
        "batch": case.batch_size,
        "micro_batch": case.micro_batch_size,
        "sequence": case.sequence_length,
        "steps": case.steps,
        "warmup_seconds": warmup_seconds,
        "step_ms": 1000 * elapsed / case.steps,
        "tokens_per_second": tokens_per_second,
        "model_TFLOPs": achieved / 1e12,
        "MFU": achieved / peak if peak else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    delta = {name: before[name] - parameter.detach() for name, parameter in model.named_parameters()}
    return row, delta


def installs_are_exact(case: TrainingCase, device: torch.device) -> bool:
    """Fresh full fp32 values installed into the model on the device come back bit for bit."""
    torch.manual_seed(1)
    model = case.build().to(device)
    names = [name for name, _ in model.named_parameters()]
    generator = torch.Generator().manual_seed(2)
    values = {name: torch.randn(parameter.shape, generator=generator) for name, parameter in model.named_parameters()}
    install_parameters(model, values, names, ONE_PROCESS)
    on_device = all(parameter.device == device for parameter in model.parameters())
    back = full_parameters(model, names, ONE_PROCESS)
    return on_device and all(torch.equal(back[name], values[name]) for name in names)


def codec_on_device(tensors: dict[str, torch.Tensor], codecs: list[Codec], repeats: int) -> list[dict[str, Any]]:
    """Per codec: whether device tensors encode to the same payload as their CPU copies
    and decode to the same values, and the encode and decode rates from and to the
    device (MB/s of fp32 values, medians of ``repeats``)."""
    secret = RunSecret.generate()
    device = next(iter(tensors.values())).device
    on_cpu = {name: tensor.cpu() for name, tensor in tensors.items()}
    megabytes = sum(tensor.numel() * 4 for tensor in tensors.values()) / 1e6
    rows = []
    for codec in codecs:
        spec = CodecSpec(codec=codec)
        payload = encode_payload(tensors.items(), spec, secret)
        cpu_payload = encode_payload(on_cpu.items(), spec, secret)
        expected = decode_payload(cpu_payload, secret).tensors
        on_device = decode_onto(payload, secret, device)
        same_values = on_device.keys() == expected.keys() and all(
            torch.equal(on_device[name].cpu(), expected[name]) for name in expected
        )
        encode_times, decode_times = [], []
        for _ in range(repeats):
            synchronize(device)
            encode_times.append(seconds(lambda spec=spec: encode_payload(tensors.items(), spec, secret)))
            decode_times.append(seconds(lambda payload=payload: decode_onto(payload, secret, device)))
        rows.append(
            {
                "codec": codec.value,
                "fp32_MB": megabytes,
                "payload_MB": len(payload) / 1e6,
                "same_payload_as_cpu": payload == cpu_payload,
                "same_values_as_cpu": same_values,
                "encode_MBps": megabytes / median(encode_times),
                "decode_MBps": megabytes / median(decode_times),
            }
        )
    return rows


def decode_onto(payload: bytes, secret: RunSecret, device: torch.device) -> dict[str, torch.Tensor]:
    """A payload decoded (on the CPU, where the codec works) and moved onto ``device``,
    as a learner installs global weights; returns once the copies are done."""
    decoded = {name: value.to(device) for name, value in decode_payload(payload, secret).tensors.items()}
    synchronize(device)
    return decoded


def measure(device: torch.device, quick: bool, steps: int = 200) -> dict[str, Any]:
    """Every measurement; the codec's input is the outer gradient of the last case (a Llama)."""
    cases = training_cases(quick, steps)
    training, delta = [], {}
    for case in cases:
        row, delta = train_and_time(case, device)
        training.append(row)
        print(f"  {case.name}: {row['tokens_per_second']:.4g} tokens/s", flush=True)
    exact = installs_are_exact(cases[-1], device)
    codec = codec_on_device(delta, list(Codec), 1 if quick else 3)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "peak_bf16_TFLOPs": (peak / 1e12) if (peak := peak_bf16_flops(device)) else None,
        "training": training,
        "installs_bit_exact": exact,
        "codec": codec,
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = benchmark_parser(__doc__, "tiny models, a few steps (for the test suite)")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="where to measure (cpu: to exercise the code paths)"
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per model")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "no CUDA GPU found (torch.cuda.is_available() is False): nothing measured. "
            "`python -m bench.gpu --device cpu --quick` runs the same code paths on the CPU."
        )
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    results = measure(device, args.quick, args.steps)
    results["total_seconds"] = time.perf_counter() - started
    settings = {
        "device": args.device,
        "llama": TINY_LLAMA if args.quick else LLAMA_134M,
        "learning_rate": LEARNING_RATE,
        "gradient_clip": GRADIENT_CLIP,
    }
    peak = results["peak_bf16_TFLOPs"]
    print(
        f"device: {results['device']}, peak dense bf16: {f'{peak:g} TFLOP/s' if peak else 'unknown (so MFU unknown)'}"
    )
    print_table(
        results["training"], ["model", "parameters", "compiled", "step_ms", "tokens_per_second", "model_TFLOPs", "MFU"]
    )
    print(f"install then gather bit-exact on {args.device}: {results['installs_bit_exact']}")
    print_table(
        results["codec"],
        ["codec", "fp32_MB", "payload_MB", "same_payload_as_cpu", "same_values_as_cpu", "encode_MBps", "decode_MBps"],
    )
    write_and_report("gpu", args, settings, results, note=f" in {results['total_seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
