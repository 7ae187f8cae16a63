"""A learner's processes, one of them: what it gathers, copies and installs is exact, and the
blocks to shard are found (two processes: tests/integration/test_fsdp.py)."""

from __future__ import annotations

from diloco_cli.runtime.distributed import (
    full_optimizer_state,
    full_parameters,
    install_parameters,
    load_full_optimizer_state,
    transformer_blocks,
)
from tests.support.fsdp_worker import (
    MICRO_BATCH,
    ONE_PROCESS,
    batches,
    bitwise_equal,
    build_model,
    installed_values,
    make_optimizer,
    max_difference,
    train,
)


def test_one_process_gathers_copies_and_installs_exactly():
    model = build_model()
    optimizer = make_optimizer(model)
    train(model, optimizer, batches()[0], MICRO_BATCH)
    names = [name for name, _ in model.named_parameters()]
    gathered = full_parameters(model, names, ONE_PROCESS)
    next(iter(gathered.values())).add_(1.0)  # a copy: the model is untouched
    assert max_difference(full_parameters(model, names, ONE_PROCESS), gathered) == 1.0
    values = installed_values(model)
    install_parameters(model, values, names, ONE_PROCESS)
    assert bitwise_equal(full_parameters(model, names, ONE_PROCESS), values)

    state = full_optimizer_state(model, optimizer, ONE_PROCESS)
    fresh = make_optimizer(model)
    load_full_optimizer_state(model, fresh, state, ONE_PROCESS)
    assert bitwise_equal(full_optimizer_state(model, fresh, ONE_PROCESS), state)
    # the loaded buffers are the optimizer's own, not the caller's
    assert all(
        fresh.state[p]["exp_avg"].data_ptr() != state[n]["exp_avg"].data_ptr() for n, p in model.named_parameters()
    )
    load_full_optimizer_state(model, fresh, {}, ONE_PROCESS)
    assert not fresh.state


def test_blocks_are_found_in_the_built_in_gpt_and_a_hugging_face_llama():
    model = build_model()
    assert transformer_blocks(model) == list(model.blocks)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    llama = LlamaForCausalLM(config)
    assert transformer_blocks(llama) == list(llama.model.layers)
