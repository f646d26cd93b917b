"""The verbs a task's ``training_step`` takes one micro-batch with (``Step``): the
accumulation window, backward with the NaN guard, clipping and the update, over named
models and optimizers (one of each, named ``model`` and ``optimizer``, by default;
several optimizers: those of ``cfg.optimizers`` too, optimizers.py).

The step itself is the task's (training_engine/task.py: ``TaskDefaults.training_step`` is the
default, written out); these verbs keep the engine's guarantees inside it: the ranks
agree before an update is applied (``trainer.on_nan``), gradients are synchronised
only at the accumulation's last micro-batch, and clipping goes through accelerate
wherever the setup needs it (FSDP, DeepSpeed, a grad scaler). A collective under
DDP/FSDP: every rank calls the same verbs in the same order.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import DistributedType

from . import upstream
from .optimizers import by_name


class Step:
    """Built once per run (train.py) and handed to ``task.training_step`` each micro-batch."""

    def __init__(
        self,
        *,
        accelerator: Any,
        agreement: Any,
        clip_norm: float | None,
        models: dict[str, torch.nn.Module],
        optimizer: Any,
        frozen: tuple[str, ...] = (),
    ) -> None:
        self.accelerator = accelerator
        self.agreement = agreement
        self.clip_norm = clip_norm  # trainer.grad_clip_norm (None: no clipping)
        self.models = dict(models)  # every model the step may call, frozen ones too
        self.frozen = tuple(frozen)  # of those, the ones not trained (e.g. a teacher)
        self.trained = [m for name, m in self.models.items() if name not in frozen]
        self.all_optimizers = optimizer  # the run's (prepared): every optimizer
        self.optimizers = by_name(optimizer)  # by name: optimizer, and cfg.optimizers' names
        self.grad_norm: torch.Tensor | None = None  # the last clipping's total norm (logged)
        self._verdict: bool | None = None  # the ranks' agreement for this optimizer step
        self._plain_backward: bool | None = None  # asked at the first backward

    @property
    def model(self) -> torch.nn.Module:
        """The one trained model (a task with several names them: ``models[name]``)."""
        return _only(self.models, "model")

    @property
    def optimizer(self) -> Any:
        """The run's optimizer: all of them, with several."""
        return self.all_optimizers

    @property
    def sync_gradients(self) -> bool:
        """True at the accumulation's last micro-batch: clip and update then."""
        return self.accelerator.sync_gradients

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """accelerate's ``accumulate`` over every trained model: it decides
        ``sync_gradients`` and enters DDP's ``no_sync`` until the last micro-batch. With
        one micro-batch per step every micro-batch syncs, so the context is skipped
        (~0.07 ms of a 5.5 ms CPU step: the template's ``bench/bench.py --only step``)."""
        if self.accelerator.gradient_accumulation_steps == 1:
            yield
            return
        with self.accelerator.accumulate(*self.trained):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (accelerate's: scaling, DeepSpeed's engine) and the NaN guard's look
        at the loss (on the device: no host sync)."""
        if self._plain_backward is None:
            self._plain_backward = plain_backward(self.accelerator)
        if self._plain_backward:
            loss.backward()  # what accelerate's ends in, less its division by 1
        else:
            self.accelerator.backward(loss)
        self.agreement.guard.observe(loss)

    def clip_gradients(
        self, model: str | None = None, max_norm: float | None = None, parameters: Any = None
    ) -> torch.Tensor | None:
        """Clip ``model``'s gradients (or those of ``parameters``, e.g. one group) to
        ``max_norm`` (default: trainer.grad_clip_norm; none set: no clipping). Returns
        the total norm (also kept as ``grad_norm`` for train/grad_norm)."""
        max_norm = self.clip_norm if max_norm is None else max_norm
        if not max_norm:
            return None
        module = self.models[model] if model else self.model
        norm = clip_grad_norm(self.accelerator, module, max_norm, parameters)
        if norm is not None:
            self.grad_norm = norm
        return norm

    def update(self, optimizer: str | None = None) -> bool:
        """The step and zero_grad of the optimizer named ``optimizer`` (None: every
        one), unless the ranks agree to drop this step's update (a non-finite loss with
        ``on_nan=skip``: agreed once per optimizer step, at its first update, whichever
        optimizers it updates). Returns whether it was applied."""
        if self._verdict is None:
            self._verdict = self.agreement.on_update()
        target = self.all_optimizers if optimizer is None else self.optimizers[optimizer]
        if self._verdict:
            optimizer_step(self.accelerator, target)
        zero_grad(target)
        return self._verdict

    def zero_grad(self, optimizer: str | None = None) -> None:
        """Drop the gradients of ``optimizer``'s parameters (None: every one's), e.g. a
        discriminator's from the generator's loss before its own backward."""
        zero_grad(self.all_optimizers if optimizer is None else self.optimizers[optimizer])

    def update_done(self) -> bool:
        """After ``training_step``, in the loop: True when this micro-batch ended an
        optimizer step. Then the ranks' agreement on it is taken if the step made no
        update (a collective: every rank reaches it at the same micro-batch)."""
        if not self.accelerator.sync_gradients:
            return False
        if self._verdict is None:
            self._verdict = self.agreement.on_update()
        self._verdict = None
        return True


def _only(named: dict[str, Any], default: str) -> Any:
    if default in named:
        return named[default]
    if len(named) == 1:
        return next(iter(named.values()))
    raise AttributeError(f"several are named ({', '.join(named)}): pick one by name")


# Plain setups whose gradients torch's clip_grad_norm_ takes as they are.
_PLAIN_CLIP_SETUPS = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
_plain_clip: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def clip_grad_norm(
    accelerator: Any, model: torch.nn.Module, max_norm: float, parameters: Any = None
) -> Any:
    """Clip the gradients to ``max_norm``; return the total norm (None: DeepSpeed
    clips inside its engine and reports none before its step).

    accelerate's ``clip_grad_norm_`` dispatches on the setup (FSDP's own, DeepSpeed's,
    fp16's unscaling) and in the plain case passes over every parameter looking for
    DTensors before it calls torch's: ~0.07 ms a step on the tiny CPU GPT. For one
    process or DDP, with no grad scaler and no DTensor parameter (asked once per model),
    torch's is called directly: the call accelerate ends in."""
    params = list(model.parameters()) if parameters is None else list(parameters)
    plain = _plain_clip.get(model)
    if plain is None:
        plain = _plain_clip[model] = (
            accelerator.distributed_type in _PLAIN_CLIP_SETUPS
            and getattr(accelerator, "scaler", None) is None
            and not any(_is_dtensor(p) for p in model.parameters())
        )
    if plain:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return accelerator.clip_grad_norm_(params, max_norm)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def plain_backward(accelerator: Any) -> bool:
    """Whether accelerate's ``backward`` is ``loss.backward()`` after ``loss / 1``: one
    micro-batch per step, no grad scaler, not DeepSpeed's or Megatron's engine. That
    division is an op and an autograd node every step (x / 1 and its gradient are
    exact: the same bits either way)."""
    return (
        accelerator.gradient_accumulation_steps == 1
        and getattr(accelerator, "scaler", None) is None
        and accelerator.distributed_type
        not in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
    )


