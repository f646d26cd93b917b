"""Continue a prompt with a trained causal language model (model=gpt, model=hf, yours):
the text goes to stdout and, with the settings, to ``generated.txt`` and
``generation.json`` in its own run dir. ``python generate.py --help``.

    python generate.py ckpt=runs/exp1 prompt="def fib(n):"          # greedy
    python generate.py ckpt=runs/exp1 prompt="def " temperature=0.8 top_k=50 seed=1
    python generate.py ckpt=runs/chat1 'messages=[{role:user,content:"What is 2 + 3?"}]'

The model and the tokenizer come from the run (data=text: its tokenizer, or bytes);
data of token ids takes a prompt of ids. docs/text.md.
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig
from training_engine import generation
from training_engine.config import register_resolvers
from training_engine.entry import run_entry_point

PROJECT_ROOT = Path(__file__).resolve().parent
CONFIG_DIR = PROJECT_ROOT / "configs"


@hydra.main(version_base="1.3", config_path="configs", config_name="generate")
def main(raw: DictConfig) -> None:
    register_resolvers(PROJECT_ROOT)
    generation.main(raw)


if __name__ == "__main__":
    register_resolvers(PROJECT_ROOT)
    run_entry_point(main, CONFIG_DIR, "generate")  # Hydra's command-line errors: exit 2 too
