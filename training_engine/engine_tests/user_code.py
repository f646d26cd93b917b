"""What an owner writes for the ten ordinary changes of engine_tests/test_extension.py: tasks,
a data function, a model and a callback, each through the project's declared interfaces
(contract.py) and selected from the command line, with no edit to train.py or the
engine. Kept here so the project's own tests exercise them; in a project they would be
files under src/<package>/ and configs/."""

import time

import torch
import torch.nn.functional as F
from digit_trainer.contract import Callback, make_loaders
from digit_trainer.data.digits import digits
from digit_trainer.tasks.classification import Classification, cross_entropy
from digit_trainer.tasks.language_model import LanguageModel
from torch import nn


class WithF1(Classification):
    """1. A metric: macro-F1 over the whole validation set (not a mean of batches):
    every rank's predictions gathered, so it is the same on any number of processes."""

    metrics = ("val/loss", "val/acc", "val/f1")

    def evaluate(self, *, model, loader, accelerator):
        metrics = super().evaluate(model=model, loader=loader, accelerator=accelerator)
        model.eval()
        predicted, labels = [], []
        with torch.no_grad():
            for batch in loader:
                out = self.logits(model(self.inputs(batch=batch))).argmax(dim=-1)
                pair = accelerator.gather_for_metrics((out, self.targets(batch=batch)))
                predicted.append(pair[0].cpu())
                labels.append(pair[1].cpu())
        model.train()
        p, y = torch.cat(predicted), torch.cat(labels)
        scores = []
        for c in range(10):
            tp = ((p == c) & (y == c)).sum().item()
            fp, fn = ((p == c) & (y != c)).sum().item(), ((p != c) & (y == c)).sum().item()
            scores.append(2 * tp / max(1, 2 * tp + fp + fn))
        return {**metrics, "val/f1": sum(scores) / len(scores)}


class FreezeFirst(Classification):
    """3. Freezing the first N linear layers: no gradient, no optimizer."""

    def __init__(self, frozen_layers: int = 1) -> None:
        self.frozen_layers = frozen_layers

    def param_groups(self, model):
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        for layer in linears[: self.frozen_layers]:
            layer.requires_grad_(False)
        return super().param_groups(model)  # decay_groups skips what needs no gradient


def dict_digits(**digits_keys):
    """4. A custom collate: the digits (data=digits' keys) as dict batches."""
    loaders = digits(**digits_keys)
    return make_loaders(
        loaders.train.dataset,
        loaders.val.dataset,
        batch_size=digits_keys["batch_size"],
        seed=digits_keys["seed"],
        val_batch_size=digits_keys.get("val_batch_size"),
        collate_fn=as_dict,
    )


def as_dict(samples):
    pixels, labels = zip(*samples, strict=True)
    return {"pixels": torch.stack(pixels), "label": torch.stack(labels)}


class DictBatches(Classification):
    def inputs(self, *, batch):
        return batch["pixels"]

    def targets(self, *, batch):
        return batch["label"]


class TwoLearningRates(Classification):
    """5. Two optimizers with different learning rates: the body under ``optimizer``,
    the last layer under ``optimizers.head``."""

    def param_groups(self, model):
        head = list(model.net[-1].parameters())
        ids = {id(p) for p in head}
        return {"optimizer": [p for p in model.parameters() if id(p) not in ids], "head": head}


