"""Generated text at every evaluation, for a language model (``callbacks=generate_samples``):
the first ``prompt_tokens`` tokens of a validation sequence continued greedily by
``max_new_tokens``, decoded with the run's tokenizer (data=text; ids otherwise), sent to
every tracker as a text (``samples/greedy``) and written to
``<run dir>/samples/step_<N>.txt``. Every rank generates (a sharded model needs every
rank in each forward); the main process writes.
"""

from pathlib import Path
from typing import Any

import torch

from ..contract import Callback, load_tokenizer, require

IDS = "ids"  # data without a tokenizer (token ids): the samples are ids


class GenerateSamples(Callback):
    def __init__(
        self,
        *,
        prompt_tokens: int = 16,
        max_new_tokens: int = 32,
        every_n_evals: int = 1,
        tokenizer: str | None = IDS,
    ) -> None:
        for key, value in [("prompt_tokens", prompt_tokens), ("max_new_tokens", max_new_tokens)]:
            require(f"callbacks.generate_samples.{key}", value, _count(value), "an integer >= 1")
        require(
            "callbacks.generate_samples.every_n_evals",
            every_n_evals,
            _count(every_n_evals),
            "an integer >= 1",
        )
        self.prompt_tokens, self.max_new_tokens = prompt_tokens, max_new_tokens
        self.every_n_evals = every_n_evals
        # a tokenizer file (None: bytes, data=text's default); IDS: the data is token ids
        self.tokenizer = None if tokenizer == IDS else load_tokenizer(tokenizer)
        self.evaluations = 0

    @torch.no_grad()
    def on_eval_end(self, run: Any, metrics: dict[str, float]) -> None:
        self.evaluations += 1
        if self.evaluations % self.every_n_evals:
            return
        inputs = run.task.inputs(batch=next(iter(run.extras["val_loader"])))
        ids = inputs[:1, : self.prompt_tokens]
        model = run.model
        model.eval()
        for _ in range(self.max_new_tokens):
            scores = run.task.logits(model(ids))[0, -1]
            ids = torch.cat([ids, scores.argmax().view(1, 1)], dim=1)
        model.train()
        prompt, new = ids[0, : self.prompt_tokens].tolist(), ids[0, self.prompt_tokens :].tolist()
        text = f"{self._decode(prompt)} ->{self._decode(new)}"
        run.media.text("samples/greedy", text, step=run.step)
        if run.accelerator.is_main_process:
            folder = Path(run.run_dir) / "samples"
            folder.mkdir(exist_ok=True)
            (folder / f"step_{run.step:07d}.txt").write_text(text + "\n")

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " " + " ".join(map(str, ids))
        return self.tokenizer.decode(ids)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