def optimizer_step(accelerator: Any, optimizer: Any) -> None:
    """``optimizer.step()`` at the accumulation's end. accelerate's plain wrapper asks
    ``importlib.util.find_spec("lomo_optim")`` twice per call, uncached (~0.2 ms each
    on these 2 cores: 5 % of the tiny GPT's CPU step, ``bench/bench.py --only step``);
    with no grad scaler, no XLA and no LOMO optimizer inside, its step is the inner
    optimizer's, called here directly. Anything else goes through accelerate."""
    inner = getattr(optimizer, "optimizer", None)
    plain = (
        upstream.is_plain_accelerated_optimizer(optimizer)
        and optimizer.scaler is None
        and accelerator.distributed_type != DistributedType.XLA
        and accelerator.sync_gradients
        and not type(inner).__module__.startswith("lomo_optim")
    )
    (inner if plain else optimizer).step()


def zero_grad(optimizer: Any) -> None:
    """``optimizer.zero_grad(set_to_none=True)``. accelerate's plain wrapper checks the
    inner optimizer's signature on every call (``inspect``: ~0.1 ms of a 10 ms CPU step
    in ``bench/bench.py --only step``), so the inner one is called directly; its
    subclasses (DeepSpeed's, whose engine zeroes its own buffers) keep their own."""
    inner = getattr(optimizer, "optimizer", None)
    plain = upstream.is_plain_accelerated_optimizer(optimizer)
    if plain and _takes_set_to_none(type(inner).zero_grad):
        inner.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad(set_to_none=True)


@functools.cache
def _takes_set_to_none(function: Any) -> bool:
    return "set_to_none" in inspect.signature(function).parameters