class TwoHeads(nn.Module):
    """9. A model for a multi-task loss: the digit and its parity, from one body."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU())
        self.digit, self.parity = nn.Linear(width, 10), nn.Linear(width, 2)

    def forward(self, x):
        h = self.body(x)
        return {"digit": self.digit(h), "parity": self.parity(h)}


class MultiTask(Classification):
    metrics = ("val/loss", "val/acc", "val/digit_loss", "val/parity_loss", "val/parity_acc")

    def __init__(self, parity_weight: float = 0.5) -> None:
        self.parity_weight = parity_weight

    def logits(self, output):
        return output["digit"]

    def loss(self, *, model, batch):
        out, y = model(self.inputs(batch=batch)), self.targets(batch=batch)
        digit, parity = cross_entropy(out["digit"], y), cross_entropy(out["parity"], y % 2)
        acc = (out["digit"].argmax(-1) == y).float().mean()
        parity_acc = (out["parity"].argmax(-1) == y % 2).float().mean()
        logs = {"acc": acc, "digit_loss": digit.detach(), "parity_loss": parity.detach()}
        return digit + self.parity_weight * parity, {**logs, "parity_acc": parity_acc}


class Distill(Classification):
    """8b. Distillation from a frozen teacher (``frozen_models.teacher``)."""

    def __init__(self, temperature: float = 2.0) -> None:
        self.temperature = temperature

    def training_step(self, *, step, batch):
        with step.accumulate():
            x = self.inputs(batch=batch)
            student = self.logits(step.model(x))
            with torch.no_grad():
                teacher = self.logits(step.models["teacher"](x))
            t = self.temperature
            kl = F.kl_div(
                F.log_softmax(student / t, -1), F.softmax(teacher / t, -1), reduction="batchmean"
            )
            loss = kl * t * t
            step.backward(loss)
            if step.sync_gradients:
                step.clip_gradients()
                step.update()
        agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
        return loss, {"agreement": agree}


class GAN(nn.Module):
    """8a. A tiny GAN on the digits: both networks in one model, so one checkpoint
    entry holds both; the step calls them through ``forward(x, part)`` (under DDP a
    call must go through the wrapper's forward to synchronise gradients)."""

    def __init__(self, noise: int = 16, width: int = 64) -> None:
        super().__init__()
        self.noise = noise
        self.generator = nn.Sequential(
            nn.Linear(noise, width), nn.ReLU(), nn.Linear(width, 64), nn.Sigmoid()
        )
        self.discriminator = nn.Sequential(
            nn.Linear(64, width), nn.LeakyReLU(0.2), nn.Linear(width, 1)
        )

    def forward(self, x, part: str = "discriminator"):
        if part == "generator":
            return self.generator(x)
        if part == "both":  # D(G(z)): the generator's objective
            return self.discriminator(self.generator(x))
        return self.discriminator(x.flatten(1))


class GANTask(Classification):
    """The generator is ``optimizer``'s, the discriminator ``optimizers.discriminator``'s;
    one micro-batch: a generator update, then a discriminator update. The noise of
    training comes from the global RNG (seeded, saved and restored by the engine); an
    evaluation draws from its own generator, the same noise each time."""

    metrics = ("val/d_loss", "val/g_loss")

    def param_groups(self, model):
        return {
            "optimizer": list(model.generator.parameters()),
            "discriminator": list(model.discriminator.parameters()),
        }

    def losses(self, model, real, generator=None):
        z = torch.randn(len(real), model_of(model).noise, generator=generator)
        fake = model(z.to(real.device), part="generator")
        scores = model(torch.cat([real.flatten(1), fake]), part="discriminator")
        target = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
        d_loss = F.binary_cross_entropy_with_logits(scores, target.to(real.device))
        g_scores = model(z.to(real.device), part="both")
        return d_loss, F.binary_cross_entropy_with_logits(g_scores, torch.ones_like(g_scores))

    def training_step(self, *, step, batch):
        model, real = step.model, self.inputs(batch=batch)
        z = torch.randn(len(real), model_of(model).noise, device=real.device)
        g_scores = model(z, part="both")
        g_loss = F.binary_cross_entropy_with_logits(g_scores, torch.ones_like(g_scores))
        step.backward(g_loss)
        step.update("optimizer")  # the generator
        step.zero_grad("discriminator")  # its gradients from the generator's loss
        with torch.no_grad():  # no backward follows: DDP must not expect one
            fake = model(z, part="generator")
        scores = model(torch.cat([real.flatten(1), fake]), part="discriminator")
        target = torch.cat(
            [torch.ones_like(scores[: len(real)]), torch.zeros_like(scores[len(real) :])]
        )
        d_loss = F.binary_cross_entropy_with_logits(scores, target)
        step.backward(d_loss)
        step.update("discriminator")
        return d_loss, {"g_loss": g_loss.detach()}

    def loss(self, *, model, batch):
        d_loss, g_loss = self.losses(model, self.inputs(batch=batch), self._noise)
        return d_loss, {"d_loss": d_loss, "g_loss": g_loss}

    def evaluate(self, *, model, loader, accelerator):
        self._noise = torch.Generator().manual_seed(accelerator.process_index)
        metrics = super().evaluate(model=model, loader=loader, accelerator=accelerator)
        return {k: v for k, v in metrics.items() if k in self.metrics}


class SlowGAN(GAN):
    """The same GAN, 20 ms slower per call: a run still going when it is killed."""

    def forward(self, x, part: str = "discriminator"):
        time.sleep(0.02)
        return super().forward(x, part)


class SplitGPT(LanguageModel):
    """Two optimizers on one model: ``optimizer`` for the matrices of the blocks, the
    second (``optimizers.rest``) for embeddings, norms and biases."""

    def param_groups(self, model):
        matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks" in n]
        ids = {id(p) for p in matrices}
        return {"optimizer": matrices, "rest": [p for p in model.parameters() if id(p) not in ids]}


def model_of(model):
    return getattr(model, "module", model)  # DDP's wrapper


class EvalCounter(Callback):
    """10. A callback with state (test_interfaces.py has its resume test)."""

    def __init__(self) -> None:
        self.count = 0

    def on_eval_end(self, run, metrics):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = int(state["count"])


class AugmentedDigits(torch.utils.data.Dataset):
    """10. Augmentation as people write it, every draw from a global RNG: kornia's
    random affine and crop (torch's), pixel noise (``numpy.random``) and a brightness
    (``random``). The engine makes each draw a function of (seed, epoch, index);
    ``epochs`` records the epoch a ``set_epoch`` told each copy (a worker's too)."""

    def __init__(self, images, labels) -> None:
        import kornia.augmentation as K  # the vision extra

        self.images, self.labels, self.epoch = images, labels, None
        self.augment = torch.nn.Sequential(
            K.RandomAffine(degrees=15.0, translate=(0.1, 0.1), p=1.0),
            K.RandomCrop((8, 8), padding=1, p=1.0),
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        import random

        import numpy as np

        image = self.augment(self.images[index][None])[0]  # kornia takes a batch
        noise = torch.from_numpy(np.random.normal(0, 0.05, image.shape).astype("float32"))
        image = (image + noise) * (0.8 + 0.4 * random.random())
        return image, self.labels[index]


def augmented_digits(**digits_keys):
    """data=digits with AugmentedDigits for training (``_target_`` this, the keys of
    data=digits)."""
    loaders = digits(**digits_keys)
    images, labels = loaders.train.dataset.tensors
    return make_loaders(
        AugmentedDigits(images, labels),
        loaders.val.dataset,
        batch_size=digits_keys["batch_size"],
        seed=digits_keys["seed"],
        val_batch_size=digits_keys.get("val_batch_size"),
        num_workers=digits_keys.get("num_workers", 0),
    )
