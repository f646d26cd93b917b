"""An MoE trains with its router's load-balancing loss: the language-model task asks a
transformers MoE (Mixtral, from_config) for its router logits, adds ``aux_loss`` times
the config's ``router_aux_loss_coef`` to the next-token loss, logs both parts, and
keeps the perplexity that of the next-token loss alone."""

import math

import pytest
import torch

from {{ cookiecutter.package_name }}.models.hf import causal_lm
from {{ cookiecutter.package_name }}.tasks.language_model import LanguageModel

pytest.importorskip("transformers", reason="the hf extra")

MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 16,
    "router_aux_loss_coef": 0.02,
}


def test_the_training_loss_is_the_next_token_loss_plus_the_weighted_router_loss():
    torch.manual_seed(0)
    model = causal_lm(config=MIXTRAL)
    assert model.config.output_router_logits is False  # off by default: no aux_loss at all
    tokens = torch.randint(0, 64, (4, 9))
    batch = (tokens[:, :-1], tokens[:, 1:])
    loss, logs = LanguageModel().loss(model=model, batch=batch)
    out = model(batch[0], output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch[1].flatten())
    assert out.aux_loss is not None and out.aux_loss > 0
    assert torch.equal(logs["ce"], ce.detach()) and torch.equal(logs["aux_loss"], out.aux_loss)
    assert torch.equal(loss, ce + 0.02 * out.aux_loss)
    loss.backward()  # the router learns from it
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    # the task's own weight wins over the config's
    heavier, _ = LanguageModel(aux_loss_coef=1.0).loss(model=model, batch=batch)
    assert torch.allclose(heavier, ce + out.aux_loss)


def test_evaluation_reports_both_parts_and_the_perplexity_of_the_next_token_loss():
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = causal_lm(config=MIXTRAL)
    tokens = torch.randint(0, 64, (8, 9))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    metrics = LanguageModel().evaluate(
        model=model, loader=loader, accelerator=Accelerator(cpu=True)
    )
    assert metrics["val/aux_loss"] > 0
    assert math.isclose(
        metrics["val/loss"], metrics["val/ce"] + 0.02 * metrics["val/aux_loss"], rel_tol=1e-5
    )
    assert math.isclose(metrics["val/ppl"], math.exp(metrics["val/ce"]), rel_tol=1e-9)
